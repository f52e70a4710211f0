"""Plain-loop reference of d3LLM multi-block decoding (greedy), written from d3LLM's source.

Sources (hao-ai-lab/d3LLM @ e5bfcac): `generate_multi_block` in
d3llm/d3llm_LLaDA/d3llm_llada_generate_util.py (lines 167-396) with its
sampler `get_transfer_index_entropy` (831-884), and `_sample_multi_block` in
d3llm/d3llm_DREAM/d3llm_dream_generate_util.py (lines 725-988). Line numbers
below are in those files ("L" LLaDA, "D" Dream).

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

from jdllm.model import KVCache, forward

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


@functools.partial(jax.jit, static_argnames=("cfg",))
def _suffix_logits(params, tokens, prefix_k, prefix_v, *, cfg):
    """The suffix `tokens` [1, T - Lc] at slots [Lc, T) against prefix K/V [L, 1, Lc, H, D] (Lc =
    prefix length, maybe 0): returns (logits [T - Lc, V], K/V [L, 1, T, H, D] of prefix + fresh suffix)."""
    Lc, n = prefix_k.shape[2], tokens.shape[1]
    cache = KVCache.empty(cfg, 1, Lc + n, prefix_k.dtype)
    cache = KVCache(k=cache.k.at[:, :, :Lc].set(prefix_k), v=cache.v.at[:, :, :Lc].set(prefix_v),
                    length=jnp.full((1,), Lc, jnp.int32))
    pos = jnp.arange(Lc, Lc + n, dtype=jnp.int32)[None]
    out, cache = forward(params, cfg, tokens, pos, start=jnp.zeros((1,), jnp.int32), cache=cache, offset=Lc,
                         kv_len=Lc + n, attn_impl="xla")
    return out[0], cache.k, cache.v


class D3llmPrefixCache:
    """d3LLM's delayed prefix KV cache, as `generate_multi_block_kv_cache` manages it
    (hao-ai-lab/d3LLM @ e5bfcac, d3llm/d3llm_LLaDA/d3llm_llada_generate_util.py, lines 399-740):

    - the prompt is block "0", complete at nfe 0 (lines 430-440); a generation block's
      `completed_at_nfe` is set the first time the caching scan reaches it complete (581-583);
    - the scan (lines 575-591) walks the blocks not yet cached in order and stops at the first
      one that has masks or has been complete for fewer than `cache_delay_iter` forwards; the
      blocks it passes are cached: the cache edge moves to the end of the last one (594-597);
    - the forward (lines 616-704): when the edge moves, the suffix x[edge:] against the old
      prefix K/V, and the suffix's fresh K/V up to the new edge join the cache
      (`update_kvcache`, modeling_llada.py lines 751-761); else with a cache, no block
      "stabilising" (complete, scanned, not cached) and nfe % refresh_interval != 0, the same
      suffix forward without caching; else a full forward over the canvas, whose K/V replace
      the cached prefix (the "refresh", truncated to the edge: 630-652); without a cache yet,
      a plain full forward.

    Stale K/V are real here: the prefix keys/values are those of the forward that cached (or
    last refreshed) them, and `jdllm.model.forward` runs the suffix against them.

    Shifted-logit (Dream) models follow `_sample_multi_block_kv_cache`
    (d3llm/d3llm_DREAM/d3llm_dream_generate_util.py, lines 991-1420), which differs in two ways:
    - its caching scan (D1204-1220) does not stop at a complete block still inside its delay
      (there is no `elif delay < cache_delay_iter: break`, cf. L568-570): it goes on to the next
      block, whose `completed_at_nfe` is therefore set as soon as every block before it (from the
      edge) has no masks; it stops only at a block with masks. Blocks after the EOS are marked
      cached (D1122-1126) and never stop it;
    - it shifts each forward's logits by one *within the forward's input* (D1312, D1328, D1334:
      `cat([logits[:, :1], logits[:, :-1]])`), so a suffix forward predicts its first slot (the
      cache edge) from that slot's own output, not from the slot before it.
    """

    def __init__(self, params, cfg, prompt_len: int, cache_delay_iter: int, refresh_interval: int):
        self.params, self.cfg, self.n = params, cfg, prompt_len
        self.dream = bool(cfg.logit_shift)
        self.delay, self.refresh = cache_delay_iter, refresh_interval
        self.k = self.v = None  # prefix K/V [L, 1, edge, H, D], None before the first caching
        self.edge = 0
        self.completed_at = {}  # generation block index -> nfe
        # blocks the EOS early stop creates (never added): complete at that nfe and marked cached
        # without being cached (lines 474-486): after the delay the scan passes them, moving no edge
        self.eos_created = {}
        self.kinds = []  # per forward: "suffix+cache", "suffix", "refresh" or "full"

    def logits(self, seq, nfe: int, blocks, masked_blocks) -> np.ndarray:
        """Logits [T, V] predicting each slot for forward number `nfe` (zeros before the slot the
        forward starts at): raw on same-position models, shifted within the forward on Dream.

        blocks: generation blocks (start, end) added so far; masked_blocks: the indices of those
        with masks."""
        edge = self.edge
        new_edge = edge
        scan = [(-1, 0, self.n)] + [(k, a, b) for k, (a, b) in enumerate(blocks)]
        for k, _, b in scan:
            if b <= edge:
                continue
            if k in self.eos_created:
                if not self.dream and nfe - self.eos_created[k] < self.delay:
                    break
                continue
            if k in masked_blocks:
                break
            at = 0 if k < 0 else self.completed_at.setdefault(k, nfe)
            if nfe - at < self.delay:
                if self.dream:  # D1204-1220: no break; ripeness is monotone along the scan anyway
                    continue
                break
            new_edge = b
        stable = [a for k, (a, b) in enumerate(blocks)
                  if k in self.completed_at and k not in self.eos_created and b > new_edge]
        stabilising = bool(stable) or self.n > new_edge  # the prompt too, until it is cached
        if new_edge > edge:
            kind = "suffix+cache"
        elif self.k is not None and not stabilising and nfe % self.refresh != 0:
            kind = "suffix"
        else:
            kind = "refresh" if self.k is not None else "full"
        self.kinds.append(kind)
        T = len(seq)
        start = edge if kind.startswith("suffix") else 0
        L, H, D = self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim
        pk = self.k[:, :, :start] if start else jnp.zeros((L, 1, 0, H, D), jnp.float32)
        pv = self.v[:, :, :start] if start else jnp.zeros((L, 1, 0, H, D), jnp.float32)
        out, k, v = _suffix_logits(self.params, jnp.asarray([seq[start:]], jnp.int32), pk, pv, cfg=self.cfg)
        if kind == "suffix+cache":
            self.k, self.v, self.edge = k[:, :, :new_edge], v[:, :, :new_edge], new_edge
        elif kind == "refresh":  # the full forward's K/V replace the cached prefix
            # d3LLM truncates the refreshed K/V to the start of the latest stabilising block, else
            # to the edge; the scan stops at the first stabilising block, so that is the edge
            # (were it not, d3LLM's cache would outgrow its edge and the next suffix forward would
            # attend to duplicated keys: fail loudly instead)
            assert (max(stable) if stable else edge) == edge
            self.k, self.v = k[:, :, :edge], v[:, :, :edge]
        out = np.asarray(out)
        if self.dream:  # D1328: the forward's first slot keeps its own logits
            out = np.concatenate([out[:1], out[:-1]], axis=0)
        raw = np.zeros((T, out.shape[-1]), np.float32)
        raw[start:] = out
        return raw


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
                          block_add_threshold, decoded_token_threshold, max_blocks=None, early_stop=True,
                          stop_ids=(), max_forwards=None, approx_cache=None, forced_progress="first",
                          selection="auto"):
    """Returns dict(tokens, step_map, logprobs, nfe, finish, trace, entered, final).

    trace[t - 1]: block states (names) as step t's forward sees them.
    entered[k]: the steps block k entered Activated / Fully-Activated / Completed
    (-1 = never; EOS completions at the start of step t count as t - 1).

    approx_cache: None (every forward from scratch) or dict(cache_delay_iter, refresh_interval)
    for a bidirectional model: forwards through `D3llmPrefixCache` (the output then also holds
    `kinds`, the forward kind of each step), d3LLM's LLaDA cache on same-position models and its
    Dream cache on shifted ones.

    max_blocks: None (d3LLM: no cap on blocks in flight) or jdllm's cap.
    forced_progress: "first" (d3LLM, L357-379 / D953-970) or "every" (jdllm's variant).
    selection: "llada" (L347-356 + L866-881: the lowest-entropy candidate, then every one with
    entropy <= threshold), "dream" (D951: entropy < threshold, no guaranteed pick) or "auto"
    (dream on shifted-logit bidirectional models, llada otherwise).

    Differences from d3LLM's code that the issue documents rather than changes: d3LLM takes its
    mask set before the EOS fill (L242 / D808, before L252 / D819), so a slot the fill just wrote can be
    overwritten that step; here candidates are taken after the fill. d3LLM counts an NFE for an
    iteration that only early-stops (L248 / D814); here only forwards count. Entropies are float32
    here, float64 there (L844 / D941).
    """
    if selection == "auto":
        selection = "dream" if cfg.attention == "bidirectional" and cfg.logit_shift else "llada"
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
    d3 = None
    if approx_cache is not None:
        assert bidir, "d3LLM's approximate cache: bidirectional models"
        d3 = D3llmPrefixCache(params, cfg, n, **approx_cache)
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
                        if d3 is not None and state[k] == INACTIVE:  # d3LLM creates it complete, "cached"
                            d3.eos_created.setdefault(k, nfe + 1)
                        set_state(k, COMPLETED, steps)
                    elif state[k] in (ACTIVATED, FULLY) and not masked(k):
                        set_state(k, COMPLETED, steps)
        finish, stop_at = ended()
        if finish is not None:
            break
        if max_forwards is not None and nfe >= max_forwards:
            finish = "abort"  # stopped by the forward budget, not by the algorithm
            break
        # 2. activation (L273-285 / D870-880)
        for k in range(len(blocks)):
            if state[k] == ACTIVATED and (k == 0 or progress(k - 1) >= decoded_token_threshold):
                set_state(k, FULLY, steps + 1)
        # 3. adding, one block per iteration (L287-324 / D882-917); jdllm's optional cap: at most
        # max_blocks blocks from the first non-Completed one
        last = max(k for k, s in enumerate(state) if s != INACTIVE)
        nxt = last + 1
        capped = max_blocks is not None and nxt >= first_open() + max_blocks
        if (nxt < len(blocks) and state[nxt] == INACTIVE and not capped
                and (progress(last) >= block_add_threshold or not masked(last))):
            set_state(nxt, FULLY if progress(last) >= decoded_token_threshold else ACTIVATED, steps + 1)
        trace.append(list(state))
        # 4. one forward over the whole canvas (L339 / D929-932, Dream's logits shifted right by one)
        live = [k for k, s in enumerate(state) if s in (ACTIVATED, FULLY)]
        active_end = blocks[max(live)][0] + Bs
        nfe += 1
        if d3 is not None:
            added = [blocks[k] for k, s in enumerate(state) if s != INACTIVE]
            raw = d3.logits(seq, nfe, added, {k for k in range(len(added)) if masked(k)})
        else:
            raw = model_logits(params, cfg, seq if bidir else seq[:active_end])
        if cfg.logit_shift and d3 is None:  # position p is predicted at p - 1 (D932: p = 0 by itself)
            raw = np.concatenate([np.zeros_like(raw[:1]), raw[:-1]], axis=0)
        cands = [p for p in range(n, min(active_end, end)) if not known[p]]
        tok, ent, lp = _stats(raw[cands], mask)
        tok = dict(zip(cands, tok.tolist()))
        ent = dict(zip(cands, ent.tolist()))
        lp = dict(zip(cands, lp.tolist()))
        # 5. selection among the masks before active_end (L340-356 / D934-951)
        if selection == "dream":  # D951: strict, no guaranteed pick
            chosen = {p for p in cands if ent[p] < entropy_threshold}
        else:  # L866-881: topk ascending, the first kept, the rest dropped when > threshold
            chosen = {min(cands, key=lambda p: (ent[p], p))}
            chosen |= {p for p in cands if ent[p] <= entropy_threshold}
        # 6. forced progress (L357-379 / D953-970): the first block (in order) that is fully
        # activated and has masks; if nothing was chosen in it, its lowest-entropy mask
        fully = [k for k in live if state[k] == FULLY and masked(k)]
        for k in fully[:1] if forced_progress == "first" else fully:
            if not any(blocks[k][0] <= p < blocks[k][1] for p in chosen):
                chosen.add(min(masked(k), key=lambda p: (ent[p], p)))
        # 7. reveal, update (L381-390 / D972-981)
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
                entered=entered, final=list(state), kinds=d3.kinds if d3 else None)


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
