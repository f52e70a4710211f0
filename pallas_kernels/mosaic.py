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

Warp-specialised variant (`warp_specialized=True`, `_ws_kernel`; issue 28
item 2, the FlashAttention-3 layout): one program per pair of query tiles
(128 rows) runs three warpgroups. A loader warpgroup gives up its registers and
only issues the TMA loads of the K/V ring, each slot refilled when both compute
warpgroups have released it (mbarriers with two arrivals); the two compute
warpgroups each own one 64-row tile, raise their register budget to 232, and
with `pingpong` meet twice per key tile on a shared barrier so that one's
softmax runs while the other's `wgmma`s hold the tensor cores. Block-causal
masks give the later tile more keys: the earlier warpgroup releases those
tiles without computing them. Pallas's GPU interpreter runs the three
warpgroups as threads and fails a kernel that leaves a barrier phase
unobserved, so the CPU tests check the protocol, not only the numbers.

STATUS: the one-warpgroup kernel has run on an H100 and an H200 (the `gpu`
tests; 255-295 TFLOP/s block-causal at S = 4096 on the H100, see
benchmarks/RESULTS.md). The warp-specialised variant has run on an H200, where
it was the fastest without the ping-pong (0.515-0.591 ms against the one
warpgroup's 0.566-0.727 ms, S = 4096): that is the default for prompts of more
than 64 rows (`Tiles.mosaic_warp_specialized`, `Tiles.mosaic_pingpong`).
`JDLLM_PALLAS_BACKEND=triton` sidesteps both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import is_hopper  # noqa: F401 (re-exported: mosaic.is_hopper)
from pallas_kernels.common import (LOG2E, NEG, dot, key_end, normalise, online_softmax_step, pad_axis,
                                   query_rows_bounds, row_lse, row_scalars)

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


class WarpgroupOps:
    """The matrix products, iotas, vector loads and layout hints of a Mosaic kernel body, compiled
    or interpreted (module docstring): one place for the forward kernels here and the backward
    ones of `mosaic_backward.py`. bq x bk is the score tile's shape (rows x columns)."""

    def __init__(self, interpret: bool, bq: int, bk: int):
        self.plgpu, self.interpret, self.bq, self.bk = _plgpu(), interpret, bq, bk

    def layout(self, x, lay):  # layout hints exist only for the compiled kernel
        return x if self.interpret else self.plgpu.layout_cast(x, lay)

    def iota(self, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, (self.bq, self.bk), dim)
        return self.plgpu.broadcasted_iota(jnp.int32, (self.bq, self.bk), dim, layout=self.plgpu.Layout.WGMMA)

    def mm_t(self, a_s, b_s, issued=None):
        """a_s [M, K] . b_s [N, K]^T -> [M, N] f32, both operands in shared memory; `issued()` runs
        between issuing the product and reading its result (ping-pong)."""
        if self.interpret:
            out = dot(a_s[...], b_s[...], ((1,), (1,)))
            if issued is not None:
                issued()
            return out
        plgpu = self.plgpu

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a_s, plgpu.transpose_ref(b_s, (1, 0)))
            if issued is not None:
                issued()
            return acc_ref[...]
        return pl.run_scoped(mma, plgpu.ACC((a_s.shape[0], b_s.shape[0]), jnp.float32))

    def mm(self, a, b_s):
        """a [M, K] (registers, 16-bit) . b_s [K, N] (shared memory) -> [M, N] f32."""
        if self.interpret:
            return dot(a, b_s[...], ((1,), (0,)))
        plgpu = self.plgpu

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a, b_s)
            return acc_ref[...]
        return pl.run_scoped(mma, plgpu.ACC((a.shape[0], b_s.shape[-1]), jnp.float32))

    def qk(self, q_s, k_slot, issued=None):
        """[bq, bk] f32 scores of the Q tile in shared memory against the K tile `k_slot`."""
        return self.mm_t(q_s, k_slot, issued)

    def pv(self, p, v_slot):  # [bq, D] f32
        return self.mm(p, v_slot)

    def vector(self, ref, axis: int):
        """A float32 vector in shared memory, laid out to broadcast along `axis` of a score tile: axis 1
        (one value per row) or axis 0 (one per column)."""
        if self.interpret:
            return ref[...]
        return self.plgpu.load(ref, (), layout=self.plgpu.Layout.WGMMA.reduce(axis))

    def zeros(self, shape):
        wg = None if self.interpret else self.plgpu.Layout.WGMMA
        return self.layout(jnp.zeros(shape, jnp.float32), wg)

    def init_carry(self, D):
        wg = None if self.interpret else self.plgpu.Layout.WGMMA
        return (self.zeros((self.bq, D)),
                self.layout(jnp.full((self.bq,), NEG, jnp.float32), wg and wg.reduce(1)),
                self.layout(jnp.zeros((self.bq,), jnp.float32), wg and wg.reduce(1)))

    def visible(self, t, p_first, start, kind, block_size, kvl):
        """[bq, bk] bool: which keys of tile t the rows from slot p_first on see."""
        cols = t * self.bk + self.iota(1)
        end = key_end(p_first + self.iota(0), kind, block_size, kvl)
        return (cols >= start) & (cols < end)


def _kernel(start_g, qoff_g, kvl_g, q_g, k_g, v_g, o_g, lse_g, q_s, k_s, v_s, lse_s, q_bar,
            k_bar, v_bar, *, T, S, G, num_q_tiles, kind, block_size, qk_scale, stages, interpret):
    plgpu = _plgpu()
    bq, bk = BLOCK_Q, k_s.shape[1]
    ops = WarpgroupOps(interpret, bq, bk)
    dtype = q_s.dtype
    D = q_s.shape[-1]
    i = num_q_tiles - 1 - lax.axis_index("q")  # heaviest (last) query tiles launch first
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    kvh = lax.div(h, G)
    start, qoff, kvl = start_g[b], qoff_g[b], kvl_g[b]
    q0 = i * bq

    plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(q0, bq), h], q_s, q_bar)
    p_first = qoff + q0
    ta, tb, tc, td = query_rows_bounds(q0, bq, T=T, S=S, start=start, qoff=qoff, kvl=kvl, block_k=bk, kind=kind,
                                       block_size=block_size)
    ring = PrefetchRing([k_s, v_s], [k_bar, v_bar], kv_sources(k_g, v_g, b, kvh, bk), first=ta, end=td,
                        stages=stages)
    plgpu.barrier_wait(q_bar)

    def step(t, carry, masked: bool):
        slot = ring.slot(t)
        ring.advance(t)
        ring.wait(0, t)
        s = ops.qk(q_s, k_s.at[slot]) * qk_scale
        vis = ops.visible(t, p_first, start, kind, block_size, kvl) if masked else None

        def pv_after_v_lands(p):
            ring.wait(1, t)
            return ops.pv(p.astype(dtype), v_s.at[slot])
        return online_softmax_step(carry, s, vis, pv_after_v_lands)

    carry = ops.init_carry(D)
    carry = lax.fori_loop(ta, tb, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(tb, tc, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(tc, td, functools.partial(step, masked=True), carry)

    q_s[...] = normalise(acc, l).astype(dtype)
    lse_s[...] = row_lse(m, l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, o_g.at[b, pl.ds(q0, bq), h])
    plgpu.copy_smem_to_gmem(lse_s, lse_g.at[b, h, pl.ds(q0, bq)])
    plgpu.wait_smem_to_gmem(0)


COMPUTE_REGISTERS, LOADER_REGISTERS = 232, 40  # per thread, warp-specialised: 2 x 232 + 40 warps' worth fit


def kv_sources(k_g, v_g, b, kvh, bk: int):
    """sources(t) -> [K tile t, V tile t] in global memory, KV head kvh of batch row b: what the
    rings of the prefill and dq kernels stream."""
    def sources(t):
        rows = (b, pl.ds(t * bk, bk), kvh)
        return [k_g.at[rows], v_g.at[rows]]
    return sources


class TmaRing:
    """A ring of `stages` shared-memory slots fed by TMA: item n of the walk [first, end) goes
    into slot (n - first) % stages of every buffer in `buffers` ([stages, ...] arrays), buffer j
    signalling its `full[j]` barrier; sources(n) -> one global-memory ref per buffer."""

    def __init__(self, buffers, full, sources, *, first, end, stages: int):
        self.plgpu = _plgpu()
        self.buffers, self.full, self.sources = buffers, full, sources
        self.first, self.end, self.stages = first, end, stages

    def slot(self, n):
        return lax.rem(n - self.first, self.stages)

    def issue(self, n, which=None):
        """Start the copies of item n (of the buffers `which`, default all)."""
        srcs, slot = self.sources(n), self.slot(n)
        for j in range(len(self.buffers)) if which is None else which:
            self.plgpu.copy_gmem_to_smem(srcs[j], self.buffers[j].at[slot], self.full[j].at[slot])

    def wait(self, j: int, n):
        self.plgpu.barrier_wait(self.full[j].at[self.slot(n)])


class PrefetchRing(TmaRing):
    """One warpgroup's ring: the first stages - 1 items are issued when it is built, and each step
    (`advance(n)`) issues item n + stages - 1 into the slot of item n - 1, whose products have
    completed by then (each product's result is read before the next step)."""

    def __init__(self, buffers, full, sources, *, first, end, stages: int):
        super().__init__(buffers, full, sources, first=first, end=end, stages=stages)
        for j in range(stages - 1):
            pl.when(first + j < end)(functools.partial(self.issue, first + j))

    def advance(self, n):
        ahead = n + (self.stages - 1)
        pl.when(ahead < self.end)(functools.partial(self.issue, ahead))


class SharedRing(TmaRing):
    """The ring of a warp-specialised program: warpgroup 2 loads, warpgroups 0 and 1 compute.

    `groups` lists, per `free` barrier array (two arrivals: one per compute warpgroup), the
    buffers whose next load waits for it. A compute warpgroup (`compute_side`) waits for a buffer
    (`wait`), releases a group once its products have read it (`release`), and passes over an
    item only its neighbour computes with `skip` (waits and releases everything, and meets twice,
    as a computed item does). With `pingpong` the two compute warpgroups `meet` on the `turn`
    barrier (two arrivals) twice per item: warpgroup 1 starts one meeting late (`start_turn`) and
    warpgroup 0 ends with the spare one (`end_turn`), so one's softmax runs beside the other's
    matrix products. The loader (`load`) gives its registers away, issues each item's copies once
    its slot is free, then waits for the last releases, so every barrier phase is observed
    (Pallas's GPU interpreter checks that)."""

    def __init__(self, buffers, full, sources, free, groups, turn, *, first, end, stages: int, pingpong: bool,
                 interpret: bool):
        super().__init__(buffers, full, sources, first=first, end=end, stages=stages)
        self.free, self.groups, self.turn = free, groups, turn
        self.pingpong, self.interpret = pingpong, interpret

    def compute_side(self):
        """At the top of a compute warpgroup's branch: take the registers the loader gives up."""
        if not self.interpret:
            self.plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

    def release(self, g: int, n):
        self.plgpu.barrier_arrive(self.free[g].at[self.slot(n)])

    def meet(self):
        if self.pingpong:
            self.plgpu.barrier_arrive(self.turn)
            self.plgpu.barrier_wait(self.turn)

    def hand_over(self):  # first half of a split meeting: this warpgroup's softmax is done
        if self.pingpong:
            self.plgpu.barrier_arrive(self.turn)

    def take_back(self):  # second half: the other warpgroup's products are issued
        if self.pingpong:
            self.plgpu.barrier_wait(self.turn)

    def start_turn(self, wg):
        pl.when(wg == 1)(self.meet)

    def end_turn(self, wg):
        pl.when(wg == 0)(self.meet)

    def skip(self, lo, hi):
        """Items [lo, hi) this warpgroup does not compute: released as they land, two meetings each."""
        def one(n, _):
            for g, bufs in enumerate(self.groups):
                for j in bufs:
                    self.wait(j, n)
                self.release(g, n)
                self.meet()
            for _ in range(2 - len(self.groups)):
                self.meet()
        lax.fori_loop(lo, hi, one, None)

    def load(self):
        """The loader warpgroup's whole branch."""
        plgpu = self.plgpu
        if not self.interpret:
            plgpu.set_max_registers(LOADER_REGISTERS, action="decrease")

        def one(n, _):
            for g, bufs in enumerate(self.groups):
                @pl.when(n - self.first >= self.stages)
                def _():
                    plgpu.barrier_wait(self.free[g].at[self.slot(n)])
                self.issue(n, bufs)

        def drain(n, _):
            for g in range(len(self.groups)):
                plgpu.barrier_wait(self.free[g].at[self.slot(n)])

        lax.fori_loop(self.first, self.end, one, None)
        lax.fori_loop(jnp.maximum(self.first, self.end - self.stages), self.end, drain, None)


def _ws_kernel(start_g, qoff_g, kvl_g, q_g, k_g, v_g, o_g, lse_g, qo_s, k_s, v_s, lse_s, q_bar,
               k_bar, v_bar, k_free, v_free, turn, *, T, S, G, num_q_tiles, kind, block_size, qk_scale,
               stages, pingpong, interpret):
    """Warp-specialised body: three warpgroups per program ("wg"); 0 and 1 compute, 2 loads.

    The program owns two adjacent 64-row query tiles, one per compute warpgroup, and one ring
    (`SharedRing`) of K/V slots that both read; the loader gives its registers to the other two.
    Both compute warpgroups walk the program's key tiles [a, d): each its own masked / unmasked /
    masked segments of `tile_bounds` up to its own horizon, then skips the tiles only its
    neighbour needs (the block-causal mask gives the later query tile more keys).
    """
    plgpu = _plgpu()
    bq, bk = BLOCK_Q, k_s.shape[1]
    ops = WarpgroupOps(interpret, bq, bk)
    dtype = qo_s.dtype
    D = qo_s.shape[-1]
    i = num_q_tiles - 1 - lax.axis_index("q")  # heaviest (last) query tiles launch first
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    wg = lax.axis_index("wg")
    start, qoff, kvl = start_g[b], qoff_g[b], kvl_g[b]
    pair0 = i * (2 * bq)

    bounds = functools.partial(query_rows_bounds, T=T, S=S, start=start, qoff=qoff, kvl=kvl, block_k=bk,
                               kind=kind, block_size=block_size)

    ta, _, _, td = bounds(pair0, 2 * bq)  # the program's tiles: the union of both warpgroups'
    ring = SharedRing([k_s, v_s], [k_bar, v_bar], kv_sources(k_g, v_g, b, lax.div(h, G), bk), [k_free, v_free],
                      [[0], [1]], turn, first=ta, end=td, stages=stages, pingpong=pingpong, interpret=interpret)

    @pl.when(wg < 2)
    def _compute():
        ring.compute_side()
        q0 = pair0 + wg * bq
        q_tile = qo_s.at[wg]
        plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(q0, bq), h], q_tile, q_bar.at[wg])
        a, tb, tc, d = bounds(q0, bq)
        p_first = qoff + q0
        plgpu.barrier_wait(q_bar.at[wg])
        ring.start_turn(wg)

        def step(t, carry, masked: bool):
            slot = ring.slot(t)
            ring.wait(0, t)
            s = ops.qk(q_tile, k_s.at[slot], issued=ring.meet) * qk_scale
            ring.release(0, t)
            vis = ops.visible(t, p_first, start, kind, block_size, kvl) if masked else None

            def pv_after_v_lands(p):
                p = p.astype(dtype)
                ring.hand_over()  # softmax done: hand the tensor cores over, then wait for them
                ring.wait(1, t)
                ring.take_back()
                out = ops.pv(p, v_s.at[slot])
                ring.release(1, t)
                return out
            return online_softmax_step(carry, s, vis, pv_after_v_lands)

        carry = ops.init_carry(D)
        carry = lax.fori_loop(a, tb, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(tb, tc, functools.partial(step, masked=False), carry)
        acc, m, l = lax.fori_loop(tc, d, functools.partial(step, masked=True), carry)
        ring.skip(d, td)
        ring.end_turn(wg)

        q_tile[...] = normalise(acc, l).astype(dtype)
        lse_s.at[wg][...] = row_lse(m, l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_g.at[b, pl.ds(q0, bq), h])
        plgpu.copy_smem_to_gmem(lse_s.at[wg], lse_g.at[b, h, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 2)(ring.load)


SMEM_BYTES = 227 * 1024  # shared memory one Hopper block may hold (sm_90: 227 KiB)
SMEM_SLACK = 4096  # what Mosaic GPU adds to the scratch (barriers, alignment): 2.7 KiB measured


def prefill_attention(q, k, v, *, start, q_offset=0, kv_len=None, kind="causal", block_size=1,
                      scale=None, block_k: int = BLOCK_K, stages: int = STAGES,
                      warp_specialized: bool = False, pingpong: bool = True,
                      interpret: bool = False, return_lse: bool = False):
    """Mosaic GPU flash attention forward: q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D].

    Arguments as `flash.prefill_attention`; `block_k` (64 or 128) keys per
    tile, `stages` (>= 2) K/V tiles in shared memory. `warp_specialized=True`
    runs `_ws_kernel` (two compute warpgroups on 128 query rows, one TMA
    loader warpgroup; `pingpong` staggers the two compute warpgroups) instead of
    one warpgroup per 64 rows. `interpret=True` runs Pallas's GPU interpret mode
    (CPU), whose uninitialised output memory is NaN, so an element the kernel
    forgets to write fails the tests; it also checks that every barrier phase
    is observed and runs the three warpgroups as concurrent threads.
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
    compute_wgs = 2 if warp_specialized else 1
    smem_bytes = ((compute_wgs * BLOCK_Q + 2 * stages * block_k) * D * q.dtype.itemsize
                  + compute_wgs * BLOCK_Q * 4 + SMEM_SLACK)  # Q/O tiles, the K/V ring, the lse rows
    if smem_bytes > SMEM_BYTES:
        raise ValueError(f"block_k={block_k} x stages={stages} at head_dim {D} needs about {smem_bytes} bytes "
                         f"of shared memory, over the {SMEM_BYTES} a Hopper block holds: fewer stages")
    kv_len = S if kv_len is None else kv_len
    scale = D ** -0.5 if scale is None else scale
    rows = compute_wgs * BLOCK_Q  # query rows per program
    Tp, Sp = pl.cdiv(T, rows) * rows, pl.cdiv(S, block_k) * block_k
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    q, k, v = pad_axis(q, 1, Tp), pad_axis(k, 1, Sp), pad_axis(v, 1, Sp)
    start, qoff, kvl = row_scalars(start, q_offset, kv_len, B, S)
    nq = Tp // rows

    if interpret:
        smem = lambda shape: plgpu.SMEM(shape, q.dtype)  # noqa: E731
    else:
        swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = lambda shape: plgpu.SMEM(shape, q.dtype, transforms=swizzle)  # noqa: E731
    ring = [smem((stages, block_k, D)), smem((stages, block_k, D))]
    common_kw = dict(T=T, S=S, G=G, num_q_tiles=nq, kind=kind, block_size=block_size,
                     qk_scale=scale * LOG2E, stages=stages, interpret=interpret)
    kwargs = {}
    if warp_specialized:
        scratch = [smem((2, BLOCK_Q, D)), *ring, plgpu.SMEM((2, BLOCK_Q), jnp.float32),
                   plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages),
                   plgpu.Barrier(num_barriers=stages),
                   plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                   plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier(num_arrivals=2)]
        body = functools.partial(_ws_kernel, **common_kw, pingpong=pingpong)
        kwargs.update(num_threads=3, thread_name="wg")
    else:
        scratch = [smem((BLOCK_Q, D)), *ring, plgpu.SMEM((BLOCK_Q,), jnp.float32), plgpu.Barrier(),
                   plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)]
        body = functools.partial(_kernel, **common_kw)
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


__all__ = ["prefill_attention", "unsupported_reason", "is_hopper", "WarpgroupOps", "TmaRing", "PrefetchRing",
           "SharedRing", "kv_sources", "BLOCK_Q", "BLOCK_K", "STAGES", "SMEM_BYTES"]
