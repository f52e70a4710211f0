"""Mosaic GPU (Hopper) backward of the flash attention, under jdllm's masking rule.

The math and the tile walks are those of the Triton kernels in `backward.py`
(FlashAttention-2: the probabilities are recomputed tile by tile from the
forward's row log2-sum-exp2; delta = rowsum(o * do) comes from XLA). Here every
matrix product is a `wgmma` and every streamed operand arrives by TMA through a
ring of `stages` shared-memory slots, the loads of the next tiles in flight
while the current one is computed, as in the forward (`mosaic.py`):

- `_dq_kernel`, one program per (64-row query tile, batch row, query head): Q,
  dO, lse and delta of the tile are loaded once; K and V tiles stream over the
  forward's key range (`tile_bounds`: masked / unmasked / masked). Per tile:
  S = Q K^T, P = exp2(S - lse), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
- `_dkv_kernel`, one program per (64-key tile, batch row, KV head): K and V are
  loaded once; for each of the G query heads sharing the KV head, the query
  tiles that see the key tile stream through the ring (Q, dO, lse, delta: one
  walk over G x tiles, masked only where some query of the tile does not see
  every key). Per tile, transposed so the key tile is the 64-row operand:
  S^T = K Q^T, P^T = exp2(S^T - lse), dV += P^T dO, dP^T = V dO^T,
  dS^T = P^T (dP^T - delta), dK += dS^T Q. The GQA sum stays in registers.

float16 / bfloat16, head_dim a multiple of 64, like the forward.
Warp-specialised variants (`warp_specialized=True`: `_ws_dq_kernel`,
`_ws_dkv_kernel`) take `mosaic._ws_kernel`'s layout: two compute warpgroups
(two 64-row query tiles, or two 64-key tiles) read one TMA ring
(`mosaic.SharedRing`) that a loader warpgroup fills, optionally taking turns on
the tensor cores (`pingpong`); each skips the ring items only its neighbour
needs. They give the one-warpgroup kernels' gradients bit for bit in the GPU
interpreter.

`flash.attention` runs these on the "mosaic" backends (`Tiles.mosaic_backward`,
on by default since an H200 timed forward + backward at 1.64-1.89 ms against the
Triton backward's 3.27-3.49 ms, S = 4096); the warp-specialised pair
(`Tiles(mosaic_backward_warp_specialized=True)`) was slower there (1.92-2.13 ms)
and stays off. In interpret mode ("mosaic_interpret") the products are plain dots on
values loaded from shared memory (`mosaic.WarpgroupOps`); the copies,
barriers, tile walks and masks are the compiled kernel's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (LOG2E, dot_precision, key_end, key_tile_queries, pad_axis, query_rows_bounds,
                                   row_scalars)
from pallas_kernels.mosaic import BLOCK_Q, PrefetchRing, SharedRing, WarpgroupOps, kv_sources, unsupported_reason

BLOCK_K = 64  # keys per tile (the dK / dV programs' 64 rows)


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415 (GPU-only import)
    return plgpu


def query_sources(q_g, do_g, lse_g, delta_g, b, kvh, G: int, lo, per_head):
    """sources(n) -> [Q, dO, lse, delta] of item n of a dk / dv walk in global memory: over the G heads
    sharing KV head kvh (batch row b), per_head query tiles each from tile lo on."""
    def sources(n):
        width = jnp.maximum(per_head, 1)
        h = kvh * G + lax.div(n, width)
        rows = pl.ds((lo + lax.rem(n, width)) * BLOCK_Q, BLOCK_Q)
        return [q_g.at[b, rows, h], do_g.at[b, rows, h], lse_g.at[b, h, rows], delta_g.at[b, h, rows]]
    return sources


def _dq_kernel(start_g, qoff_g, kvl_g, q_g, k_g, v_g, do_g, lse_g, delta_g, dq_g, q_s, do_s, lse_s, delta_s,
               k_s, v_s, tile_bar, k_bar, v_bar, *, T, S, G, num_q_tiles, kind, block_size, qk_scale, scale,
               stages, interpret):
    plgpu = _plgpu()
    bq, bk = BLOCK_Q, BLOCK_K
    ops = WarpgroupOps(interpret, bq, bk)
    i = num_q_tiles - 1 - lax.axis_index("q")  # heaviest (last) query tiles launch first
    b, h = lax.axis_index("b"), lax.axis_index("h")
    kvh = lax.div(h, G)
    start, qoff, kvl = start_g[b], qoff_g[b], kvl_g[b]
    q0 = i * bq
    rows = (b, pl.ds(q0, bq), h)
    plgpu.copy_gmem_to_smem(q_g.at[rows], q_s, tile_bar.at[0])
    plgpu.copy_gmem_to_smem(do_g.at[rows], do_s, tile_bar.at[1])
    plgpu.copy_gmem_to_smem(lse_g.at[b, h, pl.ds(q0, bq)], lse_s, tile_bar.at[2])
    plgpu.copy_gmem_to_smem(delta_g.at[b, h, pl.ds(q0, bq)], delta_s, tile_bar.at[3])
    p_first = qoff + q0
    ta, tb, tc, td = query_rows_bounds(q0, bq, T=T, S=S, start=start, qoff=qoff, kvl=kvl, block_k=bk, kind=kind,
                                       block_size=block_size)

    ring = PrefetchRing([k_s, v_s], [k_bar, v_bar], kv_sources(k_g, v_g, b, kvh, bk), first=ta, end=td,
                        stages=stages)
    for j in range(4):
        plgpu.barrier_wait(tile_bar.at[j])
    lse = ops.vector(lse_s, 1)
    delta = ops.vector(delta_s, 1)

    def step(t, dq, masked: bool):
        slot = ring.slot(t)
        ring.advance(t)
        ring.wait(0, t)
        s = ops.mm_t(q_s, k_s.at[slot]) * qk_scale
        p = jnp.exp2(s - lax.broadcast_in_dim(lse, (bq, bk), [0]))
        if masked:
            p = jnp.where(ops.visible(t, p_first, start, kind, block_size, kvl), p, 0.0)
        ring.wait(1, t)
        dp = ops.mm_t(do_s, v_s.at[slot])
        ds = p * (dp - lax.broadcast_in_dim(delta, (bq, bk), [0]))
        return dq + ops.mm(ds.astype(q_s.dtype), k_s.at[slot])

    dq = ops.zeros((bq, q_s.shape[-1]))
    dq = lax.fori_loop(ta, tb, functools.partial(step, masked=True), dq)
    dq = lax.fori_loop(tb, tc, functools.partial(step, masked=False), dq)
    dq = lax.fori_loop(tc, td, functools.partial(step, masked=True), dq)
    q_s[...] = (dq * scale).astype(q_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, dq_g.at[rows])
    plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(start_g, qoff_g, kvl_g, q_g, k_g, v_g, do_g, lse_g, delta_g, dk_g, dv_g, k_s, v_s, q_s, do_s,
                lse_s, delta_s, kv_bar, q_bar, do_bar, lse_bar, delta_bar, *, T, G, kind, block_size, qk_scale,
                scale, stages, interpret):
    plgpu = _plgpu()
    bq, bk = BLOCK_Q, BLOCK_K
    ops = WarpgroupOps(interpret, bk, bq)  # the transposed score tile: keys x queries
    j = lax.axis_index("k")
    b, kvh = lax.axis_index("b"), lax.axis_index("h")
    start, qoff, kvl = start_g[b], qoff_g[b], kvl_g[b]
    k0 = j * bk
    keys = (b, pl.ds(k0, bk), kvh)
    plgpu.copy_gmem_to_smem(k_g.at[keys], k_s, kv_bar.at[0])
    plgpu.copy_gmem_to_smem(v_g.at[keys], v_s, kv_bar.at[1])
    qa, qb, qe = key_tile_queries(k0, bk, bq, T=T, start=start, qoff=qoff, kvl=kvl, kind=kind, block_size=block_size)
    per_head = qe - qa
    total = G * per_head  # one walk over (head of the group, query tile)

    ring = PrefetchRing([q_s, do_s, lse_s, delta_s], [q_bar, do_bar, lse_bar, delta_bar],
                        query_sources(q_g, do_g, lse_g, delta_g, b, kvh, G, qa, per_head), first=0, end=total,
                        stages=stages)
    plgpu.barrier_wait(kv_bar.at[0])
    plgpu.barrier_wait(kv_bar.at[1])

    def step(qt, carry, g, masked: bool):
        dk, dv = carry
        n = g * per_head + (qt - qa)  # position in the walk: its ring slot, and what to fetch ahead
        slot = ring.slot(n)
        ring.advance(n)
        ring.wait(0, n)
        ring.wait(2, n)
        s_t = ops.mm_t(k_s, q_s.at[slot]) * qk_scale  # [bk, bq]
        p_t = jnp.exp2(s_t - lax.broadcast_in_dim(ops.vector(lse_s.at[slot], 0), (bk, bq), [1]))
        if masked:
            keys_at = k0 + ops.iota(0)
            vis = (keys_at >= start) & (keys_at < key_end(qoff + qt * bq + ops.iota(1), kind, block_size, kvl))
            p_t = jnp.where(vis, p_t, 0.0)
        ring.wait(1, n)
        ring.wait(3, n)
        dv = dv + ops.mm(p_t.astype(k_s.dtype), do_s.at[slot])
        dp_t = ops.mm_t(v_s, do_s.at[slot])
        ds_t = p_t * (dp_t - lax.broadcast_in_dim(ops.vector(delta_s.at[slot], 0), (bk, bq), [1]))
        dk = dk + ops.mm(ds_t.astype(k_s.dtype), q_s.at[slot])
        return dk, dv

    def head(g, carry):  # masked only where some query of the tile misses some key of this one
        carry = lax.fori_loop(qa, qb, functools.partial(step, g=g, masked=True), carry)
        return lax.fori_loop(qb, qe, functools.partial(step, g=g, masked=False), carry)

    D = k_s.shape[-1]
    dk, dv = lax.fori_loop(0, G, head, (ops.zeros((bk, D)), ops.zeros((bk, D))))
    k_s[...] = (dk * scale).astype(k_s.dtype)
    v_s[...] = dv.astype(v_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_s, dk_g.at[keys])
    plgpu.copy_smem_to_gmem(v_s, dv_g.at[keys])
    plgpu.wait_smem_to_gmem(0)


def _ws_dq_kernel(start_g, qoff_g, kvl_g, q_g, k_g, v_g, do_g, lse_g, delta_g, dq_g, q_s, do_s, lse_s, delta_s,
                  k_s, v_s, tile_bar, k_bar, v_bar, k_free, v_free, turn, *, T, S, G, num_q_tiles, kind, block_size,
                  qk_scale, scale, stages, pingpong, interpret):
    """`_dq_kernel` warp-specialised (`mosaic._ws_kernel`'s layout): two compute warpgroups, one 64-row
    query tile each, read one K/V ring (`mosaic.SharedRing`) that warpgroup 2 fills."""
    plgpu = _plgpu()
    bq, bk = BLOCK_Q, BLOCK_K
    ops = WarpgroupOps(interpret, bq, bk)
    i = num_q_tiles - 1 - lax.axis_index("q")
    b, h, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
    start, qoff, kvl = start_g[b], qoff_g[b], kvl_g[b]
    pair0 = i * (2 * bq)

    bounds = functools.partial(query_rows_bounds, T=T, S=S, start=start, qoff=qoff, kvl=kvl, block_k=bk,
                               kind=kind, block_size=block_size)

    ta, _, _, td = bounds(pair0, 2 * bq)
    ring = SharedRing([k_s, v_s], [k_bar, v_bar], kv_sources(k_g, v_g, b, lax.div(h, G), bk), [k_free, v_free],
                      [[0], [1]], turn, first=ta, end=td, stages=stages, pingpong=pingpong, interpret=interpret)

    @pl.when(wg < 2)
    def _compute():
        ring.compute_side()
        q0 = pair0 + wg * bq
        rows = (b, pl.ds(q0, bq), h)
        q_tile, do_tile = q_s.at[wg], do_s.at[wg]
        plgpu.copy_gmem_to_smem(q_g.at[rows], q_tile, tile_bar.at[4 * wg])
        plgpu.copy_gmem_to_smem(do_g.at[rows], do_tile, tile_bar.at[4 * wg + 1])
        plgpu.copy_gmem_to_smem(lse_g.at[b, h, pl.ds(q0, bq)], lse_s.at[wg], tile_bar.at[4 * wg + 2])
        plgpu.copy_gmem_to_smem(delta_g.at[b, h, pl.ds(q0, bq)], delta_s.at[wg], tile_bar.at[4 * wg + 3])
        a, tb, tc, d = bounds(q0, bq)
        p_first = qoff + q0
        for j in range(4):
            plgpu.barrier_wait(tile_bar.at[4 * wg + j])
        lse = ops.vector(lse_s.at[wg], 1)
        delta = ops.vector(delta_s.at[wg], 1)
        ring.start_turn(wg)

        def step(t, dq, masked: bool):
            slot = ring.slot(t)
            ring.wait(0, t)
            s = ops.mm_t(q_tile, k_s.at[slot], issued=ring.meet) * qk_scale
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, (bq, bk), [0]))
            if masked:
                p = jnp.where(ops.visible(t, p_first, start, kind, block_size, kvl), p, 0.0)
            ring.wait(1, t)
            dp = ops.mm_t(do_tile, v_s.at[slot])
            ring.release(1, t)
            ds = (p * (dp - lax.broadcast_in_dim(delta, (bq, bk), [0]))).astype(q_s.dtype)
            ring.hand_over()
            ring.take_back()
            dq = dq + ops.mm(ds, k_s.at[slot])
            ring.release(0, t)
            return dq

        dq = ops.zeros((bq, q_s.shape[-1]))
        dq = lax.fori_loop(a, tb, functools.partial(step, masked=True), dq)
        dq = lax.fori_loop(tb, tc, functools.partial(step, masked=False), dq)
        dq = lax.fori_loop(tc, d, functools.partial(step, masked=True), dq)
        ring.skip(d, td)
        ring.end_turn(wg)
        q_tile[...] = (dq * scale).astype(q_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_g.at[rows])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 2)(ring.load)


def _ws_dkv_kernel(start_g, qoff_g, kvl_g, q_g, k_g, v_g, do_g, lse_g, delta_g, dk_g, dv_g, k_s, v_s, q_s, do_s,
                   lse_s, delta_s, kv_bar, q_bar, do_bar, lse_bar, delta_bar, free, turn, *, T, G, kind, block_size,
                   qk_scale, scale, stages, pingpong, interpret):
    """`_dkv_kernel` warp-specialised: two compute warpgroups, one 64-key tile each, read one ring of
    (Q, dO, lse, delta) tiles that warpgroup 2 fills. The ring walks, for each head of the group, the
    query tiles either key tile needs; a warpgroup skips those only the other needs (the later key
    tile's first queries come later under a causal mask)."""
    plgpu = _plgpu()
    bq, bk = BLOCK_Q, BLOCK_K
    ops = WarpgroupOps(interpret, bk, bq)  # the transposed score tile: keys x queries
    j2 = lax.axis_index("k")
    b, kvh, wg = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
    start, qoff, kvl = start_g[b], qoff_g[b], kvl_g[b]
    query_tiles = functools.partial(key_tile_queries, block_k=bk, block_q=bq, T=T, start=start, qoff=qoff, kvl=kvl,
                                    kind=kind, block_size=block_size)

    pair0 = j2 * (2 * bk)
    (qa0, _, qe0), (qa1, _, qe1) = query_tiles(pair0), query_tiles(pair0 + bk)
    lo, hi = jnp.minimum(qa0, qa1), jnp.maximum(qe0, qe1)
    per_head = hi - lo
    ring = SharedRing([q_s, do_s, lse_s, delta_s], [q_bar, do_bar, lse_bar, delta_bar],
                      query_sources(q_g, do_g, lse_g, delta_g, b, kvh, G, lo, per_head), [free], [[0, 1, 2, 3]],
                      turn, first=0, end=G * per_head, stages=stages, pingpong=pingpong, interpret=interpret)

    @pl.when(wg < 2)
    def _compute():
        ring.compute_side()
        k0 = pair0 + wg * bk
        keys = (b, pl.ds(k0, bk), kvh)
        k_tile, v_tile = k_s.at[wg], v_s.at[wg]
        plgpu.copy_gmem_to_smem(k_g.at[keys], k_tile, kv_bar.at[2 * wg])
        plgpu.copy_gmem_to_smem(v_g.at[keys], v_tile, kv_bar.at[2 * wg + 1])
        qa, qb, qe = query_tiles(k0)
        plgpu.barrier_wait(kv_bar.at[2 * wg])
        plgpu.barrier_wait(kv_bar.at[2 * wg + 1])
        ring.start_turn(wg)

        def step(qt, carry, g, masked: bool):
            dk, dv = carry
            n = g * per_head + (qt - lo)
            slot = ring.slot(n)
            ring.wait(0, n)
            ring.wait(2, n)
            s_t = ops.mm_t(k_tile, q_s.at[slot], issued=ring.meet) * qk_scale  # [bk, bq]
            p_t = jnp.exp2(s_t - lax.broadcast_in_dim(ops.vector(lse_s.at[slot], 0), (bk, bq), [1]))
            if masked:
                keys_at = k0 + ops.iota(0)
                vis = (keys_at >= start) & (keys_at < key_end(qoff + qt * bq + ops.iota(1), kind, block_size, kvl))
                p_t = jnp.where(vis, p_t, 0.0)
            ring.wait(1, n)
            ring.wait(3, n)
            dv = dv + ops.mm(p_t.astype(k_s.dtype), do_s.at[slot])
            dp_t = ops.mm_t(v_tile, do_s.at[slot])
            ds_t = p_t * (dp_t - lax.broadcast_in_dim(ops.vector(delta_s.at[slot], 0), (bk, bq), [1]))
            ring.hand_over()
            ring.take_back()
            dk = dk + ops.mm(ds_t.astype(k_s.dtype), q_s.at[slot])
            ring.release(0, n)
            return dk, dv

        def head(g, carry):
            base = g * per_head - lo
            ring.skip(base + lo, base + qa)
            carry = lax.fori_loop(qa, qb, functools.partial(step, g=g, masked=True), carry)
            carry = lax.fori_loop(qb, qe, functools.partial(step, g=g, masked=False), carry)
            ring.skip(base + qe, base + hi)
            return carry

        D = k_s.shape[-1]
        dk, dv = lax.fori_loop(0, G, head, (ops.zeros((bk, D)), ops.zeros((bk, D))))
        ring.end_turn(wg)
        k_tile[...] = (dk * scale).astype(k_s.dtype)
        v_tile[...] = dv.astype(v_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_tile, dk_g.at[keys])
        plgpu.copy_smem_to_gmem(v_tile, dv_g.at[keys])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 2)(ring.load)


def attention_backward(q, k, v, o, lse, do, *, start, q_offset, kv_len, kind, block_size, scale=None,
                       stages: int = 2, warp_specialized: bool = False, pingpong: bool = True,
                       interpret: bool = False):
    """(dq, dk, dv) of the masked attention from its output o and row lse [B, H, T] (log2 units), as
    `backward.attention_backward`; q, o, do [B, T, H, D], k, v [B, S, KV, D], float16 / bfloat16.
    `warp_specialized`: the `_ws_*` kernels (two compute warpgroups on 128 query rows / keys and a
    loader warpgroup, `pingpong` staggering the two) instead of one warpgroup per 64."""
    plgpu = _plgpu()
    reason = unsupported_reason(q, k)
    if reason:
        raise ValueError(f"Mosaic GPU attention backward cannot take {reason}")
    if stages < 2:
        raise ValueError(f"stages={stages} must be >= 2")
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    G = H // KV
    scale = D ** -0.5 if scale is None else scale
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32),
                       precision=dot_precision(jnp.float32))  # [B, H, T]
    wgs = 2 if warp_specialized else 1
    Tp, Sp = pl.cdiv(T, wgs * BLOCK_Q) * wgs * BLOCK_Q, pl.cdiv(S, wgs * BLOCK_K) * wgs * BLOCK_K
    k, v, do = k.astype(q.dtype), v.astype(q.dtype), do.astype(q.dtype)
    q, do = pad_axis(q, 1, Tp), pad_axis(do, 1, Tp)  # zero rows: their dO and delta add nothing
    k, v = pad_axis(k, 1, Sp), pad_axis(v, 1, Sp)
    lse, delta = pad_axis(lse, 2, Tp), pad_axis(delta, 2, Tp)
    start, qoff, kvl = row_scalars(start, q_offset, kv_len, B, S)
    nq, nk = Tp // (wgs * BLOCK_Q), Sp // (wgs * BLOCK_K)
    common = dict(kind=kind, block_size=block_size, qk_scale=scale * LOG2E, scale=scale, stages=stages,
                  interpret=interpret)

    if interpret:
        smem = lambda shape: plgpu.SMEM(shape, q.dtype)  # noqa: E731
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415
        kwargs = dict(interpret=InterpretGPUParams())
    else:
        swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = lambda shape: plgpu.SMEM(shape, q.dtype, transforms=swizzle)  # noqa: E731
        params = getattr(plgpu, "CompilerParams", None) or plgpu.GPUCompilerParams
        kwargs = dict(compiler_params=params(approx_math=True))
    vec = lambda *shape: plgpu.SMEM(shape, jnp.float32)  # noqa: E731

    if warp_specialized:
        ws = dict(num_threads=3, thread_name="wg")
        turn = plgpu.Barrier(num_arrivals=2)
        ring = [plgpu.Barrier(num_barriers=stages) for _ in range(2)]
        free = [plgpu.Barrier(num_arrivals=2, num_barriers=stages) for _ in range(2)]
        dq = plgpu.kernel(
            functools.partial(_ws_dq_kernel, T=T, S=S, G=G, num_q_tiles=nq, pingpong=pingpong, **common),
            out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
            scratch_types=[smem((2, BLOCK_Q, D)), smem((2, BLOCK_Q, D)), vec(2, BLOCK_Q), vec(2, BLOCK_Q),
                           smem((stages, BLOCK_K, D)), smem((stages, BLOCK_K, D)), plgpu.Barrier(num_barriers=8),
                           *ring, *free, turn],
            grid=(nq, B, H), grid_names=("q", "b", "h"), **ws, **kwargs,
        )(start, qoff, kvl, q, k, v, do, lse, delta)
        ring = [plgpu.Barrier(num_barriers=stages) for _ in range(4)]
        dk, dv = plgpu.kernel(
            functools.partial(_ws_dkv_kernel, T=T, G=G, pingpong=pingpong, **common),
            out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2,
            scratch_types=[smem((2, BLOCK_K, D)), smem((2, BLOCK_K, D)), smem((stages, BLOCK_Q, D)),
                           smem((stages, BLOCK_Q, D)), vec(stages, BLOCK_Q), vec(stages, BLOCK_Q),
                           plgpu.Barrier(num_barriers=4), *ring,
                           plgpu.Barrier(num_arrivals=2, num_barriers=stages), turn],
            grid=(nk, B, KV), grid_names=("k", "b", "h"), **ws, **kwargs,
        )(start, qoff, kvl, q, k, v, do, lse, delta)
        return dq[:, :T], dk[:, :S], dv[:, :S]

    dq = plgpu.kernel(
        functools.partial(_dq_kernel, T=T, S=S, G=G, num_q_tiles=nq, **common),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=[smem((BLOCK_Q, D)), smem((BLOCK_Q, D)), vec(BLOCK_Q), vec(BLOCK_Q),
                       smem((stages, BLOCK_K, D)), smem((stages, BLOCK_K, D)), plgpu.Barrier(num_barriers=4),
                       plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)],
        grid=(nq, B, H), grid_names=("q", "b", "h"), **kwargs,
    )(start, qoff, kvl, q, k, v, do, lse, delta)

    ring = [plgpu.Barrier(num_barriers=stages) for _ in range(4)]
    dk, dv = plgpu.kernel(
        functools.partial(_dkv_kernel, T=T, G=G, **common),
        out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2,
        scratch_types=[smem((BLOCK_K, D)), smem((BLOCK_K, D)), smem((stages, BLOCK_Q, D)),
                       smem((stages, BLOCK_Q, D)), vec(stages, BLOCK_Q), vec(stages, BLOCK_Q),
                       plgpu.Barrier(num_barriers=2), *ring],
        grid=(nk, B, KV), grid_names=("k", "b", "h"), **kwargs,
    )(start, qoff, kvl, q, k, v, do, lse, delta)
    return dq[:, :T], dk[:, :S], dv[:, :S]


__all__ = ["attention_backward", "BLOCK_K"]
