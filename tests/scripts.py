"""One of the repository's scripts (examples/, benchmarks/) loaded as a module, for tests that call its
functions or its main()."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(relpath: str):
    """The script at `relpath` (from the repository root) as a module named after its file, registered
    in sys.modules under that name first (dataclasses look their module up by name)."""
    name = os.path.splitext(os.path.basename(relpath))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


def subprocess_env(devices: int | None = None, **extra: str) -> dict:
    """The environment for a test's child process on the CPU: this one's (the root conftest's XLA_FLAGS
    included, so the child compiles as the tests do), JAX_PLATFORMS=cpu, the checkout first on
    PYTHONPATH; `devices` fake CPU devices (--xla_force_host_platform_device_count added to
    XLA_FLAGS); then `extra`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if devices is not None:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    env.update(extra)
    return env
