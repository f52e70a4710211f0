"""Attention for jdllm: one masking rule, several implementations.

`attention(q, k, v, start=..., q_offset=..., kv_len=..., kind=..., block_size=...,
impl=...)` is the single entry point the model calls. `impl`:

- "xla": the reference in `reference.py` (any backend);
- "pallas": the Pallas flash kernels: on Hopper (H100/H200) the prefill
  forward runs the Mosaic GPU kernel of `mosaic.py` (wgmma + TMA) and the rest
  the Triton lowering of `flash.py` / `backward.py`; the Triton lowering on other
  NVIDIA GPUs; `interpret=True` on the CPU. `JDLLM_PALLAS_BACKEND` (one of
  `flash.BACKENDS`) overrides that choice;
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` with the mask
  as a boolean mask (a GPU baseline);
- "auto": "pallas" on a GPU, "xla" elsewhere;
- a `ShardedAttention` (what `jdllm.sharding.Placement.attention_impl` builds
  for a device mesh): the kernel above per shard, under `shard_map` over the
  batch and head axes of the mesh (the XLA path needs no wrapper: XLA
  partitions it itself).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.reference import (KINDS, SMALL_WINDOW, attention_reference, dequantize, horizon,
                                      masked_attention_reference, visible_mask, window_reference)

IMPLS = ("auto", "xla", "pallas", "cudnn")


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """Run attention `impl` ("pallas" | "cudnn") per shard of `mesh`: rows split over mesh axis
    `batch`, query heads over `heads` and KV heads over `kv_heads` (None: not split).

    Hashable, so it rides as a jit static argument in place of an impl string.
    With `heads` split and `kv_heads` not (more model shards than KV heads), each
    shard takes the KV heads its query heads read (GQA groups are contiguous).
    """

    impl: str
    mesh: Any
    batch: Any = None
    heads: Any = None
    kv_heads: Any = None

    def __call__(self, q, k, v, *, start, q_offset, kv_len, kind, block_size, scale):

        B, H, KV = q.shape[0], q.shape[2], k.shape[2]
        q_offset, kv_len = jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_len, jnp.int32)
        # an axis that does not divide (a batch of 1 on 2 data shards) is not split here
        batch = self.batch if B % _axis_size(self.mesh, self.batch) == 0 else None
        heads, kv_heads = self.heads, self.kv_heads
        if H % _axis_size(self.mesh, heads) or KV % _axis_size(self.mesh, kv_heads):
            heads = kv_heads = None
        row = P(batch)
        qspec = P(batch, None, heads, None)
        kvspec = P(batch, None, kv_heads, None)
        n_heads, n_kv = _axis_size(self.mesh, heads), _axis_size(self.mesh, kv_heads)
        h_local = H // n_heads

        def local(q, k, v, start, qo, kl):
            if n_kv < n_heads and KV > 1:  # KV heads replicated over part of `heads`: keep the ones read
                group = H // KV  # query heads per KV head
                first = jax.lax.axis_index(heads) * h_local // group
                need = max(1, h_local // group)
                k = jax.lax.dynamic_slice_in_dim(k, first % k.shape[2], need, axis=2)
                v = jax.lax.dynamic_slice_in_dim(v, first % v.shape[2], need, axis=2)
            return attention(q, k, v, start=start, q_offset=qo, kv_len=kl, kind=kind, block_size=block_size,
                             scale=scale, impl=self.impl)  # the unsharded dispatch, on this shard

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(qspec, kvspec, kvspec, row, row if q_offset.ndim else P(),
                                     row if kv_len.ndim else P()),
                           out_specs=qspec, check_vma=False)
        return fn(q, k, v, jnp.asarray(start, jnp.int32), q_offset, kv_len)


def _axis_size(mesh, axis) -> int:

    if axis is None:
        return 1
    return math.prod(mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))


def resolve_impl(impl) -> str:
    if isinstance(impl, ShardedAttention):
        return impl.impl
    if impl not in IMPLS:
        raise ValueError(f"attention impl={impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def _cudnn(q, k, v, *, start, q_offset, kv_len, kind, block_size, scale):
    B, T, H, D = q.shape
    S = k.shape[1]
    mask = visible_mask(T, S, start=start, q_offset=q_offset, kv_len=kv_len,
                        kind=kind, block_size=block_size)[:, None]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale,
                                        implementation="cudnn")


def attention(q, k, v, *, start, q_offset=0, kv_len=None, kind="causal", block_size=1,
              scale=None, impl="auto", mask=None, layer=None, k_scale=None, v_scale=None):
    """q [B, T, H, D], k/v [B, S, KV, D], start [B] -> [B, T, H, D].

    Query t sits at absolute slot q_offset + t; keys at slots >= kv_len are
    ignored (kv_len defaults to S). `mask` [B, T, S] (bool) replaces the rule
    outright; it exists for training objectives whose masks the rule cannot
    express (BD3-LM's noisy/clean pairing) and always runs on the XLA path.

    layer (an int32 scalar, traced or not): k / v are a stacked KV cache [L, B, S, KV, D] and the
    keys are its layer `layer`: the Pallas kernels read it in place (`flash.attention`), where a
    slice handed to a kernel is a copy of the layer's cache on every call; the other
    implementations take the slice.

    k_scale / v_scale (float32 [B, S, KV, 1], stacked [L, ...]): k / v are an int8 KV cache. The
    Pallas kernels read it as int8 and scale on chip (`flash.attention`); the other
    implementations (and a mesh's `ShardedAttention`) take it dequantized to q's dtype.
    """
    pallas = mask is None and not isinstance(impl, ShardedAttention) and resolve_impl(impl) == "pallas"
    if not pallas:  # the other paths take layer `layer`'s slice, an int8 cache dequantized to q's dtype
        if layer is not None:
            def at(x):
                return None if x is None else jax.lax.dynamic_index_in_dim(x, jnp.asarray(layer, jnp.int32), 0,
                                                                            keepdims=False)
            k, v, k_scale, v_scale, layer = at(k), at(v), at(k_scale), at(v_scale), None
        if k_scale is not None:
            k, v, k_scale, v_scale = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype), None, None
    if mask is not None:
        return masked_attention_reference(q, k, v, mask, scale=scale)
    if kind not in KINDS:
        raise ValueError(f"attention kind {kind!r} is not one of {KINDS}")
    if kv_len is None:
        kv_len = k.shape[-3]
    kw = dict(start=jnp.asarray(start, jnp.int32), q_offset=q_offset, kv_len=kv_len,
              kind=kind, block_size=block_size, scale=scale)
    if isinstance(impl, ShardedAttention):
        return impl(q, k, v, **kw)
    impl = resolve_impl(impl)
    if impl == "xla":  # one-query windows (AR steps) without the reference's transposed cache copy
        return (window_reference if q.shape[1] <= SMALL_WINDOW else attention_reference)(q, k, v, **kw)
    if impl == "cudnn":
        return _cudnn(q, k, v, **kw)
    from pallas_kernels import flash  # noqa: PLC0415 (imported only when asked for)
    return flash.attention(q, k, v, **kw, layer=layer, k_scale=k_scale, v_scale=v_scale)


__all__ = ["attention", "ShardedAttention", "attention_reference", "dequantize", "visible_mask", "horizon", "resolve_impl",
           "KINDS", "IMPLS"]
