"""`jdllm.host_memory`: importing jdllm makes glibc keep large host buffers between calls (what
XLA:CPU allocates per execution, from its own threads), unless the user chose otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jdllm import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 8 allocations of 48 MB (above glibc's largest dynamic mmap threshold, 32 MiB, below a thread arena's
# 64 MiB heap), each touched and freed, from a thread other than the main one (as XLA's
# runtime threads allocate); prints the page faults they took after a first one
PROBE = """
import resource, sys, threading
sys.path.insert(0, {root!r})
import jdllm, numpy as np
from jdllm import host_memory
def touch():
    a = np.ones(12 << 20, np.float32); a[::1024].sum(); del a
def run():
    touch()
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(8):
        touch()
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
out = []
t = threading.Thread(target=run); t.start(); t.join()
print(out[0], sorted(host_memory.tune()))
"""


def _probe(**env) -> tuple[int, str]:
    e = {k: v for k, v in os.environ.items() if k not in host_memory.GLIBC_ENV + ("JDLLM_MALLOC",)}
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=ROOT)], env={**e, **env}, check=True,
                         capture_output=True, text=True).stdout.split(maxsplit=1)
    return int(out[0]), out[1].strip()


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory.skip_reason({}) is not None,
                    reason="glibc's mallopt is a Linux/glibc interface")
def test_import_keeps_large_buffers_between_calls():
    """With jdllm imported, a 48 MB buffer freed and allocated again from a worker thread reuses the
    same pages (no page faults); with JDLLM_MALLOC=off or the user's own MALLOC_ARENA_MAX, glibc maps
    fresh pages every time, as it does without jdllm (the comparison can fail)."""
    tuned, names = _probe()
    assert names == "['M_MMAP_THRESHOLD', 'M_TRIM_THRESHOLD']"
    off, none = _probe(JDLLM_MALLOC="off")
    user, none2 = _probe(MALLOC_ARENA_MAX="4")
    assert none == none2 == "[]"
    assert off >= 100 and user >= 100, (off, user)  # 8 x 48 MB of fresh pages (fewer faults with huge pages)
    assert tuned * 8 < min(off, user), (tuned, off, user)


def test_skip_reasons():
    """The user's allocator settings win: each of glibc's variables, a preloaded allocator, or
    JDLLM_MALLOC=off leaves the heap alone."""
    assert host_memory.skip_reason({"JDLLM_MALLOC": "off"}) == "JDLLM_MALLOC=off"
    assert host_memory.skip_reason({"JDLLM_MALLOC": "0"}) == "JDLLM_MALLOC=off"
    for var in host_memory.GLIBC_ENV:
        assert host_memory.skip_reason({var: "1"}) == f"{var} is set"
    assert host_memory.skip_reason({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "jemalloc is preloaded"
    if sys.platform.startswith("linux"):
        assert host_memory.skip_reason({"JDLLM_MALLOC": "on", "LD_PRELOAD": "libfoo.so"}) is None


# 6 buffers of 100 MB allocated (the main heap: under the tuned settings no mmap below 1 GiB, and up to
# 1 GiB of freed memory kept), all freed; prints the resident anonymous MB before and after release()
RELEASE_PROBE = """
import sys
sys.path.insert(0, {root!r})
import jdllm, numpy as np
from jdllm import host_memory
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) // 1024
bufs = [np.ones(25 << 20, np.float32) for _ in range(6)]
del bufs
before = anon()
ran = host_memory.release()
print(before, anon(), ran)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory.skip_reason({}) is not None,
                    reason="glibc's malloc_trim is a Linux/glibc interface")
def test_release_gives_freed_buffers_back():
    """What the tuned heap keeps after a burst of frees (a model load's read buffers), release()
    returns to the kernel: 600 MB freed stay resident until it runs. With
    JDLLM_MALLOC=off glibc returned them itself, and release() does nothing."""
    e = {k: v for k, v in os.environ.items() if k not in host_memory.GLIBC_ENV + ("JDLLM_MALLOC",)}

    def probe(**env):
        out = subprocess.run([sys.executable, "-c", RELEASE_PROBE.format(root=ROOT)], env={**e, **env},
                             check=True, capture_output=True, text=True).stdout.split()
        return int(out[0]), int(out[1]), out[2] == "True"

    before, after, ran = probe()
    assert ran and before - after >= 400, (before, after)
    before_off, after_off, ran_off = probe(JDLLM_MALLOC="off")
    assert not ran_off and before_off < before - 400, (before_off, before)
