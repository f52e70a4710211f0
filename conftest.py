"""Root conftest: makes the checkout importable and pins tests to the CPU."""
import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_code():
    """Free every compiled XLA executable after each test module.

    Each XLA:CPU executable keeps memory mappings of its own; a whole suite's
    worth of them passes the kernel's `vm.max_map_count` (65530 by default) and
    the next compile dies inside LLVM (SIGSEGV / SIGABRT). Tests that count
    compiles do so within one module, so dropping the caches between modules
    changes no result.
    """
    yield
    import jax  # noqa: PLC0415 (the settings above must come first)

    jax.clear_caches()
