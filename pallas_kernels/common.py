"""What the Pallas attention kernels share: tiles, backends, and the in-kernel pieces.

`flash.py` (Triton / interpret forward), `backward.py` (its backward kernels)
and `mosaic.py` (the Mosaic GPU forward on Hopper) all import from here and
from nowhere else in this package, except `flash.py`, which dispatches to the
other two. Scores are in log2 units throughout (pre-multiplied by LOG2E).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LOG2E = math.log2(math.e)
NEG = -0.7 * float(np.finfo(np.float32).max)  # finite "-inf": keeps exp2(m_old - m_new) NaN-free
BACKENDS = ("interpret", "triton", "mosaic", "mosaic_interpret")
BACKEND_ENV = "JDLLM_PALLAS_BACKEND"
MIN_TILE = 16  # smallest tile dimension the Triton dot accepts


# --------------------------------------------------------------------------- tiles and backends
@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes (powers of two) and launch knobs; hashable, so usable as a static argument.

    block_q: query rows per prefill program. block_k: keys per inner-loop step.
    block_r: packed (query, head) rows per window program. num_splits: key
    splits of the window kernel (None: enough programs for twice the device's
    cores). num_warps / num_stages: Triton launch parameters (ignored when
    interpreting). block_q_bwd / block_k_bwd: tiles of the backward kernels.
    mosaic_block_k (64 or 128) / mosaic_stages (>= 2): key tile and K/V ring
    depth of the Mosaic GPU prefill kernel (its query tile is fixed at 64).
    mosaic_warp_specialized: the Mosaic prefill's warp-specialised variant
    (two compute warpgroups on 128 query rows beside a TMA loader warpgroup;
    prompts of more than 64 rows), with `mosaic_pingpong` staggering its two
    compute warpgroups. mosaic_backward: on the "mosaic" backends, the backward
    runs the Mosaic GPU kernels of `mosaic_backward.py` (wgmma, TMA ring of
    `mosaic_stages`) instead of the Triton ones, warp-specialised with
    `mosaic_backward_warp_specialized` (its ping-pong is `mosaic_pingpong` too).
    one_row: a window of one query row per program (T = 1, one query head per KV
    head) over an int8 cache runs on the CUDA cores (`flash._attend_one_row`);
    False: the tensor-core dot of every other window. one_row_prefetch: that
    kernel loads the next key tile before folding the current one. one_row_heads:
    a one-query window with grouped heads (G > 1) runs it too, a program per query
    head, each reading its KV head's tiles. Both off: on an H100 (T=1, S=33792,
    2026-11-27) prefetch took 0.233 ms against 0.195 without, and per-head
    programs 0.149 ms against the dot's 0.075 at 8 KV heads. int8_v_words: a
    window of several query rows per KV head over an int8 cache reads V as
    32-bit words and unpacks their bytes in registers (`flash._attend`), where
    the dot over int8 V reads V out of shared memory one byte per instruction
    (head_dim a multiple of 64; None: `$JDLLM_INT8_V_WORDS`, 1 on, unset or 0
    off, until a GPU times it).
    The defaults are what an H200 timed fastest (benchmarks/attention.py,
    S=4096, 2026-11-26): the warp-specialised forward without the ping-pong
    (1.06-1.41x the one-warpgroup kernel) and the one-warpgroup Mosaic backward
    (fwd+bwd 1.8-2.1x the Triton backward; the warp-specialised backward, timed
    with the ping-pong, was 0.85-0.90x of it).
    """

    block_q: int = 128
    block_k: int = 64
    block_r: int = 128
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    mosaic_block_k: int = 64
    mosaic_stages: int = 2
    mosaic_warp_specialized: bool = True
    mosaic_pingpong: bool = False
    mosaic_backward: bool = True
    mosaic_backward_warp_specialized: bool = False
    one_row: bool = True
    one_row_prefetch: bool = False
    one_row_heads: bool = False
    int8_v_words: bool | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_r", "block_q_bwd", "block_k_bwd"):
            val = getattr(self, name)
            if val < 1 or val & (val - 1):
                raise ValueError(f"Tiles.{name}={val} must be a power of two")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"Tiles.num_splits={self.num_splits} must be >= 1 (or None)")


def env_count(name: str, least: int) -> int | None:
    """The whole number >= `least` that environment variable `name` holds, None when it is unset or
    blank; anything else is a jdllm ConfigError naming the variable (a knob read when a program is
    traced: `JDLLM_WINDOW_SPLITS`, `JDLLM_MERGE_TOKENS`)."""
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    if not env.isdigit() or int(env) < least:
        from jdllm import errors  # noqa: PLC0415 (keeps pallas_kernels importable alone)

        raise errors.ConfigError(f"{name}={env!r} must be a whole number >= {least} (or unset)")
    return int(env)


def env_switch(name: str, unset=False):
    """Environment variable `name` as an on / off switch read when a program is traced: "1" on,
    "0" off, `unset` when it is unset or blank (None: the caller decides); anything else is a jdllm
    ConfigError naming the variable (`JDLLM_INT8_V_WORDS`, `JDLLM_QMATMUL_WORDS`,
    `JDLLM_NORM_INTO_MATMUL`)."""
    value = env_count(name, 0)
    if value not in (None, 0, 1):
        from jdllm import errors  # noqa: PLC0415 (keeps pallas_kernels importable alone)

        raise errors.ConfigError(f"{name}={os.environ[name].strip()!r} must be 0 or 1 (or unset)")
    return unset if value is None else bool(value)


def default_backend() -> str:
    """`$JDLLM_PALLAS_BACKEND` if set; else "mosaic" on Hopper, "triton" on other GPUs,
    "interpret" elsewhere."""
    env = os.environ.get(BACKEND_ENV)
    if env:
        if env not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={env!r} is not one of {BACKENDS}")
        return env
    if jax.default_backend() != "gpu":
        return "interpret"
    return "mosaic" if is_hopper() else "triton"


def plain_backend(backend: str) -> str:
    """The Triton-or-interpret backend that runs what the Mosaic kernel does not."""
    return {"mosaic": "triton", "mosaic_interpret": "interpret"}.get(backend, backend)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tile_size(want: int, n: int, backend: str) -> int:
    """Tile for a dimension of size n: at most `want`, no larger than needed.

    Triton needs >= 16; interpret mode takes any power of two.
    """
    floor = MIN_TILE if backend == "triton" else 1
    return max(floor, min(want, next_pow2(n)))


def compiler_params(backend: str, num_warps: int, num_stages: int):
    """Triton's launch parameters for a pallas_call on `backend` (None off Triton)."""
    if backend != "triton":
        return None
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415 (GPU-only import)
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def triton_params(backend: str, tiles: Tiles, head_dim: int):
    return compiler_params(backend, tiles.num_warps or (4 if head_dim <= 64 else 8), tiles.num_stages)


# --------------------------------------------------------------------------- in-kernel pieces
def dot_precision(*dtypes):
    """The precision of a dot on operands of these dtypes: HIGHEST when one is float32, else None.

    Pallas's Triton lowering runs a float32 dot of precision DEFAULT or HIGH in TF32 (10-bit
    mantissa inputs) and one of HIGHEST in IEEE float32, and a dot given no precision takes
    `jax_default_matmul_precision`'s; so float32 kernels ask for HIGHEST outright and stay exact
    whatever the global setting. bfloat16 / float16 operands keep None (the global default), as
    before: the tensor cores take them as they are.
    """
    return lax.Precision.HIGHEST if any(jnp.dtype(d) == jnp.float32 for d in dtypes) else None


def dot(a, b, contract):
    """a . b over dims `contract` = ((a_dim,), (b_dim,)), accumulated in float32: every matrix
    product of the Pallas kernels (their interpret-mode stand-ins for wgmma too), at
    `dot_precision(a.dtype, b.dtype)`."""
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32,
                           precision=dot_precision(a.dtype, b.dtype))


def int8_to_float32(x):
    """int8 `x` as float32, exactly, by integer operations and one float add.

    Triton's int8 -> float32 conversion is the GPU's int-to-float instruction, which issues at a
    quarter of the float rate. Here the byte with its sign bit flipped (x + 128, 0..255) becomes
    the low mantissa of the float32 2^23 (bits 0x4B000000, whose last mantissa unit is 1): that
    float is 2^23 + 128 + x, and subtracting 2^23 + 128 leaves x."""
    bits = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32) ^ np.uint32(0x4B000080)
    return lax.bitcast_convert_type(bits, jnp.float32) - np.float32(8388736.0)


def int8_plane(words, j: int):
    """Byte j (0 = least significant) of each int32 of `words`, as int8 (the shift's low byte: an
    integer narrowing wraps, in XLA and in Triton alike)."""
    if j:
        words = lax.shift_right_logical(words, np.int32(8 * j))
    return words.astype(jnp.int8)


def int8_from_words(words):
    """int32 words [..., n] -> the int8 values they hold, [..., 4 n] in order (`int8_words`'
    inverse): the four byte planes interleaved by two-way stacks along the last axis (Triton's
    `join`, the only stack its lowering takes), then a reshape. A V tile read as words travels
    through shared memory 32 bits at a time; read as int8 it is fetched one byte per instruction
    for a dot that contracts over its keys (`flash._attend`)."""
    p = [int8_plane(words, j) for j in range(4)]
    # [.., n, 2 (c), 2 (e)] holds byte 2 c + e of word i: flattened, column 4 i + 2 c + e
    pairs = jnp.stack([jnp.stack([p[0], p[2]], axis=-1), jnp.stack([p[1], p[3]], axis=-1)], axis=-1)
    return pairs.reshape(*words.shape[:-1], 4 * words.shape[-1])


def int8_words(x):
    """int8 x [..., D] (D a multiple of 4) as int32 [..., D // 4], each word holding 4 consecutive
    values, byte j the value at 4 i + j (little-endian): a bitcast, no copy."""
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4), jnp.int32)


def cdiv(x, d: int):
    return lax.div(x + (d - 1), d)


def key_end(p, kind: str, block_size: int, kvl):
    """min(horizon(p), kv_len) for slot(s) p (nonnegative int32); `lax.div` lowers on Triton."""
    if kind == "causal":
        hz = p + 1
    elif kind == "block_causal":
        hz = (lax.div(p, block_size) + 1) * block_size
    else:
        return jnp.zeros_like(p) + kvl
    return jnp.minimum(hz, kvl)


def tile_bounds(*, start, kvl, p_first, p_last, lo_slot, hi_slot, block_k, kind, block_size):
    """Key-tile ranges [a, b) masked, [b, c) unmasked, [c, d) masked, inside [lo_slot, hi_slot).

    Tiles past the horizon of the last query (or before `start`) are never
    visited; a tile is unmasked when every query of the tile sees all its keys:
    it starts at or after `start` and ends before the horizon of the first query.
    """
    lo = jnp.maximum(start, lo_slot)
    hi = jnp.minimum(key_end(p_last, kind, block_size, kvl), hi_slot)
    a = lax.div(lo, block_k)
    d = jnp.where(hi > lo, jnp.maximum(cdiv(hi, block_k), a), a)  # nothing visible: no tile
    b = jnp.clip(cdiv(start, block_k), a, d)
    c = jnp.clip(lax.div(key_end(p_first, kind, block_size, kvl), block_k), b, d)
    return a, b, c, d


def query_rows_bounds(q0, rows: int, *, T: int, S: int, start, qoff, kvl, block_k: int, kind: str,
                      block_size: int):
    """`tile_bounds` over the whole cache [0, S) for the query rows [q0, q0 + rows) of a T-query
    chunk at slot offset qoff (rows past T count as the last query): the key walk of a prefill
    or dq program."""
    return tile_bounds(start=start, kvl=kvl, p_first=qoff + q0, p_last=qoff + jnp.minimum(q0 + (rows - 1), T - 1),
                       lo_slot=0, hi_slot=S, block_k=block_k, kind=kind, block_size=block_size)


def first_seeing(s, kind: str, block_size: int, qoff):
    """Smallest query slot whose horizon passes key slot s (qoff: any query, bidirectional)."""
    if kind == "causal":
        return s
    if kind == "block_causal":
        return lax.div(s, block_size) * block_size
    return jnp.zeros_like(s) + qoff


def key_tile_queries(k0, block_k: int, block_q: int, *, T: int, start, qoff, kvl, kind: str, block_size: int):
    """The query tiles [qa, qe) of a T-query chunk at slot offset qoff that see some key of the tile
    [k0, k0 + block_k), and qb: from it on every query of a tile sees every key of this one (tiles
    [qa, qb) need the mask); a key tile no query sees gives qa = qb = qe. The walk of a dk / dv
    program."""
    kmin = jnp.maximum(k0, start)
    empty = kmin >= jnp.minimum(kvl, k0 + block_k)
    qa = lax.div(jnp.clip(first_seeing(kmin, kind, block_size, qoff) - qoff, 0, T), block_q)
    qe = jnp.where(empty, qa, -(-T // block_q))  # the tiles holding real queries
    full_from = first_seeing(k0 + (block_k - 1), kind, block_size, qoff) - qoff
    qb = jnp.clip(cdiv(jnp.clip(full_from, 0, T), block_q), qa, qe)
    return qa, jnp.where((k0 >= start) & (k0 + block_k <= kvl), qb, qe), qe


def online_softmax_step(carry, s, vis, pv):
    """Fold one key tile into the running (acc [R, D], m [R], l [R]) of the online softmax.

    s [R, bk]: f32 scores in log2 units; vis: bool [R, bk] visibility, or None
    for a tile every row sees whole; pv(p) -> p @ V [R, D] f32 for the tile's
    probabilities p [R, bk] (the caller's matmul: a dot, or wgmma). Rows with
    nothing visible yet keep l = 0. Broadcasts are explicit `broadcast_in_dim`s
    so Mosaic GPU's layouts follow them.
    """
    acc, m, l = carry
    R, bk = s.shape
    if vis is not None:
        s = jnp.where(vis, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (R, bk), [0]))
    if vis is not None:
        p = jnp.where(vis, p, 0.0)
    l = corr * l + jnp.sum(p, axis=1)
    return acc * lax.broadcast_in_dim(corr, acc.shape, [0]) + pv(p), m_new, l


def normalise(acc, l):
    """acc [R, D] / l [R] per row; rows that saw nothing (l = 0) stay zero."""
    return acc / lax.broadcast_in_dim(jnp.where(l == 0.0, 1.0, l), acc.shape, [0])


def store_rows(ref, value, first_row, rows: int):
    """ref[...] = value [br, ...] for a block whose rows start at `first_row` of an array of `rows`
    rows: the rows past its end are masked out of the store (Triton writes a block's every row,
    inside the array or not). A block inside the array is a plain store."""
    br = value.shape[0]
    if rows % br == 0:
        ref[...] = value
        return
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415 (its store takes a mask; interpret too)

    inside = first_row + lax.broadcasted_iota(jnp.int32, value.shape, 0) < rows
    plgpu.store(ref, value, mask=inside)


def row_lse(m, l):
    """log2-sum-exp2 of a row's scores (0 for rows that see nothing; the backward masks them)."""
    return jnp.where(l == 0.0, 0.0, m + jnp.log2(jnp.where(l == 0.0, 1.0, l)))


def row_scalars(start, q_offset, kv_len, B: int, S: int):
    """Per-row int32 [B] arrays of start, q_offset and kv_len (clipped to S); traced values welcome."""
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (B,))
    qoff = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (B,))
    kvl = jnp.broadcast_to(jnp.minimum(jnp.asarray(kv_len, jnp.int32), S), (B,))
    return start, qoff, kvl


def pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def padded_head_dim(D: int, backend: str) -> int:
    """head_dim as the kernels run it: a power of two (>= 16 on Triton)."""
    return tile_size(next_pow2(D), D, backend) if backend == "triton" else next_pow2(D)


def pad_head_dim(q, k, v, backend: str):
    """Zero-pad head_dim to `padded_head_dim`; zeros change no score."""
    Dp = padded_head_dim(q.shape[-1], backend)
    return pad_axis(q, 3, Dp), pad_axis(k, 3, Dp), pad_axis(v, 3, Dp)


def is_hopper() -> bool:
    """True on an sm_90 device (H100 / H200)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return False
    cc = getattr(dev, "compute_capability", None)
    return str(cc).startswith("9")
