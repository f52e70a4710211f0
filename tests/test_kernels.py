"""Pallas attention kernels against the XLA reference.

CPU: Pallas interpret mode on small shapes (a sparse grid: every kind, block
sizes 1/4/32/64, tile and non-tile lengths, left padding with rows that see
nothing, GQA 1/2/4/8, head_dim 64/128, float32, bfloat16 and float16; prefill
chunks and windows whose last rows sit at the cache's end, kv_len = S not a tile
multiple, with window split counts that do not divide the live key tiles). Output buffers
are poisoned with NaN so an element the kernel forgets to write fails the
comparison; K/V tiles the rule hides are NaN-filled so a kernel that reads
them fails too. Also: the tile schedule against brute force, traced offsets
under jit, vmap, gradients (Pallas backward kernels), the model forward with
attn_impl="pallas" vs "xla", and the Triton lowering for CUDA (lowering only).
The Mosaic GPU (Hopper) kernel: Pallas's GPU interpret mode (NaN-initialised
outputs) against the reference, its knobs, vmap, gradients with the Pallas
backward, the model on that backend, and its Mosaic GPU lowering for CUDA.
GPU tests (marked `gpu`) compile and run the Triton and Mosaic kernels and are
skipped when no GPU (or, for Mosaic, no Hopper GPU) is present (`tests.accel.needs_gpu`;
tests/test_gpu.py holds the rest of the GPU tier). The float32 kernels' dots
are checked to lower to IEEE float32, not TF32, whatever the global precision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kernels
from jdllm import errors
from jdllm.config import ModelConfig
from jdllm.model import KVCache, default_positions, forward, init_params
from pallas_kernels import common, flash
from pallas_kernels.reference import attention_reference
from tests.accel import needs_gpu
from tests.quick import slow, slow_except

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}
EXACT = "highest"  # the references' XLA dots: float32 ones would run in TF32 on a GPU by default


def _qkv(seed, B, T, S, H, KV, D, dtype):
    """Fresh standard-normal q [B, T, H, D], k, v [B, S, KV, D] (numpy RNG: no per-shape compile)."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                 for shape in ((B, T, H, D), (B, S, KV, D), (B, S, KV, D)))


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "kernel left unwritten (NaN-poisoned) or non-finite elements"
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _check(fn, *, kind, block_size, B, T, S, H, KV, D, start, q_offset, kv_len, tiles,
           dtype=jnp.float32, seed=0, backend="interpret", poison=True):
    q, k, v = _qkv(seed, B, T, S, H, KV, D, dtype)
    start = jnp.asarray(start, jnp.int32)
    kw = dict(q_offset=q_offset, kv_len=kv_len, kind=kind, block_size=block_size)
    run = jax.jit(functools.partial(fn, **kw, tiles=tiles, backend=backend, poison=poison))
    out = run(q, k, v, start=start)
    with jax.default_matmul_precision(EXACT):
        ref = jax.jit(functools.partial(attention_reference, **kw))(q, k, v, start=start)
    err = _rel_err(out, ref)
    assert err <= TOL[dtype], f"max abs err {err:.3g} x max|ref| exceeds {TOL[dtype]}"
    return out, ref


# ----------------------------------------------------------------------------- prefill
# (kind, block_size, B, T, S, q_offset, kv_len, H, KV, D, start, tiles, dtype)
PREFILL = [
    # tile multiples, MHA, no padding
    ("causal", 1, 1, 64, 64, 0, 64, 4, 4, 64, [0], (32, 16), jnp.float32),
    # T, S not tile multiples; GQA 2; head_dim 128; left padding
    ("causal", 1, 2, 37, 37, 0, 37, 4, 2, 128, [0, 9], (16, 16), jnp.float32),
    ("block_causal", 4, 2, 45, 45, 0, 45, 8, 2, 64, [0, 13], (16, 8), jnp.float32),
    ("block_causal", 32, 2, 96, 96, 0, 96, 8, 1, 64, [3, 40], (32, 16), jnp.float32),
    ("block_causal", 64, 2, 130, 130, 0, 130, 2, 2, 128, [0, 70], (64, 32), jnp.float32),
    ("bidirectional", 1, 2, 33, 33, 0, 33, 4, 2, 64, [0, 20], (16, 16), jnp.float32),
    # chunk at an offset into a longer, partly stale cache: row 1's first queries see nothing
    ("block_causal", 4, 2, 20, 50, 24, 44, 4, 1, 128, [0, 30], (8, 8), jnp.float32),
    # bfloat16
    ("block_causal", 4, 2, 50, 50, 0, 50, 4, 2, 128, [0, 7], (16, 16), jnp.bfloat16),
    ("bidirectional", 1, 2, 24, 40, 16, 40, 2, 1, 64, [0, 12], (8, 8), jnp.bfloat16),
    # a chunk whose last rows sit at the cache's end (q_offset + T = kv_len = S, S not a tile
    # multiple: the last key tile is part padding), float16 and float32
    ("block_causal", 4, 2, 20, 50, 30, 50, 4, 2, 64, [0, 33], (8, 16), jnp.float16),
    ("causal", 1, 1, 37, 100, 63, 100, 4, 1, 128, [5], (16, 32), jnp.float32),
]


@pytest.mark.parametrize("kind,bs,B,T,S,qoff,kvl,H,KV,D,start,tiles,dtype", slow_except(PREFILL, PREFILL[1]))
def test_prefill_matches_reference(kind, bs, B, T, S, qoff, kvl, H, KV, D, start, tiles, dtype):
    _check(flash.prefill_attention, kind=kind, block_size=bs, B=B, T=T, S=S, H=H, KV=KV, D=D,
           start=start, q_offset=qoff, kv_len=kvl, dtype=dtype,
           tiles=flash.Tiles(block_q=tiles[0], block_k=tiles[1]))


def test_rows_that_see_nothing_are_zero():
    """Causal, q_offset 24, row 1 starts at 30: its queries at slots 24..29 return exact zeros."""
    out, ref = _check(flash.prefill_attention, kind="causal", block_size=1, B=2, T=12, S=40, H=2,
                      KV=1, D=64, start=[0, 30], q_offset=24, kv_len=36,
                      tiles=flash.Tiles(block_q=8, block_k=8))
    assert np.all(np.asarray(out)[1, :6] == 0.0) and np.all(np.asarray(ref)[1, :6] == 0.0)
    assert np.all(np.abs(np.asarray(out)[1, 6:]) > 0)


@slow
@pytest.mark.parametrize("variant,kind,bs,T,qoff,horizon", [
    ("prefill", "causal", 1, 8, 8, 16),  # last query p = 15 sees slots < 16
    ("window", "block_causal", 4, 4, 16, 20),  # queries 16..19 see slots < 20
])
def test_tiles_outside_the_rule_are_never_read(variant, kind, bs, T, qoff, horizon):
    """K/V tiles wholly past the horizon, or wholly before a row's start, are NaN: the result stays finite.

    A kernel that loaded such a tile and masked it would still fail: 0 * NaN in
    the P @ V product is NaN.
    """
    B, S, H, KV, D, bk = 2, 48, 4, 2, 64, 8
    q, k, v = _qkv(11, B, T, S, H, KV, D, jnp.float32)
    start = np.array([0, 8], np.int32)
    slot = np.arange(S)[None, :, None, None]
    dead = (slot >= pl.cdiv(horizon, bk) * bk) | (slot < start[:, None, None, None])  # whole tiles
    kw = dict(start=jnp.asarray(start), q_offset=qoff, kv_len=S, kind=kind, block_size=bs)
    tiles = flash.Tiles(block_q=8, block_k=bk, block_r=8, num_splits=3)
    fn = flash.prefill_attention if variant == "prefill" else flash.window_attention
    out = jax.jit(functools.partial(fn, **kw, tiles=tiles, backend="interpret"))(
        q, jnp.where(dead, jnp.nan, k), jnp.where(dead, jnp.nan, v))
    ref = jax.jit(functools.partial(attention_reference, **kw))(
        q, jnp.where(dead, 0.0, k), jnp.where(dead, 0.0, v))
    assert _rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("kind,bs", [("causal", 1), ("block_causal", 4), ("block_causal", 32),
                                     ("bidirectional", 1)])
def test_tile_schedule_is_exact(kind, bs):
    """_tile_bounds vs brute force: visited tiles = tiles with a visible pair; unmasked = fully visible.

    For random (start, kv_len, q_offset, query tile), every tile outside [a, d)
    has no visible (query, key) pair, every tile in [a, d) that holds a visible
    pair is visited, and [b, c) is exactly the set of tiles every query of the
    query tile sees whole, so only boundary tiles pay for the mask.
    """
    bq, bk, S, T = 8, 8, 96, 40
    rng = np.random.default_rng(12)
    n = 200
    start = rng.integers(0, 60, n)
    qoff = rng.integers(0, 50, n)
    kvl = np.minimum(qoff + T + rng.integers(-10, 30, n), S)
    tile = rng.integers(0, pl.cdiv(T, bq), n)
    p_first = qoff + tile * bq
    p_last = qoff + np.minimum(tile * bq + bq - 1, T - 1)

    def bounds(start, kvl, p_first, p_last):
        return common.tile_bounds(start=start, kvl=kvl, p_first=p_first, p_last=p_last, lo_slot=0,
                                  hi_slot=S, block_k=bk, kind=kind, block_size=bs)

    a, b, c, d = (np.asarray(x) for x in jax.jit(jax.vmap(bounds))(
        *(jnp.asarray(x, jnp.int32) for x in (start, kvl, p_first, p_last))))
    for i in range(n):
        p = np.arange(p_first[i], p_last[i] + 1)
        hz = {"causal": p + 1, "block_causal": (p // bs + 1) * bs, "bidirectional": np.full_like(p, kvl[i])}
        end = np.minimum(hz[kind], kvl[i])
        keys = np.arange(S)
        vis = (keys[None] >= start[i]) & (keys[None] < end[:, None])  # [queries, S]
        per_tile = vis.reshape(len(p), S // bk, bk)
        any_vis = per_tile.any(axis=(0, 2))
        all_vis = per_tile.all(axis=(0, 2))
        t = np.arange(S // bk)
        visited = (t >= a[i]) & (t < d[i])
        unmasked = (t >= b[i]) & (t < c[i])
        assert a[i] <= b[i] <= c[i] <= d[i]
        assert not (any_vis & ~visited).any(), "a tile with visible keys is skipped"
        assert not (visited & ~any_vis).any(), "a tile without visible keys is loaded"
        assert (unmasked == all_vis).all(), "mask skipped on a partial tile or paid on a full one"


# ----------------------------------------------------------------------------- window
# (kind, block_size, B, T, S, q_offset, kv_len, H, KV, D, start, (block_r, block_k, splits), dtype)
WINDOW = [
    ("block_causal", 4, 2, 4, 64, 40, 44, 8, 2, 64, [0, 42], (8, 8, 3), jnp.float32),
    # S not a tile multiple; GQA 8; head_dim 128; row 1's first three queries see nothing
    ("causal", 1, 2, 8, 100, 60, 68, 8, 1, 128, [0, 63], (16, 16, 4), jnp.float32),
    ("bidirectional", 1, 2, 16, 80, 32, 48, 4, 4, 64, [5, 0], (16, 8, None), jnp.float32),
    ("block_causal", 32, 1, 32, 128, 64, 96, 4, 2, 128, [0], (32, 16, 2), jnp.bfloat16),
    ("block_causal", 64, 1, 64, 192, 64, 128, 4, 1, 64, [17], (64, 32, 3), jnp.float32),
    ("block_causal", 1, 2, 3, 50, 20, 23, 4, 1, 64, [0, 21], (4, 8, 7), jnp.bfloat16),
    # windows whose last rows sit at the cache's end (q_offset + T = kv_len = S, S not a tile
    # multiple) with split counts that do not divide the live key tiles: 13 tiles over 5 splits
    # (float16), 7 over 3, 3 over 2 (the last split short or empty, its bound clipped at S)
    ("block_causal", 32, 1, 32, 200, 168, 200, 8, 2, 64, [0], (16, 16, 5), jnp.float16),
    ("causal", 1, 2, 8, 100, 92, 100, 4, 2, 64, [0, 37], (8, 16, 3), jnp.float32),
    ("bidirectional", 1, 2, 16, 90, 74, 90, 4, 1, 64, [3, 50], (16, 32, 2), jnp.bfloat16),
    # one split (the merge is a division), a row whose keys start past kv_len (it sees nothing)
    ("causal", 1, 2, 1, 96, 80, 81, 4, 2, 64, [0, 90], (8, 16, 1), jnp.float32),
    # one split over 6 rows (T 3 x 2 heads per KV head) in a row tile of 8: the kernel writes the
    # attention itself, its last two rows past the output's end
    ("block_causal", 2, 2, 3, 40, 30, 33, 4, 2, 64, [0, 31], (8, 16, 1), jnp.bfloat16),
]


@pytest.mark.parametrize("kind,bs,B,T,S,qoff,kvl,H,KV,D,start,tiles,dtype", slow_except(WINDOW, WINDOW[0]))
def test_window_matches_reference(kind, bs, B, T, S, qoff, kvl, H, KV, D, start, tiles, dtype):
    _check(flash.window_attention, kind=kind, block_size=bs, B=B, T=T, S=S, H=H, KV=KV, D=D,
           start=start, q_offset=qoff, kv_len=kvl, dtype=dtype,
           tiles=flash.Tiles(block_r=tiles[0], block_k=tiles[1], num_splits=tiles[2]))


def test_window_split_count_from_the_environment(monkeypatch):
    """`JDLLM_WINDOW_SPLITS` fixes the window kernel's split count where Tiles leaves it open (a
    benchmark variant: one split for short caches), capped at one split per key tile; the output is
    the reference's either way, and a bad value is a jdllm error naming the variable."""
    from jdllm import errors

    B, T, S, H, KV, D = 1, 1, 96, 4, 2, 64
    monkeypatch.delenv(flash.SPLITS_ENV, raising=False)
    auto = flash._default_splits(2, 6)
    assert auto == 6  # 2 programs, 6 key tiles: every tile its own split to fill the cores
    # the one-row kernel aims at more programs per core than the dot's kernels (8B AR at 32k: 32
    # heads, 528 key tiles), where the key tiles allow it
    cores = getattr(jax.devices()[0], "core_count", None) or 132
    wide = flash._default_splits(32, 528, flash.ONE_ROW_PROGRAMS_PER_CORE)
    assert wide == min(528, -(-flash.ONE_ROW_PROGRAMS_PER_CORE * cores // 32)) > flash._default_splits(32, 528)
    assert flash._default_splits(2, 6, flash.ONE_ROW_PROGRAMS_PER_CORE) == 6
    for value, want in (("1", 1), ("4", 4), ("64", 6)):
        monkeypatch.setenv(flash.SPLITS_ENV, value)
        assert flash._default_splits(2, 6) == want
    monkeypatch.setenv(flash.SPLITS_ENV, "1")
    _check(flash.window_attention, kind="causal", block_size=1, B=B, T=T, S=S, H=H, KV=KV, D=D, start=[3],
           q_offset=80, kv_len=81, dtype=jnp.float32, tiles=flash.Tiles(block_r=8, block_k=16))
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(flash.SPLITS_ENV, bad)
        with pytest.raises(errors.ConfigError, match=flash.SPLITS_ENV):
            flash._default_splits(2, 6)


@slow
def test_window_traced_offset_and_length_under_jit():
    """q_offset / kv_len as traced scalars (decoding with a KV cache): one compile, many windows."""
    B, T, S, H, KV, D = 2, 4, 72, 4, 2, 64
    q, k, v = _qkv(3, B, T, S, H, KV, D, jnp.float32)
    start = jnp.array([0, 9], jnp.int32)
    tiles = flash.Tiles(block_r=8, block_k=16, num_splits=3)
    traces = []

    @jax.jit
    def step(q, k, v, q_offset, kv_len):
        traces.append(1)
        return flash.attention(q, k, v, start=start, q_offset=q_offset, kv_len=kv_len,
                               kind="block_causal", block_size=4, tiles=tiles, variant="window")

    ref_step = jax.jit(lambda q, k, v, off, n: attention_reference(
        q, k, v, start=start, q_offset=off, kv_len=n, kind="block_causal", block_size=4))
    for off in (8, 36, 68):
        args = (q, k, v, jnp.int32(off), jnp.int32(off + T))
        assert _rel_err(step(*args), ref_step(*args)) <= 1e-5
    assert len(traces) == 1


@slow
def test_auto_variant_and_dispatcher():
    """impl="pallas" through the dispatcher picks window for a short window, prefill otherwise."""
    assert flash.choose_variant(8, 256) == "window"
    assert flash.choose_variant(200, 256) == "prefill"
    assert flash.choose_variant(16, 16) == "prefill"
    q, k, v = _qkv(4, 2, 6, 30, 4, 2, 64, jnp.float32)
    kw = dict(start=jnp.array([0, 4]), q_offset=20, kv_len=26, kind="block_causal", block_size=2)
    out = jax.jit(functools.partial(pallas_kernels.attention, **kw, impl="pallas"))(q, k, v)
    ref = jax.jit(functools.partial(pallas_kernels.attention, **kw, impl="xla"))(q, k, v)
    assert _rel_err(out, ref) <= 1e-5


# ----------------------------------------------------------------------------- poisoning
class _HalfStore:
    """Stands in for an output ref and stores only the first half of each tile's rows."""

    def __init__(self, ref):
        self.ref, self.dtype, self.shape = ref, ref.dtype, ref.shape

    def __setitem__(self, idx, value):
        half = value.shape[0] // 2
        self.ref[pl.ds(0, half), :] = value[:half]


def test_poison_catches_an_unwritten_tile(monkeypatch):
    """A kernel that forgets half of its stores leaves NaN behind, so the checks above can fail."""
    original = flash._prefill_kernel

    def lazy(*refs, **kw):
        original(*refs[:-1], _HalfStore(refs[-1]), **kw)

    monkeypatch.setattr(flash, "_prefill_kernel", lazy)
    q, k, v = _qkv(5, 1, 16, 16, 2, 2, 64, jnp.float32)
    out = flash.prefill_attention(q, k, v, start=jnp.zeros((1,), jnp.int32), kind="causal",
                                  tiles=flash.Tiles(block_q=8, block_k=8), backend="interpret",
                                  poison=True)
    out = np.asarray(out)  # [1, 16, 2, 64]: rows 0-3 and 8-11 written, 4-7 and 12-15 not
    written = np.array([True] * 4 + [False] * 4 + [True] * 4 + [False] * 4)
    assert np.isfinite(out[:, written]).all() and np.isnan(out[:, ~written]).all()
    with pytest.raises(AssertionError, match="unwritten"):
        _rel_err(out, np.ones_like(out))


# ----------------------------------------------------------------------------- gradients
@slow
@pytest.mark.parametrize("variant,kind,bs,T,S,qoff,H,KV,D,start,bwd_tiles,dtype", [
    ("prefill", "block_causal", 4, 21, 21, 0, 8, 2, 64, [0, 5], (8, 8), jnp.float32),
    # window over a cache; row 1's first three queries see nothing
    ("window", "causal", 1, 6, 40, 28, 8, 2, 64, [0, 31], (8, 8), jnp.float32),
    ("prefill", "bidirectional", 1, 12, 40, 24, 4, 4, 128, [0, 30], (4, 16), jnp.bfloat16),
    # at the cache's end (q_offset + T = kv_len = S, S not a tile multiple), float16; the window's
    # 2 splits over 7 key tiles
    ("window", "block_causal", 4, 8, 50, 42, 8, 2, 64, [0, 19], (8, 8), jnp.float16),
    ("prefill", "causal", 1, 20, 45, 25, 4, 2, 64, [0, 30], (8, 16), jnp.float16),
])
def test_grad_matches_reference(variant, kind, bs, T, S, qoff, H, KV, D, start, bwd_tiles, dtype):
    """jax.grad through the custom_vjp (Pallas backward kernels) equals the reference's gradients."""
    B = 2
    q, k, v = _qkv(6, B, T, S, H, KV, D, dtype)
    w = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape, np.float32))
    kw = dict(start=jnp.array(start), q_offset=qoff, kv_len=qoff + T, kind=kind, block_size=bs)
    tiles = flash.Tiles(block_q=8, block_k=8, block_r=8, num_splits=2, block_q_bwd=bwd_tiles[0],
                        block_k_bwd=bwd_tiles[1])

    def loss_pallas(q, k, v):
        out = flash.attention(q, k, v, **kw, tiles=tiles, variant=variant)
        return jnp.sum(w * out.astype(jnp.float32))

    def loss_ref(q, k, v):
        return jnp.sum(w * attention_reference(q, k, v, **kw).astype(jnp.float32))

    val, grads = jax.jit(jax.value_and_grad(loss_pallas, argnums=(0, 1, 2)))(q, k, v)
    val_r, grads_r = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1, 2)))(q, k, v)
    assert abs(float(val - val_r)) <= TOL[dtype] * (abs(float(val_r)) + 1.0)
    for g, gr in zip(grads, grads_r):
        assert g.dtype == gr.dtype
        assert _rel_err(g, gr) <= TOL[dtype]


@slow
def test_vmap_over_examples_with_own_offsets():
    """jax.vmap (RL rollouts) over examples, each with its own start / q_offset: values and grads."""
    N, B, T, S, H, KV, D = 3, 2, 6, 30, 4, 2, 64
    rng = np.random.default_rng(13)
    q = jnp.asarray(rng.standard_normal((N, B, T, H, D), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((N, B, S, KV, D), np.float32)) for _ in range(2))
    start = jnp.array([[0, 3], [1, 2], [0, 22]], jnp.int32)
    off = jnp.array([10, 20, 24], jnp.int32)
    tiles = flash.Tiles(block_r=8, block_k=8, num_splits=2, block_q_bwd=8, block_k_bwd=8)

    def pallas(q, k, v, st, o):
        return flash.attention(q, k, v, start=st, q_offset=o, kv_len=o + T, kind="block_causal",
                               block_size=4, tiles=tiles, variant="window")

    def ref(q, k, v, st, o):
        return attention_reference(q, k, v, start=st, q_offset=o, kv_len=o + T, kind="block_causal",
                                   block_size=4)

    for fn, tol in ((lambda f: f, 1e-5), (lambda f: jax.grad(lambda *a: jnp.sum(f(*a) ** 2)), 1e-5)):
        got = jax.jit(jax.vmap(fn(pallas)))(q, k, v, start, off)
        want = jax.jit(jax.vmap(fn(ref)))(q, k, v, start, off)
        assert _rel_err(got, want) <= tol


# ----------------------------------------------------------------------------- errors
def test_bad_inputs_raise_named_errors():
    q, k, v = _qkv(8, 1, 4, 4, 3, 2, 64, jnp.float32)
    with pytest.raises(errors.InputError, match="multiple of kv heads"):
        flash.attention(q, k, v, start=jnp.zeros((1,), jnp.int32))
    q, k, v = _qkv(8, 1, 4, 4, 2, 2, 64, jnp.float32)
    with pytest.raises(errors.ConfigError, match="sliding"):
        flash.attention(q, k, v, start=jnp.zeros((1,), jnp.int32), kind="sliding")
    with pytest.raises(ValueError, match="power of two"):
        flash.Tiles(block_q=48)
    # an int8 cache's scales: both or neither, with an int8 cache, one per key and KV head
    k8 = jnp.zeros(k.shape, jnp.int8)
    sc = jnp.ones(k.shape[:-1] + (1,), jnp.float32)
    for kk, ks, vs, word in ((k8, sc, None, "go together"), (k, sc, sc, "int8 cache"),
                             (k8, sc[:, :2], sc, "int8 KV scales must be")):
        with pytest.raises(errors.InputError, match=word):
            flash.attention(q, kk, kk, start=jnp.zeros((1,), jnp.int32), k_scale=ks, v_scale=vs, backend="interpret")


# ----------------------------------------------------------------------------- model level
def _tiny_cfg(kind: str) -> ModelConfig:
    return ModelConfig(model_type="test", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention=kind,
                       block_size=4 if kind == "block_causal" else 1)


@slow
@pytest.mark.parametrize("kind", ["causal", "block_causal", "bidirectional"])
def test_model_forward_pallas_equals_xla(kind):
    """jdllm.model.forward: attn_impl="pallas" (interpret) equals "xla", without and with a KVCache.

    Without a cache the prefill kernel runs (T == S); with one, a prompt is
    written into a 24-slot cache and a 4-token window then attends over it
    (the window kernel).
    """
    cfg = _tiny_cfg(kind)
    params = init_params(cfg, jax.random.key(0))
    B, P, W = 2, 10, 4
    start = jnp.array([0, 3], jnp.int32)
    tokens = jax.random.randint(jax.random.key(1), (B, P + W), 0, cfg.vocab_size)

    @functools.partial(jax.jit, static_argnames="impl")
    def run(params, tokens, impl):
        full, _ = forward(params, cfg, tokens, default_positions(start, 0, P + W), start=start,
                          attn_impl=impl)
        cache = KVCache.empty(cfg, B, 24)
        _, cache = forward(params, cfg, tokens[:, :P], default_positions(start, 0, P), start=start,
                           cache=cache, attn_impl=impl)
        win, cache = forward(params, cfg, tokens[:, P:], default_positions(start, P, W),
                             start=start, cache=cache.commit(P), attn_impl=impl)
        return full, win, cache.k

    for got, want in zip(run(params, tokens, "pallas"), run(params, tokens, "xla")):
        assert _rel_err(got, want) <= 1e-5


@slow
def test_model_forward_on_the_mosaic_backend(monkeypatch):
    """A bfloat16 block-causal model through attn_impl="pallas" with the Mosaic kernel = "xla"."""
    from pallas_kernels import mosaic

    calls = []
    kernel = mosaic.prefill_attention
    monkeypatch.setattr(mosaic, "prefill_attention", lambda *a, **kw: (calls.append(1),
                                                                       kernel(*a, **kw))[1])
    monkeypatch.setenv(flash.BACKEND_ENV, "mosaic_interpret")
    cfg = ModelConfig(model_type="test", vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                      attention="block_causal", block_size=4)
    params = init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.2)
    start = jnp.array([0, 6], jnp.int32)
    tokens = jax.random.randint(jax.random.key(1), (2, 70), 0, cfg.vocab_size)
    logits = {impl: forward(params, cfg, tokens, default_positions(start, 0, 70), start=start,
                            attn_impl=impl)[0] for impl in ("pallas", "xla")}
    assert calls, "the Mosaic kernel did not run"
    assert _rel_err(logits["pallas"], logits["xla"]) <= 5e-2


# ----------------------------------------------------------------------------- a stacked cache, in place
def _pallas_operands(closed):
    """The avals of every operand of every pallas_call in a jaxpr (and in the jaxprs inside it)."""
    from jax.extend.core import jaxprs_in_params

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.extend(v.aval for v in eqn.invars)
            else:
                for sub in jaxprs_in_params(eqn.params):
                    walk(sub)

    walk(closed.jaxpr)
    return found


def _pallas_operand_shapes(closed):
    """Shapes of every operand of every pallas_call in a jaxpr (and in the jaxprs inside it), and the
    output shapes of its dynamic_slice / slice / gather eqns."""
    from jax.extend.core import jaxprs_in_params

    into, sliced = [], []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                into.extend(tuple(v.aval.shape) for v in eqn.invars)
            elif eqn.primitive.name in ("dynamic_slice", "slice", "gather"):
                sliced.extend(tuple(v.aval.shape) for v in eqn.outvars)
            for sub in jaxprs_in_params(eqn.params):
                if eqn.primitive.name != "pallas_call":  # the kernel body's own loads are not copies
                    walk(sub)

    walk(closed.jaxpr)
    return into, sliced


@pytest.mark.parametrize("variant,T,S,tiles,in_place", [
    ("window", 4, 64, flash.Tiles(block_r=8, block_k=16, num_splits=3), True),
    ("window", 1, 48, flash.Tiles(block_r=8, block_k=32), True),  # 48 % 32: the key tile halves to 16
    ("prefill", 24, 64, flash.Tiles(block_q=16, block_k=16), True),
    ("window", 4, 50, flash.Tiles(block_r=8, block_k=16), False),  # no tile of >= 16 divides 50: sliced
])
def test_a_stacked_cache_is_read_in_place_at_its_layer(variant, T, S, tiles, in_place):
    """`attention(..., layer=l)` over a stacked cache [L, B, S, KV, D] is attention over its layer l,
    bit for bit, with a traced layer (one compile for every layer) and through the gradient; and
    the kernel takes the stacked cache itself (no slice of it, which XLA would copy on every call)
    wherever a key tile divides S, on the Triton backend's tiles."""
    L, B, H, KV, D = 3, 2, 4, 2, 32
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((L, B, S, KV, D)), jnp.float32) for _ in range(2))
    kw = dict(start=jnp.array([0, 5]), q_offset=S - T, kind="block_causal", block_size=4, tiles=tiles,
              variant=variant, backend="interpret")
    traces = []

    @jax.jit
    def stacked(q, k, v, layer):
        traces.append(1)
        return flash.attention(q, k, v, layer=layer, **kw)

    sliced = jax.jit(lambda q, k, v: flash.attention(q, k, v, **kw))
    # the same key tile: bit for bit; a smaller one read in place (48 / 50 slots): the sum's order
    same = flash.stacked_key_tile(q, k, tiles.block_k, "interpret") == common.tile_size(tiles.block_k, S, "interpret")
    check = np.testing.assert_array_equal if same else functools.partial(np.testing.assert_allclose, rtol=2e-6,
                                                                         atol=2e-6)
    for layer in (0, 2):
        check(stacked(q, k, v, jnp.int32(layer)), sliced(q, k[layer], v[layer]))
    assert len(traces) == 1

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
    g_stacked = jax.jit(jax.grad(loss(lambda q, k, v: flash.attention(q, k, v, layer=1, **kw)), (0, 1, 2)))(q, k, v)
    g_sliced = jax.jit(jax.grad(loss(lambda q, kl, vl: flash.attention(q, kl, vl, **kw)), (0, 1, 2)))(q, k[1], v[1])
    check(g_stacked[0], g_sliced[0])
    for got, want in zip(g_stacked[1:], g_sliced[1:]):
        check(got[1], want)
        assert not np.any(np.asarray(got[0])) and not np.any(np.asarray(got[2]))

    into, cut = _pallas_operand_shapes(jax.make_jaxpr(
        lambda q, k, v: flash.attention(q, k, v, layer=jnp.int32(1), **dict(kw, backend="triton")))(q, k, v))
    layer_shape = (B, S, KV, D)
    assert ((L, B, S, KV, D) in into) == in_place
    assert any(sh[-4:] == layer_shape for sh in cut) == (not in_place)
    if in_place:  # the Triton lowering takes a layer index into the stacked block (lowering only: no GPU here)
        hlo = jax.jit(lambda q, k, v, layer: flash.attention(q, k, v, layer=layer, **dict(kw, backend="triton"))).trace(
            q, k, v, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
        assert f'name = "jdllm_flash_{variant}"' in hlo


@pytest.mark.parametrize("variant,T,S,tiles,stacked,dtype,H", slow_except([
    ("window", 4, 64, flash.Tiles(block_r=8, block_k=16, num_splits=3), True, jnp.float32, 4),
    ("window", 1, 50, flash.Tiles(block_r=8, block_k=16), True, jnp.bfloat16, 4),  # no tile divides 50: sliced
    ("prefill", 24, 64, flash.Tiles(block_q=16, block_k=16), True, jnp.float32, 4),
    ("window", 3, 40, flash.Tiles(block_r=8, block_k=16, num_splits=2), False, jnp.float32, 4),
    ("prefill", 20, 50, flash.Tiles(block_q=8, block_k=16), False, jnp.bfloat16, 4),
    # one query row (T = 1, one query head per KV head): `_attend_one_row`, no dot
    ("window", 1, 64, flash.Tiles(block_k=16, num_splits=3), True, jnp.bfloat16, 2),
    ("window", 1, 40, flash.Tiles(block_k=16), False, jnp.float32, 2),
    ("window", 1, 64, flash.Tiles(block_k=16, one_row=False), True, jnp.bfloat16, 2),  # the dot, by choice
    ("window", 1, 96, flash.Tiles(block_k=16, one_row_prefetch=True), True, jnp.float32, 2),  # loads one tile ahead
    ("window", 1, 64, flash.Tiles(block_k=16, num_splits=2, one_row_prefetch=True), False, jnp.bfloat16, 2),
    # grouped heads (G = 2), a program per query head
    ("window", 1, 64, flash.Tiles(block_k=16, num_splits=3, one_row_heads=True), True, jnp.bfloat16, 4),
    ("window", 1, 40, flash.Tiles(block_k=16, one_row_heads=True, one_row_prefetch=True), False, jnp.float32, 4),
], ("window", 4, 64, flash.Tiles(block_r=8, block_k=16, num_splits=3), True, jnp.float32, 4),
   ("window", 1, 64, flash.Tiles(block_k=16, num_splits=3), True, jnp.bfloat16, 2)))
def test_int8_cache_is_dequantized_in_the_kernel(variant, T, S, tiles, stacked, dtype, H):
    """An int8 KV cache with its scales (`jdllm.model.quantize_kv`: one per key and KV head) through
    the kernels equals the reference on the dequantized cache: in place at a stacked cache's layer
    and on one layer, windows and prefill chunks, with every hidden slot's scale NaN (a stale or
    unwritten slot: the kernel must not multiply a probability of 0 by it). The kernels take the
    int8 arrays (no float copy of the cache); the XLA dispatch dequantizes and gives the reference.
    A window of one row per program (T = 1, H = KV; or any H with `Tiles.one_row_heads`: a
    program per query head) has no dot (`_attend_one_row`, unless `Tiles.one_row` is off); every
    other has."""
    from jdllm.model import dequantize_kv, quantize_kv  # noqa: PLC0415

    L, B, KV, D = 3, 2, 2, 32
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    (k, ks), (v, vs) = (quantize_kv(jnp.asarray(rng.standard_normal((L, B, S, KV, D)), jnp.float32)) for _ in range(2))
    start, kv_len = jnp.array([0, 5]), S - 2  # slots [kv_len, S) hidden from every query
    hidden = np.arange(S) >= kv_len
    ks, vs = (jnp.where(hidden[None, None, :, None, None], jnp.nan, x) for x in (ks, vs))
    kw = dict(start=start, q_offset=kv_len - T, kv_len=kv_len, kind="block_causal", block_size=4)
    with jax.default_matmul_precision(EXACT):
        ref = attention_reference(q, dequantize_kv(k[1], jnp.nan_to_num(ks[1]), dtype),
                                  dequantize_kv(v[1], jnp.nan_to_num(vs[1]), dtype), **kw)
    run = dict(tiles=tiles, variant=variant, backend="interpret")
    if stacked:
        out = jax.jit(lambda *a: flash.attention(*a[:3], layer=jnp.int32(1), k_scale=a[3], v_scale=a[4], **kw, **run))(
            q, k, v, ks, vs)
    else:
        out = jax.jit(lambda *a: flash.attention(*a[:3], k_scale=a[3], v_scale=a[4], **kw, **run))(
            q, k[1], v[1], ks[1], vs[1])
    assert _rel_err(out, ref) <= TOL[dtype]
    finite = [jnp.nan_to_num(x) for x in (ks, vs)]  # (the XLA path multiplies every V by its scale)
    xla = pallas_kernels.attention(q, k, v, layer=1, k_scale=finite[0], v_scale=finite[1], impl="xla", **kw)
    assert _rel_err(xla, ref) <= TOL[dtype]
    closed = jax.make_jaxpr(lambda q, k, v, ks, vs: flash.attention(q, k, v, layer=1, k_scale=ks, v_scale=vs, **kw,
                                                                    **run))(q, k, v, ks, vs)
    into, _ = _pallas_operand_shapes(closed)
    in_place = flash.stacked_key_tile(q, k, tiles.block_k, "interpret", scaled=True) is not None
    assert ((L, B, S, KV, D) in into) == in_place
    kv_operands = [x for x in _pallas_operands(closed) if x.ndim >= 4 and x.shape[-3] >= S]  # k, v (not q's rows)
    assert len(kv_operands) == 2 and all(x.dtype == jnp.int8 for x in kv_operands), kv_operands
    one_row = variant == "window" and T == 1 and tiles.one_row and (H == KV or tiles.one_row_heads)
    assert _kernel_has_dot(closed) == (not one_row)
    # one_row_prefetch: the unmasked loop carries the next tile's int8 K / V
    assert _kernel_loop_carries_int8(closed) == (one_row and tiles.one_row_prefetch)


@pytest.mark.parametrize("variant,T,S,H,stacked,dtype,tiles", slow_except([
    ("window", 4, 64, 4, True, jnp.float32, flash.Tiles(block_r=8, block_k=16, num_splits=3, int8_v_words=True)),
    ("window", 1, 50, 4, False, jnp.bfloat16, flash.Tiles(block_r=8, block_k=16, int8_v_words=True)),  # GQA AR
    ("window", 8, 96, 2, True, jnp.bfloat16, flash.Tiles(block_r=8, block_k=32, int8_v_words=True)),  # bd, MHA
    ("prefill", 24, 64, 4, True, jnp.float32, flash.Tiles(block_q=16, block_k=16, int8_v_words=True)),
    ("prefill", 20, 50, 2, False, jnp.bfloat16, flash.Tiles(block_q=8, block_k=16, int8_v_words=True)),
], ("window", 4, 64, 4, True, jnp.float32, flash.Tiles(block_r=8, block_k=16, num_splits=3, int8_v_words=True)),
   ("prefill", 24, 64, 4, True, jnp.float32, flash.Tiles(block_q=16, block_k=16, int8_v_words=True))))
def test_int8_v_words_window_equals_the_reference(variant, T, S, H, stacked, dtype, tiles):
    """`Tiles.int8_v_words`: a window of several rows per KV head (or a prefill chunk) reads an int8 V as int32 words
    (a bitcast: the kernel's V operand is [.., S, KV, D / 4] int32, K stays int8) and unpacks them
    in the kernel; its output and log-sum-exp equal the reference's on the dequantized cache and
    the plain int8 kernel's, hidden slots' scales NaN as in the test above."""
    from jdllm.model import dequantize_kv, quantize_kv  # noqa: PLC0415

    L, B, KV, D = 2, 2, 2, 64
    rng = np.random.default_rng(17)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    (k, ks), (v, vs) = (quantize_kv(jnp.asarray(rng.standard_normal((L, B, S, KV, D)), jnp.float32)) for _ in range(2))
    kv_len = S - 3
    hidden = np.arange(S) >= kv_len
    ks, vs = (jnp.where(hidden[None, None, :, None, None], jnp.nan, x) for x in (ks, vs))
    kw = dict(start=jnp.array([0, 7]), q_offset=kv_len - T, kv_len=kv_len, kind="block_causal", block_size=4)
    with jax.default_matmul_precision(EXACT):
        ref = attention_reference(q, dequantize_kv(k[1], jnp.nan_to_num(ks[1]), dtype),
                                  dequantize_kv(v[1], jnp.nan_to_num(vs[1]), dtype), **kw)

    fn = flash.window_attention if variant == "window" else flash.prefill_attention

    def run(tiles, *a):
        if stacked:
            return fn(*a[:3], layer=jnp.int32(1), k_scale=a[3], v_scale=a[4], tiles=tiles,
                      backend="interpret", return_lse=True, **kw)
        return fn(a[0], a[1][1], a[2][1], k_scale=a[3][1], v_scale=a[4][1], tiles=tiles,
                  backend="interpret", return_lse=True, **kw)
    out, lse = jax.jit(functools.partial(run, tiles))(q, k, v, ks, vs)
    assert _rel_err(out, ref) <= TOL[dtype]
    plain = jax.jit(functools.partial(run, dataclasses.replace(tiles, int8_v_words=False)))(q, k, v, ks, vs)
    assert _rel_err(out, plain[0]) <= TOL[dtype] and _rel_err(lse, plain[1]) <= 1e-5
    closed = jax.make_jaxpr(functools.partial(run, tiles))(q, k, v, ks, vs)
    big = [x for x in _pallas_operands(closed) if x.ndim >= 4 and x.shape[-3] >= S]
    assert sorted((x.dtype.name, x.shape[-1]) for x in big) == [("int32", D // 4), ("int8", D)], big


def test_int8_v_words_from_the_environment(monkeypatch):
    """Tiles(int8_v_words=None), the default, follows `JDLLM_INT8_V_WORDS` (read at trace time: the
    end-to-end A/B of gpu.py's variants); an explicit Tiles value wins; a bad value is a jdllm error
    naming the variable. The words' unpacking is `int8_words`' inverse."""
    from jdllm import errors
    from jdllm.model import quantize_kv  # noqa: PLC0415
    from pallas_kernels import common

    x = jnp.asarray(np.random.default_rng(0).integers(-128, 128, (3, 5, 64)), jnp.int8)
    assert common.int8_words(x).dtype == jnp.int32 and common.int8_words(x).shape == (3, 5, 16)
    np.testing.assert_array_equal(common.int8_from_words(common.int8_words(x)), x)
    B, S, H, KV, D = 1, 32, 4, 2, 64
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((B, 2, H, D)), jnp.float32)
    (k, ks), (v, vs) = (quantize_kv(jnp.asarray(rng.standard_normal((B, S, KV, D)), jnp.float32)) for _ in range(2))

    def v_dtypes(tiles):
        closed = jax.make_jaxpr(lambda *a: flash.window_attention(*a[:3], k_scale=a[3], v_scale=a[4], start=0,
                                                                  tiles=tiles, backend="interpret"))(q, k, v, ks, vs)
        return sorted(x.dtype.name for x in _pallas_operands(closed) if x.ndim >= 4 and x.shape[-3] >= S)
    for env, tiles, words in (("", flash.Tiles(), False), ("1", flash.Tiles(), True), ("0", flash.Tiles(), False),
                              ("1", flash.Tiles(int8_v_words=False), False), ("", flash.Tiles(int8_v_words=True), True)):
        monkeypatch.setenv(flash.WORDS_ENV, env)
        assert v_dtypes(tiles) == (["int32", "int8"] if words else ["int8", "int8"]), (env, tiles)
    for bad in ("yes", "2"):  # a switch: 0 or 1
        monkeypatch.setenv(flash.WORDS_ENV, bad)
        with pytest.raises(errors.ConfigError, match=flash.WORDS_ENV):
            v_dtypes(flash.Tiles())
    # the Triton lowering (no GPU here): V loaded as i32, unpacked by joins, one PV dot in bfloat16
    monkeypatch.delenv(flash.WORDS_ENV)
    qb = q.astype(jnp.bfloat16)
    dots = []
    for words in (False, True):
        fn = jax.jit(lambda *a: flash.window_attention(*a[:3], k_scale=a[3], v_scale=a[4], start=0, backend="triton",
                                                       tiles=flash.Tiles(int8_v_words=words)))
        [text] = _triton_irs(fn.trace(qb, k, v, ks, vs).lower(lowering_platforms=("cuda",)))
        assert ("tt.join" in text) == words and (f"x{D // 4}x!tt.ptr<i32>>" in text) == words  # a [bk, D/4] tile
        dots.append([ln.split(":")[-1] for ln in text.splitlines() if "tt.dot " in ln])
    assert dots[0] == dots[1] and len(dots[0]) == 6, dots  # QK and PV in each of the three key loops, as bytes


def test_one_row_window_returns_the_dots_log_sum_exp():
    """`return_lse` from the one-row int8 window (one program per query head, grouped heads) equals
    the tensor-core dot's over the same cache: outputs and log-sum-exps per head and query, with the
    key splits merged after the kernel and with one split (the kernel writes the attention itself)."""
    from jdllm.model import quantize_kv  # noqa: PLC0415

    B, S, H, KV, D = 2, 48, 4, 2, 32
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((B, 1, H, D)), jnp.float32)
    (k, ks), (v, vs) = (quantize_kv(jnp.asarray(rng.standard_normal((B, S, KV, D)), jnp.float32)) for _ in range(2))
    kw = dict(start=jnp.array([0, 3]), q_offset=S - 5, kv_len=S - 4, kind="causal", k_scale=ks, v_scale=vs,
              backend="interpret", return_lse=True)
    for splits in (None, 1):
        got = flash.window_attention(q, k, v, tiles=flash.Tiles(block_k=16, one_row_heads=True, num_splits=splits),
                                     **kw)
        want = flash.window_attention(q, k, v, tiles=flash.Tiles(block_k=16, block_r=8, one_row=False,
                                                                 num_splits=3 if splits == 1 else 1), **kw)
        for g, w in zip(got, want):
            assert g.shape == w.shape and _rel_err(g, w) <= 1e-5, splits


def _kernel_loop_carries_int8(closed) -> bool:
    """Whether a loop inside a pallas_call's kernel body carries an int8 array (not a ref to one)."""
    from jax.core import ShapedArray
    from jax.extend.core import jaxprs_in_params

    def walk(jaxpr, inside):
        for eqn in jaxpr.eqns:
            if inside and eqn.primitive.name == "while" and any(
                    type(v.aval) is ShapedArray and v.aval.dtype == jnp.int8 for v in eqn.outvars):
                return True
            if any(walk(sub, inside or eqn.primitive.name == "pallas_call") for sub in jaxprs_in_params(eqn.params)):
                return True
        return False
    return walk(closed.jaxpr, False)


def _kernel_has_dot(closed) -> bool:
    """Whether a pallas_call's kernel body in this jaxpr (or in the jaxprs inside it) has a dot_general."""
    from jax.extend.core import jaxprs_in_params

    def walk(jaxpr, inside):
        return any((inside and eqn.primitive.name == "dot_general")
                   or any(walk(sub, inside or eqn.primitive.name == "pallas_call")
                          for sub in jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns)
    return walk(closed.jaxpr, False)


def test_stacked_prefill_chunks_on_hopper_pick_in_place_or_the_mosaic_kernel(monkeypatch):
    """On the Mosaic backend a prefill chunk over a stacked cache runs the Triton kernel in place up
    to STACKED_TRITON_MAX_T queries and the Mosaic kernel on the layer's slice beyond; both equal the
    reference."""
    from pallas_kernels import mosaic

    calls = []
    kernel = mosaic.prefill_attention
    monkeypatch.setattr(mosaic, "prefill_attention", lambda *a, **kw: (calls.append(a[1].shape), kernel(*a, **kw))[1])
    L, B, T, S, H, KV, D = 2, 1, 72, 128, 2, 1, 64
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((L, B, S, KV, D)), jnp.bfloat16) for _ in range(2))
    kw = dict(start=jnp.array([0]), q_offset=S - T, kind="causal", backend="mosaic_interpret", variant="prefill")
    with jax.default_matmul_precision(EXACT):
        ref = attention_reference(q, k[1], v[1], start=kw["start"], q_offset=S - T, kind="causal")
    for limit, mosaic_runs in ((flash.STACKED_TRITON_MAX_T, False), (64, True)):
        monkeypatch.setattr(flash, "STACKED_TRITON_MAX_T", limit)
        calls.clear()
        out = jax.jit(lambda q, k, v: flash.attention(q, k, v, layer=1, **kw))(q, k, v)
        assert bool(calls) == mosaic_runs and all(c == (B, S, KV, D) for c in calls)
        assert _rel_err(out, ref) <= TOL[jnp.bfloat16]
        into, _ = _pallas_operand_shapes(jax.make_jaxpr(lambda q, k, v: flash.attention(q, k, v, layer=1, **kw))(q, k, v))
        assert ((L, B, S, KV, D) in into) == (not mosaic_runs)


def test_int8_cache_prefill_on_hopper_runs_long_chunks_on_the_mosaic_kernel(monkeypatch):
    """An int8 cache on the Mosaic backend: a prefill chunk of up to STACKED_TRITON_MAX_T queries runs
    the Triton kernel on the int8 layer in place (scaled on chip); a longer one (a long prompt,
    compute-bound) the Mosaic kernel on the layer dequantized. Both equal the reference."""
    from jdllm.model import dequantize_kv, quantize_kv  # noqa: PLC0415
    from pallas_kernels import mosaic

    calls = []
    kernel = mosaic.prefill_attention
    monkeypatch.setattr(mosaic, "prefill_attention", lambda *a, **kw: (calls.append(a[1].dtype), kernel(*a, **kw))[1])
    L, B, T, S, H, KV, D = 2, 1, 72, 128, 2, 1, 64
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
    (k, ks), (v, vs) = (quantize_kv(jnp.asarray(rng.standard_normal((L, B, S, KV, D)), jnp.float32)) for _ in range(2))
    kw = dict(start=jnp.array([0]), q_offset=S - T, kind="causal", backend="mosaic_interpret", variant="prefill")
    with jax.default_matmul_precision(EXACT):
        ref = attention_reference(q, dequantize_kv(k[1], ks[1], q.dtype), dequantize_kv(v[1], vs[1], q.dtype),
                                  start=kw["start"], q_offset=S - T, kind="causal")
    for limit, mosaic_runs in ((flash.STACKED_TRITON_MAX_T, False), (64, True)):
        monkeypatch.setattr(flash, "STACKED_TRITON_MAX_T", limit)
        calls.clear()
        out = jax.jit(lambda *a: flash.attention(*a[:3], layer=1, k_scale=a[3], v_scale=a[4], **kw))(q, k, v, ks, vs)
        assert calls == ([jnp.bfloat16] if mosaic_runs else [])
        assert _rel_err(out, ref) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("kv", [None, "int8"])
def test_model_forward_reads_its_stacked_cache_in_place(kv):
    """jdllm.model.forward with a KVCache on attn_impl="pallas": each layer's kernel takes the stacked
    cache itself, and the logits and the written cache equal the XLA path's (a prompt, then a
    4-token window over a 32-slot cache). An int8 cache (kv_cache_dtype "int8"): the kernels take
    the int8 cache and its scales, with no dequantized copy of a layer (the XLA path dequantizes
    the layer it reads); the logits agree to float32 rounding (the kernel scales the scores, the XLA
    path the keys) and the written int8 values to one step."""
    cfg = _tiny_cfg("block_causal").replace(kv_cache_dtype=kv)
    params = init_params(cfg, jax.random.key(0))
    B, P, W, S = 2, 12, 4, 32
    start = jnp.array([0, 3], jnp.int32)
    tokens = jax.random.randint(jax.random.key(1), (B, P + W), 0, cfg.vocab_size)

    def run(params, tokens, impl):
        _, cache = forward(params, cfg, tokens[:, :P], default_positions(start, 0, P), start=start,
                           cache=KVCache.empty(cfg, B, S), attn_impl=impl)
        win, cache = forward(params, cfg, tokens[:, P:], default_positions(start, P, W), start=start,
                             cache=cache.commit(P), attn_impl=impl)
        return win, cache.k, cache.v

    (win, k, v), (win_x, k_x, v_x) = (jax.jit(run, static_argnums=2)(params, tokens, impl) for impl in ("pallas", "xla"))
    assert _rel_err(win, win_x) <= 1e-5
    for got, want in ((k, k_x), (v, v_x)):
        if kv is None:
            assert _rel_err(got, want) <= 1e-5
        else:
            assert got.dtype == jnp.int8 and np.max(np.abs(np.asarray(got, np.int32) - np.asarray(want, np.int32))) <= 1
    into, cut = _pallas_operand_shapes(jax.make_jaxpr(run, static_argnums=2)(params, tokens, "pallas"))
    stacked = (cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim)
    assert into.count(stacked) == 2 * 2  # K and V, both forwards (the layer body, traced once)
    assert not any(sh[-4:] == stacked[1:] for sh in cut) and stacked[1:] not in into
    if kv == "int8":  # and both scales, [L, B, S, KV] (the cache's [..., 1] as a bitcast)
        assert into.count(stacked[:-1]) == 2 * 2


# ----------------------------------------------------------------------------- Triton lowering
@pytest.mark.parametrize("variant,kind,bs,T,S,H,KV,D,dtype", [
    pytest.param("prefill", "block_causal", 32, 300, 300, 8, 2, 128, jnp.bfloat16, marks=slow),
    ("prefill", "causal", 1, 40, 90, 4, 4, 8, jnp.float32),  # head_dim padded to 16
    pytest.param("window", "bidirectional", 1, 7, 3000, 28, 4, 96, jnp.float32, marks=slow),  # G = 7, head_dim 96
])
def test_triton_path_lowers_for_cuda(variant, kind, bs, T, S, H, KV, D, dtype):
    """The Triton kernels (forward, backward dq and dk/dv) lower to Triton custom calls for CUDA.

    Cross-platform lowering on the CPU runs the Pallas -> Triton IR lowering, which
    rejects unsupported primitives and tile shapes; PTX compilation and the run
    itself still need a GPU (the `gpu` tests below).
    """
    q, k, v = (jnp.zeros((2, T, H, D), dtype), jnp.zeros((2, S, KV, D), dtype),
               jnp.zeros((2, S, KV, D), dtype))

    def loss(q, k, v, off, n):
        out = flash.attention(q, k, v, start=jnp.array([0, 3]), q_offset=off, kv_len=n, kind=kind,
                              block_size=bs, backend="triton", variant=variant)
        return jnp.sum(out.astype(jnp.float32))

    fn = jax.jit(jax.value_and_grad(loss))
    hlo = fn.trace(q, k, v, jnp.int32(S - T), jnp.int32(S)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 3
    for name in (f"jdllm_flash_{variant}", "jdllm_flash_bwd_dq", "jdllm_flash_bwd_dkv"):
        assert f'name = "{name}"' in hlo


# ----------------------------------------------------------------------------- float32 precision
def _dot_precisions(closed):
    """(operand dtype, precision) of every dot_general in a jaxpr and in every jaxpr inside it:
    the Pallas kernels' bodies, their loops, the custom_vjp backward, the XLA glue around them."""
    from jax.extend.core import jaxprs_in_params

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is jax.lax.dot_general_p:
                found.append((eqn.invars[0].aval.dtype, eqn.params["precision"]))
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return found


def _triton_dots(lowered):
    """The `tt.dot` lines of every Triton kernel in a CUDA lowering."""
    irs = _triton_irs(lowered)
    return len(irs), [ln.strip() for text in irs for ln in text.splitlines() if "tt.dot " in ln]


def _triton_irs(lowered):
    """The Triton IR of every Triton kernel in a CUDA lowering, as text (the kernels' Triton IR is
    MLIR bytecode in each custom call's backend config; parsed back with the Triton dialect)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if o.operation.name == "stablehlo.custom_call" and \
                            "xla.gpu.triton" in str(o.attributes["call_target_name"]):
                        calls.append(o)
                    walk(o.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    texts = []
    for call in calls:
        raw = ir.StringAttr(ir.DictAttr(call.attributes["mhlo.backend_config"])["ir"]).value_bytes
        ctx = ir.Context()
        tt.register_dialect(ctx)
        with ctx:
            texts.append(str(ir.Module.parse(raw)))
    return texts


@pytest.mark.parametrize("global_precision", slow_except([None, "bfloat16", "tensorfloat32"], "bfloat16"))
@pytest.mark.parametrize("variant,T,S", slow_except([("prefill", 40, 40), ("window", 4, 100)], ("prefill", 40, 40)))
def test_float32_kernel_dots_are_exact_whatever_the_global_precision(global_precision, variant, T, S):
    """float32 kernels (forward and backward) ask for HIGHEST, which the Triton lowering runs as IEEE
    float32, by default and under `jax.default_matmul_precision("bfloat16" | "tensorfloat32")`, where
    a dot that asked for nothing runs in TF32 on a GPU; so do the XLA dots around them (the window's
    split merge, the backward's delta). bfloat16 kernels ask for nothing more than before."""
    def loss(q, k, v):
        out = flash.attention(q, k, v, start=jnp.array([0, 3]), q_offset=S - T, kind="block_causal",
                              block_size=4, backend="triton", variant=variant)
        return jnp.sum(out.astype(jnp.float32))

    for dtype in (jnp.float32, jnp.bfloat16):
        q, k, v = (jnp.zeros((2, T, 4, 32), dtype), jnp.zeros((2, S, 2, 32), dtype),
                   jnp.zeros((2, S, 2, 32), dtype))
        with jax.default_matmul_precision(global_precision):
            fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            dots = _dot_precisions(jax.make_jaxpr(fn)(q, k, v))
            n_kernels, tt_dots = _triton_dots(fn.trace(q, k, v).lower(lowering_platforms=("cuda",)))
        assert n_kernels == 3 and tt_dots  # forward, backward dq, backward dk/dv
        if dtype == jnp.float32:  # Triton prints no inputPrecision for its default, IEEE (not tf32)
            assert all("xf32>" in ln and "inputPrecision" not in ln for ln in tt_dots), tt_dots
        else:  # the kernels' own dots: bf16 x bf16 under the global setting, as before
            assert all("xbf16>" in ln for ln in tt_dots), tt_dots
        highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
        f32 = [p for dt, p in dots if dt == jnp.float32]
        low = [p for dt, p in dots if dt != jnp.float32]
        assert f32 and all(p == highest for p in f32), f32
        assert (not low) if dtype == jnp.float32 else (low and all(p != highest for p in low)), low


# ----------------------------------------------------------------------------- Mosaic GPU kernel
# Run in Pallas's GPU interpret mode, whose uninitialised output memory is NaN (the poisoning).
# (kind, block_size, B, T, S, q_offset, kv_len, H, KV, D, start, dtype)
MOSAIC = [
    ("causal", 1, 1, 64, 64, 0, 64, 2, 2, 64, [0], jnp.bfloat16),
    # T, S not multiples of the 64-row tile; GQA 4; left padding
    ("block_causal", 4, 2, 45, 45, 0, 45, 8, 2, 64, [0, 13], jnp.float16),
    # GQA 8, head_dim 128, padding past the first tile
    ("block_causal", 32, 2, 130, 130, 0, 130, 8, 1, 128, [3, 70], jnp.bfloat16),
    ("block_causal", 64, 1, 150, 150, 0, 150, 2, 1, 64, [0], jnp.bfloat16),
    ("bidirectional", 1, 2, 33, 33, 0, 33, 4, 2, 64, [0, 20], jnp.float16),
    # chunk at an offset into a longer, partly stale cache: row 1's first queries see nothing
    ("block_causal", 4, 2, 20, 150, 70, 90, 2, 1, 128, [0, 80], jnp.bfloat16),
    # a chunk whose last rows sit at the cache's end (q_offset + T = kv_len = S = 100: the second
    # 64-key tile is part padding)
    ("block_causal", 4, 1, 20, 100, 80, 100, 2, 1, 64, [0], jnp.float16),
]


@slow
@pytest.mark.parametrize("kind,bs,B,T,S,qoff,kvl,H,KV,D,start,dtype", MOSAIC)
def test_mosaic_prefill_matches_reference(kind, bs, B, T, S, qoff, kvl, H, KV, D, start, dtype):
    from pallas_kernels import mosaic

    q, k, v = _qkv(20, B, T, S, H, KV, D, dtype)
    kw = dict(start=jnp.asarray(start, jnp.int32), q_offset=qoff, kv_len=kvl, kind=kind,
              block_size=bs)
    out, lse = mosaic.prefill_attention(q, k, v, **kw, interpret=True, return_lse=True)
    assert _rel_err(out, attention_reference(q, k, v, **kw)) <= TOL[jnp.bfloat16]
    # the saved log-sum-exp is the one the Pallas backward kernels read
    _, lse_ref = flash.prefill_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                         v.astype(jnp.float32), **kw, backend="interpret",
                                         return_lse=True)
    assert np.abs(np.asarray(lse) - np.asarray(lse_ref)).max() <= 2e-2


@slow
@pytest.mark.parametrize("block_k,stages", [(128, 2), (64, 3)])
def test_mosaic_key_tile_and_ring_depth(block_k, stages):
    """The tuning knobs: 128-key tiles, a three-slot K/V ring (tile loads wrap around it)."""
    from pallas_kernels import mosaic

    q, k, v = _qkv(25, 2, 100, 420, 4, 1, 64, jnp.bfloat16)
    kw = dict(start=jnp.array([0, 150]), q_offset=300, kv_len=400, kind="block_causal",
              block_size=32)
    out = mosaic.prefill_attention(q, k, v, **kw, block_k=block_k, stages=stages, interpret=True)
    assert _rel_err(out, attention_reference(q, k, v, **kw)) <= TOL[jnp.bfloat16]
    with pytest.raises(ValueError, match="block_k"):
        mosaic.prefill_attention(q, k, v, **kw, block_k=32, interpret=True)


# (kind, block_size, B, T, S, q_offset, kv_len, H, KV, D, start, block_k, stages, pingpong): the later tile of
# each pair sees key tiles the earlier one does not (causal: it releases them uncomputed); a chunk at
# an offset into a longer cache with left padding past the first tile; a three-slot ring of 128-key
# tiles that wraps; T not a multiple of the 128-row pair (with and without the ping-pong)
MOSAIC_WS = [
    ("causal", 1, 1, 256, 256, 0, 256, 2, 1, 64, [0], 64, 2, True),
    ("causal", 1, 1, 256, 256, 0, 256, 2, 1, 64, [0], 64, 2, False),
    ("block_causal", 32, 2, 100, 420, 300, 400, 2, 1, 64, [0, 150], 128, 3, True),
    ("block_causal", 4, 2, 150, 150, 0, 150, 2, 1, 128, [0, 70], 64, 2, False),
]


@slow
@pytest.mark.parametrize("kind,bs,B,T,S,qoff,kvl,H,KV,D,start,block_k,stages,pingpong", MOSAIC_WS)
def test_mosaic_warp_specialized_matches_one_warpgroup(kind, bs, B, T, S, qoff, kvl, H, KV, D, start, block_k,
                                                       stages, pingpong):
    """The warp-specialised variant (a loader warpgroup, two compute warpgroups, the ping-pong) runs
    the one-warpgroup kernel's tile steps in the same order: the same output and log-sum-exp bit for
    bit, and the reference's within the tolerance. Pallas's GPU interpreter runs the three
    warpgroups as threads and fails on a barrier phase left unobserved."""
    from pallas_kernels import mosaic

    q, k, v = _qkv(27, B, T, S, H, KV, D, jnp.bfloat16)
    kw = dict(start=jnp.asarray(start, jnp.int32), q_offset=qoff, kv_len=kvl, kind=kind, block_size=bs,
              block_k=block_k, stages=stages, interpret=True, return_lse=True)
    out, lse = mosaic.prefill_attention(q, k, v, **kw, warp_specialized=True, pingpong=pingpong)
    out1, lse1 = mosaic.prefill_attention(q, k, v, **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out1, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse1))
    ref_kw = {n: kw[n] for n in ("start", "q_offset", "kv_len", "kind", "block_size")}
    assert _rel_err(out, attention_reference(q, k, v, **ref_kw)) <= TOL[jnp.bfloat16]


def test_mosaic_shared_memory_budget_is_checked():
    from pallas_kernels import mosaic

    q, k, v = _qkv(28, 1, 130, 130, 2, 1, 128, jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):  # 2 x 64 x 128 + 2 x 4 x 128 x 128 bf16: 288 KiB
        mosaic.prefill_attention(q, k, v, start=jnp.zeros((1,), jnp.int32), block_k=128, stages=4,
                                 warp_specialized=True, interpret=True)


@slow
@pytest.mark.parametrize("ws", [False, True], ids=["one-warpgroup", "warp-specialized"])
def test_mosaic_tiles_outside_the_rule_are_never_read(ws):
    """K/V tiles wholly past the horizon or before a row's start are NaN: the result stays finite
    (warp-specialised: the loader stops at the later query tile's horizon)."""
    from pallas_kernels import mosaic

    B, T, S, H, KV, D, qoff = 2, 128 if ws else 64, 320, 2, 1, 64, 64
    q, k, v = _qkv(21, B, T, S, H, KV, D, jnp.bfloat16)
    start = np.array([0, 64], np.int32)
    slot = np.arange(S)[None, :, None, None]
    dead = (slot >= qoff + T) | (slot < start[:, None, None, None])  # whole 64-key tiles
    kw = dict(start=jnp.asarray(start), q_offset=qoff, kv_len=S, kind="causal")
    out = mosaic.prefill_attention(q, jnp.where(dead, jnp.nan, k), jnp.where(dead, jnp.nan, v),
                                   **kw, warp_specialized=ws, interpret=True)
    ref = attention_reference(q, jnp.where(dead, 0.0, k), jnp.where(dead, 0.0, v), **kw)
    assert _rel_err(out, ref) <= TOL[jnp.bfloat16]


@slow
def test_mosaic_backend_through_attention_with_grad_and_fallbacks(monkeypatch):
    """backend="mosaic_interpret": the Mosaic forward and backward (the defaults); float32 and windows fall back."""
    q, k, v = _qkv(22, 2, 70, 70, 4, 2, 64, jnp.bfloat16)
    kw = dict(start=jnp.array([0, 9]), kind="block_causal", block_size=4)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, **kw).astype(jnp.float32) ** 2)

    mosaic_attn = functools.partial(flash.attention, backend="mosaic_interpret")
    got = jax.grad(functools.partial(loss, mosaic_attn), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, attention_reference), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert _rel_err(g, w) <= 5e-2
    # what the Mosaic kernel does not take runs the interpret-mode flash kernels
    for T, dtype in ((6, jnp.bfloat16), (40, jnp.float32)):  # a window; a float32 prefill
        q, k, v = _qkv(23, 2, T, 40, 4, 2, 64, dtype)
        out = flash.attention(q, k, v, **kw, backend="mosaic_interpret")
        assert _rel_err(out, attention_reference(q, k, v, **kw)) <= TOL[dtype]
    monkeypatch.setenv(flash.BACKEND_ENV, "mosaic_interpret")
    assert flash.default_backend() == "mosaic_interpret"
    monkeypatch.setenv(flash.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="JDLLM_PALLAS_BACKEND"):
        flash.default_backend()


@slow
def test_mosaic_under_vmap():
    """vmap over examples, each with its own left padding (how RL loops call generation)."""
    q, k, v = _qkv(26, 3, 70, 70, 4, 2, 64, jnp.bfloat16)
    start = jnp.array([0, 5, 9])

    def one(fn, q, k, v, s):
        return fn(q[None], k[None], v[None], start=s[None], kind="causal")[0]

    mosaic_attn = functools.partial(flash.attention, backend="mosaic_interpret")
    out = jax.vmap(functools.partial(one, mosaic_attn))(q, k, v, start)
    ref = jax.vmap(functools.partial(one, attention_reference))(q, k, v, start)
    assert _rel_err(out, ref) <= TOL[jnp.bfloat16]


@slow
@pytest.mark.parametrize("kind,bs,T,S,H,KV,D", [
    ("block_causal", 32, 300, 300, 8, 2, 128),
    ("causal", 1, 256, 512, 4, 4, 64),
])
@pytest.mark.parametrize("block_k,stages", [(64, 2), (128, 3)])
@pytest.mark.parametrize("ws", [False, True], ids=["one-warpgroup", "warp-specialized"])
def test_mosaic_path_lowers_for_cuda(kind, bs, T, S, H, KV, D, block_k, stages, ws):
    """backend="mosaic" with the Triton backward (`mosaic_backward=False`; the Mosaic one's lowering is
    tested below) lowers to one Mosaic GPU custom call (forward) and two Triton ones (backward).

    Cross-platform lowering on the CPU runs the Pallas -> Mosaic GPU lowering
    (layouts, wgmma and TMA shapes) with the compiled path's wgmma, layout casts
    and swizzled shared memory; PTX compilation needs a GPU.
    """
    q, k, v = (jnp.zeros((2, T, H, D), jnp.bfloat16), jnp.zeros((2, S, KV, D), jnp.bfloat16),
               jnp.zeros((2, S, KV, D), jnp.bfloat16))

    def loss(q, k, v, off):
        out = flash.attention(q, k, v, start=jnp.array([0, 3]), q_offset=off, kind=kind,
                              block_size=bs, backend="mosaic", variant="prefill",
                              tiles=flash.Tiles(mosaic_block_k=block_k, mosaic_stages=stages,
                                                mosaic_warp_specialized=ws, mosaic_backward=False))
        return jnp.sum(out.astype(jnp.float32))

    def lower():
        return jax.jit(jax.value_and_grad(loss)).trace(q, k, v, jnp.int32(S - T)).lower(
            lowering_platforms=("cuda",)).as_text()
    if ws and (2 * 64 + 2 * stages * block_k) * D * 2 > 220 * 1024:  # jdllm's check, before Mosaic's own
        with pytest.raises(ValueError, match="fewer stages"):
            lower()
        return
    hlo = lower()
    assert hlo.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert hlo.count("__gpu$xla.gpu.triton") == 2


# (kind, block_size, B, T, S, q_offset, kv_len, H, KV, D, start, stages): GQA 2 with T past one tile (the
# dK / dV walk runs over both heads of the group and wraps the ring); a chunk at an offset into a longer
# cache with left padding (key tiles no query sees, queries that see nothing); bidirectional GQA with a
# three-slot ring and head_dim 128
MOSAIC_BWD = [
    ("causal", 1, 1, 130, 130, 0, 130, 2, 1, 64, [0], 2),
    ("block_causal", 4, 2, 20, 150, 70, 90, 2, 1, 64, [0, 80], 2),
    ("bidirectional", 1, 2, 70, 70, 0, 70, 4, 2, 128, [0, 20], 3),
]


@slow
@pytest.mark.parametrize("kind,bs,B,T,S,qoff,kvl,H,KV,D,start,stages", MOSAIC_BWD)
def test_mosaic_backward_matches_the_triton_kernels(kind, bs, B, T, S, qoff, kvl, H, KV, D, start, stages):
    """The Mosaic backward (GPU interpreter) gives the Triton kernels' dq, dk, dv (interpret mode) and the
    XLA reference's VJP within bfloat16's tolerance."""
    from pallas_kernels import mosaic_backward
    from pallas_kernels.backward import attention_backward

    q, k, v = _qkv(31, B, T, S, H, KV, D, jnp.bfloat16)
    do = jnp.asarray(np.random.default_rng(32).standard_normal(q.shape), jnp.bfloat16)
    kw = dict(start=jnp.asarray(start, jnp.int32), q_offset=qoff, kv_len=kvl, kind=kind, block_size=bs)
    o, lse = flash.prefill_attention(q, k, v, **kw, backend="interpret", return_lse=True)
    got = mosaic_backward.attention_backward(q, k, v, o, lse, do, **kw, stages=stages, interpret=True)
    want = attention_backward(q, k, v, o, lse, do, **kw, backend="interpret")
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, **kw), *f32)
    ref = vjp(do.astype(jnp.float32))
    for g, w, r in zip(got, want, ref):
        assert g.dtype == jnp.bfloat16 and g.shape == w.shape
        assert _rel_err(g, w) <= 1e-3
        assert _rel_err(g, r) <= 2e-2


@slow
@pytest.mark.parametrize("case,pingpong", [(0, True), (1, False)], ids=["causal-pingpong", "offset-chunk-no-pingpong"])
def test_mosaic_backward_warp_specialized_matches_one_warpgroup(case, pingpong):
    """The warp-specialised dq and dk/dv kernels (a loader warpgroup, two compute warpgroups on a
    shared ring, which skip the items only the other needs) give the one-warpgroup kernels'
    gradients bit for bit."""
    from pallas_kernels import mosaic_backward

    kind, bs, B, T, S, qoff, kvl, H, KV, D, start, stages = MOSAIC_BWD[case]
    q, k, v = _qkv(36, B, T, S, H, KV, D, jnp.bfloat16)
    do = jnp.asarray(np.random.default_rng(37).standard_normal(q.shape), jnp.bfloat16)
    kw = dict(start=jnp.asarray(start, jnp.int32), q_offset=qoff, kv_len=kvl, kind=kind, block_size=bs,
              stages=stages, interpret=True)
    o, lse = flash.prefill_attention(q, k, v, **{n: kw[n] for n in ("start", "q_offset", "kv_len", "kind")},
                                     block_size=bs, backend="interpret", return_lse=True)
    one = mosaic_backward.attention_backward(q, k, v, o, lse, do, **kw)
    ws = mosaic_backward.attention_backward(q, k, v, o, lse, do, **kw, warp_specialized=True, pingpong=pingpong)
    for a, b in zip(ws, one):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@slow
def test_mosaic_backward_through_attention_and_lowered_for_cuda():
    """Tiles.mosaic_backward (the default): jax.grad of flash.attention on "mosaic_interpret" runs the
    Mosaic backward (the Triton backward's gradients); lowered for CUDA, forward and backward are three
    Mosaic GPU kernels and no Triton one, with or without warp specialisation (forward and backward
    each have their own switch). float32 keeps the Triton backward."""
    q, k, v = _qkv(33, 2, 70, 70, 4, 2, 64, jnp.bfloat16)
    kw = dict(start=jnp.array([0, 9]), kind="block_causal", block_size=4)

    def loss(tiles, q, k, v):
        out = flash.attention(q, k, v, **kw, backend="mosaic_interpret", variant="prefill", tiles=tiles)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    one = dict(mosaic_warp_specialized=False)  # the one-warpgroup forward: a third of the interpreter's time
    got = jax.grad(functools.partial(loss, flash.Tiles(**one)), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, flash.Tiles(**one, mosaic_backward=False)), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert _rel_err(g, w) <= 1e-3

    for ws in (False, True):  # and the warp-specialised forward and backward
        def cuda_loss(q, k, v):
            out = flash.attention(q, k, v, **kw, backend="mosaic", variant="prefill",
                                  tiles=flash.Tiles(mosaic_warp_specialized=ws,
                                                    mosaic_backward_warp_specialized=ws))
            return jnp.sum(out.astype(jnp.float32))
        hlo = jax.jit(jax.grad(cuda_loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
            lowering_platforms=("cuda",)).as_text()
        assert hlo.count("stablehlo.custom_call @mosaic_gpu") == 3 and "__gpu$xla.gpu.triton" not in hlo
    with pytest.raises(ValueError, match="stages"):
        from pallas_kernels import mosaic_backward
        mosaic_backward.attention_backward(q, k, v, q, jnp.zeros((2, 4, 70)), q, start=kw["start"], q_offset=0,
                                           kv_len=70, kind="causal", block_size=1, stages=1, interpret=True)


@slow
def test_attention_example_runs_the_mosaic_backward(capsys):
    """examples/attention.py with the Mosaic forward and backward (GPU interpreter) checks itself against
    the XLA reference and exits 0 (with the one-warpgroup forward: the warp-specialised default is the
    same path with a flag, its kernels are tested above, and in the interpreter it costs 30 s here)."""
    from tests.scripts import load_script

    example = load_script("examples/attention.py")
    assert example.main(["--backend", "mosaic_interpret", "--one-warpgroup"]) == 0
    assert "matches the XLA reference" in capsys.readouterr().out


def test_mosaic_warp_specialized_dispatch(monkeypatch):
    """Tiles.mosaic_warp_specialized sends prompts of more than one 64-row tile to the
    warp-specialised variant (with the ping-pong setting given); one tile keeps one warpgroup. By
    default: warp-specialised, no ping-pong; mosaic_warp_specialized=False keeps one warpgroup."""
    from pallas_kernels import mosaic

    seen = []

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], kw["warp_specialized"], kw["pingpong"]))
        return (jnp.zeros_like(q), jnp.zeros(q.shape[:1] + q.shape[2:3] + q.shape[1:2], jnp.float32))
    monkeypatch.setattr(mosaic, "prefill_attention", spy)
    for T, pp in ((100, True), (64, True), (300, False)):
        q, k, v = _qkv(29, 1, T, T, 2, 1, 64, jnp.bfloat16)
        tiles = flash.Tiles(mosaic_warp_specialized=True, mosaic_pingpong=pp)
        flash.attention(q, k, v, start=jnp.zeros((1,), jnp.int32), kind="causal", backend="mosaic_interpret",
                        variant="prefill", tiles=tiles)
    flash.attention(q, k, v, start=jnp.zeros((1,), jnp.int32), kind="causal", backend="mosaic_interpret",
                    variant="prefill")
    flash.attention(q, k, v, start=jnp.zeros((1,), jnp.int32), kind="causal", backend="mosaic_interpret",
                    variant="prefill", tiles=flash.Tiles(mosaic_warp_specialized=False))
    assert seen == [(100, True, True), (64, False, True), (300, True, False), (300, True, False),
                    (300, False, False)]


# ----------------------------------------------------------------------------- quantized matmul
# (rows, K, N, transpose, x dtype, weight dtype): one row (AR), a 32-token window, 64 rows with the
# contraction split over programs, a weight [N, K] (a tied embedding as the LM head), rows that are
# no power of two, and a K / N whose tiles are not the default 128
QMATMUL = [(1, 512, 256, False, jnp.bfloat16, jnp.int8), (32, 1024, 384, False, jnp.float32, jnp.int8),
           (64, 2048, 128, False, jnp.float32, jnp.float8_e4m3fn), (5, 256, 640, True, jnp.float32, jnp.int8),
           (3, 96, 48, False, jnp.float16, jnp.int8)]


def _qmatmul_inputs(seed, M, K, N, transpose, dtype, wdtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    wshape = (N, K) if transpose else (K, N)
    if wdtype == jnp.int8:
        q = jnp.asarray(rng.integers(-127, 128, wshape), jnp.int8)
    else:
        q = jnp.asarray(rng.standard_normal(wshape) * 50, wdtype)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, N) / 127, jnp.float32)
    return x, q, scale


@pytest.mark.parametrize("M,K,N,transpose,dtype,wdtype", QMATMUL)
def test_quantized_matmul_kernel_matches_xla(M, K, N, transpose, dtype, wdtype):
    """`pallas_kernels.qmatmul` (interpret mode) against XLA's float32 product of the converted
    weight, scaled per column: float32 to 1e-5 (the kernel adds 2,048 products in another order than
    XLA's dot, whose blocking follows the CPU: ~sqrt(K) x 6e-8; 2.1e-6 on an AMD EPYC), 16-bit
    activations to their output rounding."""
    from pallas_kernels import qmatmul

    x, q, scale = _qmatmul_inputs(M * 7 + K, M, K, N, transpose, dtype, wdtype)
    p = qmatmul.plan(M, K, N, "interpret")
    assert p is not None and p[0] >= M
    got = qmatmul.qmatmul(x, q, scale, transpose=transpose, backend="interpret")
    w = q.astype(jnp.float32)
    with jax.default_matmul_precision(EXACT):
        ref = (x.astype(jnp.float32) @ (w.T if transpose else w)) * scale
    assert got.shape == (M, N) and got.dtype == dtype
    assert _rel_err(got, ref) <= (1e-5 if dtype == jnp.float32 else 4e-3)
    if M == 64:  # this shape splits the contraction: the partial sums add up
        assert p[3] > 1
    # the sweep's knobs (benchmarks/qmatmul.py) compute the same product: other tiles and splits, and
    # one row as multiply-and-sum (per step, or into a tile-shaped accumulator)
    knobs = [dict(block_k=32, block_n=16, splits=1)] + ([dict(mode="reduce", splits=2), dict(mode="accumulate"),
                                                         dict(mode="accumulate", block_k=16, splits=2)]
                                                        if M == 1 else [])
    # the weight read as int32 words, unpacked in the kernel (a [K, N] weight, column tiles >= 64)
    knobs += [dict(words=True), dict(words=True, block_n=64, block_k=32)] if not transpose and N % 64 == 0 else []
    for kw in knobs:
        alt = qmatmul.qmatmul(x, q, scale, transpose=transpose, backend="interpret", **kw)
        assert _rel_err(alt, ref) <= (1e-5 if dtype == jnp.float32 else 4e-3), kw


def test_quantized_matmul_kernel_plans_and_lowers_to_triton():
    """Tiles and splits for the 8B shape's matmuls at batch 1 (enough programs for every H100
    multiprocessor, x padded to Triton's 16 rows), no plan past MAX_ROWS or without a tile, and
    the Triton lowering: one kernel whose dot takes the converted weight (bf16 x bf16; float32 x
    float32 as IEEE, not TF32)."""
    from pallas_kernels import qmatmul

    assert qmatmul.plan(1, 4096, 4096, "triton") == (16, 128, 128, 8)  # o: 32 column tiles x 8 splits
    assert qmatmul.plan(1, 12288, 4096, "triton")[3] == 8  # down
    assert qmatmul.plan(32, 4096, 126464, "triton") == (32, 128, 128, 1)  # the LM head: 988 programs
    assert qmatmul.plan(qmatmul.MAX_ROWS + 1, 4096, 4096, "triton") is None
    assert qmatmul.plan(1, 4100, 4096, "triton") is None and qmatmul.plan(1, 4096, 8, "triton") is None
    for dtype, transpose in ((jnp.bfloat16, False), (jnp.float32, True)):
        x, q, scale = _qmatmul_inputs(0, 1, 4096, 1024, transpose, dtype, jnp.int8)
        fn = jax.jit(functools.partial(qmatmul.qmatmul, transpose=transpose, backend="triton"))
        n_kernels, tt_dots = _triton_dots(fn.trace(x, q, scale).lower(lowering_platforms=("cuda",)))
        assert n_kernels == 1 and len(tt_dots) == 1, tt_dots
        if dtype == jnp.float32:
            assert "xf32>" in tt_dots[0] and "inputPrecision" not in tt_dots[0], tt_dots
        else:
            assert "xbf16>" in tt_dots[0], tt_dots
        # one row as multiply-and-sum: a Triton kernel with no dot
        fn = jax.jit(functools.partial(qmatmul.qmatmul, transpose=transpose, backend="triton", mode="reduce"))
        assert _triton_dots(fn.trace(x, q, scale).lower(lowering_platforms=("cuda",))) == (1, [])
    # words: the weight loaded as i32 and unpacked by joins (Triton's two-way stack), then one bf16 dot
    x, q, scale = _qmatmul_inputs(0, 1, 4096, 1024, False, jnp.bfloat16, jnp.int8)
    for words in (False, True):
        fn = jax.jit(functools.partial(qmatmul.qmatmul, backend="triton", words=words))
        [text] = _triton_irs(fn.trace(x, q, scale).lower(lowering_platforms=("cuda",)))
        assert ("tt.join" in text) == words and ("!tt.ptr<i32>" in text) == words
        assert len([ln for ln in text.splitlines() if "tt.dot " in ln and "xbf16>" in ln]) == 1


def test_quantized_matmul_words_from_the_environment(monkeypatch):
    """qmatmul(words=None), what jdllm runs, follows `JDLLM_QMATMUL_WORDS`; the kernel then takes the
    weight as int32 [K, N / 4] (a bitcast); an explicit `words` wins; a bad value is a jdllm error."""
    from jdllm import errors
    from pallas_kernels import qmatmul

    x, q, scale = _qmatmul_inputs(1, 2, 256, 128, False, jnp.float32, jnp.int8)

    def weight_operand(**kw):
        closed = jax.make_jaxpr(lambda *a: qmatmul.qmatmul(*a, backend="interpret", **kw))(x, q, scale)
        [w] = [o for o in _pallas_operands(closed) if o.shape[0] == 256]
        return w.dtype.name, w.shape
    for env, kw, words in (("", {}, False), ("1", {}, True), ("0", {}, False), ("1", dict(words=False), False)):
        monkeypatch.setenv(qmatmul.WORDS_ENV, env)
        assert weight_operand(**kw) == (("int32", (256, 32)) if words else ("int8", (256, 128))), (env, kw)
    for bad in ("on", "2"):  # a switch: 0 or 1
        monkeypatch.setenv(qmatmul.WORDS_ENV, bad)
        with pytest.raises(errors.ConfigError, match=qmatmul.WORDS_ENV):
            weight_operand()


# ----------------------------------------------------------------------------- GPU (compiled)
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind,bs,dtype", [("causal", 1, jnp.bfloat16),
                                           ("block_causal", 32, jnp.bfloat16),
                                           ("block_causal", 4, jnp.float32),
                                           ("bidirectional", 1, jnp.float32)])
def test_gpu_prefill_compiled(kind, bs, dtype):
    _check(flash.prefill_attention, kind=kind, block_size=bs, B=2, T=300, S=300, H=8, KV=2, D=128,
           start=[0, 77], q_offset=0, kv_len=300, dtype=dtype, tiles=flash.Tiles(), backend="triton")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind,bs,T,dtype", [("block_causal", 32, 32, jnp.bfloat16),
                                             ("causal", 1, 1, jnp.bfloat16),
                                             ("bidirectional", 1, 96, jnp.float32)])
def test_gpu_window_compiled(kind, bs, T, dtype):
    _check(flash.window_attention, kind=kind, block_size=bs, B=1, T=T, S=4000, H=28, KV=4, D=128,
           start=[5], q_offset=2048, kv_len=2048 + T, dtype=dtype, tiles=flash.Tiles(),
           backend="triton")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("T,H,KV,dtype", [(1, 8, 8, jnp.bfloat16), (1, 8, 8, jnp.float32), (1, 28, 4, jnp.bfloat16),
                                          (12, 28, 4, jnp.float32), (32, 8, 8, jnp.bfloat16)])
def test_gpu_window_one_split_compiled(T, H, KV, dtype):
    """One key split, compiled: the kernel normalises the rows and writes the attention itself, the
    rows past the output's end masked out of the store (T = 1: one row, or a KV head's 7 query heads,
    in the dot's 16; 12 x 7 rows in tiles of 16 or more), equal to the reference, and its
    log-sum-exp to the merged splits'."""
    _check(flash.window_attention, kind="block_causal", block_size=4, B=2, T=T, S=448, H=H, KV=KV, D=128,
           start=[5, 0], q_offset=400, kv_len=400 + T, dtype=dtype, tiles=flash.Tiles(num_splits=1),
           backend="triton")
    rng = np.random.default_rng(T)
    q = jnp.asarray(rng.standard_normal((2, T, H, 128), np.float32), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, 448, KV, 128), np.float32), dtype) for _ in range(2))
    kw = dict(start=jnp.array([5, 0]), q_offset=400, kv_len=400 + T, kind="block_causal", block_size=4,
              backend="triton", return_lse=True)
    one = jax.jit(lambda *a: flash.window_attention(*a, tiles=flash.Tiles(num_splits=1), **kw))(q, k, v)
    split = jax.jit(lambda *a: flash.window_attention(*a, tiles=flash.Tiles(num_splits=4), **kw))(q, k, v)
    for a, b in zip(one, split):
        assert a.shape == b.shape and _rel_err(a, b) <= TOL[dtype]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,T,S,dtype", [("window", 1, 4032, jnp.bfloat16), ("window", 32, 448, jnp.float32),
                                               ("prefill", 160, 416, jnp.float32)])
def test_gpu_stacked_cache_read_in_place(variant, T, S, dtype):
    """The Triton kernels over layer l of a stacked cache [L, B, S, KV, D], compiled: what the
    model's decode steps run (416 slots: the key tile halves to 32), equal to the kernel over
    that layer's slice and to the reference."""
    L, B, H, KV, D = 4, 2, 8, 2, 128
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((B, T, H, D), np.float32), dtype)
    k, v = (jnp.asarray(rng.standard_normal((L, B, S, KV, D), np.float32), dtype) for _ in range(2))
    kw = dict(start=jnp.array([0, 9]), q_offset=S - T, kind="block_causal", block_size=32, backend="triton",
              variant=variant)
    out = jax.jit(lambda q, k, v, layer: flash.attention(q, k, v, layer=layer, **kw))(q, k, v, jnp.int32(2))
    sliced = jax.jit(lambda q, k, v: flash.attention(q, k, v, **kw))(q, k[2], v[2])
    ref_kw = {key: val for key, val in kw.items() if key not in ("backend", "variant")}
    with jax.default_matmul_precision(EXACT):
        ref = attention_reference(q, k[2], v[2], **ref_kw)
    assert _rel_err(out, ref) <= TOL[dtype]
    assert _rel_err(out, sliced) <= TOL[dtype]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant,T,S,dtype,H,words", [
    ("window", 1, 4032, jnp.bfloat16, 8, False), ("window", 32, 448, jnp.bfloat16, 8, False),
    ("window", 4, 448, jnp.float32, 8, False), ("prefill", 160, 416, jnp.bfloat16, 8, False),
    ("window", 1, 4032, jnp.bfloat16, 2, False), ("window", 1, 448, jnp.float32, 2, False),
    ("window", 32, 448, jnp.bfloat16, 2, True), ("window", 1, 4032, jnp.bfloat16, 8, True),
    ("window", 4, 448, jnp.float32, 8, True)])
def test_gpu_int8_cache_dequantized_in_the_kernel(variant, T, S, dtype, H, words):
    """An int8 stacked cache with its scales through the compiled Triton kernels (what an int8 KV
    cache's decode steps run, the layer read in place) equals the reference on the dequantized
    layer; H = KV at T = 1 is the one-row window (`flash._attend_one_row`, no dot); `words`: V read
    as int32 words and unpacked in the kernel (`Tiles.int8_v_words`)."""
    from jdllm.model import dequantize_kv, quantize_kv  # noqa: PLC0415

    L, B, KV, D = 4, 2, 2, 128
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((B, T, H, D), np.float32), dtype)
    (k, ks), (v, vs) = (quantize_kv(jnp.asarray(rng.standard_normal((L, B, S, KV, D)), jnp.float32)) for _ in range(2))
    kw = dict(start=jnp.array([0, 9]), q_offset=S - T, kind="block_causal", block_size=32)
    out = jax.jit(lambda *a: flash.attention(*a[:3], layer=a[5], k_scale=a[3], v_scale=a[4], **kw, backend="triton",
                                             variant=variant, tiles=flash.Tiles(int8_v_words=words)))(
        q, k, v, ks, vs, jnp.int32(2))
    with jax.default_matmul_precision(EXACT):
        ref = attention_reference(q, dequantize_kv(k[2], ks[2], dtype), dequantize_kv(v[2], vs[2], dtype), **kw)
    assert _rel_err(out, ref) <= TOL[dtype]


@pytest.mark.gpu
@needs_gpu
def test_gpu_grad_and_auto_dispatch():
    q, k, v = _qkv(9, 2, 256, 256, 8, 2, 128, jnp.float32)
    kw = dict(start=jnp.array([0, 31]), kind="block_causal", block_size=32)
    out = pallas_kernels.attention(q, k, v, **kw, impl="auto")
    g = jax.grad(lambda q: jnp.sum(pallas_kernels.attention(q, k, v, **kw, impl="pallas") ** 2))(q)
    with jax.default_matmul_precision(EXACT):
        ref = attention_reference(q, k, v, **kw)
        gr = jax.grad(lambda q: jnp.sum(attention_reference(q, k, v, **kw) ** 2))(q)
    assert _rel_err(out, ref) <= 1e-5
    assert _rel_err(g, gr) <= 1e-5


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind,bs,qoff,dtype", [("causal", 1, 0, jnp.bfloat16),
                                                ("block_causal", 32, 0, jnp.bfloat16),
                                                ("block_causal", 4, 100, jnp.float16),
                                                ("bidirectional", 1, 0, jnp.bfloat16)])
@pytest.mark.parametrize("variant", ["one-warpgroup", "warp-specialized", "warp-specialized-no-pingpong"])
def test_gpu_mosaic_prefill_compiled(kind, bs, qoff, dtype, variant):
    from pallas_kernels import mosaic

    if not mosaic.is_hopper():
        pytest.skip("the Mosaic GPU kernel needs Hopper (sm_90)")
    q, k, v = _qkv(24, 2, 300, 300 + qoff, 8, 2, 128, dtype)
    kw = dict(start=jnp.array([0, 77]), q_offset=qoff, kind=kind, block_size=bs)
    opts = dict(warp_specialized=variant != "one-warpgroup", pingpong=not variant.endswith("no-pingpong"))
    out = jax.jit(functools.partial(mosaic.prefill_attention, **kw, **opts))(q, k, v)
    assert _rel_err(out, attention_reference(q, k, v, **kw)) <= TOL[jnp.bfloat16]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind,bs,qoff", [("causal", 1, 0), ("block_causal", 32, 100), ("bidirectional", 1, 0)])
@pytest.mark.parametrize("ws", [False, True], ids=["one-warpgroup", "warp-specialized"])
def test_gpu_mosaic_backward_compiled(kind, bs, qoff, ws):
    """The Mosaic backward (one warpgroup, or warp-specialised) compiled for Hopper against the XLA
    reference's VJP."""
    from pallas_kernels import mosaic, mosaic_backward

    if not mosaic.is_hopper():
        pytest.skip("the Mosaic GPU kernels need Hopper (sm_90)")
    q, k, v = _qkv(34, 2, 300, 300 + qoff, 8, 2, 128, jnp.bfloat16)
    do = jnp.asarray(np.random.default_rng(35).standard_normal(q.shape), jnp.bfloat16)
    kw = dict(start=jnp.array([0, 77]), q_offset=qoff, kv_len=300 + qoff, kind=kind, block_size=bs)
    o, lse = jax.jit(functools.partial(mosaic.prefill_attention, **kw, return_lse=True))(q, k, v)
    got = jax.jit(functools.partial(mosaic_backward.attention_backward, **kw, warp_specialized=ws))(q, k, v, o, lse, do)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, **kw), *f32)
    for g, r in zip(got, vjp(do.astype(jnp.float32))):
        assert _rel_err(g, r) <= 2e-2


def test_kernel_modules_import_without_a_cycle():
    """flash, backward and mosaic share `common`; none reaches into a sibling's private names,
    and no module-level import is deferred into a function to dodge a circle."""
    import ast
    import pathlib

    root = pathlib.Path(flash.__file__).parent
    deps, problems = {}, []
    for path in root.glob("*.py"):
        mod = path.stem
        deps[mod] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pallas_kernels"):
                target = (node.module.split(".") + [a.name for a in node.names])[1]
                deps[mod].add(target)
                problems += [f"{mod} imports private {a.name}" for a in node.names if a.name.startswith("_")]
                if node.col_offset and mod != "__init__":
                    problems.append(f"{mod} imports {node.module} inside a function")
    assert not problems

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, seen + (d,))) for d in deps.get(a, ()))

    assert not [m for m in deps if reaches(m, m)]
    assert deps["backward"] <= {"common"} and deps["mosaic"] <= {"common"}
    assert deps["mosaic_backward"] <= {"common", "mosaic"}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M,K,N,transpose,dtype,wdtype", QMATMUL[:4])
def test_gpu_quantized_matmul_compiled(M, K, N, transpose, dtype, wdtype):
    """The quantized matmul compiled by Triton on the GPU, against XLA's float32 product; a [K, N]
    weight also read as int32 words (`qmatmul(words=True)`)."""
    from pallas_kernels import qmatmul

    x, q, scale = _qmatmul_inputs(M + K, M, K, N, transpose, dtype, wdtype)
    w = q.astype(jnp.float32)
    with jax.default_matmul_precision(EXACT):
        ref = (x.astype(jnp.float32) @ (w.T if transpose else w)) * scale
    for words in (False, True) if not transpose else (False,):
        got = jax.jit(functools.partial(qmatmul.qmatmul, transpose=transpose, backend="triton", words=words))(
            x, q, scale)
        assert _rel_err(got, ref) <= (1e-5 if dtype == jnp.float32 else 4e-3), words


@pytest.mark.parametrize("n", [1, 2, 6, flash.UNROLLED_SPLITS, flash.UNROLLED_SPLITS + 1, 33])
def test_combine_splits_merges_partials_as_one_softmax(n):
    """`combine_splits` (written out over the split axis up to UNROLLED_SPLITS, reductions past it)
    against a float64 merge in numpy: each split's partial (acc, max, sum, log2 units) rescaled to the
    rows' common max. Splits that saw nothing (m = NEG, l = 0) drop out; a row that saw nothing in any
    split comes out as zeros."""
    rng = np.random.default_rng(n)
    B, R, KV, D = 2, 4, 3, 8  # the window kernel's layout: [B, n, rows, heads, D]
    m = rng.normal(0.0, 4.0, (B, n, R, KV)).astype(np.float32)
    l = rng.uniform(0.5, 3.0, (B, n, R, KV)).astype(np.float32)
    acc = (rng.normal(size=(B, n, R, KV, D)) * l[..., None]).astype(np.float32)
    if n > 1:
        m[:, 1], l[:, 1], acc[:, 1] = common.NEG, 0.0, 0.0  # a split that saw nothing
    m[0, :, 0, 0], l[0, :, 0, 0], acc[0, :, 0, 0] = common.NEG, 0.0, 0.0  # a row that saw nothing at all
    out, lse = jax.jit(flash.combine_splits)(acc, m, l)

    m64, l64, a64 = (x.astype(np.float64) for x in (m, l, acc))
    top = m64.max(axis=1, keepdims=True)
    w = np.exp2(m64 - top)
    den = (w * l64).sum(axis=1)
    want = (w[..., None] * a64).sum(axis=1) / np.where(den == 0.0, 1.0, den)[..., None]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    assert not np.asarray(out)[0, 0, 0].any()
    want_lse = np.where(den == 0.0, 0.0, top[:, 0] + np.log2(np.where(den == 0.0, 1.0, den)))
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
