"""How this process's C heap hands out large host buffers (Linux with glibc only).

XLA:CPU allocates each execution's temporary buffers with malloc and frees them when the execution
ends, from its own runtime threads. glibc serves an allocation above its mmap threshold (128 KiB,
rising to at most 32 MiB as such blocks are freed) with a fresh mmap, so every program that needs
larger buffers (a block-diffusion step's logits over a 151,936-token vocabulary: 155 MB for 8 rows
x 32 slots) gets new pages from the kernel on every call, and the kernel zeroes each 4 KiB page on
its first touch. A decode loop compiled as one program allocates once per `generate`; the
host-driven paths (the serving engine, constrained decoding, `compiled_steps`) allocate once per
step. The serving engine, 16 requests of 128 tokens: 17.1 million page faults and 68 s with glibc's
defaults, 8.8 million and 54 s with the settings below (`benchmarks/host_memory.py`).

`tune()` (run when `jdllm` is imported) makes glibc keep such buffers: no mmap below 1 GiB
(`M_MMAP_THRESHOLD`) and freed memory kept up to 1 GiB (`M_TRIM_THRESHOLD`). Blocks above a thread
arena's heap (64 MiB) are still mapped afresh: one arena for every thread (`M_ARENA_MAX` 1) would
keep those too (2.5 million faults, 49 s in the run above) but made XLA's multi-threaded compiles
~40% slower on 2 cores (the test suite: 77 -> 110 s for two files), so it is not set. The cost:
the process's resident memory stays at its high-water mark instead of shrinking between calls.
It changes nothing when `JDLLM_MALLOC=off` (or `0`), when any of glibc's own `MALLOC_ARENA_MAX`,
`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` is set (the user's choice wins), when another
allocator is preloaded (`LD_PRELOAD` naming jemalloc, tcmalloc or mimalloc), or off Linux/glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # below this, freed buffers stay in the heap for the next call

GLIBC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_DONE: dict[str, int] | None = None


def skip_reason(environ=None) -> str | None:
    """Why `tune` leaves the heap alone in this environment, or None when it tunes it."""
    env = os.environ if environ is None else environ
    if env.get("JDLLM_MALLOC", "").strip().lower() in ("off", "0", "false", "no"):
        return "JDLLM_MALLOC=off"
    user = [k for k in GLIBC_ENV if k in env]
    if user:
        return f"{user[0]} is set"
    preload = env.get("LD_PRELOAD", "")
    other = next((a for a in OTHER_ALLOCATORS if a in preload), None)
    if other:
        return f"{other} is preloaded"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    return None


def tune() -> dict[str, int]:
    """Set the two mallopt parameters once per process (see the module docstring); returns what
    was set ({} when nothing was: skipped, or not glibc). Never raises."""
    global _DONE
    if _DONE is not None:
        return _DONE
    _DONE = {}
    if skip_reason() is not None:
        return _DONE
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has mallopt with other numbers)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return _DONE
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    for name, param in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD), ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD)):
        if mallopt(param, KEEP_BYTES) == 1:  # 1: accepted
            _DONE[name] = KEEP_BYTES
    return _DONE


def release() -> bool:
    """Give the heap's free memory back to the kernel (glibc's `malloc_trim(0)`), when `tune` set
    the heap to keep it. For the end of work that frees a lot once, such as loading a model: an 8B
    model loaded with `quantize="int8"` onto one CPU device kept 3.2 GiB of freed read buffers
    (11.63 GiB resident at the end against 8.41 GiB with `JDLLM_MALLOC=off`). Returns whether it ran;
    never raises."""
    if not _DONE:
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True


__all__ = ["tune", "skip_reason", "release", "KEEP_BYTES"]
