"""The device's own limits, measured: copy and read bandwidth and a matmul rate.

Shared by benchmarks/gpu.py (its weight-read floor) and benchmarks/attention.py (each kernel's
fraction of the limit). Each figure is `passes` passes inside one compiled loop on random data:
one dispatch, so host overhead and a first launch's clock ramp stay out (timing one pass per call
read 2,641 GB/s and 487 TFLOP/s on an H200 that other probes put at ~4.3 TB/s and ~790), and
random operands, since zeros or ones can run faster than real data.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

PASSES = 10


def median_seconds(fn, *args, iters: int, warmup: int = 1) -> float:
    """Median wall seconds of fn(*args) (jitted), after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def loop_seconds(fn, q, *rest, iters: int, passes: int = PASSES) -> float:
    """Seconds per call of fn(q, *rest) -> an array shaped like q, from `passes` calls chained in one
    compiled loop (each call's q takes a trace of the previous output, so none is hoisted or merged):
    for kernels of tens of microseconds, which one dispatch per call would measure instead."""
    def body(i, q):
        return (q + 1e-3 * fn(q, *rest).astype(q.dtype)).astype(q.dtype)
    f = jax.jit(lambda q, *rest: jax.lax.fori_loop(0, passes, body, q))
    return median_seconds(f, q, *rest, iters=iters, warmup=2) / passes


def copy_gbps(nbytes: int, iters: int, passes: int = PASSES) -> float:
    """Bytes read + written by `passes` passes of x <- x * a + b over `nbytes` of float32 (donated)."""
    x = jax.random.uniform(jax.random.key(0), (nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: jax.lax.fori_loop(0, passes, lambda i, x: x * 0.999 + 0.001, x), donate_argnums=0)
    x = jax.block_until_ready(f(x))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        x = jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return 2 * x.nbytes * passes / statistics.median(ts) / 1e9


def read_gbps(nbytes: int, iters: int, passes: int = PASSES) -> float:
    """Bytes read by `passes` max-reductions of `nbytes` of bf16 that depend on the loop's carry (so
    none is hoisted): what a decode step does to the weights."""
    w = jax.random.normal(jax.random.key(3), (nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda w: jax.lax.fori_loop(
        0, passes, lambda i, acc: acc + jnp.max(w.astype(jnp.float32) + acc * 1e-9), jnp.float32(0)))
    return w.nbytes * passes / median_seconds(f, w, iters=iters, warmup=2) / 1e9


def matmul_tflops(n: int, dtype, iters: int, passes: int = PASSES) -> float:
    """A chain of `passes` n^3 products (b scaled so the chain stays finite)."""
    a = jax.random.normal(jax.random.key(1), (n, n), dtype)
    b = (jax.random.normal(jax.random.key(2), (n, n), jnp.float32) / n ** 0.5).astype(dtype)
    f = jax.jit(lambda a, b: jax.lax.fori_loop(0, passes, lambda i, a: a @ b, a))
    return 2 * n ** 3 * passes / median_seconds(f, a, b, iters=iters, warmup=2) / 1e12
