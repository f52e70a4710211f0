"""Root conftest: makes the checkout importable and pins tests to the CPU, except the GPU tier.

JAX_PLATFORMS, when you set it, is yours. Otherwise the tests run on the CPU
(JAX_PLATFORMS=cpu), unless the run selects the `gpu` marker (`pytest -m gpu`):
then JAX sees every platform it has, the GPU first, so the GPU tier can run
(tests/accel.py says where; the tier also needs the CPU, for its references, so
a JAX_PLATFORMS of yours without "cpu" gets ",cpu" added for `-m gpu`).

The CPU run also compiles with LLVM's backend optimization off (XLA_FLAGS gets
--xla_backend_optimization_level=0, unless your XLA_FLAGS names that flag; the
`gpu` tier is left alone). The tests' models are tiny, so compiling is most of
their time: this level halves XLA:CPU compile time for the same HLO and the same
float semantics (the decode tests already compiled jdllm's programs so, through
tests/decode_fixtures.FAST_COMPILE), and now also covers the tests' own jitted
references, eager ops and the subprocesses they start (which inherit the variable).
CPU seconds on 2 shared cores, same passes: tests/test_kv_cache.py 48 (XLA's default
level) -> 30; against level 2, test_kernels.py 112 -> 86, test_models.py 33 -> 26,
test_nnx.py 58 -> 48, test_quality.py 28 -> 22.
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


FAST_XLA_FLAG = "--xla_backend_optimization_level=0"


def pytest_configure(config):
    platforms = os.environ.get("JAX_PLATFORMS")
    if _selects_gpu_tier(config.getoption("markexpr", "") or ""):
        if platforms and "cpu" not in platforms.split(","):
            os.environ["JAX_PLATFORMS"] = platforms + ",cpu"
    else:
        if platforms is None:
            os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_backend_optimization_level" not in flags:  # read when JAX starts its backend, after this
            os.environ["XLA_FLAGS"] = (flags + " " + FAST_XLA_FLAG).strip()
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
