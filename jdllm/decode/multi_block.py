"""`multi_block`: d3LLM pipelined parallel decoding, several blocks in flight.

Blocks
------
The generation region is cut into blocks of `block_size` slots. Block-causal
models use their absolute block grid (as `block_diffusion`: rows are
left-padded so every row's first decode block starts at slot `base` =
prefill_len, the prompt remainder sits pre-revealed at its start); the last
block is whole, its slots past the row's limit hold the mask token and are
never generated (as in `block_diffusion`).
Bidirectional models start block 0 at the first generated slot; their canvas
is right-aligned so every row's canvas ends exactly at prompt + max_new_tokens
(= slot S), which is what a full-attention forward must see.

Each block moves Inactive -> Activated -> Fully-Activated -> Completed; its
progress is the fraction of its slots (below the row's limit; prompt slots
count) that hold a token. Per step, in this order:

1. EOS early stop (`early_stop`, with the sampling stop ids): after the
   leftmost revealed stop token every generation slot becomes that token
   (revealed, step_map 0, log-prob 0); blocks wholly after it, and added
   blocks left without masks, are Completed. Rows that can stop, stop.
2. Activation: an Activated block whose predecessor's progress >=
   decoded_token_threshold becomes Fully-Activated (block 0 starts so).
3. Adding: when the newest block's progress >= block_add_threshold or it has no
   masks, the next block is added, Fully-Activated at once if the newest block's
   progress >= decoded_token_threshold, else Activated. No cap by default, as
   in d3LLM; `max_blocks=K` (a jdllm option, for memory) allows at most K
   blocks from the row's first non-Completed block to its newest one and
   sizes the slots in flight and the KV-cache windows from it.
4. One forward. active_end = end of the rightmost Activated / Fully-Activated
   block (each such block has masks).
5. Candidates: masked slots before active_end (float32 entropy of the sampling
   distribution; ties go to the leftmost). `selection`:
   "llada" (d3LLM's LLaDA sampler, `get_transfer_index_entropy`): the
   lowest-entropy candidate plus every one with entropy <= entropy_threshold;
   "dream" (d3LLM's Dream sampler, `_sample_multi_block`): every candidate with
   entropy < entropy_threshold (strict), no guaranteed pick;
   "auto" (default): "dream" on shifted-logit bidirectional models (the Dream
   family), "llada" on the others (block-causal models included, for which
   d3LLM has no multi-block decoder).
6. Forced progress, `forced_progress`: "first" (default, d3LLM): the first
   Fully-Activated block with masks, if it got nothing in 5, reveals its
   lowest-entropy masked slot; "every" (jdllm's earlier rule): every such
   block that got nothing does (more tokens per forward, not d3LLM's
   outputs).
7. One `common.reveal` (one step number), then added blocks without masks
   become Completed.

Known differences from d3LLM's code, kept on purpose: d3LLM takes its mask
set before the EOS fill, so slots the fill just wrote stay candidates for
that step (jdllm never overwrites a filled slot); d3LLM counts one NFE for an
iteration that only early-stops (no forward runs; jdllm counts forwards);
d3LLM's entropies are float64 (jdllm's float32: a tie at the threshold can
break the other way).

Block states stay in `state.extra["block_state"]` [B, NB] and the step each
block entered a state in `state.extra["block_steps"]` [B, NB, 3] (columns:
Activated, Fully-Activated, Completed; -1 = never). Entering Activated or
Fully-Activated in phases 2-3 of step t records t (step t's forward sees it);
Completed by step t's reveals records t; Completed by the EOS fill at the
start of step t records t - 1 (the reveal that caused it). So during step t's
forward a block is Completed iff 0 <= C < t, else Fully-Activated iff 0 <= F
<= t, else Activated iff 0 <= A <= t, else Inactive. `Output.trace` carries
both arrays per row (`block_state`, `block_steps`).

KV cache
--------
`cache="none"`: every step runs the model without a cache, over the whole
canvas for bidirectional models and over the prefix [0, active_end) for
block-causal ones (rounded up to prefill_len + 1, 2, 4, ... blocks: a few
static shapes).

`cache="exact"` (the default for block-causal models, `"auto"`): slots
[0, cache.length) hold clean K/V; each forward covers a window starting at
cache.length, the narrowest of 1, 2, 4, ... blocks (up to 2 * max_blocks)
that reaches the active end. Commits cost no
forward: the blocks that were already Completed *before* a forward (so the
forward ran on their final tokens) are committed right after it, up to the
first block some running row still has in flight. A block completed by a
step's reveal therefore rides along in the next forward, which writes its
clean K/V; K/V written while a block still had masks are never committed.
Under block-causal attention nothing after active_end influences the window,
so the logits equal the no-cache forward's and so does the output. In a batch
the window sits at the slowest row's frontier; when a row ahead does not fit
the step runs one full forward instead (same result, more compute). The
first step starts from an empty cache at slot 0 (a window when the prompt's
whole blocks are short enough, else the full forward); it writes the prompt's
blocks, which are committed right after it.

`cache="approx"` (bidirectional models, off by default): d3LLM's delayed
prefix cache, `generate_multi_block_kv_cache` (d3llm_llada_generate_util.py),
per row. The cache holds the K/V of slots [0, edge) (cache.length); the
prompt is complete at forward 0, a generation block counts as complete from
the first forward whose caching scan reaches it without masks. The scan walks
the blocks past the edge in order and stops at the first that has masks or
has been complete for fewer than `cache_delay_iter` forwards; the edge moves
to the end of the blocks it passed. Then the forward (n = the row's forward
number): if the edge moved, the suffix [old edge, S) against the cached
prefix, whose fresh K/V up to the new edge join the cache; else, with a
cache, no block "stabilising" (complete, scanned, not cached) and n %
`refresh_interval` != 0, the same suffix forward; else a full forward, whose
K/V replace the cached prefix (a refresh). So the suffix always runs to the
canvas end, future masks included, and the prefix K/V are those of the
forward that cached or last refreshed them (stale: later reveals are not
seen there). The batch runs one forward whose window ends at S and starts at
or before every row's own first slot (its edge, or 0), the narrowest of 1,
2, 4, ... blocks or the canvas; `forward(keep_below=...)` keeps each row's
cached prefix as it is, so a row computes what it computes alone.
`tests/reference_multi_block.py` replays d3LLM's cache with explicit K/V.
Blocks the EOS early stop completes without their being added are, as d3LLM
creates them, complete at that forward and marked cached: the scan passes
them after the delay without caching them, and they never stabilise.
Shifted-logit models (Dream) follow d3LLM's Dream version,
`_sample_multi_block_kv_cache` (d3llm_dream_generate_util.py), which differs
in two ways: its scan does not stop at a complete block still inside its
delay (only at masks), so a block's delay starts as soon as every block
before it has no masks; and it shifts the logits within each forward, so a
suffix forward predicts its first slot (the cache edge) from that slot's own
output. One thing is not reproduced: when two or more blocks are stabilising
at a refresh, d3LLM truncates the refreshed K/V at the start of the latest
one, past its cache edge, and its next suffix forward then attends to those
slots twice (its cache outgrows `manual_cache_length`); jdllm keeps the
refreshed prefix at the edge, as the LLaDA version (where at most one block
is ever stabilising) always does.

`cache="window"` (bidirectional models; jdllm's earlier approximation, kept
for comparison, see benchmarks/RESULTS.md): the cache holds K/V for the whole
canvas from the last full forward; a step recomputes only a window of
`max_blocks + 1` blocks (`WINDOW_BLOCKS + 1` without a cap) starting at the first block that is not yet frozen (a
block freezes `cache_delay_iter` steps after it is Completed; with 0 it
freezes with the K/V of its last masked state) and attends to the stale
cached K/V everywhere else, future masks included (the window sees the
cached slots after it through `forward(kv_len=S)`); d3LLM instead recomputes
the whole suffix from its prefix cache's edge (`cache="approx"`). Not
d3LLM's algorithm, but the fastest of the two on the CPU (fewer slots per
step). Every
`refresh_interval` steps, and whenever the active blocks do not fit in the
window, a full forward refreshes everything. Output may differ from the exact
run (the benchmark measures by how much); `refresh_interval=1` is the exact
run.

Step split (`jdllm.decode.loop`): `plan` runs phases 1-3 and names the slots
in flight, row b's [first non-Completed block, + max_blocks blocks) (every
candidate lies there; without a cap: the whole generation region, which is
then the LM head's width at every step: set `max_blocks` to bound it);
`forward` is phase 4 and computes the LM head only at
those slots (plus the last committed slot on shifted models); `reveal` is
phases 5-7. A constraint's bitmask covers the planned slots.

Sampling: `common.sample_window`: at temperature > 0 the token at position q
of a row draws with fold_in(step key, q), so the draw does not depend on the
window's shape and cache / no-cache runs sample the same tokens.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors
from jdllm.decode import common
from jdllm.decode.protocol import Paradigm
from jdllm.model import default_positions, forward
from jdllm.sampling import Sample
from jdllm.state import DecodeState, generated_mask, slot_index

INACTIVE, ACTIVATED, FULLY_ACTIVATED, COMPLETED = 0, 1, 2, 3
BLOCK_STATES = ("inactive", "activated", "fully_activated", "completed")
CACHE_MODES = ("auto", "none", "exact", "approx", "window")
FORCED_PROGRESS = ("first", "every")
SELECTIONS = ("auto", "llada", "dream")
WINDOW_BLOCKS = 4  # cache="window" recomputes this many blocks (+ 1) when max_blocks is None


@dataclasses.dataclass(frozen=True)
class MultiBlock(Paradigm):
    """d3LLM multi-block decoding (see the module docstring for the exact step).

    block_size: slots per block (block-causal: the attention block grid too).
    entropy_threshold: reveal every candidate with entropy <= this (nats, >= 0).
    block_add_threshold: add the next block once the newest one's progress
      reaches this, in [0, 1].
    decoded_token_threshold: a block is Fully-Activated once its predecessor's
      progress reaches this, in [0, 1].
    early_stop: fill everything after the first revealed stop token with it.
    max_forwards: stop a row after this many forwards (finish_reason "abort",
      output up to its first masked slot); None = no cap.
    max_blocks: None (default, d3LLM: no cap) or the most blocks in flight per
      row, counted from its first non-Completed block (>= 1; a jdllm option that
      bounds memory: the LM head's width and the KV-cache windows; it changes
      outputs at aggressive thresholds).
    forced_progress: "first" (d3LLM: force a token in the first Fully-Activated
      block with masks when it got none) or "every" (in each such block).
    selection: "auto" (d3LLM's rule for the model family), "llada" (lowest
      entropy + all <= entropy_threshold) or "dream" (all < entropy_threshold).
    cache: "auto" (exact for block-causal models, none for bidirectional ones),
      "none", "exact" (block-causal only), "approx" (d3LLM's delayed prefix
      cache) or "window" (jdllm's windowed variant), both bidirectional only.
    cache_delay_iter, refresh_interval: the approximate caches' delay (forwards
      after a block completes before it is cached, >= 0) and full-refresh
      period (forwards, >= 1); d3LLM's chat script uses cache_delay_iter=2.
    """

    name: ClassVar[str] = "multi_block"
    joins_running_batch: ClassVar[bool] = False  # rows share one block grid and prefill length
    trace_keys: ClassVar[tuple[str, ...]] = ("num_blocks", "block_state", "block_steps")  # what output_trace reads

    block_size: int = 32
    entropy_threshold: float = 0.9
    block_add_threshold: float = 0.5
    decoded_token_threshold: float = 0.5
    early_stop: bool = True
    max_forwards: int | None = None
    max_blocks: int | None = None
    forced_progress: str = "first"
    selection: str = "auto"
    cache: str = "auto"
    cache_delay_iter: int = 1
    refresh_interval: int = 10000

    def __post_init__(self):
        def integer(name, lo):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < lo:
                raise errors.DecodingConfigError(f"{name}={v!r} must be an integer >= {lo}")

        integer("block_size", 1)
        if self.max_blocks is not None:
            integer("max_blocks", 1)
        integer("cache_delay_iter", 0)
        integer("refresh_interval", 1)
        if self.max_forwards is not None:
            integer("max_forwards", 1)
        if not (np.isfinite(self.entropy_threshold) and self.entropy_threshold >= 0):
            raise errors.DecodingConfigError(
                f"entropy_threshold={self.entropy_threshold} must be a finite entropy >= 0 (nats)")
        for name in ("block_add_threshold", "decoded_token_threshold"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise errors.DecodingConfigError(f"{name}={v} must be a fraction in [0, 1]")
        if not isinstance(self.early_stop, bool):
            raise errors.DecodingConfigError(f"early_stop={self.early_stop!r} must be True or False")
        if self.forced_progress not in FORCED_PROGRESS:
            raise errors.DecodingConfigError(
                f"forced_progress={self.forced_progress!r} is not one of {FORCED_PROGRESS}")
        if self.selection not in SELECTIONS:
            raise errors.DecodingConfigError(f"selection={self.selection!r} is not one of {SELECTIONS}")
        if self.cache not in CACHE_MODES:
            raise errors.DecodingConfigError(f"cache={self.cache!r} is not one of {CACHE_MODES}")

    # ----------------------------------------------------------------- host side
    def validate(self, cfg) -> None:
        common.require_diffusion_model("multi_block", cfg, ("block_causal", "bidirectional"), "jdllm.AR")
        if self.cache == "exact" and cfg.attention != "block_causal":
            raise errors.DecodingConfigError(
                "cache='exact' needs a block-causal model; for bidirectional models use cache='none' "
                "or the approximate cache='approx'")
        if self.cache in ("approx", "window") and cfg.attention != "bidirectional":
            raise errors.DecodingConfigError(
                f"cache={self.cache!r} is for bidirectional models; block-causal models get the exact "
                "cache with cache='exact' (or 'auto')")
        if cfg.attention == "block_causal" and self.block_size != cfg.block_size:
            warnings.warn(f"block_size={self.block_size} differs from the model's trained "
                          f"block_size={cfg.block_size}; quality may suffer", stacklevel=3)

    def cache_mode(self, cfg) -> str:
        """The cache actually used: "none", "exact" or "approx"."""
        if self.cache == "auto":
            return "exact" if cfg.attention == "block_causal" else "none"
        return self.cache

    def selection_rule(self, cfg) -> str:
        """The reveal rule actually used: "llada" or "dream" (d3LLM's per family under "auto")."""
        if self.selection != "auto":
            return self.selection
        return "dream" if cfg.attention == "bidirectional" and cfg.logit_shift else "llada"

    def _flight_width(self, ctx, S: int) -> int:
        """Static width of the slots in flight: max_blocks blocks, or the generation region."""
        if self.max_blocks is None:
            return S - ctx.prefill_len
        return min(self.max_blocks * self.block_size, S)

    def attention_config(self, cfg):
        """Block-causal models attend on the block_size grid."""
        if cfg.attention != "block_causal" or cfg.block_size == self.block_size:
            return cfg
        return cfg.replace(block_size=self.block_size)

    def layout(self, lengths: np.ndarray, max_new_tokens: int, cfg) -> common.Layout:
        Bs = self.block_size
        lengths = np.asarray(lengths, np.int64)
        if cfg.attention == "block_causal":
            nb = lengths // Bs
            N = common.bucket(int(nb.max()), 0)
            G = common.bucket(max_new_tokens, 16, steps_per_octave=4)  # bucket the tokens, not blocks
            gen_blocks = -(-(Bs - 1 + G) // Bs)
            start = (Bs * (N - nb)).astype(np.int32)
            gen_start = (N * Bs + lengths % Bs).astype(np.int32)
            return common.Layout(start=start, gen_start=gen_start, slots=(N + gen_blocks) * Bs,
                                 prefill_len=N * Bs)
        # bidirectional: right-aligned, every row's canvas ends at S = gen_start + max_new_tokens
        P = common.bucket(int(lengths.max()), 16)
        S = P + common.bucket(max_new_tokens, 16, steps_per_octave=4)
        gen_start = np.full(lengths.shape, S - max_new_tokens, np.int32)
        return common.Layout(start=(gen_start - lengths).astype(np.int32), gen_start=gen_start, slots=S,
                             prefill_len=0)

    def max_iterations(self, state: DecodeState) -> int:
        bound = state.slots + 8
        return bound if self.max_forwards is None else min(bound, self.max_forwards + 1)

    def replay_approximation(self) -> str | None:
        if self.cache == "approx":
            return "MultiBlock(cache='approx') is d3LLM's approximate delayed prefix cache"
        if self.cache == "window" and self.refresh_interval != 1:
            return f"MultiBlock(cache='window', refresh_interval={self.refresh_interval}) is an approximate cache"
        return None

    def output_trace(self, extra: dict, row: int) -> dict:
        """Per-row analysis arrays for `Output.trace` (host numpy `extra`)."""
        nb = int(extra["num_blocks"][row])
        return {"block_state": [int(x) for x in extra["block_state"][row, :nb]],
                "block_steps": [[int(y) for y in x] for x in extra["block_steps"][row, :nb]]}

    # ----------------------------------------------------------------- geometry
    def _num_blocks(self, ctx, state: DecodeState) -> int:
        """Static number of block columns NB (covers every row's generation)."""
        Bs, S = self.block_size, state.slots
        if ctx.model.attention == "block_causal":
            return (S - ctx.prefill_len) // Bs
        return -(-S // Bs)

    def _view(self, state: DecodeState, base, NB: int):
        """Slot index [NB*Bs] (clipped into the canvas) and validity [B, NB, Bs] of the block grid."""
        Bs, S = self.block_size, state.slots
        raw = base + jnp.arange(NB * Bs, dtype=jnp.int32)  # [NB*Bs]
        ok = (raw[None] < state.limit[:, None]) & (raw[None] < S)  # [B, NB*Bs]
        return jnp.minimum(raw, S - 1), ok.reshape(-1, NB, Bs)

    def _stats(self, state: DecodeState, idx, ok):
        """(size, decoded) per block [B, NB]: slots below the limit, and those holding a token."""
        rev = jnp.take(state.revealed, idx, axis=1).reshape(ok.shape) & ok  # [B, NB, Bs]
        return jnp.sum(ok, -1).astype(jnp.int32), jnp.sum(rev, -1).astype(jnp.int32)

    @staticmethod
    def _reached(decoded, size, threshold: float):
        """progress = decoded / size >= threshold, per block [B, NB]."""
        return decoded.astype(jnp.float32) >= jnp.float32(threshold) * size.astype(jnp.float32)

    @staticmethod
    def _stamp(steps_arr, old, new, step_no):
        """Record step_no [B] for blocks entering states 1..3 (first entry only)."""
        cols = []
        for s in (ACTIVATED, FULLY_ACTIVATED, COMPLETED):
            col = steps_arr[..., s - 1]
            hit = (new == s) & (old != s) & (col < 0)
            cols.append(jnp.where(hit, step_no[:, None], col))
        return jnp.stack(cols, axis=-1)

    @staticmethod
    def _first_open(st):
        """First block that is not Completed [B] (NB when all are)."""
        NB = st.shape[-1]
        k = jnp.arange(NB, dtype=jnp.int32)
        return jnp.min(jnp.where(st != COMPLETED, k, NB), axis=-1).astype(jnp.int32)

    # ----------------------------------------------------------------- phases 1-3
    def _early_stop(self, ctx, state: DecodeState, idx, ok, base) -> DecodeState:
        if not self.early_stop:
            return state
        s = slot_index(state)
        S = state.slots
        gen = generated_mask(state)
        is_eos = gen & state.revealed & common.is_stop_token(state)
        first = jnp.min(jnp.where(is_eos, s, S), axis=-1)  # [B]
        eos = jnp.take_along_axis(state.tokens, jnp.minimum(first, S - 1)[:, None], axis=-1)  # [B, 1]
        fill = gen & (s > first[:, None]) & ~state.done[:, None]
        state = state.replace(tokens=jnp.where(fill, eos, state.tokens), revealed=state.revealed | fill,
                              step_map=jnp.where(fill, 0, state.step_map),
                              logprobs=jnp.where(fill, 0.0, state.logprobs))
        st = state.extra["block_state"]
        NB, Bs = st.shape[-1], self.block_size
        block_start = base + Bs * jnp.arange(NB, dtype=jnp.int32)  # [NB]
        exists = jnp.any(ok, -1)
        after = (block_start[None] > first[:, None]) & exists & ~state.done[:, None]
        new = jnp.where(after, COMPLETED, st)
        size, dec = self._stats(state, idx, ok)
        new = jnp.where(((new == ACTIVATED) | (new == FULLY_ACTIVATED)) & (dec >= size), COMPLETED, new)
        bsteps = self._stamp(state.extra["block_steps"], st, new, state.steps)
        state = state.replace(extra={**state.extra, "block_state": new, "block_steps": bsteps})
        return common.finish_rows(state)

    def _activate_and_add(self, state: DecodeState, idx, ok) -> DecodeState:
        st = state.extra["block_state"]
        NB = st.shape[-1]
        k = jnp.arange(NB, dtype=jnp.int32)
        size, dec = self._stats(state, idx, ok)
        exists = size > 0
        passed = self._reached(dec, size, self.decoded_token_threshold)  # [B, NB]
        pred_passed = jnp.concatenate([jnp.ones_like(passed[:, :1]), passed[:, :-1]], axis=-1)
        running = ~state.done[:, None]
        new = jnp.where((st == ACTIVATED) & pred_passed & running, FULLY_ACTIVATED, st)
        # adding: the newest added block decides
        last = jnp.max(jnp.where((new != INACTIVE) & exists, k, -1), axis=-1)  # [B]
        li = jnp.maximum(last, 0)[:, None]
        at = lambda x: jnp.take_along_axis(x, li, axis=-1)[:, 0]  # noqa: E731
        last_size, last_dec = at(size), at(dec)
        trigger = self._reached(last_dec, last_size, self.block_add_threshold) | (last_dec >= last_size)
        nxt = last + 1
        nxt_ok = (nxt < NB) & jnp.take_along_axis(
            jnp.concatenate([exists, jnp.zeros_like(exists[:, :1])], -1), jnp.minimum(nxt, NB)[:, None], -1)[:, 0]
        cap = True if self.max_blocks is None else nxt < self._first_open(new) + self.max_blocks
        add = trigger & nxt_ok & cap & (last >= 0) & ~state.done
        kind = jnp.where(self._reached(last_dec, last_size, self.decoded_token_threshold),
                         FULLY_ACTIVATED, ACTIVATED)
        new = jnp.where(add[:, None] & (k[None] == nxt[:, None]) & (new == INACTIVE), kind[:, None], new)
        bsteps = self._stamp(state.extra["block_steps"], st, new, state.steps + 1)
        return state.replace(extra={**state.extra, "block_state": new, "block_steps": bsteps})

    # ----------------------------------------------------------------- the canvas view of a window
    @staticmethod
    def _to_canvas(s: Sample, offset, S: int) -> Sample:
        """Place a window's Sample [B, W] (offset scalar or [B]) on the whole canvas [B, S]
        (entropy +inf elsewhere)."""
        B = s.token.shape[0]

        def put(x, fill):
            return common.set_window(jnp.full((B, S), fill, x.dtype), offset, x)

        return Sample(token=put(s.token, 0), prob=put(s.prob, 0.0), entropy=put(s.entropy, jnp.inf),
                      logprob=put(s.logprob, 0.0))

    # ----------------------------------------------------------------- forwards
    def _prefix_logits(self, params, ctx, state: DecodeState, width: int, at):
        """No cache: the model over slots [0, width) alone -> (state, logits predicting `at` [B, N, V])."""
        tokens = state.tokens[:, :width]  # [B, W]
        positions = default_positions(state.start, 0, width)
        idx = jnp.clip(common.head_index(ctx, at, 0), 0, width - 1)
        logits, _ = forward(params, ctx.model, tokens, positions, start=state.start, attn_impl=ctx.attn_impl,
                            logits_at=idx)
        return state.replace(forwards=state.forwards + 1), logits

    def _nocache_forward(self, params, ctx, state: DecodeState, at, active_end):
        """Bidirectional: the whole canvas. Block-causal: the prefix up to active_end, rounded up to
        base + 2^i blocks (a few static widths; later slots cannot change these logits)."""
        S, Bs = state.slots, self.block_size
        if ctx.model.attention != "block_causal":
            return self._prefix_logits(params, ctx, state, S, at)
        widths, w = [], Bs
        while ctx.prefill_len + w < S:
            widths.append(ctx.prefill_len + w)
            w *= 2
        need = jnp.max(jnp.where(~state.done, active_end, 0))
        return common.switch_width(ctx, state, widths + [S], need,
                                   lambda w: lambda st: self._prefix_logits(params, ctx, st, w, at))

    # ----------------------------------------------------------------- the step
    def prefill(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        """Set up the block grid (block 0 Fully-Activated); no forward.

        The first step then runs on an empty cache: its window cannot cover the
        prompt, so it takes the full forward, which also fills the cache with
        the prompt's blocks (committed right after it).
        """
        B = state.batch
        if ctx.model.attention == "block_causal":
            base = jnp.asarray(ctx.prefill_len, jnp.int32)
        else:
            base = jnp.min(state.gen_start).astype(jnp.int32)
        NB = self._num_blocks(ctx, state)
        _, ok = self._view(state, base, NB)
        num = jnp.sum(jnp.any(ok, -1), -1).astype(jnp.int32)
        st = jnp.zeros((B, NB), jnp.int32).at[:, 0].set(FULLY_ACTIVATED)
        bsteps = jnp.full((B, NB, 3), -1, jnp.int32).at[:, 0, FULLY_ACTIVATED - 1].set(0)
        extra = dict(block_state=st, block_steps=bsteps, base=base, num_blocks=num,
                     completed_at=jnp.full((B, NB), -1, jnp.int32), scanned_at=jnp.full((B, NB), -1, jnp.int32))
        return state.replace(extra=extra)

    def _frontier(self, state: DecodeState):
        """(active_end [B], candidate slots [B, S]): masked generation slots of running rows before
        the end of their rightmost Activated / Fully-Activated block."""
        st = state.extra["block_state"]
        k = jnp.arange(st.shape[-1], dtype=jnp.int32)
        in_flight = (st == ACTIVATED) | (st == FULLY_ACTIVATED)
        newest = jnp.max(jnp.where(in_flight, k, -1), axis=-1)  # [B]
        active_end = state.extra["base"] + (newest + 1) * self.block_size  # [B]; = base when nothing is in flight
        cand = (generated_mask(state) & ~state.revealed & ~state.done[:, None]
                & (slot_index(state) < active_end[:, None]))
        return active_end, cand

    def plan(self, ctx, state: DecodeState):
        """Phases 1-3, then the slots in flight: row b's [first open block, + max_blocks blocks)."""
        base = state.extra["base"]
        NB = self._num_blocks(ctx, state)
        idx, ok = self._view(state, base, NB)
        state = self._early_stop(ctx, state, idx, ok, base)
        state = self._activate_and_add(state, idx, ok)
        _, cand = self._frontier(state)
        width = self._flight_width(ctx, state.slots)
        p = common.make_plan(state, base + self._first_open(state.extra["block_state"]) * self.block_size, width)
        return state, dataclasses.replace(p, valid=common.window(cand, p.offset, width))

    def forward(self, params, ctx, state: DecodeState, plan: common.Plan):
        """Phase 4: one forward, per the cache mode; logits predicting the planned slots."""
        mode = self.cache_mode(ctx.model)
        active_end, _ = self._frontier(state)
        rows = jnp.any(plan.valid, axis=-1)  # [B] rows with work in this forward
        at = plan.slots
        if mode == "none":
            state, logits = self._nocache_forward(params, ctx, state, at, active_end)
        elif mode == "exact":
            state, logits = self._exact_forward(params, ctx, state, at, active_end)
        elif mode == "approx":
            state, logits = self._approx_forward(params, ctx, state, at)
        else:
            state, logits = self._window_forward(params, ctx, state, at, active_end)
        return common.count_forward(state, rows), logits

    def reveal(self, ctx, state: DecodeState, plan: common.Plan, logits, bitmask=None) -> DecodeState:
        """Phases 5-7 (module docstring). bitmask: optional packed [B, N, ceil(V/32)] over the plan."""
        Bs = self.block_size
        base = state.extra["base"]
        NB = self._num_blocks(ctx, state)
        idx, ok = self._view(state, base, NB)
        st = state.extra["block_state"]
        _, cand = self._frontier(state)
        running = ~state.done
        state, s = common.sample_window(ctx, state, logits, plan.offset, bitmask, rows=jnp.any(plan.valid, -1))
        s = self._to_canvas(s, plan.offset, state.slots)

        # phase 5: the family's rule (module docstring)
        s_idx = slot_index(state)
        ent = jnp.where(cand, s.entropy, jnp.inf)  # [B, S]
        if self.selection_rule(ctx.model) == "dream":
            sel = cand & (s.entropy < self.entropy_threshold)
        else:
            lowest = jnp.argmin(ent, axis=-1)  # [B], leftmost among ties
            sel = cand & ((s.entropy <= self.entropy_threshold) | (s_idx == lowest[:, None]))
        # phase 6: forced progress for the first (or every) Fully-Activated block with masks that got nothing
        size, dec = self._stats(state, idx, ok)
        view = lambda x: jnp.take(x, idx, axis=1).reshape(ok.shape)  # noqa: E731  [B, NB, Bs]
        masked_v = ~view(state.revealed) & ok
        got = jnp.any(view(sel) & ok, axis=-1)  # [B, NB]
        eligible = (st == FULLY_ACTIVATED) & (dec < size)  # [B, NB]
        if self.forced_progress == "first":
            k = jnp.arange(eligible.shape[-1], dtype=jnp.int32)
            eligible = eligible & (k[None] == jnp.argmax(eligible, axis=-1)[:, None])
        need = eligible & ~got & running[:, None]
        pick = jnp.argmin(jnp.where(masked_v, view(ent), jnp.inf), axis=-1)  # [B, NB]
        forced_v = need[..., None] & masked_v & (jnp.arange(Bs)[None, None] == pick[..., None])
        forced = jnp.zeros_like(sel).at[:, idx].max(forced_v.reshape(state.batch, -1))
        # phase 7
        state = common.reveal(state, 0, sel | (forced & cand), s)
        size, dec = self._stats(state, idx, ok)
        new = jnp.where(((st == ACTIVATED) | (st == FULLY_ACTIVATED)) & (dec >= size), COMPLETED, st)
        bsteps = self._stamp(state.extra["block_steps"], st, new, state.steps)
        done_at = state.extra["completed_at"]
        done_at = jnp.where((new == COMPLETED) & (done_at < 0), state.forwards, done_at)
        state = state.replace(extra={**state.extra, "block_state": new, "block_steps": bsteps,
                                     "completed_at": done_at})
        state = common.finish_rows(state)
        if self.max_forwards is not None:
            state = common.close_rows(state, ~state.done & (state.nfe >= self.max_forwards), common.ABORT)
        return state

    # ----------------------------------------------------------------- host edits (constrained decoding)
    def rewind(self, ctx, state: DecodeState, before: DecodeState, remasked, written) -> DecodeState:
        """Bookkeeping after a host edited slots between steps (`jdllm.constraints.guidance`: its
        grammar matcher re-masked provisional tokens it rejected, [B, S] `remasked`, or wrote forced
        ones, `written`); `before` is the state the edits were applied to. Pure; the unconstrained
        loop never calls it.

        1. EOS fill: a re-masked slot that held a stop token takes back the early-stop fill it
           caused (every generation slot after it that the fill wrote, step_map 0, is masked again).
        2. Block states: a Completed block that has masks again reopens in the state it reached
           before (Fully-Activated or Activated; Inactive when only the EOS fill completed it); its
           Completed stamp and cache counters are cleared. An Activated / Fully-Activated block the
           writes filled becomes Completed (as phase 7).
        3. KV cache: no row keeps committed K/V at or after the start of its first edited block
           (block-causal attention: a block's K/V depend on all of its slots).
        """
        Bs, S = self.block_size, state.slots
        s_idx = slot_index(state)
        if self.early_stop:
            stop_rm = remasked & common.is_stop_token(before)
            first = jnp.min(jnp.where(stop_rm, s_idx, S), axis=-1)  # [B]
            unfill = (generated_mask(state) & state.revealed & (state.step_map == 0)
                      & (s_idx > first[:, None]))
            state = state.replace(tokens=jnp.where(unfill, common.fill_token(ctx.model), state.tokens),
                                  revealed=state.revealed & ~unfill,
                                  logprobs=jnp.where(unfill, 0.0, state.logprobs))
            remasked = remasked | unfill
        base = state.extra["base"]
        NB = self._num_blocks(ctx, state)
        idx, ok = self._view(state, base, NB)
        size, dec = self._stats(state, idx, ok)
        st, bst = state.extra["block_state"], state.extra["block_steps"]
        reopen = (st == COMPLETED) & (dec < size)  # [B, NB]
        was = jnp.where(bst[..., FULLY_ACTIVATED - 1] >= 0, FULLY_ACTIVATED,
                        jnp.where(bst[..., ACTIVATED - 1] >= 0, ACTIVATED, INACTIVE))
        new = jnp.where(reopen, was, st)
        new = jnp.where(((new == ACTIVATED) | (new == FULLY_ACTIVATED)) & (dec >= size) & (size > 0), COMPLETED, new)
        bst = bst.at[..., COMPLETED - 1].set(jnp.where(reopen, -1, bst[..., COMPLETED - 1]))
        bst = self._stamp(bst, st, new, state.steps)
        extra = {**state.extra, "block_state": new, "block_steps": bst,
                 "completed_at": jnp.where(reopen, -1, state.extra["completed_at"]),
                 "scanned_at": jnp.where(reopen, -1, state.extra["scanned_at"])}
        state = state.replace(extra=extra)
        if state.cache is not None:
            edited = remasked | written
            first = jnp.min(jnp.where(edited, s_idx, S), axis=-1)  # [B]
            floor = jnp.where(first < S, base + (first - base) // Bs * Bs, S)
            state = state.replace(cache=state.cache.commit(jnp.minimum(state.cache.length, jnp.maximum(floor, 0))))
        return state

    # ----------------------------------------------------------------- cached forwards
    def _exact_forward(self, params, ctx, state, at, active_end):
        """Window from cache.length; commit the blocks that were Completed before this forward.

        Window widths: 1, 2, 4, ... blocks up to 2 * max_blocks (without a cap: up to the canvas; the
        narrowest that reaches every running row's active end), else the whole canvas. A window that would run off the canvas
        starts earlier instead: it then recomputes some committed slots from their final tokens,
        which rewrites the same K/V. The batch shares one cache length (the slowest row's frontier).
        """
        Bs, S = self.block_size, state.slots
        K = S if self.max_blocks is None else self.max_blocks
        base = state.extra["base"]
        running = ~state.done
        first_open = self._first_open(state.extra["block_state"])  # [B] at forward time
        F = jnp.min(jnp.where(running, first_open, jnp.iinfo(jnp.int32).max))
        L = jnp.max(state.cache.length)
        new_len = jnp.where(jnp.any(running), jnp.maximum(base + F * Bs, L), L).astype(jnp.int32)
        also = jnp.broadcast_to(new_len - 1, (state.batch, 1))  # the last committed slot's raw logits

        def commit(st, logits):
            N = at.shape[1]
            prev = jnp.where(new_len > L, logits[:, N], st.prev_logits)
            return st.replace(cache=st.cache.commit(new_len), prev_logits=prev), logits[:, :N]

        def windowed(width):
            def run(st):
                offset = jnp.minimum(L, S - width)
                logits, st = common.forward_window(params, ctx, st, offset, width, at=at, also=also,
                                                   use_prev=True)
                return commit(st, logits)
            return run

        def full(st):
            logits, st = common.forward_window(params, ctx, st, 0, S, at=at, also=also)
            return commit(st, logits)

        widths, n = [], 1
        while n <= 2 * K and n * Bs < S:
            widths.append(n * Bs)
            n *= 2
        need = jnp.max(jnp.where(running, active_end - L, 0))  # slots the window must cover
        return common.switch_width(ctx, state, widths + [S], need, lambda w: windowed(w) if w < S else full)

    def _approx_forward(self, params, ctx, state, at):
        """d3LLM's delayed prefix cache (`generate_multi_block_kv_cache`), per row; see the module
        docstring. One forward for the batch: the window ends at S and starts at or before every
        running row's own start (its cache edge, or 0 for a full forward); `keep_below` keeps each
        row's cached prefix K/V as they are, stale included, so a row computes what it computes alone.
        """
        Bs, S = self.block_size, state.slots
        base = state.extra["base"]
        NB = self._num_blocks(ctx, state)
        idx, ok = self._view(state, base, NB)
        size, dec = self._stats(state, idx, ok)
        st = state.extra["block_state"]
        running = ~state.done
        n = state.nfe + 1  # [B] the row's forward number (d3LLM's nfe)
        edge = state.cache.length  # [B]
        ends = jnp.minimum(base + Bs * (jnp.arange(NB, dtype=jnp.int32) + 1), S)  # [NB]
        # the caching scan: the prompt (complete at nfe 0), then the added blocks, in order
        complete = (st != INACTIVE) & (size > 0) & (dec >= size)  # [B, NB]
        seen = state.extra["scanned_at"]  # [B, NB] d3LLM's completed_at_nfe (-1: None)
        # blocks the EOS early stop completed without their being added: d3LLM creates them
        # complete at that forward and marks them cached; the scan passes them after the delay,
        # caching nothing, and they never count as stabilising
        bst = state.extra["block_steps"]
        eos = (st == COMPLETED) & (bst[..., ACTIVATED - 1] < 0) & (bst[..., FULLY_ACTIVATED - 1] < 0)
        seen = jnp.where(running[:, None] & eos & (seen < 0), n[:, None], seen)
        since = jnp.where(seen >= 0, n[:, None] - seen, 0)
        ripe = jnp.concatenate([(n >= self.cache_delay_iter)[:, None],
                                complete & (since >= self.cache_delay_iter)], axis=-1)  # [B, 1 + NB]
        col_end = jnp.concatenate([jnp.broadcast_to(base, (state.batch, 1)),
                                   jnp.broadcast_to(ends, st.shape)], axis=-1)
        below = col_end <= edge[:, None]
        eos_col = jnp.concatenate([jnp.zeros_like(eos[:, :1]), eos], axis=-1)
        prefix = lambda go: jnp.cumprod(go.astype(jnp.int32), axis=-1) > 0  # noqa: E731
        if ctx.model.logit_shift:
            # d3LLM's Dream scan goes on past complete blocks still inside their delay (and past the
            # blocks after an EOS, marked cached there) and stops only at masks; it caches the ripe ones
            # (ripeness cannot skip a block: a block is first scanned no earlier than the one before it)
            clear = prefix(below | jnp.concatenate([jnp.ones_like(eos[:, :1]), complete | eos], axis=-1))
            reached = jnp.concatenate([jnp.ones_like(clear[:, :1]), clear[:, :-1]], axis=-1)[:, 1:]
            caches = clear & ripe & ~eos_col
        else:  # LLaDA's scan stops at the first block that is not ripe
            passed = prefix(below | ripe)
            reached = jnp.concatenate([jnp.ones_like(passed[:, :1]), passed[:, :-1]], axis=-1)[:, 1:]
            caches = passed & ~eos_col
        new_edge = jnp.maximum(edge, jnp.max(jnp.where(caches, col_end, 0), axis=-1))
        seen = jnp.where(running[:, None] & reached & complete & (ends[None] > edge[:, None]) & (seen < 0),
                         n[:, None], seen)
        stabilising = jnp.any((seen >= 0) & ~eos & (ends[None] > new_edge[:, None]), axis=-1) | (base > new_edge)
        suffix = (new_edge > edge) | ((edge > 0) & ~stabilising & (n % self.refresh_interval != 0))
        floor = jnp.where(running, jnp.where(suffix, edge, 0), S).astype(jnp.int32)  # [B] first slot recomputed
        commit = jnp.where(running, new_edge, edge)
        state = state.replace(extra={**state.extra, "scanned_at": seen})
        if ctx.model.logit_shift:  # Dream shifts within the forward: a suffix's first slot predicts itself
            own = (running & suffix)[:, None] & (at == floor[:, None])
            at = jnp.where(own, at + 1, at)  # the head then reads slot `floor`'s own output
        # window widths: blocks 1, 2, 4, ... and the whole canvas; the narrowest that reaches every floor
        widths = sorted({S} | {Bs * 2 ** i for i in range(S.bit_length()) if Bs * 2 ** i < S})

        def run(width):
            def f(s_):
                logits, s_ = common.forward_window(params, ctx, s_, S - width, width, at=at, kv_len=S,
                                                   keep_below=floor, commit=commit)
                return s_, logits
            return f

        return common.switch_width(ctx, state, widths, S - jnp.min(floor), run)

    def _window_forward(self, params, ctx, state, at, active_end):
        """jdllm's windowed approximation (cache="window"; see the module docstring)."""
        Bs, S = self.block_size, state.slots
        K = WINDOW_BLOCKS if self.max_blocks is None else self.max_blocks
        base = state.extra["base"]
        lead = int(ctx.model.logit_shift)  # shifted logits: the slot before the window predicts its first
        W = min((K + 1) * Bs + lead, S)
        running = ~state.done
        st = state.extra["block_state"]
        NB = st.shape[-1]
        k = jnp.arange(NB, dtype=jnp.int32)
        done_at = state.extra["completed_at"]
        frozen = (st == COMPLETED) & (done_at >= 0) & (state.forwards - done_at >= self.cache_delay_iter)
        first_live = jnp.min(jnp.where(frozen, NB, k), axis=-1)  # [B] first block not frozen
        first_live = jnp.min(jnp.where(running, first_live, NB))
        offset = jnp.clip(base + first_live * Bs - lead, 0, S - W).astype(jnp.int32)

        def windowed(s_):
            logits, s_ = common.forward_window(params, ctx, s_, offset, W, at=at, kv_len=S)
            return s_, logits

        def full(s_):
            logits, s_ = common.forward_window(params, ctx, s_, 0, S, at=at)
            return s_, logits

        fits = jnp.all(~running | (active_end <= offset + W))
        refresh = state.forwards % self.refresh_interval == 0  # the first forward always refreshes
        return jax.lax.cond(fits & ~refresh, windowed, full, state)


__all__ = ["MultiBlock", "BLOCK_STATES", "CACHE_MODES", "FORCED_PROGRESS", "SELECTIONS", "INACTIVE", "ACTIVATED", "FULLY_ACTIVATED",
           "COMPLETED"]
