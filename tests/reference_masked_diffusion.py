"""Plain-loop reference of LLaDA / Dream / Fast-dLLM masked-diffusion decoding, for one prompt.

Written from the published algorithms (LLaDA's `generate` with
`get_num_transfer_tokens` and `add_gumbel_noise`, Dream's `_sample`,
Fast-dLLM's threshold rule), not from jdllm/decode: every step runs the model
over the whole sequence (prompt + gen_length slots, no padding, no cache) and
picks tokens with numpy in float64. Shared with jdllm only: the model forward
and, for the random parts, the PRNG derivation (row key -> split per step ->
fold_in(., 0) for the Gumbel draw, fold_in(., 1) for the uniforms) and the
Exp(1) noise generator, so the same draws can be compared token for token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jdllm.decode.masked_diffusion import exponential_noise
from jdllm.model import KVCache, forward


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, tokens, *, cfg):
    T = tokens.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)[None].repeat(tokens.shape[0], 0)
    logits, _ = forward(params, cfg, tokens, pos, start=jnp.zeros((tokens.shape[0],), jnp.int32), attn_impl="xla")
    return logits


def model_logits(params, cfg, seqs) -> np.ndarray:
    """Raw float64 logits [N, T, V] of whole sequences [N, T] (no padding: a bidirectional model sees it all)."""
    return np.asarray(_forward(params, jnp.asarray(np.asarray(seqs, np.int32)), cfg=cfg)).astype(np.float64)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward_cached(params, tokens, cache, offset, kv_len, *, cfg):
    T = tokens.shape[1]
    pos = offset + jnp.arange(T, dtype=jnp.int32)[None]
    logits, cache = forward(params, cfg, tokens, pos, start=jnp.zeros((1,), jnp.int32), cache=cache, offset=offset,
                            kv_len=kv_len, attn_impl="xla")
    return logits, cache


CACHE_SLOTS = 64  # fixed cache size for the cached reference (fewer compiles); slots >= len(x) stay invisible


def cached_logits(params, cfg, x, cache_mode, state, b0, b1) -> np.ndarray:
    """Raw float64 logits [T, V] (rows outside the computed window are NaN) under Fast-dLLM's caches.

    state["kv"] is None at a block's first step: the whole sequence runs and its K/V become the
    cache. Later steps run only [b0 - shift, T) ('prefix', against the cached prefix) or
    [b0 - shift, b1) ('dual', against the cached prefix and suffix), from that block-start cache.
    Keys at slots >= T are masked off (kv_len = T), so padding the cache to CACHE_SLOTS changes nothing.
    """
    T, shift = len(x), int(cfg.logit_shift)
    assert T <= CACHE_SLOTS
    if state["kv"] is None:
        padded = np.full((1, CACHE_SLOTS), cfg.mask_token_id, np.int32)
        padded[0, :T] = x
        empty = KVCache.empty(cfg, 1, CACHE_SLOTS)
        logits, state["kv"] = _forward_cached(params, jnp.asarray(padded), empty, 0, T, cfg=cfg)
        return np.asarray(logits[0, :T], np.float64)
    lo = b0 - shift
    hi = T if cache_mode == "prefix" else b1
    logits, _ = _forward_cached(params, jnp.asarray(x[None, lo:hi], jnp.int32), state["kv"], lo, T, cfg=cfg)
    out = np.full((T, cfg.vocab_size), np.nan)
    out[lo:hi] = np.asarray(logits[0], np.float64)
    return out


def _log_softmax(z):
    m = np.max(z, axis=-1, keepdims=True)
    return z - m - np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True))


def num_transfer_tokens(mask_count: int, steps: int) -> list[int]:
    """LLaDA's linear schedule: mask_count // steps each, the remainder to the first steps."""
    base, rem = mask_count // steps, mask_count % steps
    return [base + 1 if j < rem else base for j in range(steps)]


def llada_gumbel_argmax(logits: np.ndarray, exp_noise: np.ndarray, temperature: float) -> np.ndarray:
    """LLaDA's float64 Gumbel trick: argmax(exp(logits) / (-log u)^T), with E = -log u given."""
    z = np.asarray(logits, np.float64)
    return np.argmax(np.exp(z) / np.asarray(exp_noise, np.float64) ** temperature, axis=-1)


def masked_diffusion_reference(params, cfg, prompt, *, gen_length, steps=None, block_length=None,
                               remasking="low_confidence", confidence_threshold=None, cfg_scale=0.0, alg=None,
                               eps=1e-3, temperature=0.0, key=None, stop_ids=(), cache="none"):
    """Decode one prompt; returns dict(tokens, step_map, logprobs, nfe, finish).

    cache: "none" (a full forward every step), or Fast-dLLM's "prefix" / "dual" (`cached_logits`).
    key: the row's typed PRNG key (needed for temperature > 0, remasking='random'
    and alg='origin'). Steps that reveal nothing do not advance step_map's counter.
    """
    mask = cfg.mask_token_id
    n, G = len(prompt), gen_length
    Bl = G if block_length is None else block_length
    nb = G // Bl
    spb = (G if steps is None else steps) // nb
    x = np.array(list(prompt) + [mask] * G, np.int64)
    step_of, lp_of = {}, {}
    nfe, counter = 0, 0
    finish = None

    def ended():
        gen = x[n:]
        holes = np.nonzero(gen == mask)[0]
        first_hole = holes[0] if len(holes) else G
        for j in range(first_hole):
            if gen[j] in stop_ids:
                return "stop", j + 1
        return ("length", G) if first_hole == G else (None, first_hole)

    for blk in range(nb):
        b0, b1 = n + blk * Bl, n + (blk + 1) * Bl
        sched = num_transfer_tokens(int(np.sum(x[b0:b1] == mask)), spb)
        t = np.linspace(1.0, eps, spb + 1)
        i = 0
        kv = {"kv": None}  # refreshed at each block's first step
        while np.any(x[b0:b1] == mask) and finish is None:
            if cache != "none":
                logits = cached_logits(params, cfg, x, cache, kv, b0, b1)
                nfe += 1
            elif cfg_scale > 0:
                un = x.copy()
                un[:n] = mask
                cond, unc = model_logits(params, cfg, np.stack([x, un]))
                logits = unc + (cfg_scale + 1.0) * (cond - unc)
                nfe += 2
            else:
                logits = model_logits(params, cfg, x[None])[0]
                nfe += 1
            if cfg.logit_shift:  # Dream: position p is predicted at p - 1
                logits = np.concatenate([logits[:1], logits[:-1]], axis=0)
            z = logits[b0:b1].copy()  # [Bl, V]
            z[:, mask] = -np.inf
            masked = x[b0:b1] == mask
            exp_noise = uniform = None
            if key is not None:
                key, sub = jax.random.split(key)
                exp_noise = np.asarray(exponential_noise(jax.random.fold_in(sub, 0), z.shape), np.float64)
                uniform = np.asarray(jax.random.uniform(jax.random.fold_in(sub, 1), (Bl,)))
            zt = z / temperature if temperature > 0 else z
            logp_t = _log_softmax(zt)
            if temperature > 0:
                tok = llada_gumbel_argmax(z, exp_noise, temperature)
            else:
                tok = np.argmax(z, axis=-1)
            rows = np.arange(Bl)
            lp = logp_t[rows, tok]
            idx = np.nonzero(masked)[0]
            if alg is None:
                conf = uniform.astype(np.float64) if remasking == "random" else np.exp(_log_softmax(z)[rows, tok])
            elif alg == "maskgit_plus":
                conf = np.exp(lp)
            elif alg == "topk_margin":
                ps = np.sort(np.exp(logp_t), axis=-1)
                conf = ps[:, -1] - ps[:, -2]
            elif alg == "entropy":
                p = np.exp(logp_t)
                conf = np.sum(np.where(p > 0, p * np.where(p > 0, logp_t, 0.0), 0.0), axis=-1)
            order = idx[np.argsort(-conf[idx], kind="stable")] if alg != "origin" else idx
            if confidence_threshold is not None:  # Fast-dLLM: the best one always, plus all >= threshold
                chosen = [order[0]] + [j for j in order[1:] if conf[j] >= confidence_threshold]
            elif alg is None:
                chosen = list(order[:sched[min(i, spb - 1)]])
            else:
                last = i >= spb - 1
                ratio = np.float32(1.0 - t[i + 1] / t[i]) if not last else np.float32(1.0)
                if alg == "origin":
                    chosen = [j for j in idx if uniform[j] < ratio]
                else:
                    k = len(idx) if last else int(np.floor(np.float32(len(idx)) * ratio))
                    chosen = list(order[:k])
            if chosen:
                counter += 1
            for j in chosen:
                x[b0 + j] = int(tok[j])
                step_of[b0 + j] = counter
                lp_of[b0 + j] = float(lp[j])
            finish, _ = ended()
            i += 1
        if finish is not None:
            break
    finish, end = ended()
    pos = range(n, n + end)
    return dict(tokens=[int(x[p]) for p in pos], step_map=[step_of[p] for p in pos],
                logprobs=[lp_of[p] for p in pos], nfe=nfe, finish=finish)
