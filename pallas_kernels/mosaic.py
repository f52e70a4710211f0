"""Mosaic GPU (Hopper: H100 / H200) flash attention forward under jdllm's masking rule.

One program per (query tile of 64 rows, batch row, query head), one warpgroup
each. Q is brought into shared memory by the bulk tensor copy engine (TMA);
K and V tiles stream through a ring of `stages` shared-memory slots filled by
TMA on mbarriers, the copies of tiles t + 1 .. t + stages - 1 in flight while
tile t is computed. Both matrix products are `wgmma`:
S = Q K^T from shared memory, O += P V with P from registers. The key loop is
the prefill kernel's (`common.tile_bounds`): it starts at `start[b]`'s tile,
stops at the horizon of the tile's last query (tiles beyond are never loaded),
and only the boundary tiles (left padding, the diagonal, `kv_len`) apply the
mask. Online softmax in float32, base 2: `common.online_softmax_step`, the
Triton and interpret kernels' own step.

Constraints: float16 / bfloat16, head_dim a multiple of 64 (the 128-byte
swizzle of a 64-element row), forward only (`flash.attention` pairs it with the
Pallas backward kernels through the saved row log-sum-exp).

Backends: "mosaic" compiles for sm_90a; "mosaic_interpret" runs the same body in
Pallas's GPU interpret mode on the CPU, which simulates shared memory, TMA and
mbarriers. That interpreter (jax 0.10) cannot run `wgmma`, layout casts or
transposed shared-memory refs, so in interpret mode (and only there) the two
matrix products are plain dots (`common.dot`) on values loaded from shared memory and
the layout hints are dropped; the copies, barriers, tile bounds, masking and
softmax are the compiled kernel's own code. What checks the compiled path on a
CPU is lowering it for CUDA (`test_mosaic_path_lowers_for_cuda`): that runs the
Pallas -> Mosaic GPU lowering, with its layout inference and `wgmma` shape
checks, and stops short of PTX.

STATUS: not yet compiled to PTX or run on a GPU (no GPU was lent to the
session that wrote it). The first GPU session must run
`bash benchmarks/gpu_session.sh` (the `gpu` tests, then the benchmark);
`JDLLM_PALLAS_BACKEND=triton` sidesteps this kernel meanwhile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import is_hopper  # noqa: F401 (re-exported: mosaic.is_hopper)
from pallas_kernels.common import (LOG2E, NEG, dot, key_end, normalise, online_softmax_step, pad_axis, row_lse,
                                   row_scalars, tile_bounds)

BLOCK_Q = 64  # one wgmma M tile per warpgroup
BLOCK_K = 64  # default key tile (64 or 128)
STAGES = 2  # default depth of the K/V ring
DTYPES = (jnp.float16, jnp.bfloat16)


def unsupported_reason(q, k) -> str | None:
    """Why the Mosaic kernel cannot take these inputs (None when it can)."""
    if q.dtype not in map(jnp.dtype, DTYPES):
        return f"dtype {q.dtype} (Mosaic kernel takes float16/bfloat16)"
    if q.shape[-1] % 64:
        return f"head_dim {q.shape[-1]} (Mosaic kernel needs a multiple of 64)"
    return None


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415 (GPU-only import)
    return plgpu


def _kernel(start_g, qoff_g, kvl_g, q_g, k_g, v_g, o_g, lse_g, q_s, k_s, v_s, lse_s, q_bar,
            k_bar, v_bar, *, T, S, G, num_q_tiles, kind, block_size, qk_scale, stages, interpret):
    plgpu = _plgpu()
    bq, bk = BLOCK_Q, k_s.shape[1]
    dtype = q_s.dtype
    D = q_s.shape[-1]
    i = num_q_tiles - 1 - lax.axis_index("q")  # heaviest (last) query tiles launch first
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    kvh = lax.div(h, G)
    start, qoff, kvl = start_g[b], qoff_g[b], kvl_g[b]
    q0 = i * bq

    def layout(x, lay):  # layout hints exist only for the compiled kernel
        return x if interpret else plgpu.layout_cast(x, lay)

    def iota(dim):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, (bq, bk), dim)
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim, layout=plgpu.Layout.WGMMA)

    def fetch(t, slot):
        kv_rows = (b, pl.ds(t * bk, bk), kvh)
        plgpu.copy_gmem_to_smem(k_g.at[kv_rows], k_s.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_g.at[kv_rows], v_s.at[slot], v_bar.at[slot])

    def qk(slot):  # [bq, bk] f32
        if interpret:
            return dot(q_s[...], k_s[slot], ((1,), (1,)))

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, q_s, plgpu.transpose_ref(k_s.at[slot], (1, 0)))
            return acc_ref[...]
        return pl.run_scoped(mma, plgpu.ACC((bq, bk), jnp.float32))

    def pv(p, slot):  # [bq, D] f32
        if interpret:
            return dot(p, v_s[slot], ((1,), (0,)))

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, p, v_s.at[slot])
            return acc_ref[...]
        return pl.run_scoped(mma, plgpu.ACC((bq, D), jnp.float32))

    plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(q0, bq), h], q_s, q_bar)
    p_first = qoff + q0
    p_last = qoff + jnp.minimum(q0 + (bq - 1), T - 1)
    ta, tb, tc, td = tile_bounds(start=start, kvl=kvl, p_first=p_first, p_last=p_last, lo_slot=0,
                                  hi_slot=S, block_k=bk, kind=kind, block_size=block_size)

    for j in range(stages - 1):  # fill the ring but its last slot
        @pl.when(ta + j < td)
        def _():
            fetch(ta + j, j)

    plgpu.barrier_wait(q_bar)

    def step(t, carry, masked: bool):
        slot = lax.rem(t - ta, stages)
        ahead = t + (stages - 1)

        @pl.when(ahead < td)
        def _():  # its slot held tile t - 1, whose products have completed
            fetch(ahead, lax.rem(ahead - ta, stages))

        plgpu.barrier_wait(k_bar.at[slot])
        s = qk(slot) * qk_scale
        vis = None
        if masked:
            cols = t * bk + iota(1)
            end = key_end(p_first + iota(0), kind, block_size, kvl)
            vis = (cols >= start) & (cols < end)

        def pv_after_v_lands(p):
            plgpu.barrier_wait(v_bar.at[slot])
            return pv(p.astype(dtype), slot)
        return online_softmax_step(carry, s, vis, pv_after_v_lands)

    wg = plgpu.Layout.WGMMA if not interpret else None
    carry = (layout(jnp.zeros((bq, D), jnp.float32), wg),
             layout(jnp.full((bq,), NEG, jnp.float32), wg and wg.reduce(1)),
             layout(jnp.zeros((bq,), jnp.float32), wg and wg.reduce(1)))
    carry = lax.fori_loop(ta, tb, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(tb, tc, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(tc, td, functools.partial(step, masked=True), carry)

    q_s[...] = normalise(acc, l).astype(dtype)
    lse_s[...] = row_lse(m, l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, o_g.at[b, pl.ds(q0, bq), h])
    plgpu.copy_smem_to_gmem(lse_s, lse_g.at[b, h, pl.ds(q0, bq)])
    plgpu.wait_smem_to_gmem(0)


def prefill_attention(q, k, v, *, start, q_offset=0, kv_len=None, kind="causal", block_size=1,
                      scale=None, block_k: int = BLOCK_K, stages: int = STAGES,
                      interpret: bool = False, return_lse: bool = False):
    """Mosaic GPU flash attention forward: q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D].

    Arguments as `flash.prefill_attention`; `block_k` (64 or 128) keys per
    tile, `stages` (>= 2) K/V tiles in shared memory. `interpret=True` runs
    Pallas's GPU interpret mode (CPU), whose uninitialised output memory is
    NaN, so an element the kernel forgets to write fails the tests.
    """
    plgpu = _plgpu()
    reason = unsupported_reason(q, k)
    if reason:
        raise ValueError(f"Mosaic GPU attention cannot take {reason}")
    if block_k not in (64, 128) or stages < 2:
        raise ValueError(f"block_k={block_k} must be 64 or 128 and stages={stages} >= 2")
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    G = H // KV
    kv_len = S if kv_len is None else kv_len
    scale = D ** -0.5 if scale is None else scale
    Tp, Sp = pl.cdiv(T, BLOCK_Q) * BLOCK_Q, pl.cdiv(S, block_k) * block_k
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    q, k, v = pad_axis(q, 1, Tp), pad_axis(k, 1, Sp), pad_axis(v, 1, Sp)
    start, qoff, kvl = row_scalars(start, q_offset, kv_len, B, S)
    nq = Tp // BLOCK_Q

    if interpret:
        smem = lambda shape: plgpu.SMEM(shape, q.dtype)  # noqa: E731
    else:
        swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = lambda shape: plgpu.SMEM(shape, q.dtype, transforms=swizzle)  # noqa: E731
    scratch = [smem((BLOCK_Q, D)), smem((stages, block_k, D)), smem((stages, block_k, D)),
               plgpu.SMEM((BLOCK_Q,), jnp.float32), plgpu.Barrier(),
               plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)]
    body = functools.partial(_kernel, T=T, S=S, G=G, num_q_tiles=nq, kind=kind,
                             block_size=block_size, qk_scale=scale * LOG2E, stages=stages,
                             interpret=interpret)
    kwargs = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415
        kwargs["interpret"] = InterpretGPUParams()
    else:
        params = getattr(plgpu, "CompilerParams", None) or plgpu.GPUCompilerParams
        kwargs["compiler_params"] = params(approx_math=True)
    out, lse = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((B, Tp, H, D), q.dtype),
                  jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)),
        scratch_types=scratch,
        grid=(nq, B, H),
        grid_names=("q", "b", "h"),
        **kwargs,
    )(start, qoff, kvl, q, k, v)
    out = out[:, :T]
    return (out, lse[:, :, :T]) if return_lse else out


__all__ = ["prefill_attention", "unsupported_reason", "is_hopper", "BLOCK_Q", "BLOCK_K", "STAGES"]
