"""Training objectives: autoregressive, masked-diffusion (LLaDA) and block-diffusion (BD3-LM / SDAR).

Pure functions of (params, cfg, batch[, key]) -> scalar loss, so they drop
into `jax.value_and_grad` and an optax update. Every objective takes the same
batch layout:

    tokens [B, T] int32   left-padded rows: [pad ... | prompt | answer ...]
    target [B, T] bool    positions the model must learn (the answer part);
                          prompt and padding are given and never noised
    start  [B]    int32   first real slot of each row (RoPE positions are
                          slot - start, as at inference)

The diffusion objectives noise only `target` positions, so the model learns
prompt -> answer. `loss_for(cfg)` picks the objective that matches the
model's attention kind.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jdllm import errors
from jdllm.config import ModelConfig
from jdllm.model import Params, aligned_logits, default_positions, forward


def _token_ce(logits, tokens):
    """Cross-entropy of `tokens` [B, T] under `logits` [B, T, V] -> [B, T] float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def ar_loss(params: Params, cfg: ModelConfig, tokens, target, start, key=None):
    """Next-token cross-entropy over target positions (mean per target token).

    The logit at slot p predicts the token at p + 1; `key` is unused (kept so
    every objective has one signature).
    """
    del key
    B, T = tokens.shape
    pos = default_positions(start, 0, T)
    logits, _ = forward(params, cfg, tokens, pos, start=start, attn_impl="xla")  # [B, T, V]
    ce = _token_ce(logits[:, :-1], tokens[:, 1:])  # [B, T-1]
    w = target[:, 1:].astype(jnp.float32)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def _uniform(key, shape, low_discrepancy: bool):
    """U(0, 1) draws; low_discrepancy spreads them evenly: (u + i / n) mod 1 (MDLM's sampler)."""
    if not low_discrepancy:
        return jax.random.uniform(key, shape)
    n = math.prod(shape)
    k_u, k_p = jax.random.split(key)
    t = jnp.mod(jax.random.uniform(k_u, ()) + jnp.arange(n, dtype=jnp.float32) / n, 1.0)
    return jax.random.permutation(k_p, t).reshape(shape)


def mask_noise(key, tokens, target, mask_id: int, *, eps: float = 1e-3, block_size: int | None = None,
               low_discrepancy: bool = False):
    """Replace target tokens by `mask_id` with probability p = (1 - eps) * t + eps.

    t ~ U(0, 1) per sequence (LLaDA), or per block of `block_size` slots when
    given (BD3-LM: each block its own noise level); `low_discrepancy` stratifies
    the draws over the batch (same expectation, lower variance of the 1/t
    weighted loss). Returns (noisy [B, T], masked [B, T] bool, p_mask [B, T] float32).
    """
    B, T = tokens.shape
    k_t, k_m = jax.random.split(key)
    if block_size is None:
        t = _uniform(k_t, (B, 1), low_discrepancy)
        t = jnp.broadcast_to(t, (B, T))
    else:
        nb = -(-T // block_size)
        t = _uniform(k_t, (B, nb), low_discrepancy)
        t = jnp.repeat(t, block_size, axis=1)[:, :T]
    p_mask = (1.0 - eps) * t + eps  # [B, T]
    masked = (jax.random.uniform(k_m, (B, T)) < p_mask) & target
    noisy = jnp.where(masked, jnp.asarray(mask_id, tokens.dtype), tokens)
    return noisy, masked, p_mask


def _weighted_masked_ce(logits, tokens, masked, p_mask, target):
    """LLaDA's normalisation: per row, sum(CE / p_mask over masked) / #target; mean over rows."""
    ce = _token_ce(logits, tokens)  # [B, T]
    per_row = jnp.sum(jnp.where(masked, ce / p_mask, 0.0), axis=1)
    n_target = jnp.maximum(jnp.sum(target, axis=1).astype(jnp.float32), 1.0)
    return jnp.mean(per_row / n_target)


def _require_mask_id(cfg: ModelConfig) -> int:
    if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise errors.ConfigError(
            f"mask_token_id={cfg.mask_token_id} must be a token id in [0, {cfg.vocab_size}) "
            "for a diffusion objective; set it in the model config")
    return int(cfg.mask_token_id)


def masked_diffusion_loss(params: Params, cfg: ModelConfig, tokens, target, start, key, *, eps: float = 1e-3,
                          low_discrepancy: bool = False):
    """LLaDA SFT loss for bidirectional models: mask target tokens at ratio t, CE on them weighted by 1/t."""
    mask_id = _require_mask_id(cfg)
    B, T = tokens.shape
    noisy, masked, p_mask = mask_noise(key, tokens, target, mask_id, eps=eps, low_discrepancy=low_discrepancy)
    pos = default_positions(start, 0, T)
    logits, _ = forward(params, cfg, noisy, pos, start=start, attn_impl="xla")
    logits = aligned_logits(logits, cfg)  # shifted families predict p from p - 1
    return _weighted_masked_ce(logits, tokens, masked, p_mask, target)


def bd3lm_attention_mask(T: int, block_size: int, start, end=None) -> jax.Array:
    """BD3-LM mask [B, 2T, 2T] over the sequence [x_noisy ; x_clean] (bool, True = visible).

    Slot s of either copy is in block s // block_size. Noisy block i sees all of
    noisy block i and clean blocks < i; clean block j sees clean blocks <= j
    (block-causal). Keys before `start[b]` (left padding) are hidden in both copies, and with `end`
    [B] keys from `end[b]` on (right padding: a last block that the row fills only in part).
    """
    s = jnp.arange(T, dtype=jnp.int32)
    blk = s // block_size  # [T]
    qb, kb = blk[:, None], blk[None, :]  # [T, 1], [1, T]
    noisy_noisy = qb == kb
    noisy_clean = kb < qb
    clean_noisy = jnp.zeros((T, T), bool)
    clean_clean = kb <= qb
    m = jnp.block([[noisy_noisy, noisy_clean], [clean_noisy, clean_clean]])  # [2T, 2T]
    valid = s[None, :] >= jnp.asarray(start, jnp.int32)[:, None]  # [B, T]
    if end is not None:
        valid = valid & (s[None, :] < jnp.asarray(end, jnp.int32)[:, None])
    valid2 = jnp.concatenate([valid, valid], axis=1)  # [B, 2T]
    return m[None] & valid2[:, None, :]


def block_diffusion_forward(params: Params, cfg: ModelConfig, noisy, clean, start, end=None, logits_at=None):
    """Logits [B, T, V] of the noisy copy under the BD3-LM mask (one pass over [noisy ; clean]).

    Equal to denoising each noisy block with the clean earlier blocks as
    context under the block-causal rule, which is what inference does. `end` [B]: right padding
    from there on is hidden; `logits_at` [B, N] (slots of the noisy copy): the LM head only there
    (logits [B, N, V]).
    """
    B, T = clean.shape
    pos = default_positions(start, 0, T)
    both = jnp.concatenate([noisy, clean], axis=1)  # [B, 2T]
    pos2 = jnp.concatenate([pos, pos], axis=1)  # same RoPE positions in both copies
    mask = bd3lm_attention_mask(T, cfg.block_size, start, end)
    logits, _ = forward(params, cfg, both, pos2, start=start, attn_mask=mask, attn_impl="xla", logits_at=logits_at)
    return logits if logits_at is not None else logits[:, :T]


def block_diffusion_loss(params: Params, cfg: ModelConfig, tokens, target, start, key, *, eps: float = 1e-3,
                         low_discrepancy: bool = False):
    """SDAR / BD3-LM loss for block-causal models: per-block mask ratio t, CE on masked tokens weighted by 1/t."""
    mask_id = _require_mask_id(cfg)
    if cfg.attention != "block_causal":
        raise errors.ConfigError(f"block_diffusion_loss needs a block_causal model, got attention={cfg.attention!r}")
    noisy, masked, p_mask = mask_noise(key, tokens, target, mask_id, eps=eps, block_size=cfg.block_size,
                                       low_discrepancy=low_discrepancy)
    logits = aligned_logits(block_diffusion_forward(params, cfg, noisy, tokens, start), cfg)
    return _weighted_masked_ce(logits, tokens, masked, p_mask, target)


def loss_for(cfg: ModelConfig):
    """The objective matching `cfg.attention`: causal -> AR, block_causal -> BD3-LM, bidirectional -> LLaDA."""
    return {"causal": ar_loss, "block_causal": block_diffusion_loss,
            "bidirectional": masked_diffusion_loss}[cfg.attention]
