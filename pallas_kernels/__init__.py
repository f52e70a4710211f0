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
- "auto": "pallas" on a GPU, "xla" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import (KINDS, attention_reference, horizon, masked_attention_reference,
                                      visible_mask)

IMPLS = ("auto", "xla", "pallas", "cudnn")


def resolve_impl(impl: str) -> str:
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
              scale=None, impl="auto", mask=None):
    """q [B, T, H, D], k/v [B, S, KV, D], start [B] -> [B, T, H, D].

    Query t sits at absolute slot q_offset + t; keys at slots >= kv_len are
    ignored (kv_len defaults to S). `mask` [B, T, S] (bool) replaces the rule
    outright; it exists for training objectives whose masks the rule cannot
    express (BD3-LM's noisy/clean pairing) and always runs on the XLA path.
    """
    if mask is not None:
        return masked_attention_reference(q, k, v, mask, scale=scale)
    if kind not in KINDS:
        raise ValueError(f"attention kind {kind!r} is not one of {KINDS}")
    if kv_len is None:
        kv_len = k.shape[1]
    impl = resolve_impl(impl)
    kw = dict(start=jnp.asarray(start, jnp.int32), q_offset=q_offset, kv_len=kv_len,
              kind=kind, block_size=block_size, scale=scale)
    if impl == "xla":
        return attention_reference(q, k, v, **kw)
    if impl == "cudnn":
        return _cudnn(q, k, v, **kw)
    from pallas_kernels import flash  # noqa: PLC0415 (imported only when asked for)
    return flash.attention(q, k, v, **kw)


__all__ = ["attention", "attention_reference", "visible_mask", "horizon", "resolve_impl",
           "KINDS", "IMPLS"]
