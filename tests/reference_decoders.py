"""Plain-Python-loop reference decoders (greedy) that jdllm's compiled paradigms must match.

Every step runs the model over the whole sequence from position 0 with no
KV cache (`jdllm.model.forward(..., cache=None)`), then picks tokens with
numpy. No padding, no slot grid, no jit of the loop: written from the
paradigms' definitions, not from jdllm/decode.

Each returns dict(tokens, step_map, logprobs, nfe, finish) for one prompt.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jdllm.model import forward


@functools.partial(jax.jit, static_argnames=("cfg",),
                   compiler_options={"xla_backend_optimization_level": 0})  # compile time matters here
def _forward_full(params, tokens, *, cfg):
    T = tokens.shape[1]
    pos = jax.numpy.arange(T, dtype=jax.numpy.int32)[None]
    logits, _ = forward(params, cfg, tokens, pos, start=jax.numpy.zeros((1,), jax.numpy.int32), attn_impl="xla")
    return logits


def full_logits(params, cfg, seq) -> np.ndarray:
    """Raw logits [T, V] of the sequence, run alone from position 0.

    The sequence is right-padded to a multiple of 16 (to bound recompiles);
    for causal and block-causal models (blocks aligned to position 0, 16 a
    multiple of the block) earlier positions never see the padding.
    """
    T = len(seq)
    Tp = -(-T // 16) * 16
    x = np.zeros((1, Tp), np.int32)
    x[0, :T] = seq
    return np.asarray(_forward_full(params, jax.numpy.asarray(x), cfg=cfg))[0, :T]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = np.max(z, axis=-1, keepdims=True)
    return z - m - np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True))


def _distribution(logits: np.ndarray, mask_id):
    """Greedy token, prob, entropy and log-prob per row of logits [W, V], mask token excluded."""
    z = logits.astype(np.float64).copy()
    if mask_id is not None:
        z[:, mask_id] = -np.inf
    logp = _log_softmax(z)
    p = np.exp(logp)
    tok = np.argmax(z, axis=-1)
    lp = logp[np.arange(len(tok)), tok]
    ent = -np.sum(np.where(p > 0, p * np.where(p > 0, logp, 0.0), 0.0), axis=-1)
    return tok, np.exp(lp), ent, lp


def ar_reference(params, cfg, prompt, *, max_new_tokens, stop_ids=()):
    """Greedy next-token decoding: one full forward per generated token."""
    seq = list(prompt)
    out, lps = [], []
    finish = "length"
    for _ in range(max_new_tokens):
        logits = full_logits(params, cfg, seq)[-1:]  # [1, V]
        tok, _, _, lp = _distribution(logits, cfg.mask_token_id)
        seq.append(int(tok[0]))
        out.append(int(tok[0]))
        lps.append(float(lp[0]))
        if out[-1] in stop_ids:
            finish = "stop"
            break
    return dict(tokens=out, step_map=list(range(1, len(out) + 1)), logprobs=lps, nfe=len(out), finish=finish)


def _select(strategy, cand_idx, conf, ent, *, k, threshold, eb, dynamic_minimum="lmdeploy"):
    """Positions (window indices) to reveal among the masked candidates `cand_idx`."""
    cand_idx = np.asarray(cand_idx)
    if strategy == "low_confidence_dynamic" and dynamic_minimum == "sdar":
        # SDAR generate.py (JetAstra/SDAR @ c2041a8, lines 168-178): high_conf_mask = confidence >
        # threshold; if its count >= num_transfer_tokens[step] (= block_length // denoising_steps,
        # lines 49-54) reveal exactly those, else torch.topk(confidence, num_transfer_tokens[step])
        # over the block with -inf at revealed slots (so at most the masked ones remain).
        high = [i for i in cand_idx if conf[i] > threshold]
        if len(high) >= k:
            return high
        return sorted(cand_idx[np.argsort(-conf[cand_idx], kind="stable")][:k])
    if strategy == "sequential":
        return list(cand_idx[:k])
    if strategy == "low_confidence_static":
        order = cand_idx[np.argsort(-conf[cand_idx], kind="stable")]
        return list(order[:k])
    if strategy == "low_confidence_dynamic":
        order = cand_idx[np.argsort(-conf[cand_idx], kind="stable")]
        chosen = [i for i in cand_idx if conf[i] >= threshold]
        return sorted(set(chosen) | {order[0]})
    if strategy == "entropy_bounded":
        order = cand_idx[np.argsort(ent[cand_idx], kind="stable")]
        chosen, total = [], 0.0
        for n, i in enumerate(order):
            total += ent[i]
            if n == 0 or total < eb:
                chosen.append(i)
            else:
                break
        return chosen
    raise ValueError(strategy)


def block_diffusion_reference(params, cfg, prompt, *, block_length, denoising_steps, strategy,
                              max_new_tokens, confidence_threshold=0.9, eb_threshold=0.35, stop_ids=(),
                              dynamic_minimum="lmdeploy"):
    """SDAR block diffusion, greedy: each step runs the whole sequence up to the current block's end.

    Returns nfe for the unfused schedule (prefill of the prompt's whole blocks,
    every denoising forward, one commit forward per filled block) and
    `nfe_fused`, the denoising forwards alone (what fusing every commit into the
    next block's first step leaves).
    """
    B, mask = block_length, cfg.mask_token_id
    cfg = cfg.replace(block_size=B)
    n = len(prompt)
    gen_start, limit = n, n + max_new_tokens
    canvas = list(prompt)
    revealed = [True] * n
    step_of, lp_of = {}, {}
    steps, denoise_fw, commits = 0, 0, int(n // B > 0)
    block = (n // B) * B
    finish = None

    def ended():
        first_hole = next((p for p in range(gen_start, limit) if p >= len(canvas) or not revealed[p]), limit)
        for p in range(gen_start, first_hole):
            if canvas[p] in stop_ids:
                return "stop", p + 1
        return ("length", limit) if first_hole == limit else (None, first_hole)

    while finish is None:
        while len(canvas) < block + B:
            canvas.append(mask)
            revealed.append(False)
        while True:
            cand = [i for i in range(B) if not revealed[block + i] and gen_start <= block + i < limit]
            if not cand:
                break
            raw = full_logits(params, cfg, canvas[:block + B])
            denoise_fw += 1
            if cfg.logit_shift:  # position p is predicted at p - 1 (position 0 is never generated)
                raw = np.concatenate([np.zeros_like(raw[:1]), raw], axis=0)
                logits = raw[block:block + B]
            else:
                logits = raw[block:block + B]
            tok, conf, ent, lp = _distribution(logits, mask)
            chosen = _select(strategy, cand, conf, ent, k=B // denoising_steps,
                             threshold=confidence_threshold, eb=eb_threshold, dynamic_minimum=dynamic_minimum)
            steps += 1
            for i in chosen:
                canvas[block + i] = int(tok[i])
                revealed[block + i] = True
                step_of[block + i] = steps
                lp_of[block + i] = float(lp[i])
            finish, end = ended()
            if finish is not None:
                break
        if finish is None:
            commits += 1
            block += B
    _, end = ended()
    pos = range(gen_start, end)
    return dict(tokens=[canvas[p] for p in pos], step_map=[step_of[p] for p in pos],
                logprobs=[lp_of[p] for p in pos], nfe=denoise_fw + commits, nfe_fused=denoise_fw,
                finish=finish)
