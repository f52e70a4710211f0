"""Counting jit traces in tests, from JAX's own monitoring events (no counters in the library).

    with traces() as seen:
        jdllm.generate(...)
    assert seen["run"] == 0          # the decode loop was not traced again

`seen` maps a traced function's name (`loop.run` traces as "run") to how many times it was
traced inside the block; a trace is what precedes every new compile of a jitted function.
"""

from __future__ import annotations

import collections
import contextlib

import jax

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def traces():
    seen: collections.Counter = collections.Counter()

    def listen(event, duration, **kw):
        if event == TRACE_EVENT:
            seen[kw.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
