"""The one decoder-only transformer every jdllm family runs on.

Parameters are a plain nested dict that jit-compiled functions take as an argument. Each weight
is described once in `param_specs` (shape, logical axes, initialiser); random initialisation,
sharding and checkpoint layout all derive from that table. Two layouts of the layer weights:
stacked on a leading `layers` axis (checkpoints, `init_params`; `forward` runs them through
`lax.scan`) and per layer (what `jdllm.load` returns: `layers` a tuple of per-layer dicts, q/k/v
and gate/up fused; `forward` runs them as straight-line code reading each weight in place, as a
GPU decode step at the weight-read floor needs). `to_layout` converts between them.

`forward` knows nothing about decoding paradigms: it takes a window of tokens
at absolute slots, an optional static-shape KV cache, and the attention kind
of the model, and returns float32 logits (and the cache with the window's K/V
written in). Masking follows pallas_kernels' one rule.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np
import jax.numpy as jnp

from jdllm import errors, quant
from jdllm.config import ModelConfig
from pallas_kernels import attention as attention_op
from pallas_kernels import dequantize, resolve_impl
from pallas_kernels.common import dot_precision, env_switch

Params = dict[str, Any]


# --------------------------------------------------------------------------- weights
@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim
    init: str = "normal"  # "normal" | "ones" | "zeros"


LAYOUTS = ("stacked", "per_layer", "per_layer_fused")


def param_specs(cfg: ModelConfig, layout: str = "stacked") -> Params:
    """Every weight of the model, described once.

    layout "stacked" (what checkpoints store): layer weights lead with a `layers` axis.
    "per_layer" (what `jdllm.load` returns): `layers` is a tuple of per-layer dicts, the same
    weights without the `layers` axis. "per_layer_fused": per layer with q / k / v as one `qkv`
    [D, H + 2 KV, Dh] and gate / up as one `gate_up` [D, 2 F] (`fuse_projections`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    H, KV, Dh, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
    layer = {
        "attn_norm": ParamSpec((L, D), ("layers", "embed"), "ones"),
        "q": ParamSpec((L, D, H, Dh), ("layers", "embed", "q_heads", "head_dim")),
        "k": ParamSpec((L, D, KV, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "v": ParamSpec((L, D, KV, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "o": ParamSpec((L, H, Dh, D), ("layers", "q_heads", "head_dim", "embed")),
        "mlp_norm": ParamSpec((L, D), ("layers", "embed"), "ones"),
        "gate": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "up": ParamSpec((L, D, F), ("layers", "embed", "mlp")),
        "down": ParamSpec((L, F, D), ("layers", "mlp", "embed")),
    }
    if cfg.qkv_bias:
        layer["q_bias"] = ParamSpec((L, H, Dh), ("layers", "q_heads", "head_dim"), "zeros")
        layer["k_bias"] = ParamSpec((L, KV, Dh), ("layers", "kv_heads", "head_dim"), "zeros")
        layer["v_bias"] = ParamSpec((L, KV, Dh), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.qk_norm:
        layer["q_norm"] = ParamSpec((L, Dh), ("layers", "head_dim"), "ones")
        layer["k_norm"] = ParamSpec((L, Dh), ("layers", "head_dim"), "ones")
    specs: Params = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "layers": layer,
        "final_norm": ParamSpec((D,), ("embed",), "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"))
    if layout != "stacked":
        one = {k: ParamSpec(s.shape[1:], s.axes[1:], s.init) for k, s in layer.items()}
        if layout == "per_layer_fused":  # fused axes have no sharding rule: only unsplit heads are fused
            for k in ("q", "k", "v", "gate", "up"):
                del one[k]
            one["qkv"] = ParamSpec((D, H + 2 * KV, Dh), ("embed", "qkv_heads", "head_dim"))
            one["gate_up"] = ParamSpec((D, 2 * F), ("embed", "gate_up"))
        specs["layers"] = tuple(dict(one) for _ in range(L))
    return specs


def is_param_spec(x) -> bool:
    """The `is_leaf` of a `param_specs` tree (a ParamSpec is a dataclass, not a pytree leaf by itself)."""
    return isinstance(x, ParamSpec)


def flat_param_specs(cfg: ModelConfig) -> dict[tuple[str, ...], ParamSpec]:
    """`param_specs` (stacked) keyed by path, e.g. ('layers', 'q') -> its ParamSpec."""
    flat = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=is_param_spec)[0]
    return {tuple(k.key for k in path): spec for path, spec in flat}


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random parameters following `param_specs` (stacked; normal(0, std) weights, unit norms).
    `unstack_layers` gives the per-layer layout of the same values."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_param_spec)
    keys = jax.random.split(key, len(leaves))

    def make(spec: ParamSpec, k):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])


def param_shapes(cfg: ModelConfig, layout: str = "stacked") -> Params:
    return jax.tree.map(lambda s: s.shape, param_specs(cfg, layout), is_leaf=is_param_spec)


def param_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of the model's weights in `dtype` (any layout holds the same)."""
    n = sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_param_spec))
    return n * jnp.dtype(dtype).itemsize


def shape_mismatch(tree, cfg: ModelConfig, *, other_entries: bool = False):
    """The first disagreement between a weight pytree in any layout (leaves with `.shape`: arrays,
    Orbax metadata, ShapeDtypeStructs) and the config's shapes for that layout, as (weight name,
    got, want) with got None for a missing weight and want None for an extra one; None when they
    agree. other_entries: top-level entries that are no weight of the model (what a paradigm binds
    beside it: ar_spec's "draft") are not extras; an extra inside a weight entry still is."""
    layers = tree.get("layers") if isinstance(tree, dict) else None
    layout = layer_layout(tree) if layers is not None else "stacked"
    specs = param_specs(cfg, layout)
    flat_w = {jax.tree_util.keystr(k): tuple(s.shape) for k, s in
              jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_param_spec)[0]}
    flat_t = {jax.tree_util.keystr(k): (k, tuple(v.shape))  # a quantized weight (`quant.QArray`) has its weight's shape
              for k, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=quant.is_quantized)[0]}
    for name, want in flat_w.items():
        got = flat_t[name][1] if name in flat_t else None
        if got != want:
            return name, got, want
    for name, (path, got) in flat_t.items():
        if name not in flat_w and not (other_entries and getattr(path[0], "key", None) not in specs):
            return name, got, None
    return None


def check_params(params, cfg: ModelConfig, *, allow_extra: bool = False) -> None:
    """params must have the model's weight shapes -> ConfigError naming the weight. From static
    shapes: it works under jit and costs nothing there, so every entry point (`loop.layers_for`, the
    RL replay, the nnx view) runs it and another model's params are named, not decoded.

    allow_extra: tolerate top-level entries that are no weight of the model (what a paradigm binds
    beside them, e.g. a draft model's under "draft"); an extra weight inside the model's entries (a
    k_norm another family has) is refused all the same."""
    try:
        bad = shape_mismatch(params, cfg, other_entries=allow_extra)
    except Exception as e:  # noqa: BLE001
        raise errors.ConfigError(f"params are not a weight pytree: {e}") from None
    if bad is None:
        return
    name, got, want = bad
    if got is None:
        raise errors.ConfigError(f"params lack weight {name} of shape {want}: they are from another model config")
    if want is None:
        raise errors.ConfigError(f"params hold weight {name} this model config does not have: params from "
                                 "another model config")
    raise errors.ConfigError(f"params weight {name} has shape {got}, the model config wants {want}: "
                             "params from another model config")


def logical_axes(cfg: ModelConfig) -> Params:
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=is_param_spec)


# --------------------------------------------------------------------------- KV cache
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Static-shape KV cache. Row b's slots [0, length[b]) hold committed keys.

    k, v: [layers, B, S_max, kv_heads, head_dim]; length: [B] int32, one per
    row, so rows can sit at different positions (advance by several slots,
    rewind, or join late). Left padding is hidden by the `start` of the
    masking rule.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array
    k_scale: jax.Array | None = None  # int8 cache (cfg.kv_cache_dtype "int8"): [layers, B, S_max, kv_heads, 1]
    v_scale: jax.Array | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        """Zeros in `dtype`, or int8 with float32 scales when cfg.kv_cache_dtype is "int8" (K and V
        are quantized as they are written, one absmax scale per token and KV head, and
        dequantized to the activation dtype where attention reads them)."""
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        if cfg.kv_cache_dtype == "int8":
            scales = shape[:-1] + (1,)
            return cls(k=jnp.zeros(shape, jnp.int8), v=jnp.zeros(shape, jnp.int8),
                       length=jnp.zeros((batch,), jnp.int32), k_scale=jnp.zeros(scales, jnp.float32),
                       v_scale=jnp.zeros(scales, jnp.float32))
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   length=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def commit(self, length) -> "KVCache":
        """Mark slots [0, length) as committed (their K/V were written by a forward).

        length: one value for every row or [B]. Lowering it rewinds a row."""
        return dataclasses.replace(self, length=jnp.broadcast_to(jnp.asarray(length, jnp.int32), (self.batch,)))


def write_rows(buf: jax.Array, x: jax.Array, offset, layer=None, keep=None) -> jax.Array:
    """buf [B, S, ...] (or [L, B, S, ...] with `layer`) with x [B, T, ...] written at slots
    [offset, offset + T) of each row (of that layer).

    offset: a scalar (one dynamic_update_slice) or [B] (each row at its own slot:
    a scatter; one row's [1], an update at that start clipped into [0, S - T]).
    Like dynamic_update_slice, a start is clamped so the window stays inside S.

    keep [B, T] (bool), optional: those slots keep what buf holds; the scatter drops them (their
    indices are sent past the end) instead of the window being read back and merged. Under a
    conditional whose branches all update the cache (multi_block approx's switch over suffix
    widths), that read before the write made XLA:GPU copy the whole cache into and out of the
    conditional on every step (8B shape, P128 + G256, deviceless H100 compile: 192 MiB per step in
    the loop body and 584 MiB on the worst step; with the drop: 0 and 8 MiB, 575 -> 506 kernels).
    """
    x = x.astype(buf.dtype)
    offset = jnp.asarray(offset, jnp.int32)
    lead = () if layer is None else (jnp.asarray(layer, jnp.int32),)
    if keep is None and offset.shape == (1,):
        # one row: its slice updated at the start the scatter below would use (clipped: a negative one
        # would otherwise wrap around in dynamic_update_slice); the scatter of a single row became a
        # read of the old rows, a select (its dropped-if-out-of-bounds rule) and an update: two kernels
        # more per K / V write on the GPU (AR batch 1, 8B: 64 per token)
        offset = jnp.clip(offset[0], 0, buf.shape[len(lead) + 1] - x.shape[1])
    if keep is None and offset.ndim == 0:
        start = (*lead, jnp.zeros((), jnp.int32), offset) + (jnp.zeros((), jnp.int32),) * (x.ndim - 2)
        return jax.lax.dynamic_update_slice(buf, x[None] if lead else x, start)
    B, T = x.shape[:2]
    S = buf.shape[len(lead) + 1]
    slots = jnp.clip(offset, 0, S - T).reshape(-1, 1) + jnp.arange(T, dtype=jnp.int32)  # [B or 1, T]
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    if keep is None:
        return buf.at[(*lead, rows, slots)].set(x, unique_indices=True)
    return buf.at[(*lead, rows, jnp.where(keep, S, slots))].set(x, mode="drop", unique_indices=True)


KV_BUCKETS_FROM = 128  # shorter caches are attended whole: a switch would cost more compile time than it saves


def kv_buckets(max_len: int) -> tuple[int, ...]:
    """Key lengths the XLA attention path may be cut to: from max_len / 8 (at least 32) up to below
    max_len, the powers of two and, from 128 on, 1.5x each of them (128, 192, 256, 384, ...), then
    max_len; just max_len below KV_BUCKETS_FROM slots. A forward attends over the smallest one that
    holds every row's live keys (`kv_len`), so attention costs what the live length costs, not the
    whole canvas. The 1.5x steps cut the slots a cut attends past the live keys from up to 2x to up
    to 1.5x: SDAR dynamic at gen 512 (576 slots) runs 2.4% faster on one CPU core; each size is one
    branch of a per-layer switch that holds the attention alone, so the extra compile time is small."""
    if max_len < KV_BUCKETS_FROM:
        return (max_len,)
    sizes, n = [], 32
    while n < max_len:
        if 8 * n >= max_len:
            sizes += [m for m in ((n, 3 * n // 2) if n >= 128 else (n,)) if m < max_len]
        n *= 2
    return (*sizes, max_len)


def quantize_kv(x):
    """K or V [B, T, KV, Dh] -> (int8 values, float32 scales [B, T, KV, 1]): absmax per token and head."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8), scale


dequantize_kv = dequantize  # int8 values and their scales [..., 1] -> dtype: what every attention path reads


# --------------------------------------------------------------------------- pieces
def mm(spec: str, x, w, kernel: bool = False, **kw):
    """`jnp.einsum(spec, x, w)` at full float32 precision when an operand is float32 (XLA:GPU would
    run it in TF32 by default: a float32 model is exact on every backend), the backend's default
    (the tensor cores) for bfloat16. A `jdllm.quant.QArray` weight runs as `quant.einsum`, with
    `kernel` (see `quant_matmul_kernel`) passed on."""
    if isinstance(w, quant.QArray):  # weight-only quantized: q converted inside the dot, output channels scaled
        return quant.einsum(spec, x, w, precision=dot_precision(x.dtype, x.dtype), kernel=kernel, **kw)
    return jnp.einsum(spec, x, w, precision=dot_precision(x.dtype, w.dtype), **kw)


QUANT_MATMUL_ENV = "JDLLM_QUANT_MATMUL"
QUANT_MATMULS = ("auto", "pallas", "xla")


def quant_matmul_kernel(attn_impl) -> bool:
    """Whether a quantized weight's matmuls of a few rows run as the Pallas kernel
    (`pallas_kernels.qmatmul`: the weight read in 8 bits and converted on chip) instead of XLA's dot.

    `$JDLLM_QUANT_MATMUL`: "auto" (default) = on a GPU when the attention runs the Pallas kernels
    (attn_impl "auto" / "pallas"); "pallas" = wherever attn_impl is a name (the CPU runs the kernel
    in Pallas's interpret mode: how the tests check it); "xla" = never; anything else is a
    `jdllm.errors.QuantizationError` naming it. A mesh's attention (a
    `ShardedAttention`) keeps XLA's dot, which XLA partitions with the sharded weights."""
    how = os.environ.get(QUANT_MATMUL_ENV, "auto")
    if how not in QUANT_MATMULS:
        raise errors.QuantizationError(f"{QUANT_MATMUL_ENV}={how!r} is not one of {QUANT_MATMULS}")
    if how == "xla" or not isinstance(attn_impl, str):
        return False
    return how == "pallas" or (jax.default_backend() == "gpu" and resolve_impl(attn_impl) == "pallas")


def rms_scale(xf, eps):
    """1 / rms of float32 rows xf [..., D] -> [..., 1]: the factor `rms_norm` scales each row by."""
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * rms_scale(xf, eps)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


NORM_INTO_MATMUL_ENV = "JDLLM_NORM_INTO_MATMUL"


def norm_into_matmul(h, attn_impl) -> bool:
    """Whether `forward` folds each RMS norm into the matmul it feeds (`rms_fold`): the matmul takes
    x·w and its output is scaled by the row's 1 / rms, the same product rounded in another place.

    Why: XLA:GPU makes a single row's norm (AR at batch 1, rows = B·T = 1) a scalar reduction and a
    separate normalizing kernel, where it fuses a multi-row norm into one Triton kernel. Folded, the
    row's sum of squares comes out of the same kernel as x·w and the scale rides on the matmul's
    consumers: per layer one kernel fewer per norm, the matmuls unchanged (8B AR step, deviceless
    H100 compile: 578 -> 514 kernels; `benchmarks/RESULTS.md`). With more rows it saves nothing.

    `$JDLLM_NORM_INTO_MATMUL`: unset = on for one row on a GPU when the attention runs the Pallas
    kernels (attn_impl "auto" / "pallas"), activations not float16 (x·w could overflow where the
    normed x does not); "1" = on for every forward (how the tests check it on the CPU); "0" = off;
    anything else is a `jdllm.errors.ConfigError`."""
    forced = env_switch(NORM_INTO_MATMUL_ENV, unset=None)
    if forced is not None:
        return forced
    return (h.shape[0] * h.shape[1] == 1 and h.dtype != jnp.float16 and isinstance(attn_impl, str)
            and jax.default_backend() == "gpu" and resolve_impl(attn_impl) == "pallas")


def rms_fold(x, w, eps):
    """`rms_norm(x, w, eps)` in the two parts a matmul folds in: (x·w in x's dtype, the rows' 1 / rms
    [..., 1] in float32). `rescale(mm(x·w, W), r)` is `mm(rms_norm(x, w), W)` up to rounding."""
    xf = x.astype(jnp.float32)
    return (xf * w.astype(jnp.float32)).astype(x.dtype), rms_scale(xf, eps)


def rescale(y, r):
    """A matmul's output y [B, T, ...] scaled by its rows' r [B, T, 1] (`rms_fold`), in y's dtype."""
    r = r.reshape(r.shape[:2] + (1,) * (y.ndim - 2))
    return (y.astype(jnp.float32) * r).astype(y.dtype)


def rope_frequencies(cfg: ModelConfig) -> tuple[jax.Array, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale, per cfg.rope_scaling."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    sc = cfg.rope_scaling_dict
    kind = sc.get("rope_type", "default")
    if kind == "default" or not sc:
        return inv, 1.0
    factor = float(sc["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        lo_f, hi_f = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        lo_wl, hi_wl = old / lo_f, old / hi_f
        wl = 2 * math.pi / inv
        scaled = jnp.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wl >= hi_wl) & (wl <= lo_wl)
        return jnp.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        beta_fast, beta_slow = float(sc.get("beta_fast", 32)), float(sc.get("beta_slow", 1))

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = sc.get("attention_factor")
        if att is None:
            if sc.get("mscale") and sc.get("mscale_all_dim"):
                att = mscale(factor, sc["mscale"]) / mscale(factor, sc["mscale_all_dim"])
            else:
                att = mscale(factor)

        def corr(rot):
            return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = corr(beta_fast), corr(beta_slow)
        if sc.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - lo) / (hi - lo), 0, 1)
        extra = 1 - ramp
        inv = (inv / factor) * (1 - extra) + inv * extra
        return inv, float(att)
    raise ValueError(f"rope type {kind!r}")


def rope_tables(positions, inv_freq, scale):
    """cos and sin [B, T, 1, Dh] of the rotary angles at positions [B, T], for every layer's q and k.

    Evaluated on the Dh/2 distinct angles and then duplicated, XLA computes them once per forward;
    as cos(concatenate([ang, ang])) it fused the transcendentals into each of the 2 x layers
    rotations (every element of every head: a 512-query window's rotations took 0.76 ms per layer
    on the CPU, for ~0.1 ms of arithmetic)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    return tuple(jnp.concatenate([t, t], axis=-1)[:, :, None, :]
                 for t in (jnp.cos(ang) * scale, jnp.sin(ang) * scale))


def apply_rope(x, cos, sin):
    """x [B, T, N, Dh] rotated by `rope_tables`' cos / sin [B, T, 1, Dh] (rotate-half convention)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


# --------------------------------------------------------------------------- forward
def forward(params: Params, cfg: ModelConfig, tokens, positions, *, start, cache: KVCache | None = None,
            offset=None, attn_impl: str = "auto", return_hidden: bool = False, attn_mask=None, kv_len=None,
            logits_at=None, keep_below=None, keep_from=None, write_cache: bool = True, head: bool = True):
    """Run the window `tokens` [B, T] at absolute slots [offset, offset + T).

    positions [B, T]: RoPE positions (slot - start for left-padded rows).
    start [B]: first real slot of each row; earlier slots are padding.
    cache None: the window is the whole sequence (slots [0, T)).
    cache given: the window's K/V are written into the cache at `offset`
    (default cache.length) and it attends to cache slots [start, offset + T)
    under the model's attention kind. The returned cache keeps `length`
    unchanged: committing is the caller's decision (`cache.commit`).
    offset: one slot for the batch, or [B] (each row's window at its own slot).

    kv_len (with a cache), optional, scalar or [B]: keys at slots >= kv_len are
    invisible; default offset + T. A bidirectional model may set it past the
    window so the window also sees cached slots after it (Fast-dLLM's dual
    cache: prefix and suffix cached, only the window recomputed).

    keep_below (with a cache), optional, [B] int32: the window's K/V are not
    written at slots below it; those keys keep their cached (possibly stale)
    values, which the whole window attends to (d3LLM's approximate prefix
    cache with one window shape for rows whose cache edges differ). The
    window's queries there still run; their outputs are the caller's to ignore.
    keep_from (with a cache), optional, [B] int32: likewise for slots at or after it, so a row
    may recompute only [keep_below, keep_from) of a wider window (a row running its dual-cache
    block beside rows that refresh the whole canvas).

    write_cache (with a cache): False attends exactly as True does (the window's fresh K/V in place of
    the cached ones) but leaves the cache as it was: the window's K/V go into a copy of each layer's
    slice only (on the XLA path, of the cut of it that the attention reads). For windows whose K/V
    nobody reads later (a denoising step that the next step recomputes): inside a `lax.cond` /
    `lax.switch`, only a branch that writes the cache in place makes XLA copy the whole cache (every
    layer) on each pass, so the branches that run on most steps should not write.

    attn_mask [B, T, S] (bool), optional: replaces the masking rule (training
    objectives such as BD3-LM's noisy/clean pairing; XLA path only).

    logits_at [B, N] int32 (window positions), optional: run the LM head only
    there (logits [B, N, V]); the default is every position. Decoding asks only
    for the positions whose tokens it chooses: the head is the largest matmul
    of a small model and its output the largest buffer.

    head False: the final-normed hidden states [B, T or N, D] where the logits would be (the caller
    runs `head_logits` on them later: `jdllm.decode.common.switch_width`'s chain of conditionals).

    Returns (logits [B, T or N, V] float32, cache or None[, hidden [B, T, D]]).
    """
    B, T = tokens.shape
    cos, sin = rope_tables(positions, *rope_frequencies(cfg))  # once, for every layer
    h = quant.take_rows(params["embed"], tokens)  # [B, T, D]
    start = jnp.asarray(start, jnp.int32)

    if cache is None:
        q_offset, kv_len = 0, T
    else:
        q_offset = cache.length if offset is None else jnp.asarray(offset, jnp.int32)
        if q_offset.ndim:  # per row: clamp as the cache write does
            q_offset = jnp.clip(q_offset, 0, cache.max_len - T)
        kv_len = q_offset + T if kv_len is None else jnp.asarray(kv_len, jnp.int32)

    merge_cached = keep_below is not None or keep_from is not None  # cached K/V kept outside [below, from)
    if merge_cached:
        if q_offset.ndim:
            raise ValueError("keep_below / keep_from need one window offset for the batch")
        slots = q_offset + jnp.arange(T, dtype=jnp.int32)
        keep = jnp.zeros((B, T), bool)
        if keep_below is not None:
            keep = keep | (slots[None] < jnp.asarray(keep_below, jnp.int32).reshape(-1, 1))  # [B, T]
        if keep_from is not None:
            keep = keep | (slots[None] >= jnp.asarray(keep_from, jnp.int32).reshape(-1, 1))

        def window_of(c):  # [B, S, H, D] -> the window's slots [B, T, H, D]
            return jax.lax.dynamic_slice_in_dim(c, q_offset, T, axis=1)

    # the XLA path attends over the smallest kv_buckets length holding every row's live keys; the
    # kernels and an explicit mask bound their own key loops
    bucket, sizes = None, ()
    if cache is not None and attn_mask is None and isinstance(attn_impl, str) and resolve_impl(attn_impl) == "xla":
        sizes = kv_buckets(cache.max_len)
        if len(sizes) > 1 and not isinstance(kv_len, jax.core.Tracer):  # known now (dual cache: S): no switch
            live = int(np.max(np.asarray(kv_len)))
            sizes = (next((n for n in sizes if n >= live), sizes[-1]),)
        elif len(sizes) > 1:
            live = jnp.max(jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (B,)))
            bucket = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), live), len(sizes) - 1)

    # a window whose K/V are not written (write_cache=False), on the XLA path: each attention branch
    # copies only the cut of the layer's cache it attends to and writes the window there
    # (`attend_merged`), not the layer's whole cache (SDAR dynamic at gen 512: those copies were 5.6%
    # of the decode's time)
    merge_window = (cache is not None and not write_cache and bool(sizes) and cache.k_scale is None)
    # the Pallas kernels read layer i of the stacked cache in place (`pallas_kernels.attention(layer=)`):
    # a slice of it handed to a kernel is a copy of the layer's whole cache on every forward (an AR step
    # at 384 slots on an H100, deviceless compile: 64 copy kernels, 192 MiB moved; 16 GiB at 32k)
    in_place = attn_mask is None and isinstance(attn_impl, str) and resolve_impl(attn_impl) == "pallas"
    qk = quant_matmul_kernel(attn_impl)  # quantized weights: few-row matmuls through the Pallas kernel

    fold = norm_into_matmul(h, attn_impl)

    def normed(h, w):  # a norm's output, or its parts folded into the matmuls it feeds (`rms_fold`)
        if not fold:
            return rms_norm(h, w, cfg.rms_norm_eps), lambda y: y
        x, r = rms_fold(h, w, cfg.rms_norm_eps)
        return x, lambda y: rescale(y, r)

    def layer(carry, xs):
        h, ck, cv, sk, sv = carry  # sk / sv: an int8 cache's scales (None otherwise)
        lp, i = xs
        x, out = normed(h, lp["attn_norm"])
        if "qkv" in lp:  # fused by `unstack_layers`: one matmul, then the heads split apart
            qkv = out(mm("btd,dhk->bthk", x, lp["qkv"], qk))
            q, k, v = jnp.split(qkv, (cfg.num_heads, cfg.num_heads + cfg.num_kv_heads), axis=2)
        else:
            q, k, v = (out(mm("btd,dhk->bthk", x, lp[n], qk)) for n in ("q", "k", "v"))
        if cfg.qkv_bias:
            q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
        if "qkv" in lp and not cfg.qkv_bias and not merge_cached:
            # q's and k's heads normed and rotated as one array, the way the fused matmul returns them:
            # one kernel for both where XLA:GPU made two each (4B shape, AR: 22 kernels a layer -> 20).
            # Not where cached K is merged in (multi_block approx): there XLA then copied more per step
            nq = cfg.num_heads + cfg.num_kv_heads
            qk_heads = qkv[:, :, :nq]
            if cfg.qk_norm:
                w = jnp.concatenate([jnp.broadcast_to(lp["q_norm"], (cfg.num_heads, cfg.head_dim)),
                                     jnp.broadcast_to(lp["k_norm"], (cfg.num_kv_heads, cfg.head_dim))])
                qk_heads = rms_norm(qk_heads, w, cfg.rms_norm_eps)
            q, k = jnp.split(apply_rope(qk_heads, cos, sin), (cfg.num_heads,), axis=2)
        else:
            if cfg.qk_norm:
                q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        def attend(keys, vals, layer=None, scales=(None, None)):
            # layer: keys / vals are the stacked cache, read at that layer; scales: an int8 cache's,
            # dequantized by the attention (on chip by the Pallas kernels)
            keep_dtype = layer is not None or scales[0] is not None
            cast = (lambda x: x) if keep_dtype else (lambda x: x.astype(q.dtype))  # noqa: E731
            return attention_op(q, cast(keys), cast(vals), start=start, q_offset=q_offset,
                                kv_len=kv_len, kind=cfg.attention, block_size=cfg.block_size,
                                impl=attn_impl, mask=attn_mask, layer=layer, k_scale=scales[0], v_scale=scales[1])

        if ck is None:
            a = attend(k, v)
        else:
            if cfg.qk_norm and merge_cached:
                # K's norm apart from the merge with layer i's cached K: fused, XLA:GPU made the norm a
                # Triton kernel holding layer i's cache slice, one kernel per layer and window width
                # that it compiled anew each time (4B shape, multi_block approx, H200: a 79 s first
                # call); alone, one norm kernel serves every layer
                k = jax.lax.optimization_barrier(k)
            # on the kernels (they read the cache where it lies) the kept slots are dropped from the
            # write (`write_rows(keep=)`; an int8 cache's scales too) instead of read back and merged
            drop_kept = merge_cached and write_cache and in_place
            if merge_cached and not drop_kept:  # keep the cached K/V outside [below, from)
                if sk is None:
                    k, v = (jnp.where(keep[:, :, None, None], window_of(c[i]), x.astype(c.dtype))
                            for c, x in ((ck, k), (cv, v)))
                else:  # int8: re-quantizing a kept row gives it back
                    k, v = (jnp.where(keep[:, :, None, None], dequantize_kv(window_of(c[i]), window_of(sc[i]), x.dtype),
                                      x) for c, sc, x in ((ck, sk, k), (cv, sv, v)))
            if sk is not None:  # int8 cache: K / V written quantized, one scale per (token, KV head)
                # K and V quantized as one array: one absmax reduction where two were two kernels a layer
                kvq, kvs = quantize_kv(jnp.concatenate([k, v.astype(k.dtype)], axis=2))
                (k, v), (ks, vs) = jnp.split(kvq, 2, axis=2), jnp.split(kvs, 2, axis=2)
            if write_cache:  # the window written in place; each bucket branch cuts layer i's first slots
                kept = keep if drop_kept else None
                ck, cv = write_rows(ck, k, q_offset, layer=i, keep=kept), write_rows(cv, v, q_offset, layer=i, keep=kept)
                if sk is not None:
                    sk, sv = (write_rows(sk, ks, q_offset, layer=i, keep=kept),
                              write_rows(sv, vs, q_offset, layer=i, keep=kept))
                # the stacked arrays themselves go into the switch: XLA passes them without a copy,
                # where slicing layer i out first copied it whole (AR at gen 512: 374 of 2,416 ms of
                # XLA op time)
                operands, stacked = (ck, cv) if sk is None else (ck, cv, sk, sv), True
            elif merge_window:
                operands, stacked = (ck, cv, k, v), True
            else:  # the window's K/V go into a copy of this layer's slice only
                pairs = ((ck, k), (cv, v)) + (() if sk is None else ((sk, ks), (sv, vs)))
                operands = tuple(write_rows(jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False), x, q_offset)
                                 for c, x in pairs)
                stacked = False

            def cut(x, n):  # this layer's slots [0, n)
                return (jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False) if stacked else x)[:, :n]

            def upto(n):  # attention over this layer's cache slots [0, n)
                if merge_window:
                    return lambda ck, cv, k, v: attend_merged(n, ck, cv, k, v)
                whole = stacked and in_place and n == ck.shape[2]  # the kernel reads layer i where it lies
                if sk is None and whole:
                    return lambda kl, vl: attend(kl, vl, layer=i)
                if sk is None:
                    return lambda kl, vl: attend(cut(kl, n), cut(vl, n))
                if whole:  # an int8 cache too, its tiles scaled on chip
                    return lambda kl, vl, ks, vs: attend(kl, vl, layer=i, scales=(ks, vs))
                return lambda kl, vl, ks, vs: attend(cut(kl, n), cut(vl, n), scales=(cut(ks, n), cut(vs, n)))

            def attend_merged(n, ck, cv, k, v):
                # this layer's cached slots [0, n + T) copied and the window written there (where it
                # lies past n, at a clamped start, only keys past every row's kv_len <= n move), then
                # cut to [0, n): writing into a copy of the layer's whole cache instead cost a copy
                # of every slot per layer and step
                m = min(n + T, ck.shape[2])

                def merged(c, x):
                    return write_rows(cut(c, m), x, q_offset)[:, :n]
                return attend(merged(ck, k), merged(cv, v))

            if bucket is None:
                a = upto(sizes[0] if sizes else ck.shape[2])(*operands)
            else:
                a = jax.lax.switch(bucket, [upto(n) for n in sizes], *operands)
        h = h + mm("bthk,hkd->btd", a, lp["o"], qk)
        x, out = normed(h, lp["mlp_norm"])
        if "gate_up" in lp:
            g, u = jnp.split(out(mm("btd,df->btf", x, lp["gate_up"], qk)), 2, axis=-1)
        else:
            g, u = (out(mm("btd,df->btf", x, lp[n], qk)) for n in ("gate", "up"))
        h = h + mm("btf,fd->btd", jax.nn.silu(g) * u, lp["down"], qk)
        return (h, ck, cv, sk, sv), None

    ck, cv = (None, None) if cache is None else (cache.k, cache.v)
    sk, sv = (None, None) if cache is None else (cache.k_scale, cache.v_scale)
    if isinstance(params["layers"], (tuple, list)):  # one weight dict per layer (`unstack_layers`)
        # One trace of the layer for all of them: a jitted body called per layer (XLA inlines the
        # calls, so the program is the straight-line one), traced and lowered once instead of once
        # per layer. Tracing and lowering are Python work paid on every new trace, before the
        # persistent cache is consulted; a Pallas Mosaic GPU kernel lowers in ~0.3 s per call site.
        # Only under a trace: called eagerly, a jitted body would compile once per `forward` call.
        once = _TRACE_LAYER_ONCE and isinstance(h, jax.core.Tracer)
        body = jax.jit(layer) if once else layer
        for i, lp in enumerate(params["layers"]):
            (h, ck, cv, sk, sv), _ = body((h, ck, cv, sk, sv), (lp, np.int32(i) if once else i))
    else:
        idx = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (h, ck, cv, sk, sv), _ = jax.lax.scan(layer, (h, ck, cv, sk, sv), (params["layers"], idx))

    def at_logits(h):  # the rows the LM head reads
        return h if logits_at is None else jnp.take_along_axis(h, jnp.asarray(logits_at, jnp.int32)[..., None], axis=1)

    if fold and head and not return_hidden:  # the final norm folded into the LM head (its float32 logits scaled)
        x, out = normed(at_logits(h), params["final_norm"])
        logits = out(lm_head(params, cfg, x, kernel=qk))
    else:
        h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
        hs = at_logits(h)
        logits = lm_head(params, cfg, hs, kernel=qk) if head else hs
    new_cache = None if cache is None else dataclasses.replace(cache, k=ck, v=cv, k_scale=sk, v_scale=sv)
    if return_hidden:
        return logits, new_cache, h
    return logits, new_cache


_TRACE_LAYER_ONCE = True  # see `forward`: per-layer weights share one traced layer body


def unstack_layers(params: Params, fuse: bool = True) -> Params:
    """params with `layers` as a tuple of per-layer weight dicts (the per-layer layout): `forward`
    then runs the layers as straight-line code over arrays it reads in place, instead of a
    `lax.scan` whose slices XLA copies out of the stacked arrays on every pass (a dynamic-slice per
    weight per step: ~20% of an AR step on the CPU, 2.5-3x the weight-read floor on an H100).

    `jdllm.load` and `Model.random` return this layout, built once outside any jit; called inside
    a jit on stacked params (`loop.layers_for`), the slices are a second copy of the weights.

    fuse: also concatenate each layer's q / k / v projections into one `qkv` [D, H + 2 KV, Dh] and
    gate / up into one `gate_up` [D, 2 F] (`fuse_projections`), so a layer runs 4 matmuls instead
    of 7. `stack_layers` is the inverse (the checkpoint layout: stacked, separate)."""
    if isinstance(params["layers"], (tuple, list)):
        return params
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    layers = tuple(jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(n))
    return dict(params, layers=tuple(fuse_projections(lp) for lp in layers) if fuse else layers)


def stack_layers(params: Params, cfg: ModelConfig | None = None) -> Params:
    """The stacked layout (what checkpoints store and `param_specs` describes: each layer weight
    [layers, ...], q / k / v and gate / up separate) of params in either layout; a no-op on
    stacked params. cfg is needed only to split a fused `qkv` whose heads it cannot infer."""
    if not isinstance(params["layers"], (tuple, list)):
        return params
    layers = [split_projections(lp, cfg) for lp in params["layers"]]
    stacked = {k: quant.stack([lp[k] for lp in layers]) for k in layers[0]}
    return dict(params, layers=stacked)


def layer_layout(params: Params) -> str:
    """'stacked' (one [layers, ...] array per weight, run through lax.scan), 'per_layer' (one dict
    per layer) or 'per_layer_fused' (per layer, q/k/v and gate/up fused)."""
    layers = params["layers"]
    if not isinstance(layers, (tuple, list)):
        return "stacked"
    return "per_layer_fused" if layers and "qkv" in layers[0] else "per_layer"


def to_layout(params: Params, cfg: ModelConfig, layout: str, *, shardings=None, consume: bool = False) -> Params:
    """params (any layout) in `layout`, converted eagerly (outside jit), one weight at a time.

    shardings: the target layout's shardings (`Placement.param_shardings(cfg, layout)`), else each
    new array stays where its source lives. consume: delete each source array once it is
    converted (the caller owns them), so converting a loaded model peaks at the model plus one
    stacked weight, never two copies of it. Arrays the conversion creates and then fuses are
    always freed."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    have = layer_layout(params)
    if have == layout and shardings is None:
        return params

    def place(x, path):
        if shardings is None:
            return x
        s = shardings
        for k in path:
            s = s[k]
        if isinstance(x, quant.QArray):  # q as the weight, its scale along the same output axes
            return quant.put(x, s)
        return x if getattr(x, "sharding", None) == s else jax.device_put(x, s)

    def drop(x):
        if consume and isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()

    out = {k: place(v, (k,)) for k, v in params.items() if k != "layers"}
    if consume:
        for k, v in params.items():
            if k != "layers" and out[k] is not v:
                drop(v)
    if layout == "stacked":
        stacked = stack_layers(params, cfg)["layers"]
        out["layers"] = {k: place(v, ("layers", k)) for k, v in stacked.items()}
        return out
    if have == "stacked":
        L = cfg.num_layers
        layers: list[dict] = [{} for _ in range(L)]
        for name in list(params["layers"]):
            x = params["layers"][name]
            for i in range(L):
                layers[i][name] = x[i]
            drop(x)
    else:
        layers = [split_projections(lp, cfg) if layout == "per_layer" else dict(lp) for lp in params["layers"]]
    for i, lp in enumerate(layers):
        if layout == "per_layer_fused" and "qkv" not in lp:
            lp = fuse_projections(lp)  # the unfused slices are freed with their last reference
        layers[i] = {k: place(v, ("layers", i, k)) for k, v in lp.items()}
    if consume and have != "stacked":
        kept = {id(y) for y in jax.tree.leaves(layers)}
        for x in jax.tree.leaves(params["layers"]):
            if id(x) not in kept:
                drop(x)
    out["layers"] = tuple(layers)
    return out


def weight(params: Params, path: tuple[str, ...], layer: int | None, cfg: ModelConfig):
    """One weight from params in any layout: `path` as in the stacked layout (("embed",),
    ("layers", "q"), ...) and the layer index for layer weights (a fused `qkv` / `gate_up` is sliced)."""
    x = params
    if path[0] != "layers":
        for k in path:
            x = x[k]
        return x
    name, layers = path[1], params["layers"]
    if not isinstance(layers, (tuple, list)):
        return layers[name][layer]
    lp = layers[layer]
    return lp[name] if name in lp else split_projections(lp, cfg)[name]


def default_layout(placement=None) -> str:
    """The layout jdllm runs: per layer and fused, unless the placement splits attention heads or
    MLP columns over devices (a fused array split by rows would mix q, k and v heads): then per
    layer, unfused."""
    if placement is not None and not placement.fuses_projections():
        return "per_layer"
    return "per_layer_fused"


def fuse_projections(lp: Params) -> Params:
    """One layer's weights with q / k / v as one `qkv` (heads concatenated) and gate / up as one
    `gate_up` (columns concatenated); `forward` splits the products. Fewer, wider matmuls: on one
    CPU thread a small-M matmul pays a fixed cost per call (see benchmarks/RESULTS.md), on a GPU a
    kernel launch."""
    lp = dict(lp)
    lp["qkv"] = quant.concat([lp.pop("q"), lp.pop("k"), lp.pop("v")], axis=1)
    lp["gate_up"] = quant.concat([lp.pop("gate"), lp.pop("up")], axis=1)
    return lp


def split_projections(lp: Params, cfg: ModelConfig | None = None) -> Params:
    """The inverse of `fuse_projections` (a no-op on an unfused layer). The q / kv head split of a
    fused `qkv` comes from cfg, or from the q / k norms' or biases' shapes when cfg is None."""
    lp = dict(lp)
    if "qkv" in lp:
        qkv = lp.pop("qkv")
        if cfg is not None:
            H, KV = cfg.num_heads, cfg.num_kv_heads
        elif "k_bias" in lp:
            KV = lp["k_bias"].shape[0]
            H = qkv.shape[1] - 2 * KV
        else:
            raise ValueError("stack_layers: a fused qkv needs cfg to split its heads")
        lp["q"], lp["k"], lp["v"] = qkv[:, :H], qkv[:, H:H + KV], qkv[:, H + KV:]
    if "gate_up" in lp:
        g = lp.pop("gate_up")
        F = g.shape[1] // 2
        lp["gate"], lp["up"] = g[:, :F], g[:, F:]
    return lp


def lm_head(params: Params, cfg: ModelConfig, h, kernel: bool = False) -> jax.Array:
    """Final-norm hidden states [..., D] -> float32 logits [..., V]."""
    if cfg.tie_word_embeddings:
        return mm("...d,vd->...v", h, params["embed"], kernel, preferred_element_type=jnp.float32)
    return mm("...d,dv->...v", h, params["lm_head"], kernel, preferred_element_type=jnp.float32)


def head_logits(params: Params, cfg: ModelConfig, hs, attn_impl="auto") -> jax.Array:
    """The LM head of `forward` on the final-normed hidden states `forward(head=False)` returns ->
    float32 logits [..., V] (the same matmul, the same kernel choice)."""
    return lm_head(params, cfg, hs, kernel=quant_matmul_kernel(attn_impl))


def predicts_next(cfg: ModelConfig) -> int:
    """1 when the logits at slot p predict the token at p + 1 (causal LMs, Dream, Fast-dLLM v2), else 0."""
    return int(cfg.logit_shift or cfg.attention == "causal")


def teacher_forced_hidden(params, cfg, tokens, start, attn_impl: str = "xla"):
    """[B, S, D]: the hidden state that predicts each slot of `tokens` [B, S] (slot p from p - 1; rows
    start at `start` [B]) in one causal forward; `lm_head` of it gives the teacher-forced logits."""
    B, S = tokens.shape
    pos = default_positions(start, 0, S)
    at = jnp.zeros((B, 1), jnp.int32)
    _, _, h = forward(params, cfg, tokens, pos, start=start, attn_impl=attn_impl, return_hidden=True,
                      logits_at=at)
    src = jnp.clip(jnp.arange(S) - 1, 0, S - 1)
    return h[:, src]  # slot p is predicted at p - 1


def aligned_logits(logits, cfg: ModelConfig, prev_last=None):
    """Logits that predict the token *at* each position, [B, T, V].

    Same-position models return `logits` unchanged. Shifted models (Dream,
    Fast-dLLM v2) predict position p from p - 1: the window's logits move right
    by one and `prev_last` [B, V] (the logits of the slot before the window)
    fills position 0 (zeros when absent).
    """
    if not cfg.logit_shift:
        return logits
    if prev_last is None:
        prev_last = jnp.zeros_like(logits[:, 0])
    return jnp.concatenate([prev_last[:, None], logits[:, :-1]], axis=1)


def default_positions(start, offset: int | jax.Array, T: int):
    """RoPE positions [B, T] of slots [offset, offset + T) for rows starting at `start`.

    offset: one slot for the batch or [B]."""
    offset = jnp.asarray(offset, jnp.int32)
    base = offset[:, None] if offset.ndim else offset
    slots = base + jnp.arange(T, dtype=jnp.int32)
    return jnp.maximum(slots - jnp.asarray(start, jnp.int32)[:, None], 0)
