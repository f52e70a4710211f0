"""Where the `gpu` test tier runs: one place for its devices and skip markers.

`pytest -m gpu` (the root conftest then lets JAX see the GPU) runs the tier on the
first GPU, against references computed on the CPU device of the same process.
JDLLM_TEST_ACCEL=cpu makes the CPU stand in for the GPU, so that on a machine
without one `JDLLM_TEST_ACCEL=cpu python -m pytest -m gpu tests/test_gpu.py` runs
the whole tier (CPU against CPU) and proves the test code itself; unset (or
"gpu"), the tier is skipped where no GPU is visible.

- `on_accel`: a test that runs on `accel_device()` (the GPU, or the CPU stand-in);
- `needs_gpu`: a test that needs a real GPU whatever JDLLM_TEST_ACCEL says (it
  compiles Triton / Mosaic GPU kernels itself);
- `gpu_tier`: the `gpu` marker plus `on_accel`, for a whole module's `pytestmark`.
"""

from __future__ import annotations

import functools
import os

import jax
import pytest

ACCEL_ENV = "JDLLM_TEST_ACCEL"
ACCELS = ("gpu", "cpu")


def accel_kind() -> str:
    kind = os.environ.get(ACCEL_ENV, "") or "gpu"
    if kind not in ACCELS:
        raise ValueError(f"{ACCEL_ENV}={kind!r} is not one of {ACCELS}")
    return kind


@functools.lru_cache(maxsize=None)
def gpu_device():
    """The first GPU when it is JAX's default backend (what attn_impl="auto" and the kernels'
    backend choice go by), else None."""
    return jax.devices()[0] if jax.default_backend() == "gpu" else None


@functools.lru_cache(maxsize=None)
def cpu_device():
    """The CPU device the references run on."""
    return jax.devices("cpu")[0]


def accel_device():
    """The device the tier tests: the first GPU, or the CPU under JDLLM_TEST_ACCEL=cpu (which is
    for machines where the CPU is JAX's default backend); None: skip."""
    if accel_kind() == "cpu":
        return cpu_device() if jax.default_backend() == "cpu" else None
    return gpu_device()


def _gpu_reason() -> str:
    why = "needs an NVIDIA GPU as JAX's default backend"
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        why += " (JAX_PLATFORMS=cpu...: select the tier with `pytest -m gpu`, or set JAX_PLATFORMS=cuda,cpu)"
    return why


def _accel_reason() -> str:
    if accel_kind() == "cpu":
        return (f"{ACCEL_ENV}=cpu stands the CPU in for a GPU only where the CPU is JAX's default backend "
                f"(it is {jax.default_backend()!r}); unset it to test the GPU")
    return _gpu_reason() + f"; {ACCEL_ENV}=cpu runs this tier on the CPU instead"


needs_gpu = pytest.mark.skipif(gpu_device() is None, reason=_gpu_reason())
on_accel = pytest.mark.skipif(accel_device() is None, reason=_accel_reason())
gpu_tier = [pytest.mark.gpu, on_accel]

__all__ = ["ACCEL_ENV", "accel_device", "accel_kind", "cpu_device", "gpu_device", "needs_gpu", "on_accel",
           "gpu_tier"]
