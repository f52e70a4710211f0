"""Reading models from disk and converting Hugging Face directories to jdllm checkpoints.

A jdllm checkpoint directory holds
  jdllm_config.json   {"format": "jdllm", "version": 1, "dtype": ..., "config": ModelConfig.to_dict()}
  params/             the parameter pytree, saved with Orbax (restorable straight into shardings)
  hf_config.json      the source config.json, kept for reference
  tokenizer files     copied from the source (tokenizer.json, tokenizer_config.json, ...)

`convert_checkpoint` builds it in a temporary directory beside OUT_DIR and
renames it into place only when everything is written, so a failed or
interrupted conversion leaves nothing at OUT_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from typing import Any

import numpy as np

from convert import hf
from jdllm import errors
from jdllm.config import ModelConfig

MARKER_FILE = "jdllm_config.json"
PARAMS_DIR = "params"
HF_CONFIG_COPY = "hf_config.json"
FORMAT_VERSION = 1
DTYPES = ("bfloat16", "float16", "float32")


def np_dtype(dtype) -> np.dtype | None:
    """'bfloat16' | 'float16' | 'float32' | a NumPy/JAX dtype | None -> NumPy dtype (None keeps)."""
    if dtype is None:
        return None
    import ml_dtypes  # noqa: PLC0415

    names = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
             "float32": np.dtype(np.float32)}
    if isinstance(dtype, str):
        if dtype not in names:
            raise errors.ConfigError(f"dtype={dtype!r} is not one of {DTYPES}")
        return names[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise errors.ConfigError(f"dtype={dtype!r} is not one of {DTYPES}") from e
    if d.name not in names:
        raise errors.ConfigError(f"dtype={d.name!r} is not one of {DTYPES}")
    return d


def is_jdllm_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, hf.CONFIG_FILE))


# --------------------------------------------------------------------------- tokenizer
def load_tokenizer(path: str):
    """The directory's tokenizer (offline, no hub access), or None without tokenizer.json."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers  # noqa: PLC0415

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a custom model_type in config.json is expected here
    with warnings.catch_warnings():
        # AutoTokenizer reads config.json; its deprecation notes about model keys
        # (v4 `rope_scaling`, as published checkpoints have) say nothing about the tokenizer.
        warnings.simplefilter("ignore", FutureWarning)
        return _load_tokenizer(transformers, path, verbosity)


def _load_tokenizer(transformers, path: str, verbosity: int):
    try:
        try:
            # trust_remote_code=False: never run (or prompt for) a model's custom code.
            return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception:  # noqa: BLE001 (a custom tokenizer_class or model_type: use the generic fast one)
            pass
        try:
            return transformers.PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise errors.CorruptCheckpointError(
                f"{os.path.join(path, 'tokenizer.json')} cannot be loaded ({type(e).__name__}: {hf.one_line(e)}); "
                "replace it with the tokenizer that came with the model, or remove it to use token ids only") from e
    finally:
        transformers.logging.set_verbosity(verbosity)


# --------------------------------------------------------------------------- jdllm checkpoints
def read_jdllm_meta(path: str) -> dict[str, Any]:
    marker = os.path.join(path, MARKER_FILE)
    try:
        with open(marker) as f:
            meta = json.load(f)
        meta["config"] = ModelConfig.from_dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise errors.CorruptCheckpointError(
            f"{marker} is not a valid jdllm checkpoint marker ({type(e).__name__}: {hf.one_line(e)}); "
            "re-run `jdllm convert` to rebuild the checkpoint") from e
    if meta.get("version", 0) > FORMAT_VERSION:
        raise errors.CheckpointError(
            f"{marker} has format version {meta.get('version')}, newer than this jdllm reads "
            f"({FORMAT_VERSION}); upgrade jdllm")
    return meta


def save_params(params_dir: str, params) -> None:
    """Write the parameter pytree with Orbax (params_dir must not exist yet)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(params_dir), params)
        ckpt.wait_until_finished()


def restore_params(path: str, dtype=None, shardings=None):
    """Restore a jdllm checkpoint's params as jax Arrays.

    dtype: cast on restore (None keeps the stored dtype, bit for bit).
    shardings: optional pytree of `jax.sharding.Sharding` matching the params,
    so each device reads only its own shards; default: the first device.
    """
    import jax  # noqa: PLC0415
    import orbax.checkpoint as ocp  # noqa: PLC0415

    from jdllm.model import param_shapes  # noqa: PLC0415

    meta = read_jdllm_meta(path)
    cfg = meta["config"]
    params_dir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    want = np_dtype(dtype)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            stored = ckpt.metadata(params_dir).item_metadata.tree
            expected = param_shapes(cfg)
            got_shapes = {k: tuple(m.shape) for k, m in _flat(stored)}
            want_shapes = {k: tuple(v) for k, v in _flat(expected, leaf=lambda x: isinstance(x, tuple))}
            if got_shapes != want_shapes:
                bad = sorted(set(got_shapes.items()) ^ set(want_shapes.items()))[0]
                raise errors.CorruptCheckpointError(
                    f"{params_dir} disagrees with {MARKER_FILE} at parameter {bad[0]} "
                    f"(stored {got_shapes.get(bad[0])}, config implies {want_shapes.get(bad[0])}); "
                    "re-run `jdllm convert`")
            default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shard_tree = shardings if shardings is not None else jax.tree.map(lambda _: default, stored)
            abstract = jax.tree.map(
                lambda m, s: jax.ShapeDtypeStruct(tuple(m.shape), want if want is not None else m.dtype, sharding=s),
                stored, shard_tree)
            return ckpt.restore(params_dir, abstract)
    except errors.JdllmError:
        raise
    except Exception as e:  # noqa: BLE001 (orbax / tensorstore raise many types)
        raise errors.CorruptCheckpointError(
            f"cannot restore {params_dir} ({type(e).__name__}: {hf.one_line(e)}); re-run `jdllm convert`") from e


def _flat(tree, leaf=None) -> list[tuple[str, Any]]:
    import jax  # noqa: PLC0415

    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf)[0]]


# --------------------------------------------------------------------------- load
def load_model(path: str, dtype="bfloat16", attn_impl: str = "auto", shardings=None):
    """A `jdllm.loading.Model` from a Hugging Face directory or a jdllm checkpoint directory."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jdllm.loading import Model  # noqa: PLC0415

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise errors.CheckpointError(
            f"{path} is not a directory: pass a Hugging Face model directory (config.json + "
            "safetensors) or a jdllm checkpoint made by `jdllm convert`")
    if is_jdllm_dir(path):
        cfg = read_jdllm_meta(path)["config"]
        params = restore_params(path, dtype=dtype, shardings=shardings)
    elif is_hf_dir(path):
        cfg = ModelConfig.from_hf(path)
        want = np_dtype(dtype)
        host = hf.params_from_hf_tensors(hf.SafetensorsDir(path), cfg, dtype=want, source=path)
        if shardings is not None:
            params = jax.tree.map(jax.device_put, host, shardings)
        else:
            params = jax.tree.map(jnp.asarray, host)
    else:
        raise errors.CheckpointError(
            f"{path} has neither {hf.CONFIG_FILE} (Hugging Face) nor {MARKER_FILE} (jdllm): "
            "point at a model directory")
    return Model(config=cfg, params=params, tokenizer=load_tokenizer(path), attn_impl=attn_impl, path=path)


# --------------------------------------------------------------------------- convert
def convert_checkpoint(hf_dir: str, out_dir: str, dtype="bfloat16", overwrite: bool = False,
                       progress: bool = True) -> str:
    """Hugging Face directory -> jdllm checkpoint at out_dir (atomic: all or nothing).

    dtype: 'bfloat16' | 'float16' | 'float32', or None to keep the source dtypes.
    Returns the absolute out_dir.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    hf_dir, out_dir = os.fspath(hf_dir), os.path.abspath(os.fspath(out_dir))
    if os.path.lexists(out_dir) and not overwrite:
        raise errors.OutputExistsError(
            f"{out_dir} already exists: pass --overwrite (overwrite=True) to replace it, "
            "or choose another OUT_DIR")
    if not os.path.isdir(hf_dir) or not is_hf_dir(hf_dir):
        raise errors.CheckpointError(
            f"{hf_dir} is not a Hugging Face model directory (no {hf.CONFIG_FILE}): "
            "pass the directory that holds config.json and the safetensors weights")
    if os.path.abspath(hf_dir) == out_dir:
        raise errors.OutputExistsError(f"OUT_DIR {out_dir} is the input directory; choose another OUT_DIR")
    want = np_dtype(dtype)
    cfg = ModelConfig.from_hf(hf_dir)
    tensors = hf.SafetensorsDir(hf_dir)
    hf.check_tensor_names(tensors.keys(), cfg, source=hf_dir)

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; OUT_DIR gets ordinary permissions
        with tqdm(total=len(hf.hf_tensor_names(cfg)), desc=f"convert {os.path.basename(hf_dir.rstrip('/'))}",
                  unit="tensor", disable=not progress) as bar:
            params = hf.params_from_hf_tensors(tensors, cfg, dtype=want, source=hf_dir,
                                               progress=lambda name: bar.update(1))
        stored = {np.asarray(x).dtype.name for x in _leaves(params)}
        save_params(os.path.join(tmp, PARAMS_DIR), params)
        meta = {"format": "jdllm", "version": FORMAT_VERSION,
                "dtype": stored.pop() if len(stored) == 1 else "mixed",
                "source": os.path.abspath(hf_dir), "config": cfg.to_dict()}
        with open(os.path.join(tmp, MARKER_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        shutil.copyfile(os.path.join(hf_dir, hf.CONFIG_FILE), os.path.join(tmp, HF_CONFIG_COPY))
        hf.copy_tokenizer_files(hf_dir, tmp)
        _move_into_place(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def _move_into_place(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Rename tmp -> out_dir; an existing out_dir (overwrite) is moved aside first, then removed."""
    old = None
    if os.path.lexists(out_dir):
        if not overwrite:
            raise errors.OutputExistsError(
                f"{out_dir} appeared during conversion: pass --overwrite or choose another OUT_DIR")
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rmdir(old)
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.rename(old, out_dir)
        raise
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)
