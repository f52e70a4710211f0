"""Converting Hugging Face directories to jdllm checkpoints.

The checkpoint layout and everything that reads it live in `jdllm.checkpoint`;
this module writes it.

`convert_checkpoint` streams, one Hugging Face tensor at a time, through a pipeline:

    read (safetensors) -> rename / transpose / cast to jdllm's layout (`iter_hf_slices`)
      -> finiteness check -> `Transform` (per tensor; identity by default, e.g. quantization)
      -> write (`OrbaxStreamWriter`, as one layer's slice of its stacked parameter)

so the host holds about one tensor at a time, never the model (peak RSS <= 3 x the largest
tensor + 1 GB: `benchmarks/checkpoint_scale.py`). It builds the checkpoint in a temporary
directory beside OUT_DIR and renames it into place only when everything is written, so a
failed or interrupted conversion (an exception, Ctrl-C, SIGTERM) leaves nothing at OUT_DIR;
a temporary directory a killed conversion (SIGKILL, power loss) left is removed by the next
conversion to the same OUT_DIR. The source is only ever read.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Any, Iterable

import numpy as np

from convert import hf
from jdllm import errors
from jdllm.checkpoint import (CONFIG_FILE, FORMAT_VERSION, HF_CONFIG_COPY, MARKER_FILE, PARAMS_DIR,
                              SafetensorsDir, is_hf_dir, is_jdllm_dir, np_dtype, slabs)
from jdllm.config import ModelConfig
from jdllm.hf_layout import check_tensor_names, hf_tensor_names, iter_hf_slices
from jdllm.inputs import check_output_path
from jdllm.process import interrupt_outside_gc


# --------------------------------------------------------------------------- streaming Orbax writer
CHUNK_BYTES = 8 << 20  # zarr chunk target: a device restoring its slice decompresses little else
SLAB_BYTES = 64 << 20  # a slice is handed to tensorstore in slabs of whole chunks about this size


def chunk_shape(shape: tuple[int, ...], axes: tuple[str, ...], itemsize: int,
                target: int | None = None) -> tuple[int, ...]:
    """zarr chunk shape of a parameter: one layer per chunk, then the axes a mesh splits (vocab,
    heads, MLP) halved until a chunk holds <= `target` bytes, so a device restoring its slices
    reads (and decompresses) only chunks it needs, for any mesh size that is a power of two."""
    target = CHUNK_BYTES if target is None else target
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

    def __init__(self, params_dir: str, cfg: ModelConfig, specs: dict | None = None):
        import tensorstore as ts  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX / tensorstore)
        from jdllm.model import flat_param_specs  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX / tensorstore)
        self.ts = ts
        self.dir = os.path.abspath(params_dir)
        os.makedirs(self.dir)
        self.specs = flat_param_specs(cfg) if specs is None else specs
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
        chunks = tuple(arr.chunk_layout.write_chunk.shape)
        if layer is not None:
            arr, chunks = arr[layer], chunks[1:]
        for index in slabs(x.shape, chunks, x.dtype.itemsize, SLAB_BYTES):
            arr[index].write(x[index]).result()
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
    return dtype.name if dtype.name in ("bfloat16", "float8_e4m3fn", "int4") else dtype.str


# --------------------------------------------------------------------------- per-tensor transform
Path = tuple[str, ...]


class Transform:
    """One step of the conversion pipeline, applied to each tensor as it streams by: after the
    rename / transpose / cast to `dtype` and the finiteness check, before the write. This one
    passes every slice through unchanged; a subclass (weight quantization) overrides what it needs.

    A slice is one Hugging Face tensor in jdllm's layout: parameter `path` (e.g. ("layers", "q")),
    `layer` (its index in the stacked parameter, None for unstacked ones such as the embedding).
    """

    def specs(self, specs: dict[Path, Any]) -> dict[Path, Any]:
        """The stored parameters' {path: `jdllm.model.ParamSpec`} (stacked shapes, logical axes)
        given the model's: a transform that reshapes parameters or adds some (scales) says so
        here; the writer creates each array from its spec (its dtype from its first slice) and
        checks every one is complete."""
        return specs

    def __call__(self, path: Path, layer: int | None, x: np.ndarray) -> Iterable[tuple[Path, np.ndarray]]:
        """The slices to write for one converted tensor, as (path, array) pairs; each goes to
        `layer` of its parameter (or the whole parameter when layer is None)."""
        return ((path, x),)

    def marker(self) -> dict[str, Any]:
        """Keys added to the checkpoint's jdllm_config.json (e.g. {"quantization": {...}}), so a
        loader can tell how the stored weights were transformed."""
        return {}


class QuantizeTransform(Transform):
    """Weight-only quantization as the conversion streams (`jdllm convert --quantize`): each weight
    slice the scheme covers is quantized on the host (`jdllm.quant.checkpoint_parts`) and stored
    as its q and scale, so loading the checkpoint never builds the full-precision weights."""

    def __init__(self, qc, activation_dtype=None):
        self.qc, self.act = qc, activation_dtype

    def specs(self, specs):
        from jdllm.quant import checkpoint_specs  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX)
        return checkpoint_specs(specs, self.qc)

    def __call__(self, path, layer, x):
        from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX)
        return quant.checkpoint_parts(path, x, self.qc)

    def marker(self):
        from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX)
        return {"quantization": quant.to_meta(self.qc),
                "activation_dtype": self.act.name if self.act is not None else "bfloat16"}


# --------------------------------------------------------------------------- convert
def convert_checkpoint(hf_dir: str, out_dir: str, dtype="bfloat16", overwrite: bool = False,
                       progress: bool = True, check_finite: bool = True,
                       transform: Transform | None = None, quantize=None) -> str:
    """Hugging Face directory -> jdllm checkpoint at out_dir (atomic: all or nothing).

    dtype: 'bfloat16' | 'float16' | 'float32', or None to keep the source dtypes.
    check_finite: refuse (`errors.NonFiniteWeightsError`, naming the tensor) weights that hold NaN / inf
    in the source or once cast to `dtype`; each slice is checked as it streams by, before it is written.
    progress: a progress bar on stderr, in bytes of the source read and converted.
    transform: a per-tensor `Transform` between the cast and the write (default: none).
    quantize: None, "int8" / "fp8" / "int4" or a `jdllm.quant.Quantization` (int4's group size: its
    `group_size`, which must divide every quantized weight's contracted axis: checked before anything
    is written): each weight slice is quantized on the host as it streams by
    (`jdllm.quant.checkpoint_parts`) and stored as its q and scale, so loading it never builds the
    full-precision weights; `dtype` is then the activation dtype.
    Returns the absolute out_dir.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX / tensorstore)
    hf_dir, out_dir = os.fspath(hf_dir), os.path.abspath(os.fspath(out_dir))
    if os.path.lexists(out_dir) and not overwrite:
        raise errors.OutputExistsError(
            f"{out_dir} already exists: pass --overwrite (overwrite=True) to replace it, "
            "or choose another OUT_DIR")
    if not os.path.isdir(hf_dir) or not is_hf_dir(hf_dir):
        if not os.path.exists(hf_dir):
            why = "does not exist"
        elif not os.path.isdir(hf_dir):
            why = "is a file, not a Hugging Face model directory"
        elif is_jdllm_dir(hf_dir):
            raise errors.CheckpointError(
                f"{hf_dir} is already a jdllm checkpoint: load it as it is (jdllm.load, `jdllm generate`); "
                "to convert again (e.g. with --quantize), pass the Hugging Face directory it came from")
        else:
            why = f"is not a Hugging Face model directory (no {CONFIG_FILE})"
        raise errors.CheckpointError(
            f"{hf_dir} {why}: pass the directory that holds config.json and the safetensors weights")
    _check_not_nested(hf_dir, out_dir)
    if os.path.lexists(out_dir):
        _check_replaceable(out_dir)
    check_output_path(out_dir, "OUT_DIR", create_parents=True, directory=True)
    want = np_dtype(dtype)
    from jdllm import quant  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX / tensorstore)
    from jdllm.checkpoint import check_not_prequantized  # noqa: PLC0415
    qc = quant.as_quantization(quantize)
    check_not_prequantized(hf_dir, qc)
    cfg = ModelConfig.from_hf(hf_dir)
    tensors = SafetensorsDir(hf_dir)
    check_tensor_names(tensors.keys(), cfg, source=hf_dir)

    if transform is not None and qc is not None:
        raise ValueError("pass either transform or quantize, not both")
    transform = (QuantizeTransform(qc, want) if qc is not None else Transform()) if transform is None else transform
    from jdllm.model import flat_param_specs  # noqa: PLC0415 (startup: `jdllm convert --help` stays free of JAX)
    specs = transform.specs(flat_param_specs(cfg))

    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        remove_stale_temporaries(out_dir)
        tmp = tempfile.mkdtemp(prefix=_tmp_prefix(out_dir), dir=parent)
    except OSError as e:
        raise errors.OutputPathError(
            f"cannot create OUT_DIR {out_dir} ({e.strerror or e}); choose a writable location") from None
    try:
        with _terminate_as_interrupt():
            _claim(tmp)
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; OUT_DIR gets ordinary permissions
            writer = OrbaxStreamWriter(os.path.join(tmp, PARAMS_DIR), cfg, specs)
            table = hf_tensor_names(cfg)
            name_of = {(tuple(slot.path), slot.layer): name for name, slot in table.items()}
            total = sum(tensors.nbytes(name) for name in table)
            with tqdm(total=total, desc=f"convert {os.path.basename(hf_dir.rstrip('/'))}", unit="B",
                      unit_scale=True, unit_divisor=1024, disable=not progress) as bar:
                for path, layer, _, x in iter_hf_slices(tensors, cfg, dtype=want, source=hf_dir):
                    name = name_of[(path, layer)]
                    if check_finite:
                        where = "/".join(path) + (f"[{layer}]" if layer is not None else "")
                        _check_finite(x, name, where, tensors, hf_dir)
                    for out_path, y in transform(path, layer, x):
                        writer.write(out_path, layer, y)
                        del y
                    del x
                    bar.update(tensors.nbytes(name))
            stored = writer.finish()
            meta = {"format": "jdllm", "version": FORMAT_VERSION,
                    "dtype": stored.pop() if len(stored) == 1 else "mixed",
                    "source": os.path.abspath(hf_dir), "config": cfg.to_dict()}
            extra = transform.marker()
            if set(extra) & set(meta):
                raise ValueError(f"Transform.marker() may not replace {sorted(set(extra) & set(meta))}")
            meta.update(extra)
            _write_marker(tmp, meta, hf_dir)
            _move_into_place(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_marker(tmp: str, meta: dict, hf_dir: str) -> None:
    """jdllm_config.json, the source config.json and the tokenizer files; the owner file goes."""
    with open(os.path.join(tmp, MARKER_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    shutil.copyfile(os.path.join(hf_dir, CONFIG_FILE), os.path.join(tmp, HF_CONFIG_COPY))
    hf.copy_tokenizer_files(hf_dir, tmp)
    os.remove(os.path.join(tmp, OWNER_FILE))


# --------------------------------------------------------------------------- interruption
OWNER_FILE = ".jdllm-convert-owner"  # "host pid" of the conversion writing a temporary directory


def _tmp_prefix(out_dir: str) -> str:
    return f".{os.path.basename(out_dir)}.tmp-"


def _claim(tmp: str) -> None:
    with open(os.path.join(tmp, OWNER_FILE), "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(out_dir: str) -> list[str]:
    """Remove the temporary directories beside `out_dir` that a conversion killed outright
    (SIGKILL, out of memory, power loss) left: those whose owner, on this host, is no longer
    running. A running conversion's, another host's (a shared file system) and anything without
    an owner file stay. Returns the paths removed."""
    parent, prefix = os.path.dirname(out_dir), _tmp_prefix(out_dir)
    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return removed
    for n in names:
        path = os.path.join(parent, n)
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                host, pid = f.read().split()
            pid = int(pid)
        except (OSError, ValueError):
            continue
        if host == socket.gethostname() and pid != os.getpid() and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a `kill`, a job scheduler, a container stopping) raises KeyboardInterrupt here,
    as Ctrl-C does, so the conversion removes its temporary directory on the way out instead of
    dying with it in place. Only from the main thread, where Python delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = interrupt_outside_gc(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
