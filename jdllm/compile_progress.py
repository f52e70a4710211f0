"""Progress lines while jdllm compiles, for the command line and the server (the library stays quiet).

A first call can compile for minutes on a GPU; the `jdllm` commands and the server say so on
stderr:

    jdllm generate: compiling block_diffusion for batch 1 × 384 slots …
    jdllm generate: compiling block_diffusion for batch 1 × 384 slots … 5 s
    jdllm generate: block_diffusion for batch 1 × 384 slots: compiled in 12.3 s

(or `loaded from the compilation cache in 0.8 s` when JAX's persistent cache had the program).

The library wraps each of its big jitted calls (`generate`'s decode, the serving engine's
prefill / admission / round) in `watch(fn, name, state, key)`, which does nothing unless a
caller turned the lines on with `show(prefix)` (the CLI's `main` and `jdllm.serve.server.serve` do).

How a compile is told apart from a cached call, on jax 0.10 and 0.11 alike:
- before the call: the (piece, paradigm, context, argument shapes) key is new in this process ->
  the call will compile (what a jit's own cache is keyed on), so the first line prints at once.
  `jax.jit` objects' `_cache_size()` is private and only tells after the call, too late to
  announce anything;
- during the call: `jax.monitoring` listeners (public API, the same event names in both
  versions) on the calling thread: `/jax/core/compile/jaxpr_trace_duration` (a trace: a compile
  the key did not predict, announced then), `/jax/compilation_cache/cache_hits` (the next
  program to finish compiling came from the persistent cache) and
  `/jax/core/compile/backend_compile_duration` (a program is ready: when its `fun_name` is the
  watched function's, the last line prints then, so the time excludes running it; small
  programs compiled inside the call, such as an argument's dtype conversion, are told apart by
  that name). Where no such event comes, the last line prints when the call returns.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import jax

EVERY = 5.0  # seconds between elapsed-time lines
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_sink: tuple | None = None  # (stream, prefix, every) while `show` is on
_seen: set = set()  # keys of the calls watched so far in this process
_local = threading.local()  # .watch: the call being watched on this thread
_listening = False
_lock = threading.Lock()


@contextlib.contextmanager
def show(prefix: str = "jdllm", stream=None, every: float = EVERY):
    """Within this block, watched calls print progress lines to `stream` (default stderr), each
    starting with `prefix: `, elapsed time every `every` seconds."""
    global _sink
    _listen()
    old, _sink = _sink, (stream if stream is not None else sys.stderr, prefix, every)
    try:
        yield
    finally:
        _sink = old


def watch(fn, name: str, state, key=()):
    """Context manager around one call of the jitted function `fn` on `state` (a DecodeState: its
    tokens give the batch × slots shape), named `name` in the lines (the paradigm and piece);
    `key`: the call's static arguments (paradigm, context). A no-op unless `show` is on."""
    if _sink is None:
        return contextlib.nullcontext()
    return _Watch(getattr(fn, "__name__", None), name, state, key, *_sink)


class _Watch:
    def __init__(self, fn_name, name, state, key, stream, prefix, every):
        B, S = state.tokens.shape
        self.label = f"{name} for batch {B} × {S} slots"
        self.fn_name = fn_name
        self.key = (fn_name, name, key, tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))))
                                              for x in jax.tree.leaves(state)))
        self.stream, self.prefix, self.every = stream, prefix, every
        self.announced = self.done = self.hit = False
        self.stop = threading.Event()
        self.lock = threading.Lock()  # the ticker never prints after the last line

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.outer = getattr(_local, "watch", None)
        _local.watch = self
        with _lock:
            new = self.key not in _seen
            _seen.add(self.key)
        if new:
            self.announce()
        return self

    def __exit__(self, *exc):
        _local.watch = self.outer
        self.stop.set()
        if self.announced and not self.done and exc[0] is None:
            self.finish(f"ready in {time.perf_counter() - self.t0:.1f} s")
        return False

    def say(self, text: str) -> None:
        try:
            print(f"{self.prefix}: {text}", file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed stream must not break the call
            pass

    def announce(self) -> None:
        if self.announced:
            return
        self.announced = True
        self.say(f"compiling {self.label} …")
        threading.Thread(target=self.tick, daemon=True, name="jdllm-compile-progress").start()

    def tick(self) -> None:
        n = 1
        while not self.stop.wait(self.t0 + n * self.every - time.perf_counter()):
            with self.lock:
                if self.done:
                    return
                self.say(f"compiling {self.label} … {time.perf_counter() - self.t0:.0f} s")
            n += 1

    def finish(self, how: str) -> None:
        with self.lock:
            self.done = True
            self.stop.set()
            self.say(f"{self.label}: {how}")

    def ours(self, fun_name) -> bool:
        """Whether an event's fun_name ("run", "jit(run)") is the watched function's (an event
        without one counts as ours)."""
        return fun_name is None or self.fn_name is None or fun_name in (self.fn_name, f"jit({self.fn_name})")

    def compiled(self, hit: bool) -> None:
        if self.announced and not self.done:
            dt = time.perf_counter() - self.t0
            self.finish(f"loaded from the compilation cache in {dt:.1f} s" if hit else f"compiled in {dt:.1f} s")


def _on_event(event: str, *args, **kwargs) -> None:
    w = getattr(_local, "watch", None)
    if w is None:
        return
    if event == CACHE_HIT_EVENT:  # JAX records it just before the same program's compile event
        w.hit = True
    elif event == TRACE_EVENT and w.ours(kwargs.get("fun_name")):
        w.announce()
    elif event == COMPILE_EVENT:
        hit, w.hit = w.hit, False
        if w.ours(kwargs.get("fun_name")):
            w.compiled(hit)


def _listen() -> None:
    """Register the monitoring listeners once per process (they cost a dict lookup per event)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    for register in ("register_event_listener", "register_event_duration_secs_listener"):
        fn = getattr(jax.monitoring, register, None)
        if fn is not None:
            fn(_on_event)


__all__ = ["show", "watch", "EVERY"]
