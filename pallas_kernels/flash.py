"""Pallas flash attention under jdllm's one masking rule.

Two kernels share one inner loop (`_attend`):

- `prefill_attention`: one program per (query tile, batch row, query head); the
  key loop runs only over the tiles the query tile can see, from `start[b]`'s
  tile up to the horizon of the tile's last query. Tiles wholly visible to every
  query of the tile skip the mask arithmetic; only the boundary tiles (left
  padding, the diagonal, `kv_len`) apply it.
- `window_attention`: the denoising / decoding window over a long KV cache
  (T <= 128). The G query heads that share a KV head are packed as rows of one
  tile so each key tile is loaded once for all of them, and the keys are split
  across programs (flash-decoding) so a batch-1 step fills the GPU; a small XLA
  step combines the per-split partial softmaxes.

Both run the online softmax in float32 (base 2: scores are pre-multiplied by
log2(e)). A query that sees no key returns zeros, like the reference. Every dot
on float32 inputs, in these kernels, the backward ones and the XLA glue around
them, runs at full float32 precision (`common.dot` / `common.dot_precision`:
HIGHEST, which Triton runs as IEEE, not TF32) whatever
`jax_default_matmul_precision` says; bfloat16 / float16 dots are unchanged.

Backends (`backend=`): "interpret" (Pallas interpret mode, the CPU default and
what the tests run), "triton" (the Pallas Triton lowering, the default on
non-Hopper GPUs) and "mosaic" (the default on Hopper): the prefill forward runs
the Mosaic GPU kernel of `mosaic.py` (wgmma + TMA) when it takes the inputs
(float16/bfloat16, head_dim a multiple of 64), and everything else (the window
kernel, the backward kernels, other dtypes) runs the Triton lowering.
"mosaic_interpret" is "mosaic" on the CPU: the Mosaic kernel in Pallas's GPU
interpret mode, the rest in interpret mode. `JDLLM_PALLAS_BACKEND` overrides
the default. On the "mosaic" backends the prefill forward of more than 64 query
rows runs the Mosaic kernel's warp-specialised variant (without the ping-pong)
and the backward the Mosaic backward kernels (`mosaic_backward.py`): what an
H200 timed fastest (`Tiles` says by how much; `Tiles(mosaic_warp_specialized=False,
mosaic_backward=False)` restores the one-warpgroup forward and the Triton
backward).

STATUS: the Triton and Mosaic kernels have run on an H100 and an H200 (the
`gpu` test tier compiles each variant and checks it against the reference;
benchmarks/RESULTS.md has their timings). `JDLLM_PALLAS_BACKEND=triton` (or
`impl="xla"`) is the way around a kernel that fails to compile.

Gradients: `attention` is a `jax.custom_vjp`; the forward kernel also saves the
row log-sum-exp and the backward runs the Pallas kernels of `backward.py`
(dq, and dk/dv summed over each GQA group; on the "mosaic" backends the Mosaic
GPU ones of `mosaic_backward.py`). `bwd="xla"` swaps in the VJP of the
XLA reference instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import mosaic, mosaic_backward
from pallas_kernels.backward import attention_backward
from pallas_kernels.common import (BACKEND_ENV, BACKENDS, LOG2E, MIN_TILE, NEG, Tiles,  # noqa: F401 (re-exported)
                                   cdiv, default_backend, dot, dot_precision, env_count, env_switch, int8_from_words,
                                   int8_to_float32, int8_words, key_end,
                                   normalise, online_softmax_step, pad_axis, pad_head_dim, padded_head_dim,
                                   plain_backend, query_rows_bounds, row_lse, row_scalars, store_rows, tile_bounds,
                                   tile_size, triton_params)
from pallas_kernels.reference import KINDS, attention_reference, dequantize

WINDOW_MAX_T = 128  # queries above this use the prefill kernel
# warps of the one-row window (`_attend_one_row`) unless Tiles.num_warps says: on an H200 (T=1, S=33792,
# 32 heads of 128) 4 warps took 0.183-0.203 ms per call where 8 took 0.220-0.251
ONE_ROW_WARPS = 4
# a prefill chunk over a stacked cache (`attention(layer=)`) of at most this many queries runs the
# Triton prefill kernel on the cache in place rather than the Mosaic one on a copy of the layer: at
# 1.3x the Mosaic kernel's rate the copy of 2 S x KV x D elements (read and written) costs more than
# the slower kernel's extra 4 T S H D flops below T ~ 600 KV / H (the H100's measured rates)
STACKED_TRITON_MAX_T = 512


def _attend(q, rows_p, k_ref, v_ref, bounds, *, start, kvl, block_k, kind, block_size, qk_scale, lead=(),
            scale_refs=None, v_words=False):
    """Online softmax of q [R, D] over key tiles `bounds` of k_ref/v_ref [S, D] (or, with `lead`
    indices, [*, S, D]: a stacked cache's block, read at those leading indices).

    scale_refs (ks_ref, vs_ref) [S] (or [*, S]), optional: k / v are int8 with one float32 scale per
    key (an int8 KV cache); each tile is converted to q's dtype on chip (exact: |int8| <= 127), the
    scores are scaled per key column and the probabilities by V's scale before the PV dot, so the
    kernel reads one byte per element where a dequantized copy cost a read, a write and a read of two.

    v_words (`Tiles.int8_v_words`; with scale_refs): v_ref holds int8 V as int32 words [S, D / 4]
    (`common.int8_words`), unpacked in registers (`common.int8_from_words`) before the PV dot. The
    dot contracts V over its keys, and from an int8 tile the compiled kernel reads V out of shared
    memory one byte per instruction (96 `ld.shared.b8` in its PTX: the GPU's transposing loads take
    16-bit elements; on an H200 at 32k the int8 cache's windows took 1.4x bf16's); from words, none
    (its bfloat16 tile goes to the dot through `ldmatrix`).

    rows_p [R]: absolute slot of each row's query. Returns (acc [R, D] f32,
    m [R] f32 running max in log2 units, l [R] f32 normaliser); acc is not yet
    divided by l.
    """
    R, D = q.shape
    a, b, c, d = bounds

    def step(t, carry, masked: bool):
        k0 = t * block_k
        k = k_ref[(*lead, pl.ds(k0, block_k), slice(None))]  # [bk, D]
        v = v_ref[(*lead, pl.ds(k0, block_k), slice(None))]  # [bk, D]
        vis = None
        if masked:
            cols = k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, bk]
            end = key_end(rows_p, kind, block_size, kvl)[:, None]  # [R, 1]
            vis = (cols >= start) & (cols < end)  # [R, bk]
        if scale_refs is None:
            s = dot(q, k, ((1,), (1,))) * qk_scale  # [R, bk]
            return online_softmax_step(carry, s, vis, lambda p: dot(p.astype(v.dtype), v, ((1,), (0,))))
        ks, vs = (lax.broadcast_in_dim(r[(*lead, pl.ds(k0, block_k))], (R, block_k), [1]) for r in scale_refs)
        s = dot(q, k.astype(q.dtype), ((1,), (1,))) * (ks * qk_scale)  # [R, bk]

        def pv(p):  # a hidden key's scale may be anything (a stale or unwritten slot): 0 * NaN
            pw = p * vs if vis is None else jnp.where(vis, p * vs, 0.0)
            vt = int8_from_words(v) if v_words else v  # words: [bk, D / 4] -> [bk, D]
            return dot(pw.astype(q.dtype), vt.astype(q.dtype), ((1,), (0,)))
        return online_softmax_step(carry, s, vis, pv)

    carry = (jnp.zeros((R, D), jnp.float32), jnp.full((R,), NEG, jnp.float32),
             jnp.zeros((R,), jnp.float32))
    carry = lax.fori_loop(a, b, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(b, c, functools.partial(step, masked=False), carry)
    return lax.fori_loop(c, d, functools.partial(step, masked=True), carry)


def _attend_one_row(q, rows_p, k_ref, v_ref, bounds, *, start, kvl, block_k, kind, block_size, qk_scale, lead,
                    scale_refs, prefetch=False):
    """`_attend` for one query row over an int8 cache, on the CUDA cores: no tensor-core dot.

    A dot takes V [bk, D] with the keys as its contraction axis, but the cache keeps each key's D
    values together: for bfloat16 the GPU loads that transposed (ldmatrix.trans); for int8 the
    compiled kernel reads it out of shared memory one byte per instruction (ld.shared.b8 in its
    PTX). At a 32k context on an H200 (8B shape, 32 layers) the window kernels over an int8 cache
    took 7.41 ms per token where bfloat16's took 4.95. With one row there is nothing for a tensor
    core to share: the scores are q times each key tile summed over D, and the tile's p-weighted
    values go into an accumulator of the tile's shape [bk, D], summed over the keys once at the
    end, so K and V are read in rows as they lie (16-byte loads) and converted exactly
    (`int8_to_float32`). `prefetch` (`Tiles.one_row_prefetch`) loads the next unmasked tile before
    folding the current one. One call at T=1, S=33792, 32 heads of 128, on the H200: 0.203 ms, where
    the dot over int8 took 0.276 and bfloat16's kernel 0.192-0.208 (benchmarks/attention.py
    --kv-cache int8): the int8 bytes are read at 1.4 TB/s, bfloat16's at 2.7-2.9."""
    a, b, c, d = bounds
    D = q.shape[-1]
    qf = lax.broadcast_in_dim(q[0].astype(jnp.float32), (block_k, D), [1])  # [bk, D]
    end = key_end(rows_p[0], kind, block_size, kvl)
    ks_ref, vs_ref = scale_refs

    def load(t):  # tile t's K, V [bk, D] int8 and their scales [bk]
        k0 = t * block_k
        return (k_ref[(*lead, pl.ds(k0, block_k), slice(None))], v_ref[(*lead, pl.ds(k0, block_k), slice(None))],
                ks_ref[(*lead, pl.ds(k0, block_k))], vs_ref[(*lead, pl.ds(k0, block_k))])

    def step(t, carry, masked: bool, tile=None):
        acc, m, l = carry  # [bk, D], scalar, scalar
        k0 = t * block_k
        k, v, ks, vs = load(t) if tile is None else tile
        s = jnp.sum(int8_to_float32(k) * qf, axis=1) * (ks * qk_scale)  # [bk], log2 units
        if masked:
            cols = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            vis = (cols >= start) & (cols < end)
            s = jnp.where(vis, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new)
        if masked:  # a hidden key's scale may be anything (a stale or unwritten slot): 0 * NaN
            p = jnp.where(vis, p, 0.0)
            pw = jnp.where(vis, p * vs, 0.0)
        else:
            pw = p * vs
        acc = acc * corr + lax.broadcast_in_dim(pw, (block_k, D), [0]) * int8_to_float32(v)
        return acc, m_new, corr * l + jnp.sum(p)

    carry = (jnp.zeros((block_k, D), jnp.float32), jnp.float32(NEG), jnp.float32(0.0))
    carry = lax.fori_loop(a, b, functools.partial(step, masked=True), carry)
    if prefetch:  # the unmasked tiles' loads one tile ahead, carried (Triton pipelines no dot-less loop)
        last = k_ref.shape[-2] // block_k - 1  # (a load past the cache would be out of bounds)

        def ahead(t, carry):
            acc, m, l, tile = carry
            nxt = load(jnp.minimum(t + 1, jnp.minimum(c - 1, last)))
            return (*step(t, (acc, m, l), False, tile), nxt)

        carry = lax.fori_loop(b, c, ahead, (*carry, load(jnp.minimum(b, last))))[:3]
    else:
        carry = lax.fori_loop(b, c, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(c, d, functools.partial(step, masked=True), carry)
    return (lax.broadcast_in_dim(jnp.sum(acc, axis=0), (1, D), [1]), lax.broadcast_in_dim(m, (1,), []),
            lax.broadcast_in_dim(l, (1,), []))


# --------------------------------------------------------------------------- prefill kernel
def _prefill_kernel(start_ref, qoff_ref, kvl_ref, *refs, T, S, num_q_tiles,
                    block_q, block_k, kind, block_size, qk_scale, with_lse=False, stacked=False, scaled=False,
                    v_words=False):
    # refs: [layer_ref (stacked)], q_ref, k_ref, v_ref, [ks_ref, vs_ref (scaled)], [poisoned buffers
    # aliased to the outputs (unused)], o_ref[, lse_ref]
    lead, (q_ref, k_ref, v_ref, *refs) = _layer_lead(refs, stacked)
    scale_refs, refs = (tuple(refs[:2]), refs[2:]) if scaled else (None, refs)
    o_ref, lse_ref = (refs[-2], refs[-1]) if with_lse else (refs[-1], None)
    i = num_q_tiles - 1 - pl.program_id(0)  # heaviest (last) query tiles launch first
    start, qoff, kvl = start_ref[()], qoff_ref[()], kvl_ref[()]
    rows_p = qoff + i * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)  # [bq]
    bounds = query_rows_bounds(i * block_q, block_q, T=T, S=S, start=start, qoff=qoff, kvl=kvl, block_k=block_k,
                               kind=kind, block_size=block_size)
    acc, m, l = _attend(q_ref[...], rows_p, k_ref, v_ref, bounds, start=start, kvl=kvl,
                        block_k=block_k, kind=kind, block_size=block_size, qk_scale=qk_scale, lead=lead,
                        scale_refs=scale_refs, v_words=v_words)
    o_ref[...] = normalise(acc, l).astype(o_ref.dtype)
    if with_lse:
        lse_ref[...] = row_lse(m, l)


def stacked_key_tile(q, k, tile_k: int, backend: str, scaled: bool = False) -> int | None:
    """The key tile with which a kernel reads layer `layer` of a stacked cache k [L, B, S, KV, D]
    where it lies, or None when it cannot: the cache must need no padding (head_dim a power of
    two, q's dtype (or int8 with scales: `scaled`), S a multiple of the tile: `tile_k`, else the
    largest smaller tile dividing S, down to the backend's minimum), else the layer is sliced out
    (a copy of it) and padded as before."""
    S, D = k.shape[2], k.shape[-1]
    if padded_head_dim(D, backend) != D or k.dtype != (jnp.int8 if scaled else q.dtype):
        return None
    bk, floor = tile_size(tile_k, S, backend), (MIN_TILE if backend == "triton" else 1)
    while S % bk and bk > floor:
        bk //= 2
    return bk if S % bk == 0 else None


def _layer_of(k, v, layer):
    """Layer `layer` (traced or not) of stacked k / v [L, B, S, KV, D]."""
    return (lax.dynamic_index_in_dim(x, jnp.asarray(layer, jnp.int32), 0, keepdims=False) for x in (k, v))


def _stacked_keys(q, k, v, layer, tiles: Tiles, backend: str, scales=None):
    """(k, v, scales, key tile or None): a stacked cache's k / v (and an int8 cache's scales) as
    they are and the tile that reads its layer in place (`stacked_key_tile`), else that layer's
    slice (a copy) and None; all unchanged without `layer`."""
    bk = None if layer is None else stacked_key_tile(q, k, tiles.block_k, backend, scaled=scales is not None)
    if layer is not None and bk is None:
        k, v = _layer_of(k, v, layer)
        scales = None if scales is None else tuple(_layer_of(*scales, layer))
    return k, v, scales, bk


def _operands(q, k, v, layer, tiles: Tiles, backend, k_scale, v_scale, kv_len, scale):
    """What `prefill_attention` and `window_attention` start from: (the plain backend, k, v, the
    int8 scales or None, the stacked cache's key tile or None (`_stacked_keys`), kv_len (S when
    None), the softmax scale (D ** -0.5 when None))."""
    backend = plain_backend(backend or default_backend())
    k, v, scales, stacked_bk = _stacked_keys(q, k, v, layer, tiles, backend, _scale_pair(k, k_scale, v_scale))
    kv_len = k.shape[-3] if kv_len is None else kv_len
    return backend, k, v, scales, stacked_bk, kv_len, q.shape[-1] ** -0.5 if scale is None else scale


def _scale_pair(k, k_scale, v_scale):
    """An int8 cache's scales as the kernels take them: float32 [.., S, KV] (the cache's [.., S, KV, 1]
    without its last axis, a bitcast), or None without them."""
    from jdllm import errors  # noqa: PLC0415 (keeps pallas_kernels importable alone)

    if (k_scale is None) != (v_scale is None):
        raise errors.InputError("k_scale and v_scale go together (an int8 KV cache's two scale arrays)")
    if k_scale is None:
        return None
    if k.dtype != jnp.int8:
        raise errors.InputError(f"k_scale / v_scale come with an int8 cache; k is {k.dtype}")
    want = k.shape[:-1]
    out = []
    for x in (k_scale, v_scale):
        if x.shape == (*want, 1):
            x = x.reshape(want)
        if x.shape != want:
            raise errors.InputError(f"int8 KV scales must be {(*want, 1)} for k {k.shape}; got {x.shape}")
        out.append(x.astype(jnp.float32))
    return tuple(out)


def _scale_specs(scales, stacked: bool, Sp: int, index):
    """The scales' BlockSpecs: every slot of the program's (row, KV head) (every layer if stacked),
    `index(*grid ids) -> (b, kv head)`; empty without scales."""
    if scales is None:
        return []
    if stacked:
        spec = pl.BlockSpec((scales[0].shape[0], None, Sp, None), lambda *g: (0, index(*g)[0], 0, index(*g)[1]))
    else:
        spec = pl.BlockSpec((None, Sp, None), lambda *g: (index(*g)[0], 0, index(*g)[1]))
    return [spec, spec]


def _pad_unstacked(q, k, v, scales, backend: str, Sp: int, pad_q_to: int | None = None):
    """Pad head_dim (all three) and S to the key tiles (k / v, and the scales); K / V in q's dtype
    unless int8 with scales (then converted in the kernel)."""
    if scales is None:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    q, k, v = pad_head_dim(q, k, v, backend)
    if pad_q_to is not None:
        q = pad_axis(q, 1, pad_q_to)
    k, v = pad_axis(k, 1, Sp), pad_axis(v, 1, Sp)
    return q, k, v, None if scales is None else tuple(pad_axis(x, 1, Sp) for x in scales)


def _layer_operand(layer, stacked: bool):
    """The kernel's extra operand and BlockSpec for a stacked cache's layer index ([1] int32, the
    same block for every program, whatever the grid): empty lists otherwise."""
    if not stacked:
        return [], []
    return [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))], [pl.BlockSpec((None,), lambda *_: (0,))]


def _v_as_words(v, scales, tiles: Tiles, Dp: int, one_row: bool = False):
    """(v, whether the kernel reads it as int32 words): `Tiles.int8_v_words` (None: `$JDLLM_INT8_V_WORDS`)
    for an int8 cache's dot over V (not the one-row window's), head_dim a multiple of 64; v then as
    `int8_words` [.., D / 4] (a bitcast: the same bytes, read 4 at a time)."""
    words = scales is not None and not one_row and Dp % 64 == 0 and (
        tiles.int8_v_words if tiles.int8_v_words is not None else env_switch(WORDS_ENV))
    return (int8_words(v) if words else v), words


def _kv_specs(k, stacked: bool, Sp: int, Dp: int, words: bool, index):
    """BlockSpecs of K and V: every slot of the program's (row, KV head), every layer if stacked
    (k [L, B, S, KV, D], read in place); `index(*grid ids) -> (b, kv head)`; V's last axis D / 4 as
    words."""
    specs = []
    for d in (Dp, Dp // 4 if words else Dp):
        if stacked:  # the kernel reads its layer's tiles
            specs.append(pl.BlockSpec((k.shape[0], None, Sp, None, d), lambda *g: (0, index(*g)[0], 0, index(*g)[1], 0)))
        else:
            specs.append(pl.BlockSpec((None, Sp, None, d), lambda *g: (index(*g)[0], 0, index(*g)[1], 0)))
    return specs


def _layer_lead(refs, stacked: bool):
    """A kernel's (leading indices into its K / V blocks, the remaining refs): with a stacked cache
    the first ref is the layer index, and the K / V blocks hold every layer."""
    return ((refs[0][()],), refs[1:]) if stacked else ((), refs)


def prefill_attention(q, k, v, *, start, q_offset=0, kv_len=None, kind="causal", block_size=1,
                      scale=None, tiles: Tiles = Tiles(), backend: str | None = None,
                      poison: bool = False, return_lse: bool = False, layer=None, k_scale=None, v_scale=None):
    """Flash attention forward: q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D].

    start [B]; q_offset, kv_len: ints or traced int32 scalars. T and S need not
    be tile multiples (padded here, sliced back). `poison=True` pre-fills the
    output buffers with NaN (aliased in place) so an element the kernel forgets
    to write shows up in tests. `return_lse=True` also returns the row
    log2-sum-exp2 [B, H, T] f32 the backward needs. `layer` (an int32 scalar,
    traced or not): k / v are a stacked cache [L, B, S, KV, D] and the keys are
    its layer `layer`, read in place when `stacked_key_tile` allows (a slice,
    i.e. a copy of the layer, otherwise). k_scale / v_scale [B, S, KV, 1] (stacked: [L, ...]): k / v
    are an int8 cache with one float32 scale per key and KV head, dequantized in the kernel.
    """
    backend, k, v, scales, stacked_bk, kv_len, scale = _operands(q, k, v, layer, tiles, backend, k_scale, v_scale,
                                                                 kv_len, scale)
    stacked = stacked_bk is not None
    B, T, H, D = q.shape
    S, KV = k.shape[-3], k.shape[-2]
    G = H // KV
    bq, bk = tile_size(tiles.block_q, T, backend), stacked_bk or tile_size(tiles.block_k, S, backend)
    Tp, Sp = pl.cdiv(T, bq) * bq, pl.cdiv(S, bk) * bk
    if stacked:  # no padding (`stacked_key_tile`): the cache goes in as it is
        q = pad_axis(q, 1, Tp)
    else:
        q, k, v, scales = _pad_unstacked(q, k, v, scales, backend, Sp, pad_q_to=Tp)
    Dp = q.shape[-1]
    start, qoff, kvl = row_scalars(start, q_offset, kv_len, B, S)
    nq = Tp // bq

    v, v_words = _v_as_words(v, scales, tiles, Dp)
    kernel = functools.partial(_prefill_kernel, T=T, S=S, num_q_tiles=nq, block_q=bq, block_k=bk,
                               kind=kind, block_size=block_size, qk_scale=scale * LOG2E,
                               with_lse=return_lse, stacked=stacked, scaled=scales is not None, v_words=v_words)
    row = pl.BlockSpec((None,), lambda i, b, h: (b,))
    q_spec = pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, nq - 1 - i, h, 0))
    kv_spec, v_spec = _kv_specs(k, stacked, Sp, Dp, v_words, lambda i, b, h: (b, lax.div(h, G)))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [q_spec]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((B, H, Tp), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i)))
    lyr, lyr_spec = _layer_operand(layer, stacked)
    s_specs = _scale_specs(scales, stacked, Sp, lambda i, b, h: (b, lax.div(h, G)))
    args, in_specs, aliases = _poisoned([start, qoff, kvl, *lyr, q, k, v, *(scales or ())],
                                        [row, row, row, *lyr_spec, q_spec, kv_spec, v_spec, *s_specs],
                                        out_shape, out_specs, poison)
    outs = pl.pallas_call(
        kernel,
        grid=(nq, B, H),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_params(backend, tiles, Dp),
        interpret=backend == "interpret",
        name="jdllm_flash_prefill",
    )(*args)
    out = outs[0][:, :T, :, :D]
    return (out, outs[1][:, :, :T]) if return_lse else out


def _poisoned(args, in_specs, out_shape, out_specs, poison: bool):
    """With `poison`, append NaN-filled buffers aliased to every output."""
    aliases = {}
    if poison:
        args, in_specs = list(args), list(in_specs)
        for j, (shape, spec) in enumerate(zip(out_shape, out_specs)):
            aliases[len(args)] = j
            args.append(jnp.full(shape.shape, jnp.nan, shape.dtype))
            in_specs.append(spec)
    return args, in_specs, aliases


# --------------------------------------------------------------------------- window kernel
def _window_kernel(start_ref, qoff_ref, kvl_ref, *refs, T, G, S, num_splits,
                   block_r, block_k, kind, block_size, qk_scale, stacked=False, scaled=False, one_row=False,
                   prefetch=False, v_words=False, final=False, with_lse=False, out_rows=None):
    # refs: [layer_ref (stacked)], q_ref, k_ref, v_ref, [ks_ref, vs_ref (scaled)], [poisoned buffers],
    # then the outputs: acc_ref, m_ref, l_ref (the split's partials); or, with `final` (one split),
    # o_ref (the rows normalised, in its own dtype) [and lse_ref, `with_lse`], as the prefill kernel's,
    # of `out_rows` rows (the rows past them in the last row tile are not stored)
    lead, (q_ref, k_ref, v_ref, *refs) = _layer_lead(refs, stacked)
    scale_refs, refs = (tuple(refs[:2]), refs[2:]) if scaled else (None, refs)
    ri, sj = pl.program_id(2), pl.program_id(3)
    start, qoff, kvl = start_ref[()], qoff_ref[()], kvl_ref[()]
    r0 = ri * block_r
    rows_p = qoff + lax.div(r0 + lax.broadcasted_iota(jnp.int32, (block_r,), 0), G)  # [br]
    p_first = qoff + lax.div(r0, G)
    p_last = qoff + lax.div(jnp.minimum(r0 + (block_r - 1), T * G - 1), G)
    # Split the tiles this row tile can see, [start, horizon of its last query), evenly over the
    # splits: the work follows kv_len at run time, not the static cache length S.
    first = lax.div(start, block_k)
    last = jnp.maximum(cdiv(jnp.minimum(key_end(p_last, kind, block_size, kvl), S), block_k), first)
    per_split = cdiv(last - first, num_splits)
    lo_slot = (first + sj * per_split) * block_k
    bounds = tile_bounds(start=start, kvl=kvl, p_first=p_first, p_last=p_last, lo_slot=lo_slot,
                          hi_slot=jnp.minimum(lo_slot + per_split * block_k, S), block_k=block_k,
                          kind=kind, block_size=block_size)
    attend = (functools.partial(_attend_one_row, prefetch=prefetch) if one_row
              else functools.partial(_attend, v_words=v_words))
    acc, m, l = attend(q_ref[...], rows_p, k_ref, v_ref, bounds, start=start, kvl=kvl,
                       block_k=block_k, kind=kind, block_size=block_size, qk_scale=qk_scale, lead=lead,
                       scale_refs=scale_refs)
    if final:
        o_ref, lse_ref = (refs[-2], refs[-1]) if with_lse else (refs[-1], None)
        store_rows(o_ref, normalise(acc, l).astype(o_ref.dtype), r0, out_rows)
        if with_lse:
            store_rows(lse_ref, row_lse(m, l), r0, out_rows)
        return
    acc_ref, m_ref, l_ref = refs[-3:]
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


SPLITS_ENV = "JDLLM_WINDOW_SPLITS"
# `Tiles.int8_v_words` where Tiles leave it None (read when a program is traced): 1 reads an int8 V as
# words in the windows of several rows (`gpu.py --xla-flags-variants "" JDLLM_INT8_V_WORDS=1` times
# both end to end)
WORDS_ENV = "JDLLM_INT8_V_WORDS"


# programs per core the one-row kernel's key splits aim at (`_default_splits`): it does little work per
# key on the CUDA cores, so more programs hide more of its load latency. H100, T=1, S=33792, 32 heads,
# int8 cache (2026-11-27): 0.195 ms per call with the 2 per core of the dot's kernels (9 splits), 0.159
# / 0.163 / 0.149 ms with 16 / 32 / 64 splits; 8B AR at 32k: 10.31 ms per token, 9.58 with 32 splits
ONE_ROW_PROGRAMS_PER_CORE = 8


def _default_splits(programs: int, key_tiles: int, per_core: int = 2) -> int:
    """Key splits so that programs * splits covers `per_core` times the device's cores. `JDLLM_WINDOW_SPLITS=N`
    (read when a program is traced) fixes N instead, at most one per key tile: with 1, a short
    cache's window is one program per row tile and KV head that writes the attention itself, and no
    merge kernel follows it (benchmarks/gpu.py times it as a variant: `--xla-flags-variants ""
    JDLLM_WINDOW_SPLITS=1`)."""
    fixed = env_count(SPLITS_ENV, 1)
    if fixed is not None:
        return min(key_tiles, fixed)
    cores = getattr(jax.devices()[0], "core_count", None) or 132
    return max(1, min(key_tiles, pl.cdiv(per_core * cores, programs)))


def window_attention(q, k, v, *, start, q_offset=0, kv_len=None, kind="causal", block_size=1,
                     scale=None, tiles: Tiles = Tiles(), backend: str | None = None,
                     poison: bool = False, return_lse: bool = False, layer=None, k_scale=None, v_scale=None):
    """Flash-decoding attention of a short window q [B, T, H, D] over k/v [B, S, KV, D].

    Rows of a program are (query, head-in-group) pairs, r = t * G + g, so each
    key tile is read once per KV head. The key tiles a row tile can see,
    [start, min(horizon, kv_len)), are divided evenly at run time over
    `tiles.num_splits` programs (so a short kv_len in a long cache still uses
    every program) and the partial (acc, max, sum) are merged here in XLA
    (`combine_splits`). With one split there is nothing to merge: the kernel
    divides by the softmax sum and writes the attention in q's dtype itself.
    K/V are copied only when S is not a multiple of the key tile.
    `poison=True` pre-fills the partial buffers with NaN; `return_lse`,
    `layer` (k / v a stacked cache [L, B, S, KV, D], its layer read in place)
    and `k_scale` / `v_scale` (an int8 cache) as in `prefill_attention`.
    """
    backend, k, v, scales, stacked_bk, kv_len, scale = _operands(q, k, v, layer, tiles, backend, k_scale, v_scale,
                                                                 kv_len, scale)
    stacked = stacked_bk is not None
    B, T, H, D = q.shape
    S, KV = k.shape[-3], k.shape[-2]
    G = H // KV
    R = T * G
    bk = stacked_bk or tile_size(tiles.block_k, S, backend)
    # `_attend_one_row`: one query row per program; with grouped heads (`Tiles.one_row_heads`) a
    # program per query head, each reading its KV head's tiles (the group's G programs read them alike)
    one_row = T == 1 and scales is not None and tiles.one_row and (G == 1 or tiles.one_row_heads)
    per_head = one_row and G > 1
    P, Gk = (H, 1) if per_head else (KV, G)  # programs' heads; query heads per program's KV head
    br = 1 if one_row else tile_size(tiles.block_r, R, backend)
    Rp, Sp = (1 if per_head else pl.cdiv(R, br) * br), pl.cdiv(S, bk) * bk
    nr = Rp // br
    key_tiles = Sp // bk
    ns = tiles.num_splits or _default_splits(B * P * nr, key_tiles,
                                             ONE_ROW_PROGRAMS_PER_CORE if one_row else 2)
    split_tiles = pl.cdiv(key_tiles, min(ns, key_tiles))
    ns = pl.cdiv(key_tiles, split_tiles)  # no empty trailing split
    if not stacked:  # (stacked: nothing to pad, `stacked_key_tile`)
        q, k, v, scales = _pad_unstacked(q, k, v, scales, backend, Sp)
    Dp = q.shape[-1]
    v, v_words = _v_as_words(v, scales, tiles, Dp, one_row)
    qp = q.reshape(B, T, KV, G, Dp).transpose(0, 2, 1, 3, 4).reshape(B, KV, R, Dp)
    qp = qp.reshape(B, H, 1, Dp) if per_head else pad_axis(qp, 2, Rp)  # [B, P, Rp, Dp]
    start, qoff, kvl = row_scalars(start, q_offset, kv_len, B, S)

    def kv_head(h):
        return lax.div(h, G) if per_head else h

    # one split: the kernel divides by the softmax sum itself and writes the attention in q's dtype,
    # laid out so that no merge or transpose follows it: [B, P, rows, Dp] for one query (the rows
    # are a KV head's query heads: [B, 1, H, D] as it stands), else [B, rows, P, Dp] (for one query
    # head per KV head, [B, T, H, D]; grouped heads take a transpose)
    final, out_rows, head_major = ns == 1, (1 if per_head else R), T == 1
    kernel = functools.partial(_window_kernel, T=T, G=Gk, S=S, num_splits=ns,
                               block_r=br, block_k=bk, kind=kind, block_size=block_size,
                               qk_scale=scale * LOG2E, stacked=stacked, scaled=scales is not None,
                               one_row=one_row, prefetch=tiles.one_row_prefetch, v_words=v_words, final=final,
                               with_lse=return_lse, out_rows=out_rows)
    row = pl.BlockSpec((None,), lambda b, h, r, s: (b,))
    q_spec = pl.BlockSpec((None, None, br, Dp), lambda b, h, r, s: (b, h, r, 0))
    kv_spec, v_spec = _kv_specs(k, stacked, Sp, Dp, v_words, lambda b, h, r, s: (b, kv_head(h)))
    # partials split-major, then rows, then heads: [B, ns, Rp, P, Dp] (each program's block a strided
    # one), so the merge's output is [B, Rp, P, Dp], which for one query head per KV head is the
    # attention's [B, T, H, D] as it stands: no transpose after the merge
    acc_spec = pl.BlockSpec((None, None, br, None, Dp), lambda b, h, r, s: (b, s, r, h, 0))
    ml_spec = pl.BlockSpec((None, None, br, None), lambda b, h, r, s: (b, s, r, h))
    out_shape = [jax.ShapeDtypeStruct((B, ns, Rp, P, Dp), jnp.float32),
                 jax.ShapeDtypeStruct((B, ns, Rp, P), jnp.float32),
                 jax.ShapeDtypeStruct((B, ns, Rp, P), jnp.float32)]
    out_specs = [acc_spec, ml_spec, ml_spec]
    if final:
        # R rows, not Rp: a row tile past R (AR's one query padded to the dot's 16 rows) is masked in
        # the store, where a padded output took a slicing kernel after this one
        if head_major:
            out_shape = [jax.ShapeDtypeStruct((B, P, out_rows, Dp), q.dtype),
                         jax.ShapeDtypeStruct((B, P, out_rows), jnp.float32)]
            out_specs = [pl.BlockSpec((None, None, br, Dp), lambda b, h, r, s: (b, h, r, 0)),
                         pl.BlockSpec((None, None, br), lambda b, h, r, s: (b, h, r))]
        else:
            out_shape = [jax.ShapeDtypeStruct((B, out_rows, P, Dp), q.dtype),
                         jax.ShapeDtypeStruct((B, out_rows, P), jnp.float32)]
            out_specs = [pl.BlockSpec((None, br, None, Dp), lambda b, h, r, s: (b, r, h, 0)),
                         pl.BlockSpec((None, br, None), lambda b, h, r, s: (b, r, h))]
        n_out = 2 if return_lse else 1
        out_shape, out_specs = out_shape[:n_out], out_specs[:n_out]
    lyr, lyr_spec = _layer_operand(layer, stacked)
    s_specs = _scale_specs(scales, stacked, Sp, lambda b, h, r, s: (b, kv_head(h)))
    args, in_specs, aliases = _poisoned([start, qoff, kvl, *lyr, qp, k, v, *(scales or ())],
                                        [row, row, row, *lyr_spec, q_spec, kv_spec, v_spec, *s_specs],
                                        out_shape, out_specs, poison)
    outs = pl.pallas_call(
        kernel,
        grid=(B, P, nr, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_params(backend, tiles if tiles.num_warps or not one_row
                                      else dataclasses.replace(tiles, num_warps=ONE_ROW_WARPS), Dp),
        interpret=backend == "interpret",
        name="jdllm_flash_window",
    )(*args)
    if final:  # the attention in q's dtype [, lse]
        out, lse = outs[0], (outs[1] if return_lse else None)
        if head_major:  # [B, P, rows, Dp] [, [B, P, rows]]: one query's heads in order
            out = out[..., :D].reshape(B, 1, H, D)
            return out if lse is None else (out, lse.reshape(B, H, 1))
        return _window_output(out, lse, B, T, G, KV, D, R, q.dtype)
    acc, m, l = outs
    if per_head:  # [B, ns, 1, H, ...] -> the rows of the KV heads' groups, [B, ns, G, KV, ...]
        acc = acc.reshape(B, ns, KV, G, Dp).transpose(0, 1, 3, 2, 4)
        m, l = (x.reshape(B, ns, KV, G).transpose(0, 1, 3, 2) for x in (m, l))
    out, lse = combine_splits(acc, m, l)  # [B, Rp, KV, Dp] f32, [B, Rp, KV]
    return _window_output(out, lse if return_lse else None, B, T, G, KV, D, R, q.dtype)


def _window_output(out, lse, B, T, G, KV, D, R, dtype):
    """The window's merged rows [B, Rp, KV, Dp] (rows r = t * G + g) as the attention [B, T, H, D]
    in `dtype`, and with lse [B, Rp, KV], (attention, lse [B, H, T])."""
    H = KV * G
    out = out[:, :R, :, :D].reshape(B, T, G, KV, D)
    out = (out if G == 1 else out.transpose(0, 1, 3, 2, 4)).reshape(B, T, H, D).astype(dtype)
    if lse is None:
        return out
    return out, lse[:, :R].reshape(B, T, G, KV).transpose(0, 3, 2, 1).reshape(B, H, T)


UNROLLED_SPLITS = 16  # `combine_splits` merges up to this many splits as one elementwise expression


def combine_splits(acc, m, l):
    """Merge flash-decoding partials over axis 1: acc [B, n, ..., D], m/l [B, n, ...] (log2 units;
    the window kernel's are [B, n, rows, heads, D] and [B, n, rows, heads]).

    Splits that saw nothing carry m = NEG, l = 0 and drop out; rows that saw
    nothing in any split come out as zeros. Returns (out [B, ..., D], lse [B, ...]).
    (`window_attention` with one split merges nothing: its kernel divides.) Up to `UNROLLED_SPLITS` the
    merge is written out over the static split axis (a running maximum, the weights, the weighted
    sums, all elementwise), which XLA:GPU can make one kernel where reductions over the axis made
    two (the max and the weights, then the weighted sums). More splits keep the reductions.
    """
    n = acc.shape[1]
    if n <= UNROLLED_SPLITS:
        ms, ls, accs = ([x[:, i] for i in range(n)] for x in (m, l, acc))
        m_all = functools.reduce(jnp.maximum, ms)  # [B, ...]
        ws = [jnp.exp2(mi - m_all) for mi in ms]
        num = functools.reduce(jnp.add, [w[..., None] * a for w, a in zip(ws, accs)])
        den = functools.reduce(jnp.add, [w * li for w, li in zip(ws, ls)])
    else:
        m_all = jnp.max(m, axis=1)  # [B, ...]
        w = jnp.exp2(m - m_all[:, None])  # [B, n, ...]
        exact = dot_precision(jnp.float32)  # XLA dots too: on a GPU the default would be TF32
        num = jnp.einsum("bn...,bn...d->b...d", w, acc, precision=exact)
        den = jnp.einsum("bn...,bn...->b...", w, l, precision=exact)
    return num / jnp.where(den == 0.0, 1.0, den)[..., None], row_lse(m_all, den)


# --------------------------------------------------------------------------- entry point
@dataclasses.dataclass(frozen=True)
class _Static:
    kind: str
    block_size: int
    scale: float | None
    tiles: Tiles
    backend: str
    variant: str
    bwd: str


def _forward(q, k, v, start, q_offset, kv_len, st: _Static, return_lse: bool = False, layer=None, scales=None):
    kw = dict(start=start, q_offset=q_offset, kv_len=kv_len, kind=st.kind,
              block_size=st.block_size, scale=st.scale, return_lse=return_lse)
    if scales is not None:
        # an int8 cache: the Triton kernels convert its tiles on chip. The Mosaic prefill takes bf16: a
        # chunk longer than STACKED_TRITON_MAX_T (a long prompt's prefill, compute-bound) runs it on the
        # layer dequantized (a copy ~ S, against the Triton kernel's slower ~ T x S), as a bf16 cache's
        # long chunks run it on the layer's slice
        long_mosaic = (st.backend in ("mosaic", "mosaic_interpret") and st.variant == "prefill"
                       and q.shape[1] > STACKED_TRITON_MAX_T and mosaic.unsupported_reason(q, q) is None)
        if not long_mosaic:
            fn = window_attention if st.variant == "window" else prefill_attention
            return fn(q, k, v, **kw, tiles=st.tiles, backend=plain_backend(st.backend), layer=layer,
                      k_scale=scales[0], v_scale=scales[1])
        if layer is not None:
            k, v = _layer_of(k, v, layer)
            scales, layer = tuple(_layer_of(*scales, layer)), None
        k, v = (dequantize(x, sc.reshape(x.shape[:-1] + (1,)), q.dtype) for x, sc in zip((k, v), scales))
    if st.backend in ("mosaic", "mosaic_interpret") and st.variant == "prefill":
        # A stacked cache: the Mosaic (TMA) kernel takes one layer, a slice XLA copies on every call;
        # the Triton prefill reads the layer in place. The copy costs ~ S, the Mosaic kernel's lead
        # ~ T x S: chunks of up to STACKED_TRITON_MAX_T queries (multi_block's suffix windows) run
        # the Triton kernel in place, longer ones (a long prompt's prefill) the Mosaic one on a copy
        if layer is not None and (q.shape[1] > STACKED_TRITON_MAX_T
                                  or stacked_key_tile(q, k, st.tiles.block_k, plain_backend(st.backend)) is None) \
                and mosaic.unsupported_reason(q, k) is None:
            k, v, layer = *_layer_of(k, v, layer), None
        if layer is None and mosaic.unsupported_reason(q, k) is None:
            ws = st.tiles.mosaic_warp_specialized and q.shape[1] > mosaic.BLOCK_Q  # one tile: no pair
            return mosaic.prefill_attention(q, k, v, **kw, block_k=st.tiles.mosaic_block_k,
                                            stages=st.tiles.mosaic_stages, warp_specialized=ws,
                                            pingpong=st.tiles.mosaic_pingpong,
                                            interpret=st.backend == "mosaic_interpret")
    fn = window_attention if st.variant == "window" else prefill_attention
    return fn(q, k, v, **kw, tiles=st.tiles, backend=plain_backend(st.backend), layer=layer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, start, q_offset, kv_len, st: _Static):
    return _forward(q, k, v, start, q_offset, kv_len, st)


def _attention_fwd(q, k, v, start, q_offset, kv_len, st: _Static):
    if st.bwd == "xla":
        return _forward(q, k, v, start, q_offset, kv_len, st), (q, k, v, start, q_offset, kv_len)
    o, lse = _forward(q, k, v, start, q_offset, kv_len, st, return_lse=True)
    return o, (q, k, v, start, q_offset, kv_len, o, lse)


def _attention_bwd(st: _Static, res, g):
    q, k, v, start, q_offset, kv_len = res[:6]
    kw = dict(start=start, q_offset=q_offset, kv_len=kv_len, kind=st.kind, block_size=st.block_size,
              scale=st.scale)
    if st.bwd == "xla":
        _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, **kw), q, k, v)
        return (*vjp(g), None, None, None)
    o, lse = res[6:]
    if (st.tiles.mosaic_backward and st.backend in ("mosaic", "mosaic_interpret")
            and mosaic.unsupported_reason(q, k) is None):
        dq, dk, dv = mosaic_backward.attention_backward(q, k, v, o, lse, g, **kw, stages=st.tiles.mosaic_stages,
                                                        warp_specialized=st.tiles.mosaic_backward_warp_specialized,
                                                        pingpong=st.tiles.mosaic_pingpong,
                                                        interpret=st.backend == "mosaic_interpret")
        return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None
    dq, dk, dv = attention_backward(q, k.astype(q.dtype), v.astype(q.dtype), o, lse, g, **kw,
                                    tiles=st.tiles, backend=plain_backend(st.backend))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention_layer(q, k, v, layer, start, q_offset, kv_len, st: _Static):
    """`_attention` over layer `layer` of stacked k / v [L, B, S, KV, D], read in place; the
    gradient of k / v is zero outside that layer."""
    return _forward(q, k, v, start, q_offset, kv_len, st, layer=layer)


def _attention_layer_fwd(q, k, v, layer, start, q_offset, kv_len, st: _Static):
    kl, vl = _layer_of(k, v, layer)  # the backward's residuals: this layer only (a decode never gets here)
    if st.bwd == "xla":
        return _forward(q, k, v, start, q_offset, kv_len, st, layer=layer), \
            ((q, kl, vl, start, q_offset, kv_len), layer, k.shape)
    o, lse = _forward(q, k, v, start, q_offset, kv_len, st, return_lse=True, layer=layer)
    return o, ((q, kl, vl, start, q_offset, kv_len, o, lse), layer, k.shape)


def _attention_layer_bwd(st: _Static, res, g):
    inner, layer, shape = res
    dq, dkl, dvl = _attention_bwd(st, inner, g)[:3]
    put = lambda d: lax.dynamic_update_index_in_dim(jnp.zeros(shape, d.dtype), d, layer, 0)  # noqa: E731
    return dq, put(dkl), put(dvl), None, None, None, None


_attention_layer.defvjp(_attention_layer_fwd, _attention_layer_bwd)


def choose_variant(T: int, S: int) -> str:
    """"window" for a short query window over a longer cache, else "prefill"."""
    return "window" if T <= WINDOW_MAX_T and S > T else "prefill"


def attention(q, k, v, *, start, q_offset=0, kv_len=None, kind="causal", block_size=1, scale=None,
              tiles: Tiles | None = None, backend: str | None = None, variant: str = "auto",
              bwd: str = "pallas", layer=None, k_scale=None, v_scale=None):
    """Pallas attention under the masking rule: q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D].

    variant "auto" picks the window (flash-decoding) kernel for T <= 128 over a
    longer S and the prefill kernel otherwise. Differentiable (`jax.custom_vjp`):
    bwd "pallas" runs the Pallas backward kernels of `backward.py` from the
    forward's saved row log-sum-exp; bwd "xla" uses the XLA reference's VJP
    (materialises the [B, H, T, S] scores).

    layer (an int32 scalar, traced or not): k / v are a stacked KV cache [L, B, S, KV, D] and the
    keys are its layer `layer`. The Triton kernels read that layer where it lies (`stacked_key_tile`:
    head_dim a power of two, q's dtype, S a multiple of a key tile); the Mosaic prefill and other
    shapes take a slice of it, which XLA copies, as a caller's own slice would be.

    k_scale / v_scale ([B, S, KV, 1] float32, stacked: [L, ...]): k / v are an int8 KV cache with
    one scale per key and KV head (`jdllm.model.KVCache` with kv_cache_dtype "int8"). The Triton
    kernels (window and prefill, on every backend) read the int8 tiles and scale on chip, so a
    step reads half the bytes of a bfloat16 cache instead of a dequantized copy's three times as
    many. A decoding path: not differentiable.
    """
    from jdllm import errors  # noqa: PLC0415 (keeps pallas_kernels importable alone)

    if kind not in KINDS:
        raise errors.ConfigError(f"attention kind={kind!r} is not one of {KINDS}")
    one = k.shape if layer is None else k.shape[1:]  # a layer's shape
    if q.ndim != 4 or len(one) != 4 or k.shape != v.shape or q.shape[0] != one[0] or q.shape[3] != one[3]:
        raise errors.InputError(
            "attention expects q [B, T, H, D] and k, v [B, S, KV, D]" + ("" if layer is None else
                                                                         " (stacked: [L, B, S, KV, D])")
            + f" with equal B and D; got q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % one[2]:
        raise errors.InputError(
            f"query heads {q.shape[2]} are not a multiple of kv heads {one[2]}; fix the head counts")
    if kind == "block_causal" and block_size < 1:
        raise errors.ConfigError(f"block_size={block_size} must be >= 1 for block_causal attention")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise errors.ConfigError(f"backend={backend!r} is not one of {BACKENDS}")
    if variant == "auto":
        variant = choose_variant(q.shape[1], one[1])
    if variant not in ("prefill", "window"):
        raise errors.ConfigError(f"variant={variant!r} is not one of ('auto', 'prefill', 'window')")
    if bwd not in ("pallas", "xla"):
        raise errors.ConfigError(f"bwd={bwd!r} is not one of ('pallas', 'xla')")
    if tiles is None:
        tiles = Tiles()
    kv_len = one[1] if kv_len is None else kv_len
    st = _Static(kind=kind, block_size=int(block_size), scale=scale, tiles=tiles, backend=backend,
                 variant=variant, bwd=bwd)
    scalars = (jnp.asarray(start, jnp.int32), jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_len, jnp.int32))
    if k_scale is not None or v_scale is not None:
        return _forward(q, k, v, *scalars, st, layer=None if layer is None else jnp.asarray(layer, jnp.int32),
                        scales=(k_scale, v_scale))
    if layer is not None:
        return _attention_layer(q, k, v, jnp.asarray(layer, jnp.int32), *scalars, st)
    return _attention(q, k, v, *scalars, st)


__all__ = ["attention", "prefill_attention", "window_attention", "combine_splits", "Tiles",
           "default_backend", "choose_variant", "stacked_key_tile", "BACKENDS", "WINDOW_MAX_T"]
