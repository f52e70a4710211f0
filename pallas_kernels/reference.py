"""XLA reference attention with jdllm's one masking rule.

A query of row b at absolute slot p (p = q_offset[b] + t) sees key slot s iff

    start[b] <= s < min(horizon(p), kv_len[b])

with horizon(p) = p + 1 (causal), (p // block_size + 1) * block_size
(block_causal) or kv_len (bidirectional). `start` skips left padding; keys at
or past `kv_len` are stale cache slots. q_offset and kv_len may be one value
for the batch or one per row (rows at their own positions). Every Pallas
kernel is tested against this function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import dot_precision

KINDS = ("causal", "block_causal", "bidirectional")


def dequantize(x, scale, dtype):
    """An int8 KV cache's values x with their float32 scales [..., 1], in `dtype`."""
    return (x.astype(jnp.float32) * scale).astype(dtype)


def horizon(p: jax.Array, kind: str, block_size: int, kv_len) -> jax.Array:
    """Exclusive key bound of query slot(s) `p`, before clipping to kv_len."""
    if kind == "causal":
        return p + 1
    if kind == "block_causal":
        return (p // block_size + 1) * block_size
    if kind == "bidirectional":
        return jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), jnp.shape(p))
    raise ValueError(f"attention kind {kind!r} is not one of {KINDS}")


def visible_mask(T: int, S: int, *, start, q_offset, kv_len, kind: str, block_size: int):
    """Boolean [B, T, S]: may query t of row b attend to key slot s.

    start is [B]; q_offset and kv_len are scalars (shared by the batch) or [B]
    (each row at its own position).
    """
    start = jnp.asarray(start, jnp.int32)
    qoff = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), start.shape)  # [B]
    kvl = jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), start.shape)  # [B]
    p = qoff[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    s = jnp.arange(S, dtype=jnp.int32)  # [S]
    end = jnp.minimum(horizon(p, kind, block_size, kvl[:, None]), kvl[:, None])  # [B, T]
    return (s[None, None, :] < end[:, :, None]) & (s[None, None, :] >= start[:, None, None])


def attention_reference(q, k, v, *, start, q_offset=0, kv_len=None, kind="causal",
                        block_size=1, scale=None):
    """q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D] in q's dtype.

    Scores and softmax in float32. A query row that sees no key returns zeros.
    """
    T, S = q.shape[1], k.shape[1]
    if kv_len is None:
        kv_len = S
    mask = visible_mask(T, S, start=start, q_offset=q_offset, kv_len=kv_len,
                        kind=kind, block_size=block_size)  # [B, T, S]
    return masked_attention_reference(q, k, v, mask, scale=scale)


def masked_attention_reference(q, k, v, mask, *, scale=None):
    """Attention under an explicit boolean mask [B, T, S] (True = visible).

    Both products run as dots batched over (row, kv head) on head-major operands ([B, KV, G * T, D]
    queries, [B, KV, S, D] keys and values: one transposed copy of each, S x KV x D), so the scores
    come out [B, KV, G, T, S] with the keys minor. Written as one einsum over the slot-major cache,
    XLA:CPU laid the scores out keys-major and transposed them again in each of the mask, exp and
    normalise passes: 2-3x the time of the whole attention at T = 32-512 queries."""
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    G = H // KV
    scale = D ** -0.5 if scale is None else scale
    prec = dot_precision(q.dtype, k.dtype)  # float32: exact on every backend (no TF32)
    qh = q.reshape(B, T, KV, G, D).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, D)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KV, S, D]
    batch = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(qh, kh, (((3,), (3,)), batch), precision=prec,
                                 preferred_element_type=jnp.float32) * scale  # [B, KV, G * T, S]
    p, denom = _masked_exp(scores.reshape(B, KV, G, T, S), mask[:, None, None], axis=-1)
    out = jax.lax.dot_general(p.reshape(B, KV, G * T, S).astype(v.dtype), vh, (((3,), (2,)), batch),
                              precision=prec, preferred_element_type=jnp.float32)  # [B, KV, G * T, D]
    out = out / denom.reshape(B, KV, G * T, 1)  # normalised after the dot (flash attention's order)
    return out.reshape(B, KV, G, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q.dtype)


def _masked_softmax(scores, mask, axis: int):
    """Softmax of float32 `scores` over `axis` where `mask` (broadcastable) is True; zeros where a
    query sees no key."""
    p, denom = _masked_exp(scores, mask, axis)
    return p / denom


def _masked_exp(scores, mask, axis: int):
    """The softmax's numerator and denominator: exp(scores - the row's max) where `mask` is True and
    exactly 0 elsewhere (exp(-inf)), and the row sums (1 for a row that sees no key, whose
    numerators are all 0). Dividing after the values' dot costs T x D divisions, not a pass over
    the T x S probabilities."""
    scores = jnp.where(mask, scores, -jnp.inf)
    mx = jnp.max(scores, axis=axis, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(mx), mx, 0.0))
    denom = jnp.sum(p, axis=axis, keepdims=True)
    return p, jnp.where(denom == 0, 1.0, denom)


SMALL_WINDOW = 1  # the XLA path attends windows of at most this many queries through `window_reference`


def window_reference(q, k, v, *, start, q_offset=0, kv_len=None, kind="causal", block_size=1, scale=None):
    """`attention_reference` (same rule, float32 scores and softmax) for a window of a few queries,
    as two matmuls batched over rows only. q [B, T, H, D], k/v [B, S, KV, D] -> [B, T, H, D].

    The reference's dots batch over (row, kv head), so XLA:CPU first copies the keys and values
    to [B, KV, S, D] / [B, KV, D, S] and then runs B x KV matrix-vector products (an AR step:
    T = 1). Here the keys are read where they lie, as [B, S, KV * D]: the queries go in a
    block-diagonal [B, KV * D, T * H] (head h's D entries in its kv head's rows, zeros
    elsewhere), one dot gives every head's scores, and the values' dot gives [B, T * H, KV * D]
    of which each head keeps its kv head's D columns. KV times the attention's arithmetic (small
    next to the projections when T * KV is), no transposed copy of the cache."""
    B, T, H, D = q.shape
    S, KV = k.shape[1], k.shape[2]
    G = H // KV
    scale = D ** -0.5 if scale is None else scale
    mask = visible_mask(T, S, start=start, q_offset=q_offset, kv_len=S if kv_len is None else kv_len,
                        kind=kind, block_size=block_size)  # [B, T, S]
    eye = jnp.eye(KV, dtype=jnp.float32)
    qg = q.reshape(B, T, KV, G, D).astype(jnp.float32) * scale
    prec = dot_precision(q.dtype, k.dtype)  # float32 inputs: exact on every backend (no TF32)
    qbd = jnp.einsum("btkgd,kj->bjdtkg", qg, eye, precision=prec).reshape(B, KV * D, T * H)  # block-diagonal queries
    scores = jnp.einsum("bsc,bch->bsh", k.reshape(B, S, KV * D).astype(jnp.float32), qbd,
                        precision=prec)  # [B, S, T * H]
    m = mask.transpose(0, 2, 1)[..., None]  # [B, S, T, 1]
    p = _masked_softmax(scores.reshape(B, S, T, H), m, axis=1).reshape(B, S, T * H)
    full = jnp.einsum("bsh,bsc->bhc", p, v.reshape(B, S, KV * D).astype(jnp.float32),
                      precision=prec)  # [B, T * H, KV * D]
    out = jnp.einsum("btkgjd,kj->btkgd", full.reshape(B, T, KV, G, KV, D), eye, precision=prec)  # own kv head
    return out.reshape(B, T, H, D).astype(q.dtype)
