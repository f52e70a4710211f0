"""Will the weights fit? A check before any weight is placed on an accelerator.

`jdllm.load` (and `Model.shard`, through `Placement.place_params`) call `check_params_fit`
first: the parameter bytes each device will hold (from the config's parameter shapes and the
dtype; under a mesh, each device's shards) against that device's free memory
(`device.memory_stats()`: bytes_limit - bytes_in_use). Too big -> `errors.DeviceMemoryError`
naming the bytes, the device, its free memory and the fixes, before anything is read or
compiled, instead of an allocator failure halfway through loading. Devices without memory
statistics (the CPU) are not checked. The KV cache and activations need room on top of the
weights; this check only catches the case that can never work.

`memory_stats` (a function device -> dict or None) can be passed in, so the check runs
anywhere with made-up figures (the tests do).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Iterable

import numpy as np

from jdllm import errors
from jdllm.inputs import np_dtype

GIB = 1024 ** 3


def gib(n: int) -> str:
    """Bytes as the message shows them: '14.96 GiB (16,060,522,496 bytes)'."""
    return f"{n / GIB:.2f} GiB ({n:,} bytes)"


def device_stats(device) -> dict | None:
    """`device.memory_stats()`, or None where the backend keeps none (the CPU) or raises."""
    try:
        return device.memory_stats()
    except Exception:  # noqa: BLE001 (backends without the call raise various errors)
        return None


def bytes_per_device(leaves: Iterable[tuple[tuple[int, ...], Any, Any]], default_device=None) -> dict:
    """{device: bytes} for leaves (shape, dtype, sharding or None): a sharded leaf puts one shard
    on each of its (addressable) devices, an unsharded one all of it on `default_device`."""
    out: dict = {}
    for shape, dtype, sharding in leaves:
        size = np.dtype(dtype).itemsize
        if sharding is None:
            devices, shard = [default_device], shape
        else:
            devices = getattr(sharding, "addressable_devices", None) or sharding.device_set
            shard = sharding.shard_shape(tuple(shape))
        n = math.prod(shard) * size
        for d in devices:
            out[d] = out.get(d, 0) + n
    return out


def check_fits(need: dict, what: str, memory_stats: Callable | None = None) -> None:
    """Raise `errors.DeviceMemoryError` if a device's share in `need` ({device: bytes}) exceeds
    its free memory. what: how to name the data ("the model's parameters in bfloat16")."""
    stats_of = device_stats if memory_stats is None else memory_stats
    sharded = len(need) > 1
    for device, n in need.items():
        stats = stats_of(device) if device is not None else None
        if not stats or "bytes_limit" not in stats:
            continue
        limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
        free = limit - used
        if n > free:
            raise errors.DeviceMemoryError(
                f"{what} take {gib(n)}{' per device' if sharded else ''}, more than the {gib(free)} free on "
                f"{device} ({limit / GIB:.2f} GiB usable, {used / GIB:.2f} GiB in use): load in a smaller dtype "
                "(dtype='bfloat16' halves float32), or on a mesh whose `model` axis splits the weights over "
                "several devices (jdllm.load(path, mesh=jdllm.sharding.make_mesh('data=1,model=N'))), or free "
                "the device's memory")


def stored_dtype(source: str | None) -> str | None:
    """The dtype a model directory stores its weights in, from jdllm_config.json ("dtype") or a
    Hugging Face config.json ("torch_dtype" / "dtype"); None when it does not say."""
    if not source:
        return None
    for name, keys in (("jdllm_config.json", ("dtype",)), ("config.json", ("torch_dtype", "dtype"))):
        try:
            with open(os.path.join(source, name)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        for k in keys:
            if isinstance(meta.get(k), str):
                return meta[k]
    return None


def check_params_fit(cfg, dtype, shardings=None, *, source: str | None = None, devices=None,
                     memory_stats: Callable | None = None, quantize=None) -> None:
    """Before loading `cfg`'s weights in `dtype` (None: the dtype `source` stores, see
    `stored_dtype`; unknown -> no check) placed with `shardings` (a pytree of shardings like the
    params, or None: all on `devices[0]`, default the first device): raise
    `errors.DeviceMemoryError` where they cannot fit (see `check_fits`). quantize (a
    `jdllm.quant.Quantization`): the weights it selects count one byte per value."""
    import jax  # noqa: PLC0415

    from jdllm.model import param_shapes  # noqa: PLC0415

    if dtype is not None:
        dt = np_dtype(dtype)
    else:
        try:
            dt = np_dtype(stored_dtype(source))
        except errors.ConfigError:  # a stored dtype jdllm does not name: no estimate, no check
            return
        if dt is None:
            return
    shapes = param_shapes(cfg)
    leaves = []  # (shape, dtype, sharding) per parameter, paired by position in the tree
    one_byte = np.dtype(np.int8)

    def add(path, s, p):
        name = getattr(path[-1], "key", None)
        leaves.append((s, one_byte if quantize is not None and quantize.wants(name) else dt, p))

    jax.tree_util.tree_map_with_path(
        add, shapes, jax.tree.map(lambda _: None, shapes, is_leaf=_is_shape) if shardings is None else shardings,
        is_leaf=_is_shape)
    default = (devices or jax.devices())[0] if shardings is None else None
    check_fits(bytes_per_device(leaves, default), f"the model's parameters in {dt.name}", memory_stats)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def check_placement_fits(params, shardings, memory_stats: Callable | None = None) -> None:
    """Before placing `params` (arrays) with `shardings` (`Placement.place_params`): the same check
    for the leaves that move (one already placed with its target sharding costs nothing)."""
    import jax  # noqa: PLC0415

    pairs = []
    jax.tree.map(lambda x, s: pairs.append((x, s)), params, shardings)
    moving = [(np.shape(x), x.dtype, s) for x, s in pairs if getattr(x, "sharding", None) != s]
    if moving:
        dt = {np.dtype(d).name for _, d, _ in moving}
        check_fits(bytes_per_device(moving), f"the model's parameters in {'/'.join(sorted(dt))}", memory_stats)


__all__ = ["check_params_fit", "check_placement_fits", "check_fits", "bytes_per_device", "stored_dtype",
           "device_stats"]
