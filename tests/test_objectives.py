"""Training objectives: finite, trainable, and the BD3-LM mask means what inference assumes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdllm import errors, objectives
from jdllm.config import ModelConfig
from jdllm.model import default_positions, forward, init_params
from tests.quick import slow

V, MASK = 24, 2


def _cfg(attention: str, block_size: int = 4) -> ModelConfig:
    kind = {"causal": "qwen3", "block_causal": "sdar", "bidirectional": "llada"}[attention]
    return ModelConfig(model_type=kind, vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=attention != "bidirectional",
                       attention=attention, block_size=block_size,
                       mask_token_id=None if attention == "causal" else MASK)


def _batch(B=4, T=16, seed=0):
    """Left-padded rows: pad | prompt (4-6) | answer (rest)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, V, (B, T)).astype(np.int32)
    start = np.array([0, 1, 3, 2][:B], np.int32)
    target = np.zeros((B, T), bool)
    for b in range(B):
        tokens[b, :start[b]] = 0
        target[b, start[b] + 4 + b % 3:] = True
    return jnp.asarray(tokens), jnp.asarray(target), jnp.asarray(start)


@slow
@pytest.mark.parametrize("attention", ["causal", "block_causal", "bidirectional"])
def test_loss_finite_and_decreases(attention):
    cfg = _cfg(attention)
    loss_fn = objectives.loss_for(cfg)
    params = init_params(cfg, jax.random.key(0))
    tokens, target, start = _batch()
    key = jax.random.key(1)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, g = jax.value_and_grad(loss_fn)(params, cfg, tokens, target, start, key)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    losses = []
    for _ in range(12):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses


def test_ar_loss_matches_plain_loop():
    cfg = _cfg("causal")
    params = init_params(cfg, jax.random.key(3))
    tokens, target, start = _batch()
    got = float(objectives.ar_loss(params, cfg, tokens, target, start))
    B, T = tokens.shape
    logits, _ = forward(params, cfg, tokens, default_positions(start, 0, T), start=start)
    logits = np.asarray(logits, np.float64)
    tok, tgt = np.asarray(tokens), np.asarray(target)
    total, n = 0.0, 0
    for b in range(B):
        for p in range(1, T):
            if tgt[b, p]:
                row = logits[b, p - 1]
                total += np.log(np.sum(np.exp(row - row.max()))) + row.max() - row[tok[b, p]]
                n += 1
    np.testing.assert_allclose(got, total / n, rtol=1e-5)


def test_mask_noise_touches_only_targets():
    tokens, target, start = _batch(T=32)
    for block in (None, 4):
        noisy, masked, p_mask = objectives.mask_noise(jax.random.key(5), tokens, target, MASK, block_size=block)
        noisy, masked, p_mask = map(np.asarray, (noisy, masked, p_mask))
        assert masked.any()
        assert not (masked & ~np.asarray(target)).any()
        np.testing.assert_array_equal(noisy[~masked], np.asarray(tokens)[~masked])
        assert (noisy[masked] == MASK).all()
        assert ((p_mask > 0) & (p_mask <= 1)).all()
        if block is not None:  # one noise level per block
            assert (p_mask.reshape(4, 8, 4) == p_mask.reshape(4, 8, 4)[..., :1]).all()


def test_masked_diffusion_loss_matches_plain_loop():
    cfg = _cfg("bidirectional")
    params = init_params(cfg, jax.random.key(4))
    tokens, target, start = _batch()
    key = jax.random.key(9)
    got = float(objectives.masked_diffusion_loss(params, cfg, tokens, target, start, key))
    noisy, masked, p_mask = objectives.mask_noise(key, tokens, target, MASK)
    B, T = tokens.shape
    logits, _ = forward(params, cfg, noisy, default_positions(start, 0, T), start=start)
    logits, tok, msk, pm = (np.asarray(x, np.float64) for x in (logits, tokens, masked, p_mask))
    rows = []
    for b in range(B):
        s = 0.0
        for p in range(T):
            if msk[b, p]:
                row = logits[b, p]
                s += (np.log(np.sum(np.exp(row - row.max()))) + row.max() - row[int(tok[b, p])]) / pm[b, p]
        rows.append(s / np.asarray(target)[b].sum())
    np.testing.assert_allclose(got, np.mean(rows), rtol=1e-5)


def _loop_bd3lm_mask(T, block, start):
    B = len(start)
    m = np.zeros((B, 2 * T, 2 * T), bool)
    for b in range(B):
        for q in range(2 * T):
            for k in range(2 * T):
                q_noisy, k_noisy = q < T, k < T
                qb, kb = (q % T) // block, (k % T) // block
                if k % T < start[b]:
                    continue
                if q_noisy and k_noisy:
                    m[b, q, k] = qb == kb
                elif q_noisy:
                    m[b, q, k] = kb < qb
                elif not k_noisy:
                    m[b, q, k] = kb <= qb
    return m


@pytest.mark.parametrize("T,block", [(8, 4), (12, 4), (12, 3), (10, 4)])
def test_bd3lm_mask_equals_loop(T, block):
    start = np.array([0, 2, 5])
    got = np.asarray(objectives.bd3lm_attention_mask(T, block, jnp.asarray(start)))
    np.testing.assert_array_equal(got, _loop_bd3lm_mask(T, block, start))


@slow
def test_noisy_copy_logits_equal_blockwise_inference():
    """Each noisy block under the BD3-LM mask = a block-causal forward of [clean blocks < i ; noisy block i]."""
    cfg = _cfg("block_causal", block_size=4)
    params = init_params(cfg, jax.random.key(7))
    tokens, target, start = _batch(T=16)
    noisy, _, _ = objectives.mask_noise(jax.random.key(8), tokens, target, MASK, block_size=4)
    got = np.asarray(objectives.block_diffusion_forward(params, cfg, noisy, tokens, start))
    for i in range(16 // 4):
        lo, hi = 4 * i, 4 * (i + 1)
        window = jnp.concatenate([tokens[:, :lo], noisy[:, lo:hi]], axis=1)
        ref, _ = forward(params, cfg, window, default_positions(start, 0, hi), start=start)
        for b in range(tokens.shape[0]):
            real = slice(max(lo, int(start[b])), hi)  # padding query rows see nothing in either form
            np.testing.assert_allclose(got[b, real], np.asarray(ref)[b, real], rtol=2e-4, atol=2e-4)


def test_diffusion_loss_needs_mask_token():
    cfg = _cfg("bidirectional").replace(mask_token_id=None)
    params = init_params(cfg, jax.random.key(0))
    tokens, target, start = _batch()
    with pytest.raises(errors.ConfigError, match="mask_token_id"):
        objectives.masked_diffusion_loss(params, cfg, tokens, target, start, jax.random.key(0))
    with pytest.raises(errors.ConfigError, match="block_causal"):
        objectives.block_diffusion_loss(params, _cfg("bidirectional"), tokens, target, start, jax.random.key(0))


def test_low_discrepancy_noise_levels_are_stratified():
    tokens, target, start = _batch(T=32)
    eps = 1e-3
    for block, n in ((None, 4), (4, 32)):
        _, _, p_mask = objectives.mask_noise(jax.random.key(11), tokens, target, MASK, eps=eps, block_size=block,
                                             low_discrepancy=True)
        levels = np.asarray(p_mask)[:, 0] if block is None else np.asarray(p_mask)[:, ::4].reshape(-1)
        t = np.sort((levels - eps) / (1 - eps))
        assert t.size == n
        np.testing.assert_allclose(np.diff(t), 1.0 / n, atol=1e-5)  # one draw per stratum of width 1/n
