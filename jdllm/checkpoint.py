"""Reading models from disk: Hugging Face directories and jdllm (Orbax) checkpoints.

A Hugging Face directory holds config.json, model.safetensors (or shards listed
in model.safetensors.index.json) and the tokenizer files. A jdllm checkpoint
directory (written by `convert`) holds
  jdllm_config.json   {"format": "jdllm", "version": 1, "dtype": ..., "config": ModelConfig.to_dict()}
  params/             the parameter pytree in Orbax's StandardCheckpointer layout (OCDBT + one zarr
                      array per parameter), restorable straight into shardings; `convert` writes it
                      layer slice by layer slice (one zarr chunk per layer), older versions with
                      Orbax's own save: both restore through Orbax
  hf_config.json      the source config.json, kept for reference
  tokenizer files     copied from the source (tokenizer.json, tokenizer_config.json, ...)

`load` reads either kind into a `jdllm.loading.Model`, never holding the model twice on the
host: safetensors a slab of rows at a time (`SafetensorsDir.rows`), one parameter at a time;
jdllm checkpoints one layer's slice at a time with tensorstore (`iter_layer_slices`), Orbax one
parameter at a time as the fallback (`iter_restored_params`). The tensor-name mapping lives in
`jdllm.hf_layout`; writing checkpoints is `convert`'s job.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any, Mapping

import numpy as np

from jdllm import errors, hf_layout, host_memory
from jdllm.inputs import DTYPES, np_dtype, to_device  # noqa: F401 (DTYPES: the CLIs read it here)
from jdllm.config import ModelConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MARKER_FILE = "jdllm_config.json"
PARAMS_DIR = "params"
HF_CONFIG_COPY = "hf_config.json"
FORMAT_VERSION = 1


def one_line(e: BaseException) -> str:
    """An exception's text on one line (library messages may span several)."""
    return " ".join(str(e).split())


def is_jdllm_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER_FILE))


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


# --------------------------------------------------------------------------- safetensors (Hugging Face)
def _safetensors_error(path: str, e: Exception) -> errors.CorruptCheckpointError:
    return errors.CorruptCheckpointError(
        f"{path} is not a readable safetensors file ({type(e).__name__}: {one_line(e)}); "
        "re-download or re-export this file")


_ST_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class SafetensorsDir(Mapping):
    """Lazy {tensor name: NumPy array} over a HF directory's single or sharded safetensors.

    Opening checks the index and every shard header; a tensor is read from disk
    when it is accessed, through a mapping of its file opened for that read only (a mapping kept
    open would keep every page read so far in the process's resident memory).
    """

    def __init__(self, hf_dir: str):
        from safetensors import safe_open  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
        self.dir = os.fspath(hf_dir)
        index = os.path.join(self.dir, INDEX_FILE)
        single = os.path.join(self.dir, SINGLE_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise errors.CorruptCheckpointError(
                    f"{index} is not a valid safetensors index ({type(e).__name__}: {one_line(e)}); "
                    "it needs a 'weight_map' of tensor name -> shard file") from e
            files = sorted(set(weight_map.values()))
            for fn in files:
                if not os.path.exists(os.path.join(self.dir, fn)):
                    users = sorted(n for n, s in weight_map.items() if s == fn)
                    raise errors.MissingShardError(
                        f"shard {os.path.join(self.dir, fn)} listed in {INDEX_FILE} (holding "
                        f"{users[0]!r} and {len(users) - 1} more tensors) is missing: "
                        "download every shard of the checkpoint")
        elif os.path.exists(single):
            files, weight_map = [SINGLE_FILE], None
        else:
            raise errors.CheckpointError(
                f"{self.dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}: point at a Hugging Face "
                "model directory with safetensors weights (convert .bin weights with transformers first)")
        self._open = safe_open
        self._where: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for fn in files:
            path = os.path.join(self.dir, fn)
            try:
                with safe_open(path, framework="numpy") as h:
                    for n in h.keys():
                        info = h.get_slice(n)
                        self._where[n] = fn
                        self._shapes[n] = tuple(info.get_shape())
                        self._dtypes[n] = info.get_dtype()
            except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
                raise _safetensors_error(path, e) from e
        if weight_map is not None:
            for n, fn in weight_map.items():
                if self._where.get(n) != fn:
                    raise errors.CorruptCheckpointError(
                        f"{INDEX_FILE} places tensor {n!r} in {fn} but that shard does not hold it: "
                        "re-download the checkpoint (the index and shards disagree)")

    def __getitem__(self, name: str) -> np.ndarray:
        path = os.path.join(self.dir, self._where[name])
        try:
            with self._open(path, framework="numpy") as h:
                return h.get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise _safetensors_error(path, e) from e

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor `name` (along its first axis), read without the rest."""
        path = os.path.join(self.dir, self._where[name])
        try:
            with self._open(path, framework="numpy") as h:
                return h.get_slice(name)[start:stop]
        except Exception as e:  # noqa: BLE001
            raise _safetensors_error(path, e) from e

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def nbytes(self, name: str) -> int:
        """Bytes of tensor `name` on disk, from the header (nothing read)."""
        return int(np.prod(self._shapes[name], dtype=np.int64)) * _ST_ITEMSIZE.get(self._dtypes[name], 4)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# --------------------------------------------------------------------------- tokenizer
def load_tokenizer(path: str):
    """The directory's tokenizer (local files only, no hub access), or None without tokenizer.json."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    import transformers  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a custom model_type in config.json is expected here
    with warnings.catch_warnings():
        # AutoTokenizer reads config.json; its deprecation notes about model keys
        # (v4 `rope_scaling`, as published checkpoints have) say nothing about the tokenizer.
        warnings.simplefilter("ignore", FutureWarning)
        return _load_tokenizer(transformers, path, verbosity)


# The model types of jdllm's diffusion families: transformers registers no tokenizer for them
# (tests/test_tokenizer_loading.py checks its table), so AutoTokenizer's per-model-type corrections never
# apply and it loads the class their tokenizer_config.json names. Loading that class directly
# skips AutoTokenizer's config.json read, which imports torch wherever torch is installed (1.7 s).
_UNREGISTERED_MODEL_TYPES = frozenset({"sdar", "llada", "Dream", "Fast_dLLM_Qwen"})


def _read_json_dict(file: str) -> dict:
    """The JSON object in `file`; {} where it is missing, unreadable or not an object."""
    try:
        with open(file) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def declared_tokenizer_class(transformers, path: str):
    """The tokenizers-backed class `path`'s tokenizer_config.json names, where AutoTokenizer would
    load exactly that class; None where AutoTokenizer has to decide.

    It decides for a model type transformers knows (its corrections of hub configs are per model
    type), for custom code (`auto_map`), for no named class, and for a LlamaTokenizer (which it may
    swap for the generic class by what tokenizer.json holds). The model type comes from config.json,
    or hf_config.json in a jdllm checkpoint. The `...Fast` class is preferred, as AutoTokenizer's
    `use_fast=True` does in transformers 4 (in 5 the two names are one class).
    """
    tok_cfg = _read_json_dict(os.path.join(path, "tokenizer_config.json"))
    name = tok_cfg.get("tokenizer_class")
    if not isinstance(name, str) or not name.isidentifier() or "auto_map" in tok_cfg \
            or name.removesuffix("Fast") == "LlamaTokenizer":
        return None
    model_cfg = (_read_json_dict(os.path.join(path, CONFIG_FILE))
                 or _read_json_dict(os.path.join(path, HF_CONFIG_COPY)))
    auto_map = model_cfg.get("auto_map")
    if model_cfg.get("model_type") not in _UNREGISTERED_MODEL_TYPES \
            or (isinstance(auto_map, dict) and "AutoTokenizer" in auto_map):
        return None
    cls = None if name.endswith("Fast") else getattr(transformers, name + "Fast", None)
    cls = cls or getattr(transformers, name, None)
    fast = transformers.PreTrainedTokenizerFast
    return cls if isinstance(cls, type) and issubclass(cls, fast) else None


def _load_tokenizer(transformers, path: str, verbosity: int):
    try:
        cls = declared_tokenizer_class(transformers, path)
        if cls is not None:
            try:
                return cls.from_pretrained(path, local_files_only=True)
            except Exception:  # noqa: BLE001 (AutoTokenizer below says what is wrong, or copes)
                pass
        try:
            # trust_remote_code=False: never run (or prompt for) a model's custom code.
            return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception:  # noqa: BLE001 (a custom tokenizer_class or model_type: use the generic fast one)
            pass
        try:
            return transformers.PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise errors.CorruptCheckpointError(
                f"{os.path.join(path, 'tokenizer.json')} cannot be loaded ({type(e).__name__}: {one_line(e)}); "
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
            f"{marker} is not a valid jdllm checkpoint marker ({type(e).__name__}: {one_line(e)}); "
            "re-run `jdllm convert` to rebuild the checkpoint") from e
    if meta.get("version", 0) > FORMAT_VERSION:
        raise errors.CheckpointError(
            f"{marker} has format version {meta.get('version')}, newer than this jdllm reads "
            f"({FORMAT_VERSION}); upgrade jdllm")
    return meta


def restore_params(path: str, dtype=None, shardings=None):
    """Restore a jdllm checkpoint's params as jax Arrays (`iter_restored_params`, collected).

    dtype: cast on restore (None keeps the stored dtype, bit for bit).
    shardings: optional pytree of `jax.sharding.Sharding` matching the params,
    so each device reads only its own shards; default: the first device.
    """
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)

    meta = read_jdllm_meta(path)
    if quant.from_meta(meta.get("quantization")) is not None:
        return restore_quantized(path, meta, dtype, shardings)
    out: dict[str, Any] = {}
    for keys, x in iter_restored_params(path, dtype, shardings):
        hf_layout.set_param(out, keys, x)
    return out


def restore_quantized(path: str, meta: dict, dtype=None, shardings=None):
    """A quantized checkpoint (`jdllm convert --quantize`), restored as one tree: q / scale keep their
    stored dtypes (dtype casts the rest) and pair up into `jdllm.quant` arrays."""
    import jax  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    import orbax.checkpoint as ocp  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    QUANT_DTYPES = {jax.numpy.dtype(d) for d in quant.STORAGE.values()}
    params_dir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    want = np_dtype(dtype)
    with _restore_errors(params_dir):
        stored = _stored_tree(params_dir, meta["config"], quant.from_meta(meta.get("quantization")))
        shard_tree = (quant.checkpoint_shardings(shardings, stored) if shardings is not None
                      else jax.tree.map(lambda _: _first_device(), stored))

        def spec(m, s):  # quantized q / scale keep their stored dtypes
            keep = want is None or jax.numpy.dtype(m.dtype) in QUANT_DTYPES
            return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype if keep else want, sharding=s)

        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(params_dir, jax.tree.map(spec, stored, shard_tree))
        act = want.name if want is not None else meta.get("activation_dtype", "bfloat16")
        return quant.from_checkpoint(restored, act)


def iter_restored_params(path: str, dtype=None, shardings=None):
    """Yield (param path, jax Array) for each parameter of a jdllm checkpoint, restored one at a
    time (Orbax's partial restore): the host stages one parameter, never the whole model beside
    its device copy. Arguments: `restore_params`."""
    import jax  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    import orbax.checkpoint as ocp  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    cfg = read_jdllm_meta(path)["config"]
    params_dir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    want = np_dtype(dtype)
    with _restore_errors(params_dir):
        stored = _stored_tree(params_dir, cfg)
        shard_tree = shardings if shardings is not None else jax.tree.map(lambda _: _first_device(), stored)
        abstract = jax.tree.map(
            lambda m, s: jax.ShapeDtypeStruct(tuple(m.shape), want if want is not None else m.dtype, sharding=s),
            stored, shard_tree)
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckpt:
            for keys, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
                keys = tuple(k.key for k in keys)
                item = hf_layout.set_param({}, keys, leaf)
                got = ckpt.restore(params_dir, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                    partial_restore=True))
                for k in keys:
                    got = got[k]
                yield keys, got
                del got


def _stored_tree(params_dir: str, cfg: ModelConfig, qc=None):
    """The Orbax metadata tree of a checkpoint's params, checked against its config (a quantized
    weight by its q's shape) and its quantization `qc` (the marker's, None for a plain checkpoint:
    which weights are stored as q and scale, q's dtype, the scale's shape)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm.model import shape_mismatch  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    with ocp.StandardCheckpointer() as ckpt:
        stored = ckpt.metadata(params_dir).item_metadata.tree
    bad = shape_mismatch(quant.plain_view(stored), cfg)
    if bad is not None:
        raise errors.CorruptCheckpointError(
            f"{params_dir} disagrees with {MARKER_FILE} at parameter {bad[0]} "
            f"(stored {bad[1]}, config implies {bad[2]}); re-run `jdllm convert`")
    _check_stored_quantization(stored, cfg, qc, params_dir)
    return stored


def _check_stored_quantization(stored, cfg: ModelConfig, qc, params_dir: str) -> None:
    """QuantizationError naming the parameter when the stored arrays are not what the marker's
    quantization `qc` makes (`jdllm.quant.checkpoint_specs`): a weight stored plain that it
    quantizes or the reverse, q in another scheme's dtype, a scale of another group size."""
    import jax  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    import jax.numpy as jnp  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm.model import flat_param_specs  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)

    have = {tuple(k.key for k in keys): m for keys, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
    said = f"{MARKER_FILE}'s quantization {quant.to_meta(qc)}" if qc is not None else \
        f"{MARKER_FILE} (no quantization: a plain checkpoint)"
    if qc is None:  # plain (any layout Orbax wrote): only no q / scale pairs
        for path in sorted(have, key=str):
            if path[-1] in ("q", "scale") and len(path) > 1 and path[-2] in quant.CONTRACTED:
                raise errors.QuantizationError(
                    f"{params_dir} disagrees with {said}: it stores {'/'.join(path)}, a quantized weight; "
                    "the marker and the arrays come from different conversions: re-run `jdllm convert`")
        return
    want = quant.checkpoint_specs(flat_param_specs(cfg), qc)
    for path in sorted(set(have) | set(want), key=str):
        name = "/".join(str(k) for k in path)
        if path not in have or path not in want:
            raise errors.QuantizationError(
                f"{params_dir} disagrees with {said}: parameter {name} is "
                f"{'missing' if path not in have else 'stored but not expected'}; the marker and the "
                "arrays come from different conversions: re-run `jdllm convert`")
        got = tuple(have[path].shape)
        if got != tuple(want[path].shape):
            raise errors.QuantizationError(
                f"{params_dir} disagrees with {said}: {name} is stored with shape {got}, the quantization "
                f"implies {tuple(want[path].shape)}; re-run `jdllm convert`")
        if path[-1] == "q" and jnp.dtype(have[path].dtype) != jnp.dtype(quant.STORAGE[qc.scheme]):
            raise errors.QuantizationError(
                f"{params_dir} disagrees with {said}: {name} is stored as {jnp.dtype(have[path].dtype).name}, "
                f"scheme {qc.scheme!r} stores {jnp.dtype(quant.STORAGE[qc.scheme]).name}; re-run `jdllm convert`")


def _first_device():
    import jax  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


@contextlib.contextmanager
def _restore_errors(params_dir: str):
    """jdllm errors pass through; anything Orbax / tensorstore raises becomes a CorruptCheckpointError."""
    try:
        yield
    except errors.JdllmError:
        raise
    except Exception as e:  # noqa: BLE001 (orbax / tensorstore raise many types)
        raise errors.CorruptCheckpointError(
            f"cannot restore {params_dir} ({type(e).__name__}: {one_line(e)}); re-run `jdllm convert`") from e


SLAB_BYTES = 64 << 20  # checkpoint arrays are read and written in slabs of whole chunks about this size


def slabs(shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int, target: int | None = None):
    """Index tuples cutting an array of `shape` into whole-chunk slabs of about `target` bytes
    along its first chunked axis (one slab when no axis is), so tensorstore stages one slab at a
    time: the lm_head [D, V], chunked along V, goes in column slabs, not all at once."""
    target = SLAB_BYTES if target is None else target
    axis = next((a for a, (n, c) in enumerate(zip(shape, chunks)) if c < n), None)
    if axis is None:
        return [tuple(slice(None) for _ in shape)]
    per_chunk = int(np.prod([n if a != axis else chunks[a] for a, n in enumerate(shape)])) * itemsize
    step = chunks[axis] * max(1, target // max(1, per_chunk))
    return [tuple(slice(r, min(r + step, shape[axis])) if a == axis else slice(None) for a in range(len(shape)))
            for r in range(0, shape[axis], step)]


def restore_per_layer(path: str, cfg: ModelConfig, dtype=None, placement=None, quantize=None):
    """A jdllm checkpoint's params in the "per_layer" layout (`iter_layer_slices`, collected), or
    None when its arrays cannot be opened directly (then `restore_params`, Orbax, reads them).
    quantize (a `jdllm.quant.Quantization`): each slice is quantized as it is read, so the
    full-precision weights never all exist at once."""
    slices = iter_layer_slices(path, cfg, dtype, placement, quantize)
    if next(slices) is None:
        return None
    params: dict[str, Any] = {"layers": tuple({} for _ in range(cfg.num_layers))}
    for p, layer, x in slices:
        if layer is None:
            params[p[0]] = x
        else:
            params["layers"][layer][p[1]] = x
    return params


def iter_layer_slices(path: str, cfg: ModelConfig, dtype=None, placement=None, quantize=None):
    """Read a jdllm checkpoint with tensorstore one layer's slice at a time, each placed on the
    first device (or, under `placement`, each device reading only its own part), so the host never
    holds a stacked parameter, let alone the model twice: a load peaks at the weights plus one
    slice. quantize (a `jdllm.quant.Quantization`): each slice it selects is quantized as it is
    read, on the host with NumPy before it goes to the device (as a Hugging Face load does), or
    under `placement` on the mesh, its full-precision shards freed at once; the load then peaks
    at the quantized weights plus one full-precision slice. Yields first True (readable) or None
    (a layout this reader does not open: use `restore_params`), then (param path, layer or None,
    jax Array or `jdllm.quant.QArray`)."""
    import jax  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    import tensorstore as ts  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm.model import flat_param_specs  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    params_dir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    want = np_dtype(dtype)
    specs = flat_param_specs(cfg)
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    kvstore = {"driver": "ocdbt", "base": f"file://{params_dir}/"}
    try:
        arrays = {p: ts.open({"driver": "zarr", "kvstore": kvstore, "path": ".".join(p)}, open=True, read=True,
                             context=context).result() for p in specs}
    except Exception:  # noqa: BLE001 (not this layout: Orbax reads it, or says what is wrong)
        yield None
        return
    if any(tuple(a.shape) != specs[p].shape for p, a in arrays.items()):
        yield None  # restore_params names the parameter
        return
    yield True
    shardings = None if placement is None else placement.param_shardings(cfg, "per_layer")
    device = jax.devices()[0]

    def read(view, chunks):
        """The view's values (cast to `want`), read a slab of chunks at a time into one array."""
        view, x = view.translate_to[0], None  # a device's part keeps its offsets: index from 0
        for index in slabs(tuple(view.shape), chunks, view.dtype.numpy_dtype.itemsize):
            part = view[index].read().result()
            if x is None:
                x = np.empty(tuple(view.shape), want if want is not None else part.dtype)
            x[index] = part
            del part
        return x

    def place(view, chunks, sharding, name):
        if sharding is None:
            if quantize is not None:
                return quant.quantize_host(read(view, chunks), name, quantize, device)
            return jax.device_put(read(view, chunks), device)
        x = jax.make_array_from_callback(tuple(view.shape), sharding, lambda idx: read(view[idx], chunks))
        return x if quantize is None else quant.quantize_weight(name, x, quantize, consume=True)

    for p, arr in arrays.items():
        chunks = tuple(arr.chunk_layout.read_chunk.shape)
        try:
            if p[0] == "layers":
                for i in range(cfg.num_layers):
                    yield p, i, place(arr[i], chunks[1:], None if shardings is None else shardings["layers"][i][p[1]],
                                      p[1])
            else:
                yield p, None, place(arr, chunks, None if shardings is None else shardings[p[0]], p[0])
        except errors.JdllmError:
            raise
        except Exception as e:  # noqa: BLE001 (tensorstore raises many types)
            raise errors.CorruptCheckpointError(
                f"cannot read {params_dir} at {'/'.join(p)} ({type(e).__name__}: {one_line(e)}); "
                "re-run `jdllm convert`") from e


# --------------------------------------------------------------------------- load
ATTN_IMPLS = ("auto", "xla", "pallas", "cudnn")


def check_attn_impl(attn_impl: str) -> None:
    """`attn_impl` is one jdllm knows and one this machine can run (cuDNN needs an NVIDIA GPU)."""
    if not isinstance(attn_impl, str) or attn_impl not in ATTN_IMPLS:
        raise errors.ConfigError(f"attn_impl={attn_impl!r} is not one of {ATTN_IMPLS}; 'auto' picks for you")
    if attn_impl == "cudnn":
        import jax  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
        if jax.default_backend() != "gpu":
            raise errors.ConfigError(
                f"attn_impl='cudnn' needs an NVIDIA GPU, but JAX runs on {jax.default_backend()!r}; "
                "use attn_impl='auto' (or 'xla')")


def check_special_ids(cfg: ModelConfig, source: str) -> None:
    """mask / eos / pad / bos ids lie inside the vocabulary: an id outside it would never be
    generated (eos: rows never stop) or never match (mask: the model decodes garbage)."""
    named = [("mask_token_id", cfg.mask_token_id), ("pad_token_id", cfg.pad_token_id),
             ("bos_token_id", cfg.bos_token_id)] + [("eos_token_id", t) for t in cfg.eos_token_ids]
    for key, tid in named:
        if tid is None:
            continue
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < cfg.vocab_size:
            raise errors.ConfigError(
                f"{source}: {key}={tid!r} is outside the vocabulary [0, {cfg.vocab_size}); "
                f"set {key} in config.json to the tokenizer's id for that token")


def check_params_finite(params, cfg: ModelConfig, source: str) -> None:
    """Raise NonFiniteWeightsError naming the first tensor (by its Hugging Face name) holding NaN/inf.
    `params` in any layout; parameters absent from it (a partial tree) are skipped."""
    import jax  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    import jax.numpy as jnp  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm.model import weight  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    for slot_name, slot in hf_layout.hf_tensor_names(cfg).items():
        try:
            x = weight(params, slot.path, slot.layer, cfg)
        except (KeyError, IndexError):
            continue
        from jdllm.quant import dequantize  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
        x = dequantize(x)  # a quantized weight: checked as it computes (one weight at a time)
        if isinstance(x, np.ndarray):
            bad = ~np.isfinite(x.astype(np.float32))
            count = int(bad.sum())
        else:
            count = int(jax.device_get(jnp.sum(~jnp.isfinite(x))))
        if count:
            where = "/".join(slot.path) + (f"[{slot.layer}]" if slot.layer is not None else "")
            raise errors.NonFiniteWeightsError(
                f"tensor {slot_name!r} ({where}) in {source} holds {count} NaN/inf values: the weights "
                "are corrupt or overflowed on export; re-download or re-export them "
                "(check_finite=False / --no-check-finite loads them anyway)")


def _load_hf_params(path: str, cfg: ModelConfig, dtype, placement, check_finite: bool, stacked_shardings=None,
                    quantize=None):
    """HF safetensors -> params on the device (or the mesh of `placement`) in the layout jdllm runs
    (`jdllm.model.default_layout`), one parameter at a time: the host holds at most one stacked
    parameter, and each layer's slice goes to the device on its own, so the device never holds a
    stacked copy beside the per-layer one.
    quantize (a `jdllm.quant.Quantization`): each weight it selects is quantized as it is read, one
    layer slice at a time: on the host off a mesh, so its full-precision copy never reaches the
    device; on a mesh where its shards land, which are freed at once (with the caller's own stacked
    shardings: once the model is placed)."""
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm.model import default_layout, to_layout  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm.sharding import put  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    layout = default_layout(placement)
    # placed per layer, unfused; fused (if the layout is) once every part of a layer is there
    shardings = None if placement is None else placement.param_shardings(cfg, "per_layer")
    params: dict[str, Any] = {"layers": tuple({} for _ in range(cfg.num_layers))}

    def place(x, name, sharding):  # one weight (or layer slice) on the device / its shards, quantized if asked
        if sharding is None:
            return to_device(x) if quantize is None else quant.quantize_host(x, name, quantize)
        x = put(x, sharding)
        return x if quantize is None else quant.quantize_weight(name, x, quantize, consume=True)

    if stacked_shardings is not None:  # the caller's shardings of the stacked layout: placed stacked, then split
        params["layers"] = {}
    for p, host in hf_layout.iter_params_from_hf_tensors(SafetensorsDir(path), cfg, dtype=dtype, source=path):
        if check_finite and not np.isfinite(host.astype(np.float32)).all():
            check_params_finite(hf_layout.set_param({}, p, host), cfg, source=path)
        if stacked_shardings is not None:
            target = stacked_shardings
            for key in p:
                target = target[key]
            hf_layout.set_param(params, p, put(host, target))
        elif p[0] == "layers":
            for i, lp in enumerate(params["layers"]):
                lp[p[1]] = place(host[i], p[1], None if shardings is None else shardings["layers"][i][p[1]])
        else:
            params[p[0]] = place(host, p[0], None if shardings is None else shardings[p[0]])
        del host
        host_memory.release()  # this parameter's read buffers, before the next one's
    final = None if placement is None else placement.param_shardings(cfg, layout)
    params = to_layout(params, cfg, layout, shardings=final, consume=True)
    if quantize is not None and stacked_shardings is not None:
        params = quant.quantize_params(params, quantize, consume=True)
    return params


def check_not_prequantized(path: str, quantize) -> None:
    """A Hugging Face directory already quantized (config.json's `quantization_config`: GPTQ, AWQ,
    fp8, ...) is not read by jdllm, and quantizing it again would compound the error."""
    qcfg = _read_json_dict(os.path.join(path, CONFIG_FILE)).get("quantization_config")
    if qcfg:
        method = qcfg.get("quant_method", "?") if isinstance(qcfg, dict) else qcfg
        raise errors.QuantizationError(
            f"{os.path.join(path, CONFIG_FILE)} has quantization_config (quant_method={method!r}): these "
            f"weights are already quantized{'' if quantize is None else f', quantize={quantize.scheme!r} would quantize them twice'}; "
            "jdllm reads full-precision Hugging Face weights: use the unquantized model "
            "(then quantize=\"int8\" or \"fp8\")")


def load_model(path: str, dtype="bfloat16", attn_impl: str = "auto", shardings=None,
               check_finite: bool = False, mesh=None, rules=None, quantize=None, kv_cache=None):
    """A `jdllm.loading.Model` from a Hugging Face directory or a jdllm checkpoint directory
    (with `mesh`: params placed on it under `rules`, each device reading only its slices)."""
    from jdllm.device_memory import check_params_fit  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm.loading import Model  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    from jdllm.model import default_layout, flat_param_specs, to_layout  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    if not isinstance(path, (str, os.PathLike)):
        raise errors.ArgumentTypeError(
            f"load(path={path!r}): expected a directory path (str or os.PathLike), got {type(path).__name__}")
    check_attn_impl(attn_impl)
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
    quantize = quant.as_quantization(quantize)  # an unknown scheme fails here, before any weight is read
    if kv_cache not in quant.KV_CACHE_DTYPES:
        raise errors.QuantizationError(f"kv_cache={kv_cache!r} is not one of {quant.KV_CACHE_DTYPES}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise errors.CheckpointError(
            f"{path} is not a directory: pass a Hugging Face model directory (config.json + "
            "safetensors) or a jdllm checkpoint made by `jdllm convert`")
    placement = None
    if mesh is not None:
        from jdllm.sharding import Placement  # noqa: PLC0415 (startup: `jdllm convert --help` and config reads stay free of JAX)
        placement = Placement.of(mesh, rules)
    elif rules is not None:
        raise errors.ShardingError("rules= needs a mesh=: pass jdllm.load(path, mesh=mesh, rules=rules)")
    if is_jdllm_dir(path):
        meta = read_jdllm_meta(path)
        cfg = meta["config"]
        check_special_ids(cfg, path)
        try:
            stored_q = quant.from_meta(meta.get("quantization"))
        except (errors.QuantizationError, TypeError) as e:
            raise errors.CorruptCheckpointError(
                f"{os.path.join(path, MARKER_FILE)} has quantization {meta.get('quantization')!r}, which this jdllm "
                f"does not read ({one_line(e)}); re-run `jdllm convert`") from None
        if stored_q is not None:  # a quantized checkpoint: quantize= may only repeat what it holds
            if quantize is not None and quantize != stored_q:
                raise errors.QuantizationError(
                    f"{path} is already quantized as {stored_q} (by `jdllm convert --quantize`); "
                    f"quantize={quantize} disagrees: drop quantize= (or pass the same), or convert "
                    "the Hugging Face directory again with the scheme you want")
            quantize = None
        quant.check_shapes(quantize, flat_param_specs(cfg))  # int4's group size, before any weight is read
        if placement is not None:
            shardings = placement.param_shardings(cfg)
        check_params_fit(cfg, dtype, shardings, source=path,  # before any weight is placed
                         quantize=stored_q or quantize)
        params, late = None, quantize
        if stored_q is None and (placement is not None or shardings is None):  # read layer by layer, each
            params = restore_per_layer(path, cfg, dtype, placement, quantize)  # slice quantized as read
            late = None  # (the caller's own stacked shardings: Orbax, then quantized below)
        if params is None:
            params, late = restore_params(path, dtype=dtype, shardings=shardings), quantize
        layout = default_layout(placement)  # split per layer, each stacked array freed once split
        params = to_layout(params, cfg, layout, consume=True,
                           shardings=None if placement is None else placement.param_shardings(cfg, layout))
        params = quant.quantize_params(params, late, consume=True)
    elif is_hf_dir(path):
        cfg = ModelConfig.from_hf(path)
        check_not_prequantized(path, quantize)
        check_special_ids(cfg, os.path.join(path, CONFIG_FILE))
        quant.check_shapes(quantize, flat_param_specs(cfg))  # int4's group size, before any weight is read
        stacked = placement.param_shardings(cfg) if placement is not None else shardings
        check_params_fit(cfg, dtype, stacked, source=path, quantize=quantize)
        params = _load_hf_params(path, cfg, np_dtype(dtype), placement, check_finite,
                                 stacked_shardings=shardings if placement is None else None, quantize=quantize)
        check_finite = False  # checked on the host, before the copy to the device
    else:
        raise errors.CheckpointError(
            f"{path} has neither {CONFIG_FILE} (Hugging Face) nor {MARKER_FILE} (jdllm): "
            "point at a model directory")
    if check_finite:
        check_params_finite(params, cfg, source=path)
    quant.check_fp8_device(quantize)
    if kv_cache is not None:
        cfg = cfg.replace(kv_cache_dtype=kv_cache)
    host_memory.release()  # the read buffers, kept by the heap settings for XLA:CPU's calls, go back
    return Model(config=cfg, params=params, tokenizer=load_tokenizer(path), attn_impl=attn_impl, path=path,
                 placement=placement)


def load(path: str, dtype: str | Any = "bfloat16", attn_impl: str = "auto", check_finite: bool = False,
         mesh=None, rules=None, quantize=None, kv_cache=None):
    """Load a Hugging Face model directory or a jdllm checkpoint directory (`jdllm.load`).

    mesh: a `jax.sharding.Mesh` (`jdllm.sharding.make_mesh`, or your own `jax.make_mesh`, Auto or
    Explicit axes): the params come back placed on it (heads / MLP / vocabulary split over
    `model` under the default rules), each device reading only its own slices, and `generate`
    decodes under it (batch over `data`). rules: {logical axis: mesh axis, a tuple of them, or
    None} overriding `jdllm.sharding.DEFAULT_RULES`; every mesh axis of size > 1 must be named
    (e.g. an `fsdp` axis: rules={"batch": ("data", "fsdp")}).

    attn_impl: "auto" | "xla" | "pallas" | "cudnn" (see `pallas_kernels`).
    check_finite: scan every weight for NaN/inf first and raise
    `errors.NonFiniteWeightsError` naming the tensor (one pass over the weights;
    the `jdllm` command line does it by default).
    quantize: None (the weights in `dtype`), "int8" or "fp8" (weight-only, one scale per output
    channel; `dtype` stays the activation dtype) or a `jdllm.quant.Quantization` choosing whether
    the embedding and LM head are quantized too. Each weight is quantized as it is read.
    kv_cache: None (the KV cache in the activation dtype) or "int8" (one absmax scale per token
    and KV head; K / V dequantized where attention reads them): `config.kv_cache_dtype`.
    """
    from jdllm import compile_cache  # noqa: PLC0415

    compile_cache.enable()  # JAX's persistent compilation cache (a bad JDLLM_CACHE_DIR fails here, early)
    return load_model(path, dtype=dtype, attn_impl=attn_impl, check_finite=check_finite, mesh=mesh, rules=rules,
                      quantize=quantize, kv_cache=kv_cache)
