"""Root conftest: makes the checkout importable and pins tests to the CPU, except the GPU tier.

JAX_PLATFORMS, when you set it, is yours. Otherwise the tests run on the CPU
(JAX_PLATFORMS=cpu), unless the run selects the `gpu` marker (`pytest -m gpu`):
then JAX sees every platform it has, the GPU first, so the GPU tier can run
(tests/accel.py says where; the tier also needs the CPU, for its references, so
a JAX_PLATFORMS of yours without "cpu" gets ",cpu" added for `-m gpu`).

The CPU run also compiles with LLVM's backend optimization off and with XLA:CPU's
older elemental IR emitters in place of its MLIR fusion emitters (XLA_FLAGS gets
--xla_backend_optimization_level=0 and --xla_cpu_use_fusion_emitters=false, each
unless your XLA_FLAGS names that flag; the second only where this jaxlib knows it,
probed once, as XLA aborts on an unknown flag; the `gpu` tier is left alone). The
tests' models are tiny, so compiling is most of their time, and both cut it for the
same programs (XLA fuses them a little differently for the older emitters): they cover
jdllm's programs, the tests' own jitted references, eager ops and the subprocesses the
tests start (which inherit the variable).
- the level: CPU seconds on 2 shared cores, same passes: tests/test_kv_cache.py 48
  (XLA's default level) -> 30; test_kernels.py 112 -> 86, test_models.py 33 -> 26,
  test_nnx.py 58 -> 48, test_quality.py 28 -> 22.
- the emitters, on top of the level (2-core AMD EPYC, jaxlib 0.10.2, 2026-12-07): XLA
  backend compile over the whole suite 2,544 -> 913 s; the suite (`-n auto --dist
  loadfile`) 1,628 -> 924 s wall, 787 passed either way; tests/test_decode_block.py alone
  56 -> 36 s wall (77 -> 40 s CPU, two runs each, interleaved). A decode program on the
  tests' models compiles 1.5-2x faster (AR 1.45 -> 0.9 s, multi_block approx 2.7 -> 1.3 s).
  The MLIR emitters spend that time whatever the LLVM level; at XLA's default level the
  two compile alike (benchmarks/RESULTS.md, "XLA:CPU's fusion emitters off").
tests/test_xla_cpu_codegen.py decodes every paradigm under XLA's default CPU flags
(what users run) and under these, and checks that the tokens agree.
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


FAST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
# flags whose absence from this jaxlib is probed before they are set (XLA aborts the process on an unknown one)
PROBED_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def _flag_name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts `flag` in XLA_FLAGS: one CPU backend start in a subprocess
    (about 1.4 s, once per run: xdist workers and the tests' subprocesses inherit the result)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    try:
        done = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                              capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def fast_xla_flags(flags: str, knows=_xla_knows) -> str:
    """`flags` (an XLA_FLAGS value) with each of FAST_XLA_FLAGS added that it does not name already
    (a PROBED_FLAGS one only where `knows(flag)`)."""
    for flag in FAST_XLA_FLAGS:
        if _flag_name(flag) in flags or (flag in PROBED_FLAGS and not knows(flag)):
            continue
        flags = (flags + " " + flag).strip()
    return flags


def pytest_configure(config):
    platforms = os.environ.get("JAX_PLATFORMS")
    if _selects_gpu_tier(config.getoption("markexpr", "") or ""):
        if platforms and "cpu" not in platforms.split(","):
            os.environ["JAX_PLATFORMS"] = platforms + ",cpu"
    else:
        if platforms is None:
            os.environ["JAX_PLATFORMS"] = "cpu"
        # read when JAX starts its backend, after this
        os.environ["XLA_FLAGS"] = fast_xla_flags(os.environ.get("XLA_FLAGS", ""))
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
