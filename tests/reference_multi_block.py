"""Plain-loop reference of d3LLM multi-block decoding (greedy), written from the issue's rules.

One prompt, no padding, no slot grid, no KV cache, no jit of the loop. Every
step runs the model from position 0: over the canvas up to the active end for
block-causal models, over the whole canvas (prompt + max_new_tokens, future
masks included) for bidirectional ones. Block-causal canvases end on a whole
block (as in block diffusion): slots past prompt + max_new_tokens hold the mask
token and are never generated. Token choice, entropies and block
bookkeeping are numpy / Python.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jdllm.model import forward

INACTIVE, ACTIVATED, FULLY, COMPLETED = "inactive", "activated", "fully_activated", "completed"
STATE_CODE = {INACTIVE: 0, ACTIVATED: 1, FULLY: 2, COMPLETED: 3}


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(params, tokens, *, cfg):
    T = tokens.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    out, _ = forward(params, cfg, tokens, pos, start=jnp.zeros((1,), jnp.int32), attn_impl="xla")
    return out


def model_logits(params, cfg, seq) -> np.ndarray:
    """Raw logits [T, V] of `seq` run alone from position 0.

    Bidirectional models see exactly `seq`; block-causal ones are right-padded
    to a multiple of 16 (a multiple of the block size, so no real position
    sees the padding) to bound recompiles.
    """
    T = len(seq)
    Tp = T if cfg.attention == "bidirectional" else -(-T // 16) * 16
    x = np.zeros((1, Tp), np.int32)
    x[0, :T] = seq
    return np.asarray(_logits(params, jnp.asarray(x), cfg=cfg))[0, :T]


def _stats(logits: np.ndarray, mask_id: int):
    """Greedy token, float32 entropy and log-prob per row of logits [N, V], mask token excluded."""
    z = logits.astype(np.float32).copy()
    z[:, mask_id] = -np.inf
    m = z.max(-1, keepdims=True)
    logp = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
    p = np.exp(logp)
    ent = -np.sum(np.where(p > 0, p * np.where(p > 0, logp, 0), 0), axis=-1).astype(np.float32)
    tok = np.argmax(z, -1)
    return tok, ent, logp[np.arange(len(tok)), tok]


def multi_block_reference(params, cfg, prompt, *, max_new_tokens, block_size, entropy_threshold,
                          block_add_threshold, decoded_token_threshold, max_blocks, early_stop=True,
                          stop_ids=(), max_forwards=None):
    """Returns dict(tokens, step_map, logprobs, nfe, finish, trace, entered, final).

    trace[t - 1]: block states (names) as step t's forward sees them.
    entered[k]: the steps block k entered Activated / Fully-Activated / Completed
    (-1 = never; EOS completions at the start of step t count as t - 1).
    """
    Bs, mask = block_size, cfg.mask_token_id
    bidir = cfg.attention == "bidirectional"
    if not bidir:
        cfg = cfg.replace(block_size=Bs)
    n = len(prompt)
    end = n + max_new_tokens
    first = n if bidir else (n // Bs) * Bs
    blocks = [(a, min(a + Bs, end)) for a in range(first, end, Bs)]
    canvas = end if bidir else first + len(blocks) * Bs
    seq = list(prompt) + [mask] * (canvas - n)
    known = [True] * n + [False] * (canvas - n)
    state = [INACTIVE] * len(blocks)
    state[0] = FULLY
    entered = [[-1, -1, -1] for _ in blocks]
    entered[0][1] = 0
    step_of, lp_of = {}, {}
    steps = nfe = 0
    trace = []

    def set_state(k, s, when):
        state[k] = s
        col = {ACTIVATED: 0, FULLY: 1, COMPLETED: 2}[s]
        if entered[k][col] < 0:
            entered[k][col] = when

    def progress(k):
        a, b = blocks[k]
        return sum(known[a:b]) / (b - a)

    def masked(k):
        a, b = blocks[k]
        return [p for p in range(a, b) if not known[p]]

    def first_open():
        return next((k for k, s in enumerate(state) if s != COMPLETED), len(blocks))

    def ended():
        hole = next((p for p in range(n, end) if not known[p]), end)
        for p in range(n, hole):
            if seq[p] in stop_ids:
                return "stop", p + 1
        return ("length", end) if hole == end else (None, hole)

    finish = None
    while True:
        # 1. EOS early stop
        if early_stop and stop_ids:
            eos = [p for p in range(n, end) if known[p] and seq[p] in stop_ids]
            if eos:
                e = eos[0]
                for p in range(e + 1, end):
                    seq[p], known[p] = seq[e], True
                    step_of.pop(p, None)
                    lp_of.pop(p, None)
                for k, (a, _) in enumerate(blocks):
                    if a > e and state[k] != COMPLETED:
                        set_state(k, COMPLETED, steps)
                    elif state[k] in (ACTIVATED, FULLY) and not masked(k):
                        set_state(k, COMPLETED, steps)
        finish, stop_at = ended()
        if finish is not None:
            break
        if max_forwards is not None and nfe >= max_forwards:
            finish = "abort"  # stopped by the forward budget, not by the algorithm
            break
        # 2. activation
        for k in range(len(blocks)):
            if state[k] == ACTIVATED and (k == 0 or progress(k - 1) >= decoded_token_threshold):
                set_state(k, FULLY, steps + 1)
        # 3. adding (at most max_blocks blocks from the first non-Completed one)
        last = max(k for k, s in enumerate(state) if s != INACTIVE)
        nxt = last + 1
        if (nxt < len(blocks) and state[nxt] == INACTIVE and nxt < first_open() + max_blocks
                and (progress(last) >= block_add_threshold or not masked(last))):
            set_state(nxt, FULLY if progress(last) >= decoded_token_threshold else ACTIVATED, steps + 1)
        trace.append(list(state))
        # 4. one forward
        live = [k for k, s in enumerate(state) if s in (ACTIVATED, FULLY)]
        active_end = blocks[max(live)][0] + Bs
        raw = model_logits(params, cfg, seq if bidir else seq[:active_end])
        nfe += 1
        if cfg.logit_shift:  # position p is predicted at p - 1
            raw = np.concatenate([np.zeros_like(raw[:1]), raw[:-1]], axis=0)
        cands = [p for p in range(n, min(active_end, end)) if not known[p]]
        tok, ent, lp = _stats(raw[cands], mask)
        tok = dict(zip(cands, tok.tolist()))
        ent = dict(zip(cands, ent.tolist()))
        lp = dict(zip(cands, lp.tolist()))
        # 5. lowest entropy + all under the threshold
        chosen = {min(cands, key=lambda p: (ent[p], p))}
        chosen |= {p for p in cands if ent[p] <= entropy_threshold}
        # 6. forced progress
        for k in live:
            if state[k] == FULLY and masked(k) and not any(blocks[k][0] <= p < blocks[k][1] for p in chosen):
                chosen.add(min(masked(k), key=lambda p: (ent[p], p)))
        # 7. reveal, update
        steps += 1
        for p in chosen:
            seq[p], known[p] = tok[p], True
            step_of[p], lp_of[p] = steps, lp[p]
        for k in live:
            if not masked(k):
                set_state(k, COMPLETED, steps)
        finish, stop_at = ended()
        if finish is not None:
            break
    out = range(n, stop_at)
    return dict(tokens=[seq[p] for p in out], step_map=[step_of[p] for p in out],
                logprobs=[lp_of[p] for p in out], nfe=nfe, finish=finish, trace=trace,
                entered=entered, final=list(state))


def states_during(entered, step: int) -> list[str]:
    """Block states step `step`'s forward saw, rebuilt from per-block entry steps."""
    out = []
    for a, f, c in entered:
        if 0 <= c < step:
            out.append(COMPLETED)
        elif 0 <= f <= step:
            out.append(FULLY)
        elif 0 <= a <= step:
            out.append(ACTIVATED)
        else:
            out.append(INACTIVE)
    return out
