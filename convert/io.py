"""Converting Hugging Face directories to jdllm checkpoints.

The checkpoint layout and everything that reads it live in `jdllm.checkpoint`;
this module writes it.

`convert_checkpoint` streams: each Hugging Face tensor is converted to jdllm's
layout and written (`OrbaxStreamWriter`) as soon as it is read, so the host
holds about one tensor at a time. It builds the checkpoint in a temporary
directory beside OUT_DIR and renames it into place only when everything is
written, so a failed or interrupted conversion leaves nothing at OUT_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from convert import hf
from jdllm import errors
from jdllm.checkpoint import (CONFIG_FILE, FORMAT_VERSION, HF_CONFIG_COPY, MARKER_FILE, PARAMS_DIR,
                              SafetensorsDir, is_hf_dir, is_jdllm_dir, np_dtype)
from jdllm.config import ModelConfig
from jdllm.hf_layout import check_tensor_names, hf_tensor_names, iter_hf_slices
from jdllm.inputs import check_output_path


# --------------------------------------------------------------------------- streaming Orbax writer
CHUNK_BYTES = 8 << 20  # zarr chunk target: a device restoring its slice decompresses little else
SLAB_BYTES = 64 << 20  # an unstacked parameter (the embedding) is handed to tensorstore in slabs this size


def chunk_shape(shape: tuple[int, ...], axes: tuple[str, ...], itemsize: int,
                target: int = CHUNK_BYTES) -> tuple[int, ...]:
    """zarr chunk shape of a parameter: one layer per chunk, then the axes a mesh splits (vocab,
    heads, MLP) halved until a chunk holds <= `target` bytes, so a device restoring its slices
    reads (and decompresses) only chunks it needs, for any mesh size that is a power of two."""
    chunk = list(shape)
    if axes and axes[0] == "layers":
        chunk[0] = 1
    order = [i for i, a in enumerate(axes) if a in ("vocab", "mlp", "q_heads", "kv_heads")]
    order += [i for i, a in enumerate(axes) if i not in order and a != "layers"]
    for i in order:
        while np.prod(chunk) * itemsize > target and chunk[i] % 2 == 0:
            chunk[i] //= 2
    return tuple(int(c) for c in chunk)


class OrbaxStreamWriter:
    """Writes a params tree slice by slice in the on-disk layout of Orbax's
    `StandardCheckpointer` (an OCDBT key-value store holding one zarr array per leaf, named by
    its key path, e.g. `layers.q`, plus the `_METADATA` tree description), so
    `StandardCheckpointer.restore` reads it into any shardings, each device its own slices.

    Orbax's `save` takes the whole tree; this writes each layer of a stacked parameter as soon
    as it is read, so the host holds about one tensor at a time. Chunks: `chunk_shape`.
    """

    def __init__(self, params_dir: str, cfg: ModelConfig, quantize=None):
        import tensorstore as ts  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX / tensorstore)
        from jdllm.model import flat_param_specs  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX / tensorstore)
        self.ts = ts
        self.dir = os.path.abspath(params_dir)
        os.makedirs(self.dir)
        from jdllm.quant import checkpoint_specs  # noqa: PLC0415
        self.specs = checkpoint_specs(flat_param_specs(cfg), quantize)  # a quantized weight: its q and scale
        # one context: every array shares the one OCDBT store; no chunk cache (write and forget)
        self.context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        self.kvstore = {"driver": "ocdbt", "base": f"file://{self.dir}/",
                        "config": {"compression": {"id": "zstd"}}}
        self.arrays: dict[tuple[str, ...], Any] = {}
        self.dtypes: dict[tuple[str, ...], np.dtype] = {}
        self.written: dict[tuple[str, ...], int] = {}

    def _open(self, path: tuple[str, ...], dtype: np.dtype):
        spec = self.specs[path]
        chunks = chunk_shape(spec.shape, spec.axes, dtype.itemsize)
        arr = self.ts.open({
            "driver": "zarr", "kvstore": self.kvstore, "path": ".".join(path),
            "metadata": {"shape": list(spec.shape), "chunks": list(chunks), "dtype": _zarr_dtype(dtype),
                         "compressor": {"id": "zstd", "level": 1}, "fill_value": None, "order": "C",
                         "filters": None, "dimension_separator": "."},
        }, create=True, context=self.context).result()
        self.arrays[path], self.dtypes[path] = arr, dtype
        return arr

    def write(self, path: tuple[str, ...], layer: int | None, x: np.ndarray) -> None:
        """Write `x`: the whole parameter (layer None) or layer `layer` of a stacked one (cast to
        the dtype of the parameter's first slice)."""
        arr = self.arrays.get(path)
        if arr is None:
            arr = self._open(path, np.dtype(x.dtype))
        x = x.astype(self.dtypes[path], copy=False)
        if layer is not None:
            arr[layer].write(x).result()
        else:
            rows = max(1, SLAB_BYTES // max(1, x[:1].nbytes))
            step = arr.chunk_layout.write_chunk.shape[0]
            rows = max(step, rows // step * step)
            for r in range(0, x.shape[0], rows):
                end = min(r + rows, x.shape[0])
                arr[r:end].write(x[r:end]).result()
        self.written[path] = self.written.get(path, 0) + 1

    def finish(self) -> set[str]:
        """Write Orbax's metadata files once every parameter is complete; returns the stored dtypes."""
        for path, spec in self.specs.items():
            want = spec.shape[0] if spec.axes[:1] == ("layers",) else 1
            if self.written.get(path, 0) != want:
                raise AssertionError(f"parameter {path} got {self.written.get(path, 0)} of {want} slices")
        tree = {}
        for path in sorted(self.specs, key=lambda p: [str(k) for k in p]):
            tree[str(path)] = {"key_metadata": [{"key": k, "key_type": 2} for k in path],
                               "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
        meta = {"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": False,
                "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
        with open(os.path.join(self.dir, "_METADATA"), "w") as f:
            json.dump(meta, f)
        now = time.time_ns()
        with open(os.path.join(self.dir, "_CHECKPOINT_METADATA"), "w") as f:
            json.dump({"item_handlers": "orbax.checkpoint._src.handlers.standard_checkpoint_handler."
                                        "StandardCheckpointHandler",
                       "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now,
                       "commit_timestamp_nsecs": now, "custom_metadata": {}}, f)
        self.arrays.clear()
        return {d.name for d in self.dtypes.values()}


def _zarr_dtype(dtype: np.dtype) -> str:
    return dtype.name if dtype.name in ("bfloat16", "float8_e4m3fn") else dtype.str


# --------------------------------------------------------------------------- convert
def convert_checkpoint(hf_dir: str, out_dir: str, dtype="bfloat16", overwrite: bool = False,
                       progress: bool = True, check_finite: bool = True, quantize=None) -> str:
    """Hugging Face directory -> jdllm checkpoint at out_dir (atomic: all or nothing).

    dtype: 'bfloat16' | 'float16' | 'float32', or None to keep the source dtypes.
    check_finite: refuse (`errors.NonFiniteWeightsError`, naming the tensor) weights that hold NaN / inf
    in the source or once cast to `dtype`; each slice is checked as it streams by, before it is written.
    quantize: None, "int8" / "fp8" or a `jdllm.quant.Quantization`: each weight slice is quantized
    on the host as it streams by (`jdllm.quant.checkpoint_parts`) and stored as its q and scale, so
    loading it never builds the full-precision weights; `dtype` is then the activation dtype.
    Returns the absolute out_dir.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX / tensorstore)
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
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX / tensorstore)
    from jdllm.checkpoint import check_not_prequantized  # noqa: PLC0415
    qc = quant.as_quantization(quantize)
    check_not_prequantized(hf_dir, qc)
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
        writer = OrbaxStreamWriter(os.path.join(tmp, PARAMS_DIR), cfg, quantize=qc)
        table = hf_tensor_names(cfg)
        name_of = {(tuple(slot.path), slot.layer): name for name, slot in table.items()}
        with tqdm(total=len(table), desc=f"convert {os.path.basename(hf_dir.rstrip('/'))}",
                  unit="tensor", disable=not progress) as bar:
            for path, layer, _, x in iter_hf_slices(tensors, cfg, dtype=want, source=hf_dir,
                                                    progress=lambda name: bar.update(1)):
                if check_finite:
                    where = "/".join(path) + (f"[{layer}]" if layer is not None else "")
                    _check_finite(x, name_of[(path, layer)], where, tensors, hf_dir)
                for part, y in quant.checkpoint_parts(path, x, qc):
                    writer.write(part, layer, y)
                del x
        stored = writer.finish()
        meta = {"format": "jdllm", "version": FORMAT_VERSION,
                "dtype": stored.pop() if len(stored) == 1 else "mixed",
                "source": os.path.abspath(hf_dir), "config": cfg.to_dict()}
        if qc is not None:
            meta.update(quantization=quant.to_meta(qc), activation_dtype=want.name if want is not None else "bfloat16")
        with open(os.path.join(tmp, MARKER_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        shutil.copyfile(os.path.join(hf_dir, CONFIG_FILE), os.path.join(tmp, HF_CONFIG_COPY))
        hf.copy_tokenizer_files(hf_dir, tmp)
        _move_into_place(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


CHECK_BYTES = 16 << 20  # the finiteness check widens this much of a tensor to float32 at a time


def count_non_finite(x: np.ndarray) -> int:
    """NaN / inf entries of a float array, counted a slab at a time (no full-size float32 copy)."""
    flat = x.reshape(-1)
    step = max(1, CHECK_BYTES // 4)
    return sum(int(np.count_nonzero(~np.isfinite(flat[i:i + step].astype(np.float32, copy=False))))
               for i in range(0, flat.size, step))


def _check_finite(x: np.ndarray, name: str, where: str, tensors, source: str) -> None:
    """Raise NonFiniteWeightsError naming HF tensor `name` (jdllm's `where`, e.g. layers/k[2]) when its
    converted slice `x` holds NaN / inf: corrupt weights, or (the source being finite) values beyond the
    range of the dtype converted to."""
    count = count_non_finite(x)
    if not count:
        return
    src = np.asarray(tensors[name])
    if src.dtype != x.dtype and not count_non_finite(src):
        raise errors.NonFiniteWeightsError(
            f"tensor {name!r} ({where}) in {source} has values beyond {x.dtype.name}'s range: converting it to "
            f"{x.dtype.name} makes {count} of them inf; convert with --dtype float32 or bfloat16 "
            "(dtype='float32' / 'bfloat16'), or --no-check-finite to convert them anyway")
    raise errors.NonFiniteWeightsError(
        f"tensor {name!r} ({where}) in {source} holds {count} NaN/inf values: the weights are corrupt or "
        "overflowed on export; re-download or re-export them (--no-check-finite / check_finite=False converts "
        "them anyway)")


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
