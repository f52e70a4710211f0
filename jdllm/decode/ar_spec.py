"""`ar_spec`: speculative autoregressive decoding (draft model or prompt lookup) with exact
verification, every row advancing at its own pace.

One loop iteration, per row, with c its first unrevealed slot (its KV cache holds [0, c - 1)):

1. propose up to k = `num_draft_tokens` drafts d_0..d_{k-1} for slots c..c+k-1 (`forward`):
   - `prompt_lookup`: the longest n-gram (n from `max_ngram` down to `min_ngram`) ending at
     slot c - 1 that also occurs earlier in the row (prompt + generated text; the most recent
     occurrence wins); the tokens that followed it are the drafts (a point-mass proposal).
     Computed on the device as one [B, S, max_ngram] comparison, no scan over the history.
   - `draft_model`: k AR steps of a small causal model sharing the vocabulary, sampling with
     the row's own settings, with its own KV cache in `state.extra["draft_cache"]`. Each draft
     forward covers two slots, [c + i - 2, c + i): the first re-syncs the one slot a fully
     accepted run leaves unwritten, and one window shape means one compiled draft forward.
2. the target scores [token at c - 1, d_0..d_{k-1}] in ONE forward (width k + 1), giving the
   distributions p_0..p_k of slots c..c+k (`forward` returns them as the step's logits);
3. `reveal` accepts drafts left to right: greedy rows while d_j is the target's argmax; sampled
   rows with probability min(1, p_j(d_j) / q_j(d_j)) (q: the draft's distribution, a point mass
   for prompt lookup); at the first rejection a correction is drawn from norm(max(0, p_j - q_j)),
   after a fully accepted run a bonus token from p_k. So the output distribution equals the
   target's (after temperature / top-k / top-p), and greedy output equals `jdllm.AR`'s token
   for token. Emitted tokens are cut at the row's limit and after its first stop token.
4. both caches are rolled back to the accepted prefix: length = c + emitted - 1 (K/V past it are
   stale, hidden by the causal mask and overwritten by the next window), so rejected drafts
   leave no hole and never grow the cache.

Constraints restrict the target before the acceptance rule, at each of the k + 1 slots as it
stands after the drafts before it: a packed bitmask from the host (llguidance, `reveal`'s
bitmask) or the on-device DFA (`state.constraint.draft_mask`). A draft the constraint rejects
has probability 0 there; where nothing is drawable after accepted drafts (a grammar's dead end)
the drafts are emitted without a correction.

Tokens emitted in one verification share a step number (step_map), their log-probs are the
target's, NFE counts target forwards (prefill included; draft forwards are reported apart), and
`Output.trace` gives drafts proposed / accepted per row.

The draft model's parameters travel with the target's: `bind_params(params)` returns
`{**params, "draft": draft_params}`, which `jdllm.generate` passes to the loop (a caller of
`jdllm.decode.loop.compiled()` does the same).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors, sampling
from jdllm.decode import common
from jdllm.decode.ar import AR, first_hole
from jdllm.decode.protocol import Paradigm
from jdllm.model import KVCache
from jdllm.sampling import NEG_INF, distribution_stats, filter_logits, per_row, sample_rows
from jdllm.state import DecodeState

PROPOSERS = ("prompt_lookup", "draft_model")
MAX_DRAFT_TOKENS = 32
MAX_NGRAM = 16


@dataclasses.dataclass(frozen=True, eq=False)
class Speculative(Paradigm):
    """Speculative AR decoding: a proposer drafts `num_draft_tokens` tokens per row, the target
    verifies them in one forward (exact: greedy output equals `jdllm.AR`, sampled output follows
    the target's distribution).

    proposer: "prompt_lookup" (n-gram lookup in the row's own text, `min_ngram`..`max_ngram`)
    or "draft_model" (`draft`: a causal `jdllm.Model`, or a directory to load, sharing the
    target's vocabulary); default: "draft_model" when `draft` is given, else "prompt_lookup".
    """

    proposer: str | None = None
    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    draft: Any = dataclasses.field(default=None, repr=False)

    name: ClassVar[str] = "ar_spec"
    ragged_lengths: ClassVar[bool] = True
    is_autoregressive: ClassVar[bool] = True  # speculative sampling draws from the target: its AR likelihood
    replay_method: ClassVar[str] = "teacher_forcing"
    fast_forward: ClassVar[bool] = False  # its cache must hold every slot before the frontier; drafts
    # already cover several tokens per forward
    PROPOSERS: ClassVar[tuple[str, ...]] = PROPOSERS
    trace_keys: ClassVar[tuple[str, ...]] = ("proposed", "accepted", "draft_forwards")

    def __post_init__(self):
        if isinstance(self.draft, (str, os.PathLike)):
            from jdllm.checkpoint import load  # noqa: PLC0415

            object.__setattr__(self, "draft", load(os.fspath(self.draft), dtype="float32"))
        proposer = self.proposer or ("draft_model" if self.draft is not None else "prompt_lookup")
        object.__setattr__(self, "proposer", proposer)
        if proposer not in PROPOSERS:
            raise errors.DecodingConfigError(f"proposer={proposer!r} is not one of {PROPOSERS}")
        for name, lo, hi in (("num_draft_tokens", 1, MAX_DRAFT_TOKENS), ("min_ngram", 1, MAX_NGRAM),
                             ("max_ngram", 1, MAX_NGRAM)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                raise errors.DecodingConfigError(f"{name}={v!r} must be an integer in [{lo}, {hi}]")
        if self.min_ngram > self.max_ngram:
            raise errors.DecodingConfigError(
                f"min_ngram={self.min_ngram} > max_ngram={self.max_ngram}; min_ngram must be <= max_ngram")
        if proposer == "draft_model":
            if self.draft is None:
                raise errors.DecodingConfigError(
                    "proposer='draft_model' needs draft=<a jdllm.Model or a model directory>")
            if not hasattr(self.draft, "config") or not hasattr(self.draft, "params"):
                raise errors.DecodingConfigError(
                    f"draft={self.draft!r} is not a jdllm.Model; pass jdllm.load(DIR) or the directory")
        elif self.draft is not None:
            raise errors.DecodingConfigError(
                f"draft= is given but proposer={proposer!r}; use proposer='draft_model' or drop draft")

    # a static jit argument: equal configs (same draft *architecture*) share a compile, the
    # draft's weights are data (`bind_params`)
    def _key(self):
        d = None if self.draft is None else (self.draft.config, self.draft.params["embed"].dtype.name)
        return (self.proposer, self.num_draft_tokens, self.max_ngram, self.min_ngram, d)

    def __eq__(self, other):
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    @property
    def uses_draft(self) -> bool:
        return self.proposer == "draft_model"

    # ------------------------------------------------------------------ host-side checks
    def validate(self, cfg) -> None:
        if cfg.attention != "causal":
            raise errors.DecodingConfigError(
                f"paradigm 'ar_spec' needs a causal target model, this one has attention={cfg.attention!r}")
        if not self.uses_draft:
            return
        d = self.draft.config
        if d.attention != "causal":
            raise errors.DecodingConfigError(
                f"the draft model must be causal, it has attention={d.attention!r}")
        for name in ("vocab_size", "mask_token_id", "eos_token_ids"):
            if getattr(d, name) != getattr(cfg, name):
                raise errors.DecodingConfigError(
                    f"the draft model's {name}={getattr(d, name)!r} differs from the target's "
                    f"{getattr(cfg, name)!r}; a draft must share the target's vocabulary")

    def validate_model(self, model) -> None:
        """Tokenizer check (both models have one: the same vocabulary, token for token)."""
        if not self.uses_draft:
            return
        a, b = model.tokenizer, self.draft.tokenizer
        if a is None or b is None:
            return
        va, vb = a.get_vocab(), b.get_vocab()
        if va != vb:
            raise errors.DecodingConfigError(
                f"the draft model's tokenizer differs from the target's: {_first_difference(va, vb)} "
                f"({len(vb)} and {len(va)} tokens); a draft must share the target's tokenizer")

    def bind_params(self, params):
        """The parameters the loop takes: the target's, plus the draft's under "draft"."""
        return {**params, "draft": self.draft.params} if self.uses_draft else params

    def layout(self, lengths: np.ndarray, max_new_tokens: int, cfg) -> common.Layout:
        lengths = np.asarray(lengths, np.int32)
        P = common.bucket(int(np.max(lengths)), 16)
        # room for a full draft window past the last generation slot
        G = common.bucket(max_new_tokens + self.num_draft_tokens, 16, steps_per_octave=4)
        return common.Layout(start=np.zeros_like(lengths), gen_start=lengths, slots=P + G, prefill_len=P)

    def max_iterations(self, state: DecodeState) -> int:
        return state.slots + 2

    def output_trace(self, extra, row) -> dict:
        proposed, accepted = int(extra["proposed"][row]), int(extra["accepted"][row])
        return dict(drafts_proposed=proposed, drafts_accepted=accepted,
                    acceptance_rate=accepted / proposed if proposed else 0.0,
                    draft_forwards=int(extra["draft_forwards"][row]))

    def baseline(self) -> Paradigm:
        """`jdllm bench` also times plain AR on the same target and prompts."""
        return AR()

    def constraint_masks(self, controller, state: DecodeState, plan: common.Plan, done: np.ndarray) -> np.ndarray:
        """The drafts are known once the forward has run: masks for all k + 1 verification slots,
        mask i as the grammar stands after drafts[:i] (one parallel call)."""
        d = jax.device_get({"drafts": state.extra["drafts"], "n": state.extra["n_draft"]})
        return controller.verify_masks(np.asarray(d["drafts"]), np.asarray(d["n"]), done)

    # ------------------------------------------------------------------ the step
    def _draft_ctx(self, ctx):
        return dataclasses.replace(ctx, model=self.draft.config)

    def prefill(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        """The prompts into the target's (and draft's) cache; the first step verifies drafts already."""
        if bitmask is not None:
            raise errors.DecodingConfigError("paradigm 'ar_spec' takes no bitmask in prefill (its first "
                                             "tokens are chosen by the first step)")
        P, B, k = ctx.prefill_len, state.batch, self.num_draft_tokens
        at = state.gen_start[:, None]
        state, _ = common.forward_window(params, ctx, state, 0, P, at=at, commit=state.gen_start - 1)
        state = common.count_forward(state, ~state.done)
        extra = dict(proposed=jnp.zeros((B,), jnp.int32), accepted=jnp.zeros((B,), jnp.int32),
                     draft_forwards=jnp.zeros((B,), jnp.int32), drafts=jnp.zeros((B, k), jnp.int32),
                     n_draft=jnp.zeros((B,), jnp.int32))
        if self.uses_draft:
            if "draft" not in params:
                raise errors.DecodingConfigError(
                    "proposer='draft_model' needs the draft's parameters: pass "
                    "decoding.bind_params(model.params) as params")
            dcfg = self.draft.config
            dp = params["draft"]
            dstate = state.replace(cache=KVCache.empty(dcfg, B, state.slots, dp["embed"].dtype))
            dstate, _ = common.forward_window(dp, self._draft_ctx(ctx), dstate, 0, P, at=at,
                                              commit=state.gen_start - 1)
            extra.update(draft_cache=dstate.cache, q=jnp.zeros((B, k, ctx.model.vocab_size), jnp.float32),
                         draft_forwards=(~state.done).astype(jnp.int32))
        return state.replace(extra=extra)

    def plan(self, ctx, state: DecodeState):
        return state, common.make_plan(state, first_hole(state), self.num_draft_tokens + 1)

    def forward(self, params, ctx, state: DecodeState, plan: common.Plan):
        c = plan.offset  # [B] the first slot to choose; the cache holds [0, c - 1)
        running = ~state.done
        if self.uses_draft:
            state, drafts, q = propose_draft(params["draft"], self._draft_ctx(ctx), state, c, self.num_draft_tokens)
            n_draft = jnp.full((state.batch,), self.num_draft_tokens, jnp.int32)
        else:
            drafts, n_draft = prompt_lookup(state, c, self.num_draft_tokens, self.min_ngram, self.max_ngram)
            q = None
        n_draft = jnp.where(running, n_draft, 0)
        extra = dict(state.extra, drafts=drafts, n_draft=n_draft)
        if q is not None:
            extra["q"] = q
        state = state.replace(tokens=_write_unrevealed(state, c, drafts), extra=extra)
        W = self.num_draft_tokens + 1
        state, logits = common.forward_window(params, ctx, state, c - 1, W, at=plan.slots)
        return common.count_forward(state, running), logits

    def reveal(self, ctx, state: DecodeState, plan: common.Plan, logits, bitmask=None) -> DecodeState:
        c, k = plan.offset, self.num_draft_tokens
        running = ~state.done
        drafts, n_draft = state.extra["drafts"], state.extra["n_draft"]
        sp = state.sampling
        z = common.allowed_logits(ctx, logits, bitmask)
        if state.constraint is not None:  # on-device DFA: slot c + i's mask after drafts[:i]
            tab, allowed = state.constraint.draft_mask(state, c, drafts)
            state, z = state.replace(constraint=tab), jnp.where(allowed, z, NEG_INF)
        z = filter_logits(z, **per_row(sp.temperature, sp.top_k, sp.top_p))  # [B, k+1, V] target
        greedy = sp.temperature == 0
        state, sk = common.advance_keys(state)
        j = jnp.arange(k, dtype=jnp.int32)
        pd = jnp.exp(distribution_stats(z[:, :k], drafts).logprob)  # [B, k] p_j(d_j)
        if self.uses_draft:
            qd = jnp.take_along_axis(state.extra["q"], drafts[..., None], axis=-1)[..., 0]
        else:
            qd = jnp.ones_like(pd)
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0), (k,)))(sk)
        is_max = drafts == sampling.argmax(z[:, :k])
        drawable = jnp.any(z > NEG_INF, axis=-1)  # [B, k+1]: a bitmask may allow nothing at a slot
        ok = accept_drafts(pd, qd, u, is_max, greedy[:, None]) & (j[None] < n_draft[:, None]) & drawable[:, :k]
        n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)  # [B]

        corr = correction(z, drafts, state.extra["q"] if self.uses_draft else None, n_acc, n_draft, sk, greedy)

        W = k + 1
        jw = jnp.arange(W, dtype=jnp.int32)[None]
        dpad = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
        emit = jnp.where(jw < n_acc[:, None], dpad, corr[:, None])  # [B, W]
        # no correction where nothing is drawable after accepted drafts (a grammar's dead end: the
        # drafts stay, the host ends the row there); at the first slot the row ends INVALID as usual
        corr_ok = jnp.take_along_axis(drawable, n_acc[:, None], axis=1)[:, 0] | (n_acc == 0)
        sel = plan.valid & ((jw < n_acc[:, None]) | ((jw == n_acc[:, None]) & corr_ok[:, None]))
        stop = jnp.any(emit[..., None] == state.stop_ids[:, None, :], axis=-1) & sel
        sel = sel & (jnp.cumsum(stop, axis=-1) - stop == 0)  # nothing after the first stop token
        state = common.write_tokens(state, c, sel, distribution_stats(z, emit))
        n_sel = jnp.sum(sel, axis=-1).astype(jnp.int32)

        # roll the caches back to the accepted prefix; unaccepted draft slots hold the fill again
        grew = running & (n_sel > 0)
        length = jnp.where(grew, c + n_sel - 1, state.cache.length)
        tokens = _write_unrevealed(state, c, jnp.full_like(emit, common.fill_token(ctx.model)))
        extra = dict(state.extra,
                     proposed=state.extra["proposed"] + jnp.sum(plan.valid[:, :k] & (j[None] < n_draft[:, None]),
                                                                axis=-1).astype(jnp.int32),
                     accepted=state.extra["accepted"] + jnp.sum(sel & (jw < n_acc[:, None]), axis=-1).astype(
                         jnp.int32))
        if self.uses_draft:
            extra["draft_cache"] = extra["draft_cache"].commit(jnp.where(grew, length, extra["draft_cache"].length))
        state = state.replace(tokens=tokens, cache=state.cache.commit(length), extra=extra)
        return common.finish_rows(state)

    def rewind(self, ctx, state: DecodeState, before: DecodeState, remasked, written) -> DecodeState:
        """After a host edited slots (`jdllm.constraints.guidance` re-masking a token its grammar
        rejected): the draft model's cache keeps no K/V past the target's (their lengths agree after
        every step). Pure; the unconstrained loop never calls it."""
        if not self.uses_draft:
            return state
        dc = state.extra["draft_cache"]
        return state.replace(extra=dict(state.extra, draft_cache=dc.commit(jnp.minimum(dc.length,
                                                                                       state.cache.length))))


def accept_drafts(pd, qd, u, is_max, greedy):
    """[B, k] bool: draft j passes on its own. Greedy rows: it is the target's argmax. Sampled rows:
    u < p(d) / q(d), i.e. accepted with probability min(1, p(d) / q(d))."""
    return jnp.where(greedy, is_max, u * qd < pd)


def propose_draft(dparams, dctx, state: DecodeState, c, k: int):
    """k AR steps of the draft model (`dctx`: the draft's context) from slot c - 1:
    (state, drafts [B, k], q [B, k, V])."""
    running = ~state.done
    state, sk = common.advance_keys(state)
    sp = state.sampling
    settings = dict(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
    greedy = sp.temperature == 0

    def draw(logits, i):  # logits [B, 1, V] predicting slot c + i
        z = common.allowed_logits(dctx, logits)
        s = sample_rows(z, sk, **settings, slots=(c + i)[:, None])
        tok = s.token[:, 0]
        zf = filter_logits(z[:, 0], **settings)
        q = jnp.where(greedy[:, None], jax.nn.one_hot(tok, z.shape[-1], dtype=jnp.float32),
                      _softmax(zf))
        return tok, q

    def body(carry, i):  # forward slots [c + i - 2, c + i) (d_{i-1} written at c + i - 1): d_i
        tokens, cache, prev = carry
        tokens = common.set_window(tokens, c + i - 1, jnp.where(
            common.window(state.revealed, c + i - 1, 1) | (i == 0), common.window(tokens, c + i - 1, 1),
            prev[:, None]))
        o = jnp.maximum(c + i - 2, 0)
        ds = state.replace(tokens=tokens, cache=cache)
        ds, logits = common.forward_window(dparams, dctx, ds, o, 2, at=(c + i)[:, None])
        tok, q = draw(logits, i)
        return (tokens, ds.cache, tok), (tok, q)

    (_, cache, _), (toks, qs) = jax.lax.scan(
        body, (state.tokens, state.extra["draft_cache"], jnp.zeros_like(c)), jnp.arange(k, dtype=jnp.int32))
    drafts, q = jnp.moveaxis(toks, 0, 1), jnp.moveaxis(qs, 0, 1)  # [B, k], [B, k, V]
    extra = dict(state.extra, draft_cache=cache,
                 draft_forwards=state.extra["draft_forwards"] + k * running.astype(jnp.int32))
    return state.replace(extra=extra), drafts, q


def correction(z, drafts, q, n_acc, n_draft, sk, greedy):
    """[B] the token at window position n_acc: after the first rejection a draw from
    norm(max(0, p - q)), after a fully accepted run (the bonus) a draw from p; greedy rows take p's
    argmax. z [B, k+1, V] the target's filtered logits, q [B, k, V] the draft's distributions (None:
    prompt lookup, a point mass at each draft), sk [B] the step's keys."""
    k = drafts.shape[1]
    z_n = jnp.take_along_axis(z, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    p_n = _softmax(z_n)
    d_n = jnp.take_along_axis(drafts, jnp.minimum(n_acc, k - 1)[:, None], axis=1)[:, 0]
    if q is not None:
        q_n = jnp.take_along_axis(q, jnp.minimum(n_acc, k - 1)[:, None, None], axis=1)[:, 0]
    else:
        q_n = jax.nn.one_hot(d_n, z.shape[-1], dtype=jnp.float32)
    q_n = jnp.where((n_acc < n_draft)[:, None], q_n, 0.0)
    r = jnp.maximum(p_n - q_n, 0.0)
    r = jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, p_n)
    drawn = jax.vmap(lambda key, rr: jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(rr)))(sk, r)
    return jnp.where(greedy, sampling.argmax(z_n), drawn).astype(jnp.int32)


def _softmax(z):
    """softmax over the last axis; a row with no finite logit gives zeros (not NaN)."""
    ok = jnp.any(z > NEG_INF, axis=-1, keepdims=True)
    p = jax.nn.softmax(jnp.where(ok, z, 0.0), axis=-1)
    return jnp.where(ok & (z > NEG_INF), p, 0.0)


def _write_unrevealed(state: DecodeState, offset, value):
    """state.tokens with value [B, W] written at [offset, offset + W) where a slot is not revealed."""
    W = value.shape[1]
    keep = common.window(state.revealed, offset, W)
    return common.set_window(state.tokens, offset, jnp.where(keep, common.window(state.tokens, offset, W), value))


def prompt_lookup(state: DecodeState, c, k: int, min_ngram: int, max_ngram: int):
    """Prompt-lookup drafts: (drafts [B, k], count [B]) for slots c..c+k-1.

    The row's text is slots [start, c). For each earlier end slot e, the match length is how
    many tokens ending at e equal those ending at c - 1 (up to max_ngram); the longest match
    >= min_ngram wins, the most recent among equals, and the drafts are the tokens after it
    (at most k, and only those before c).
    """
    toks = state.tokens  # [B, S]
    S = state.slots
    e = jnp.arange(S, dtype=jnp.int32)[None]  # [1, S] candidate end slots
    last = c - 1  # [B]
    start = state.start[:, None]
    run = jnp.ones((state.batch, S), jnp.int32)
    length = jnp.zeros((state.batch, S), jnp.int32)
    for i in range(max_ngram):
        src = jnp.roll(toks, i, axis=1)  # src[:, e] = toks[:, e - i]
        tail = jnp.take_along_axis(toks, jnp.clip(last - i, 0, S - 1)[:, None], axis=1)  # [B, 1]
        ok = (src == tail) & (e - i >= start) & ((last - i)[:, None] >= start)
        run = run * ok.astype(jnp.int32)
        length = length + run
    valid = (e < last[:, None]) & (e >= start) & (length >= min_ngram)
    score = jnp.where(valid, length * S + e, -1)
    best = jnp.argmax(score, axis=-1).astype(jnp.int32)  # [B]
    found = jnp.max(score, axis=-1) >= 0
    count = jnp.where(found, jnp.minimum(k, last - best), 0).astype(jnp.int32)
    drafts = common.window(toks, best + 1, k)
    return drafts, count


def _first_difference(target: dict, draft: dict) -> str:
    """How two vocabularies (token -> id) differ: the lowest id that reads differently, else the first
    token (sorted) whose id differs (possible only where a vocabulary puts two tokens on one id)."""
    DRAFT, TARGET = "the draft's tokenizer", "the target's"  # noqa: N806

    def by_id(v):
        out: dict = {}
        for tok, i in v.items():
            out.setdefault(int(i), tok)
        return out

    def read(v, key, who):
        return f"{v[key]!r} in {who}" if key in v else f"missing from {who}"

    ia, ib = by_id(target), by_id(draft)
    for i in sorted(set(ia) | set(ib)):
        if ia.get(i) != ib.get(i):
            return f"token id {i} is {read(ib, i, DRAFT)} but {read(ia, i, TARGET)}"
    tok = next(t for t in sorted(set(target) | set(draft), key=str) if target.get(t) != draft.get(t))

    def has(v, who):
        return f"has id {v[tok]} in {who}" if tok in v else f"is missing from {who}"

    return f"token {tok!r} {has(draft, DRAFT)} but {has(target, TARGET)}"


__all__ = ["Speculative", "PROPOSERS", "prompt_lookup", "accept_drafts", "propose_draft", "correction"]
