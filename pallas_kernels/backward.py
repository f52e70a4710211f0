"""Pallas backward of the flash attention kernels (FlashAttention-2 style, under the masking rule).

Given the forward's output o and row log2-sum-exp2 `lse` [B, H, T], two kernels
recompute the probabilities tile by tile instead of storing them:

- `_dq_kernel`, one program per (query tile, batch row, query head): walks the
  same key tiles as the forward (horizon-bounded, mask only on boundary tiles)
  and accumulates dq.
- `_dkv_kernel`, one program per (key tile, batch row, KV head): walks, for
  each of the G query heads sharing the KV head, the query tiles that can see
  the key tile (from the first query whose horizon passes it), so dk and dv
  are summed over the group without atomics.

delta = rowsum(o * do) is computed in XLA. Same backends as the forward
("interpret", "triton"); the Triton path is lowered in the CPU tests but has
NOT been run on a GPU yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (LOG2E, Tiles, dot, dot_precision, key_end, key_tile_queries, pad_axis,
                                   pad_head_dim, query_rows_bounds, row_scalars, tile_size, triton_params)


def _probs(q, k, lse, qk_scale, vis):
    """Recomputed probabilities [R, bk] f32 (zero where `vis` is False, when given)."""
    s = dot(q, k, ((1,), (1,))) * qk_scale
    p = jnp.exp2(s - lse[:, None])
    return p if vis is None else jnp.where(vis, p, 0.0)


def _dq_kernel(start_ref, qoff_ref, kvl_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               T, S, num_q_tiles, block_q, block_k, kind, block_size, qk_scale, scale):
    i = num_q_tiles - 1 - pl.program_id(0)
    start, qoff, kvl = start_ref[()], qoff_ref[()], kvl_ref[()]
    rows_p = qoff + i * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    a, b, c, d = query_rows_bounds(i * block_q, block_q, T=T, S=S, start=start, qoff=qoff, kvl=kvl,
                                   block_k=block_k, kind=kind, block_size=block_size)
    q, do = q_ref[...], do_ref[...]  # [bq, D]
    lse, delta = lse_ref[...], delta_ref[...]  # [bq]

    def step(t, dq, masked: bool):
        k0 = t * block_k
        k = k_ref[pl.ds(k0, block_k), :]  # [bk, D]
        v = v_ref[pl.ds(k0, block_k), :]
        vis = None
        if masked:
            cols = k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            vis = (cols >= start) & (cols < key_end(rows_p, kind, block_size, kvl)[:, None])
        p = _probs(q, k, lse, qk_scale, vis)  # [bq, bk]
        dp = dot(do, v, ((1,), (1,)))
        ds = p * (dp - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k, ((1,), (0,)))

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = lax.fori_loop(a, b, functools.partial(step, masked=True), dq)
    dq = lax.fori_loop(b, c, functools.partial(step, masked=False), dq)
    dq = lax.fori_loop(c, d, functools.partial(step, masked=True), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(start_ref, qoff_ref, kvl_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, T, G, block_q, block_k, kind, block_size, qk_scale, scale):
    j = pl.program_id(0)
    start, qoff, kvl = start_ref[()], qoff_ref[()], kvl_ref[()]
    k0 = j * block_k
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    cols = k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, bk]
    qa, qb, qe = key_tile_queries(k0, block_k, block_q, T=T, start=start, qoff=qoff, kvl=kvl, kind=kind,
                                  block_size=block_size)

    def step(qt, carry, g, masked: bool):
        dk, dv = carry
        t0 = qt * block_q
        q = q_ref[pl.ds(t0, block_q), g, :]  # [bq, D]
        do = do_ref[pl.ds(t0, block_q), g, :]
        lse = lse_ref[g, pl.ds(t0, block_q)]  # [bq]
        delta = delta_ref[g, pl.ds(t0, block_q)]
        vis = None
        if masked:
            rows_p = qoff + t0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
            vis = (cols >= start) & (cols < key_end(rows_p, kind, block_size, kvl)[:, None])
        p = _probs(q, k, lse, qk_scale, vis)  # [bq, bk]
        dv = dv + dot(p.astype(do.dtype), do, ((0,), (0,)))
        dp = dot(do, v, ((1,), (1,)))
        ds = p * (dp - delta[:, None])
        dk = dk + dot(ds.astype(q.dtype), q, ((0,), (0,)))
        return dk, dv

    def head(g, carry):
        carry = lax.fori_loop(qa, qb, functools.partial(step, g=g, masked=True), carry)
        return lax.fori_loop(qb, qe, functools.partial(step, g=g, masked=False), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def attention_backward(q, k, v, o, lse, do, *, start, q_offset, kv_len, kind, block_size, scale=None,
                       tiles: Tiles = Tiles(), backend: str = "interpret"):
    """(dq, dk, dv) of the masked attention, from its output o and row lse [B, H, T] (log2 units).

    q, o, do [B, T, H, D]; k, v [B, S, KV, D]. Tiles: block_q_bwd / block_k_bwd.
    """
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    G = H // KV
    scale = D ** -0.5 if scale is None else scale
    bq, bk = tile_size(tiles.block_q_bwd, T, backend), tile_size(tiles.block_k_bwd, S, backend)
    Tp, Sp = pl.cdiv(T, bq) * bq, pl.cdiv(S, bk) * bk
    nq, nk = Tp // bq, Sp // bk
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32),
                       precision=dot_precision(jnp.float32))  # [B, H, T]; not TF32 on a GPU
    q, k, v = pad_head_dim(q, k, v, backend)
    do = pad_axis(do.astype(q.dtype), 3, q.shape[-1])
    Dp = q.shape[-1]
    q, do = pad_axis(q, 1, Tp), pad_axis(do, 1, Tp)
    k, v = pad_axis(k, 1, Sp), pad_axis(v, 1, Sp)
    lse, delta = pad_axis(lse, 2, Tp), pad_axis(delta, 2, Tp)  # [B, H, Tp]
    start, qoff, kvl = row_scalars(start, q_offset, kv_len, B, S)
    common = dict(block_q=bq, block_k=bk, kind=kind, block_size=block_size, qk_scale=scale * LOG2E,
                  scale=scale)
    params = triton_params(backend, tiles, Dp)
    interpret = backend == "interpret"

    row = pl.BlockSpec((None,), lambda i, b, h: (b,))
    q_spec = pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, nq - 1 - i, h, 0))
    kv_full = pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    vec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, nq - 1 - i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, T=T, S=S, num_q_tiles=nq, **common),
        grid=(nq, B, H),
        in_specs=[row, row, row, q_spec, kv_full, kv_full, q_spec, vec, vec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params, interpret=interpret, name="jdllm_flash_bwd_dq",
    )(start, qoff, kvl, q, k, v, do, lse, delta)

    q5 = q.reshape(B, Tp, KV, G, Dp)
    do5 = do.reshape(B, Tp, KV, G, Dp)
    row = pl.BlockSpec((None,), lambda j, b, h: (b,))
    q_group = pl.BlockSpec((None, Tp, None, G, Dp), lambda j, b, h: (b, 0, h, 0, 0))
    vec_group = pl.BlockSpec((None, None, G, Tp), lambda j, b, h: (b, h, 0, 0))
    kv_tile = pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, T=T, G=G, **common),
        grid=(nk, B, KV),
        in_specs=[row, row, row, q_group, kv_tile, kv_tile, q_group, vec_group, vec_group],
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
        compiler_params=params, interpret=interpret, name="jdllm_flash_bwd_dkv",
    )(start, qoff, kvl, q5, k, v, do5, lse.reshape(B, KV, G, Tp), delta.reshape(B, KV, G, Tp))
    return dq[:, :T, :, :D], dk[:, :S, :, :D], dv[:, :S, :, :D]
