"""The out-of-memory check before weights are placed (`jdllm.device_memory`), on the CPU with
made-up memory statistics passed in (the CPU keeps none, so there the check is skipped)."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest

import jdllm
from jdllm import device_memory, errors
from jdllm.config import ModelConfig
from jdllm.model import param_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_AR = os.path.join(ROOT, "models", "tiny-ar")
GIB = 1024 ** 3


def stats(free: int, limit: int = 80 * GIB):
    return lambda device: {"bytes_limit": limit, "bytes_in_use": limit - free}


class Split:
    """A sharding stand-in: dimension 0 split evenly over `devices` (what the check reads of a sharding)."""

    def __init__(self, devices):
        self.device_set = set(devices)

    def shard_shape(self, shape):
        return (shape[0] // len(self.device_set),) + tuple(shape[1:])


def test_bytes_match_the_loaded_weights():
    model = jdllm.load(TINY_AR, dtype="float32")
    real = sum(x.nbytes for x in jax.tree.leaves(model.params))
    shapes = jax.tree.leaves(param_shapes(model.config), is_leaf=lambda x: isinstance(x, tuple))
    dev = jax.devices()[0]
    assert device_memory.bytes_per_device([(s, np.float32, None) for s in shapes], dev) == {dev: real}
    assert device_memory.bytes_per_device([(s, "bfloat16", None) for s in shapes], dev) == {dev: real // 2}


def test_too_big_raises_naming_bytes_device_and_free_memory():
    cfg = ModelConfig.from_hf(TINY_AR)
    need = sum(math.prod(s) for s in jax.tree.leaves(param_shapes(cfg),
                                                     is_leaf=lambda x: isinstance(x, tuple))) * 4
    device_memory.check_params_fit(cfg, "float32", memory_stats=stats(need))  # exactly fits: fine
    with pytest.raises(errors.DeviceMemoryError) as info:
        device_memory.check_params_fit(cfg, "float32", memory_stats=stats(need - 1, limit=GIB))
    msg = str(info.value)
    dev = str(jax.devices()[0])
    assert f"take {need / GIB:.2f} GiB ({need:,} bytes), more than the {(need - 1) / GIB:.2f} GiB ({need - 1:,} " \
           f"bytes) free on {dev} (1.00 GiB usable" in msg, msg
    assert "float32" in msg and "dtype='bfloat16'" in msg and "model" in msg and "mesh" in msg, msg
    assert isinstance(info.value, MemoryError) and isinstance(info.value, errors.JdllmError)
    device_memory.check_params_fit(cfg, "bfloat16", memory_stats=stats(need - 1))  # half the bytes: fits


def test_no_statistics_no_check():
    cfg = ModelConfig.from_hf(TINY_AR)
    device_memory.check_params_fit(cfg, "float32", memory_stats=lambda d: None)
    device_memory.check_params_fit(cfg, "float32", memory_stats=lambda d: {"bytes_in_use": 10})
    device_memory.check_params_fit(cfg, "float32")  # the CPU's own statistics: None
    assert jax.devices()[0].memory_stats() is None or jax.default_backend() != "cpu"


def test_per_device_after_sharding():
    cfg = ModelConfig.from_hf(TINY_AR)
    shapes = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    total = sum(math.prod(s) for s in shapes) * 2
    split = Split(["gpu:0", "gpu:1"])
    shardings = jax.tree.unflatten(jax.tree.structure(param_shapes(cfg),
                                                      is_leaf=lambda x: isinstance(x, tuple)), [split] * len(shapes))
    # each device holds half: fits in a bit more than half, not in a bit less
    device_memory.check_params_fit(cfg, "bfloat16", shardings, memory_stats=stats(total // 2 + 64))
    with pytest.raises(errors.DeviceMemoryError, match="per device.*free on gpu:"):
        device_memory.check_params_fit(cfg, "bfloat16", shardings, memory_stats=stats(total // 2 - 64))
    # only the device short of memory is named
    per = {"gpu:0": total, "gpu:1": 0}
    with pytest.raises(errors.DeviceMemoryError, match="free on gpu:1 "):
        device_memory.check_params_fit(cfg, "bfloat16", shardings,
                                       memory_stats=lambda d: {"bytes_limit": total, "bytes_in_use": total - per[d]})


def test_dtype_none_reads_the_stored_dtype():
    cfg = ModelConfig.from_hf(TINY_AR)
    assert device_memory.stored_dtype(TINY_AR) == "float32"
    need = sum(x.nbytes for x in jax.tree.leaves(jdllm.load(TINY_AR, dtype="float32").params))
    with pytest.raises(errors.DeviceMemoryError, match="float32"):
        device_memory.check_params_fit(cfg, None, source=TINY_AR, memory_stats=stats(need - 1))
    device_memory.check_params_fit(cfg, None, source=None, memory_stats=stats(0))  # unknown dtype: no check


def test_placement_counts_only_moving_leaves():
    model = jdllm.load(TINY_AR, dtype="float32")
    on_device = jax.tree.map(lambda x: x.sharding, model.params)
    device_memory.check_placement_fits(model.params, on_device, memory_stats=stats(0))  # nothing moves
    mesh = jdllm.sharding.make_mesh("data=1,model=1")
    from jdllm.model import layer_layout  # noqa: PLC0415

    target = jdllm.sharding.Placement.of(mesh).param_shardings(model.config, layer_layout(model.params))
    with pytest.raises(errors.DeviceMemoryError):
        device_memory.check_placement_fits(model.params, target, memory_stats=stats(1000))
