"""Converting Hugging Face directories to jdllm checkpoints.

The checkpoint layout and everything that reads it live in `jdllm.checkpoint`;
this module writes it.

`convert_checkpoint` builds it in a temporary directory beside OUT_DIR and
renames it into place only when everything is written, so a failed or
interrupted conversion leaves nothing at OUT_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from convert import hf
from jdllm import errors
from jdllm.checkpoint import (CONFIG_FILE, FORMAT_VERSION, HF_CONFIG_COPY, MARKER_FILE, PARAMS_DIR,
                              SafetensorsDir, is_hf_dir, is_jdllm_dir, np_dtype)
from jdllm.config import ModelConfig
from jdllm.hf_layout import check_tensor_names, hf_tensor_names, params_from_hf_tensors
from jdllm.inputs import check_output_path


def save_params(params_dir: str, params) -> None:
    """Write the parameter pytree with Orbax (params_dir must not exist yet)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(params_dir), params)
        ckpt.wait_until_finished()


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
            f"{hf_dir} is not a Hugging Face model directory (no {CONFIG_FILE}): "
            "pass the directory that holds config.json and the safetensors weights")
    _check_not_nested(hf_dir, out_dir)
    if os.path.lexists(out_dir):
        _check_replaceable(out_dir)
    check_output_path(out_dir, "OUT_DIR", create_parents=True)
    want = np_dtype(dtype)
    cfg = ModelConfig.from_hf(hf_dir)
    tensors = SafetensorsDir(hf_dir)
    check_tensor_names(tensors.keys(), cfg, source=hf_dir)

    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    except OSError as e:
        raise errors.OutputPathError(
            f"cannot create OUT_DIR {out_dir} ({e.strerror or e}); choose a writable location") from None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; OUT_DIR gets ordinary permissions
        with tqdm(total=len(hf_tensor_names(cfg)), desc=f"convert {os.path.basename(hf_dir.rstrip('/'))}",
                  unit="tensor", disable=not progress) as bar:
            params = params_from_hf_tensors(tensors, cfg, dtype=want, source=hf_dir,
                                               progress=lambda name: bar.update(1))
        stored = {np.asarray(x).dtype.name for x in _leaves(params)}
        save_params(os.path.join(tmp, PARAMS_DIR), params)
        meta = {"format": "jdllm", "version": FORMAT_VERSION,
                "dtype": stored.pop() if len(stored) == 1 else "mixed",
                "source": os.path.abspath(hf_dir), "config": cfg.to_dict()}
        with open(os.path.join(tmp, MARKER_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        shutil.copyfile(os.path.join(hf_dir, CONFIG_FILE), os.path.join(tmp, HF_CONFIG_COPY))
        hf.copy_tokenizer_files(hf_dir, tmp)
        _move_into_place(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_not_nested(hf_dir: str, out_dir: str) -> None:
    """OUT_DIR may neither be, contain nor lie inside the input: replacing it would delete the model."""
    src, dst = os.path.realpath(hf_dir), os.path.realpath(out_dir)
    if src == dst:
        raise errors.OutputExistsError(f"OUT_DIR {out_dir} is the input directory; choose another OUT_DIR")
    if os.path.commonpath([src, dst]) == dst:
        raise errors.OutputExistsError(
            f"OUT_DIR {out_dir} contains the input directory {hf_dir}; replacing it would delete the "
            "model being converted: choose an OUT_DIR outside it")
    if os.path.commonpath([src, dst]) == src:
        raise errors.OutputExistsError(
            f"OUT_DIR {out_dir} lies inside the input directory {hf_dir}; choose an OUT_DIR outside it")


def _check_replaceable(out_dir: str) -> None:
    """--overwrite replaces a jdllm checkpoint or an empty directory, nothing else."""
    if os.path.isdir(out_dir) and (is_jdllm_dir(out_dir) or not os.listdir(out_dir)):
        return
    kind = "a file" if not os.path.isdir(out_dir) else "a non-empty directory that is not a jdllm checkpoint"
    raise errors.OutputExistsError(
        f"OUT_DIR {out_dir} is {kind}; --overwrite only replaces a jdllm checkpoint or an empty "
        "directory: remove it yourself or choose another OUT_DIR")


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
        _check_replaceable(out_dir)
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
