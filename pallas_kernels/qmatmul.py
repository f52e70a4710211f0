"""Weight-only quantized matmul for a few rows: y = (x @ q) * scale, q in int8 or fp8.

At batch 1 a decode step's matmuls have 1 to 64 rows and read every weight once: their time is the
weight bytes over the memory bandwidth, and storing the weights in 8 bits halves it only if the
matmul reads those 8 bits and converts them on chip. XLA's path (the convert fused into a GEMM of
its own choosing) did not: on an H100, 8B shape, batch 1 (2026-11-26, `benchmarks/gpu.py`), int8
weights ran AR at 6.47 ms per token against bf16's 6.45 for half the bytes.

This kernel tiles the output columns (`block_n`) and splits the contraction (`splits`) so that a
matrix of a few thousand columns still gives every multiprocessor programs to run; each program
walks its share of the contraction in `block_k` steps: it loads an int8 / fp8 tile, converts it to
x's dtype in registers, and accumulates x_tile . w_tile in float32 (x padded to 16 rows on Triton,
the smallest dot it takes). The split partials [splits, rows, N] are summed, scaled per output
column and cast by XLA in one small fusion. `transpose=True` takes the weight as [N, K] (a tied
embedding [vocab, hidden] serving as the LM head).

Backends as for the attention kernels: "triton" on a GPU, "interpret" elsewhere (the CPU tests run
the same kernel body). `fits()` says whether a shape has tiles; the caller keeps XLA's matmul for
the rest and for more than `MAX_ROWS` rows, where the matmul is no longer a pass over the weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (MIN_TILE, compiler_params, default_backend, dot, env_switch, int8_from_words,
                                   int8_to_float32, int8_words, next_pow2, pad_axis, plain_backend)

MAX_ROWS = 64  # rows (batch x tokens) up to which a matmul runs here
BLOCK_N = 128
BLOCK_K = 128
TARGET_PROGRAMS = 264  # twice an H100's 132 multiprocessors
MODES = ("dot", "reduce", "accumulate")
# `qmatmul(words=None)` (what jdllm runs) reads this at trace time: 1 reads a [K, N] weight as int32 words
# (`gpu.py --xla-flags-variants "" JDLLM_QMATMUL_WORDS=1` times both end to end); unset or 0: as bytes
WORDS_ENV = "JDLLM_QMATMUL_WORDS"


def _tile(n: int, want: int, least: int) -> int | None:
    """The largest power of two <= want (and >= least) dividing n, or None."""
    t = want
    while t >= least:
        if n % t == 0:
            return t
        t //= 2
    return None


def plan(rows: int, K: int, N: int, backend: str | None = None, *, block_k: int = BLOCK_K, block_n: int = BLOCK_N,
         splits: int | None = None, mode: str = "dot"):
    """(rows padded, block_k, block_n, splits) for x [rows, K] . w [K, N], or None when no tiling fits.

    block_k / block_n: the largest tiles wanted (powers of two; smaller ones that divide K / N are
    taken). splits: contraction splits (None: enough programs for TARGET_PROGRAMS; it must divide
    K's tiles). modes "reduce" and "accumulate" (one row only) leave the row unpadded."""
    backend = plain_backend(backend or default_backend())
    least = MIN_TILE if backend == "triton" else 1
    if rows < 1 or rows > MAX_ROWS or (mode != "dot" and rows != 1):
        return None
    bk, bn = _tile(K, block_k, least), _tile(N, block_n, least)
    if bk is None or bn is None:
        return None
    rp = 1 if mode != "dot" else max(least, next_pow2(rows))
    k_tiles, programs = K // bk, N // bn
    if splits is None:
        want = max(1, -(-TARGET_PROGRAMS // programs))
        splits = max(s for s in range(1, min(want, k_tiles, 16) + 1) if k_tiles % s == 0)
    elif k_tiles % splits:
        return None
    return rp, bk, bn, splits


def fits(rows: int, K: int, N: int, backend: str | None = None) -> bool:
    return plan(rows, K, N, backend) is not None


def _as_f32(w):
    """A weight tile in float32: int8 by integer ops (`int8_to_float32`; Triton's int8 -> float32 is the
    GPU's quarter-rate int-to-float instruction), fp8 by its conversion."""
    return int8_to_float32(w) if w.dtype == jnp.int8 else w.astype(jnp.float32)


def _kernel(x_ref, w_ref, o_ref, *, block_k, steps, transpose, mode, words_of=None):
    s = pl.program_id(1)
    k0 = s * (steps * block_k)

    def body(j, acc):
        k = pl.ds(pl.multiple_of(k0 + j * block_k, block_k), block_k)
        x = x_ref[:, k]
        if mode == "reduce":  # one row: multiply and sum on the CUDA cores, no tensor-core layout
            xf = x.astype(jnp.float32)  # [1, bk]
            if transpose:  # w [bn, bk]
                return acc + jnp.sum(_as_f32(w_ref[:, k]) * xf, axis=1)[None, :]
            return acc + jnp.sum(_as_f32(w_ref[k, :]) * xf.T, axis=0)[None, :]
        if transpose:  # w [bn, K]: contract its last axis
            w = w_ref[:, k].astype(x.dtype)
            return acc + dot(x, w, ((1,), (1,)))
        if words_of is not None:  # w_ref: [K, bn / 4] int32 words, unpacked to [bk, bn] of the weight's dtype
            w = int8_from_words(w_ref[k, :])
            w = w if words_of == jnp.int8 else lax.bitcast_convert_type(w, words_of)
        else:
            w = w_ref[k, :]
        return acc + dot(x, w.astype(x.dtype), ((1,), (0,)))

    if mode == "accumulate":  # one row, products summed into a tile-shaped accumulator, reduced once
        def fold(j, acc):
            k = pl.ds(pl.multiple_of(k0 + j * block_k, block_k), block_k)
            xf = x_ref[:, k].astype(jnp.float32)  # [1, bk]
            if transpose:  # w [bn, bk]
                return acc + _as_f32(w_ref[:, k]) * xf
            return acc + _as_f32(w_ref[k, :]) * xf.T  # w [bk, bn]

        bn = o_ref.shape[-1]
        acc = lax.fori_loop(0, steps, fold, jnp.zeros((bn, block_k) if transpose else (block_k, bn), jnp.float32))
        o_ref[...] = jnp.sum(acc, axis=1)[None, :] if transpose else jnp.sum(acc, axis=0)[None, :]
        return
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = lax.fori_loop(0, steps, body, acc)


def qmatmul(x, q, scale, *, transpose: bool = False, out_dtype=None, backend: str | None = None,
            num_warps: int = 4, num_stages: int = 3, block_k: int = BLOCK_K, block_n: int = BLOCK_N,
            splits: int | None = None, mode: str = "dot", words: bool | None = None):
    """(x [M, K] . q [K, N] (transpose: q [N, K]) in float32) * scale [N] -> [M, N] in `out_dtype`
    (x's dtype by default). q is int8 or float8; its values convert to x's dtype exactly.

    words (mode "dot", q [K, N], column tiles of 64 or more; None: `$JDLLM_QMATMUL_WORDS`, 1 on,
    unset or 0 off): the kernel reads q as int32 words [K, N / 4] (a bitcast) and unpacks their bytes
    in registers (`common.int8_from_words`). From an int8 / fp8 [K, N] tile, the dot, which
    contracts its rows, reads the weight out of shared memory one byte per instruction (128
    `ld.shared.b8` in the PTX); from words, none. Untimed.

    The tiling knobs (block_k, block_n, splits, num_warps, num_stages, and mode "reduce": one row as
    multiply-and-sum instead of a dot, each step summed across the threads; "accumulate": one row's
    products added into an accumulator of the tile's shape and summed once at the end, the reading
    of `flash._attend_one_row`) are for `benchmarks/qmatmul.py`'s sweep; the defaults are what
    jdllm runs."""
    if mode not in MODES:
        raise ValueError(f"qmatmul: mode {mode!r} is not one of {MODES}")
    backend = plain_backend(backend or default_backend())
    M, K = x.shape
    N = q.shape[0] if transpose else q.shape[1]
    if (q.shape[1] if transpose else q.shape[0]) != K or scale.shape != (N,):
        raise ValueError(f"qmatmul: x {x.shape}, q {q.shape} (transpose={transpose}), scale {scale.shape}")
    p = plan(M, K, N, backend, block_k=block_k, block_n=block_n, splits=splits, mode=mode)
    if p is None:
        raise ValueError(f"qmatmul: no tiling for {M} rows x K {K} x N {N} on {backend} (block_k {block_k}, "
                         f"block_n {block_n}, splits {splits}, mode {mode}; see plan())")
    rp, bk, bn, splits = p
    steps = K // bk // splits
    xp = pad_axis(x, 0, rp)
    words = (env_switch(WORDS_ENV) if words is None else words) and mode == "dot" and not transpose and bn % 64 == 0
    w_spec = (pl.BlockSpec((bn, K), lambda n, s: (n, 0)) if transpose
              else pl.BlockSpec((K, bn // 4 if words else bn), lambda n, s: (0, n)))
    words_of = q.dtype if words else None
    if words:  # the same bytes, 4 to an int32
        q = int8_words(lax.bitcast_convert_type(q, jnp.int8))
    part = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, steps=steps, transpose=transpose, mode=mode, words_of=words_of),
        grid=(N // bn, splits),
        in_specs=[pl.BlockSpec((rp, K), lambda n, s: (0, 0)), w_spec],
        out_specs=pl.BlockSpec((None, rp, bn), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, rp, N), jnp.float32),
        compiler_params=compiler_params(backend, num_warps, num_stages),
        interpret=backend == "interpret",
        name="jdllm_qmatmul",
    )(xp, q)
    y = (part[0] if splits == 1 else jnp.sum(part, axis=0))[:M] * scale.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)
