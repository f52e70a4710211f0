"""Root conftest: makes the checkout importable and pins tests to the CPU, except the GPU tier.

JAX_PLATFORMS, when you set it, is yours. Otherwise the tests run on the CPU
(JAX_PLATFORMS=cpu), unless the run selects the `gpu` marker (`pytest -m gpu`):
then JAX sees every platform it has, the GPU first, so the GPU tier can run
(tests/accel.py says where; the tier also needs the CPU, for its references, so
a JAX_PLATFORMS of yours without "cpu" gets ",cpu" added for `-m gpu`).
"""
import os
import re

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _selects_gpu_tier(markexpr: str) -> bool:
    """Whether `-m markexpr` keeps a test marked only `gpu` and drops an unmarked one."""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression  # noqa: PLC0415 (pytest's own -m parser)

        expr = Expression.compile(markexpr)
        return expr.evaluate(lambda name, **kw: name == "gpu") and not expr.evaluate(lambda name, **kw: False)
    except Exception:  # noqa: BLE001 (a pytest without that module: read the expression plainly)
        return re.search(r"(?<!not )\bgpu\b", markexpr) is not None


def pytest_configure(config):
    platforms = os.environ.get("JAX_PLATFORMS")
    if _selects_gpu_tier(config.getoption("markexpr", "") or ""):
        if platforms and "cpu" not in platforms.split(","):
            os.environ["JAX_PLATFORMS"] = platforms + ",cpu"
    elif platforms is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import sys  # noqa: PLC0415

    if "jax" in sys.modules and os.environ.get("JAX_PLATFORMS") != platforms:  # a plugin imported jax first
        sys.modules["jax"].config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


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
