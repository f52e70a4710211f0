"""Test-session settings.

JAX's persistent compilation cache (`jdllm.compile_cache`, on by default) goes to a fresh
temporary directory per test session, never the user's ~/.cache/jdllm/xla: set here, before any
test imports jdllm, and inherited by every subprocess a test starts (the CLI, sharding and
multi-host runs), then removed when the session ends. Per-session rather than off, measured on
a 2-core CPU: the in-process modules cost the same either way (tests/test_decode_ar.py +
test_generate_api.py: 50.8 s CPU off, 51.0 s with the cache), the subprocess ones are a little
cheaper with it (test_cli_errors.py: 68.8 s CPU off, 64.5 s with it, the same programs compiled
once for all its processes), and the suite then runs the configuration users get. Tests of the
cache itself (tests/test_compile_cache.py) set their own environment.

`JDLLM_TEST_CACHE_DIR=path` keeps the cache in `path` across sessions instead (a developer's
choice, never the default): a second session then loads every program it compiled before
(tests/test_decode_block.py + test_serve_engine.py + test_decode_ar_spec.py: 142 s CPU with a
cold cache, 31 s warm, the same 28 passes).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_KEEP = os.environ.get("JDLLM_TEST_CACHE_DIR")
_CACHE = _KEEP or tempfile.mkdtemp(prefix="jdllm-test-xla-cache-")
os.environ["JDLLM_CACHE_DIR"] = _CACHE


def pytest_sessionfinish(session, exitstatus):
    if not _KEEP:
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture
def fast_compile():
    """jdllm's compiles in this test with FAST_COMPILE (`jdllm.compiler_options`): a test or module
    asks for it by name (`pytest.mark.usefixtures("fast_compile")`), nothing to import."""
    import jdllm  # noqa: PLC0415 (jdllm after JDLLM_CACHE_DIR is set above)
    from tests.decode_fixtures import FAST_COMPILE  # noqa: PLC0415

    with jdllm.compiler_options(**dict(FAST_COMPILE)):
        yield
