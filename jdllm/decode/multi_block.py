"""`multi_block`: d3LLM pipelined parallel decoding, several blocks in flight.

Blocks
------
The generation region is cut into blocks of `block_size` slots, from each
row's own `base` (`state.extra["base"]` [B]: rows of a serving pool sit on
their own layouts and join a running batch at any step; every piece of the step
reads the row's own base, block states, cache length and forward count, so no
row depends on its neighbours). Block-causal models use their absolute block
grid (as `block_diffusion`: in a `generate` batch rows are left-padded so every
row's first decode block starts at slot base = prefill_len, the prompt
remainder sits pre-revealed at its start); the last block is whole, its slots
past the row's limit hold the mask token and are never generated (as in
`block_diffusion`).
Bidirectional models start block 0 at the first generated slot; their canvas
is right-aligned so every row's canvas ends exactly at prompt + max_new_tokens
(= slot S), which is what a full-attention forward must see (a serving row is
moved right on the pool canvas the same way, `row_layout`).

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
7. One `common.write_tokens` (one step number), then added blocks without masks
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
both arrays per row (`block_state`, `block_steps`). The grid and the state
machine (phases 1-3, phase 7's completion, `rewind`'s reopening) are functions
in `jdllm.decode.multi_block_states`.

KV cache
--------
Each mode is one strategy object in `jdllm.decode.multi_block_cache`
(`CACHE_STRATEGIES`, chosen by `MultiBlock.resolved_cache_mode`), whose forward is
phase 4.

`cache_mode="none"`: every step runs the model without a cache, over the whole
canvas for bidirectional models and over the prefix [0, active_end) for
block-causal ones (rounded up to prefill_len + 1, 2, 4, ... blocks: a few
static shapes).

`cache_mode="exact"` (the default for block-causal models, `"auto"`): slots
[0, cache.length) hold clean K/V; each forward covers a window starting at
cache.length, the narrowest of 1, 2, 4, ... blocks (up to 2 * max_blocks)
that reaches the active end. Commits cost no
forward: the blocks that were already Completed *before* a forward (so the
forward ran on their final tokens) are committed right after it, up to the
first block some running row still has in flight. A block completed by a
step's reveal therefore rides along in the next forward, which writes its
clean K/V; K/V written while a block still had masks are never committed.
Under block-causal attention nothing after active_end influences the window,
so the logits equal the no-cache forward's and so does the output. Each row's
window starts at its own cache length (per-row offsets); the batch shares the
window's width, the narrowest that reaches every row's active end (when even
the widest does not, the step runs one full forward: same result, more
compute). On the Pallas kernels, where a switch over three or more widths
would copy the cache every step, a window wider than the narrowest compiled
width runs instead as consecutive windows of that width in a while loop
(`ExactCache.chunked`; the same K/V and logits, as the chunks start on block
boundaries). The
first step starts from an empty cache at slot 0 (a window when the prompt's
whole blocks are short enough, else the full forward, or those chunks); it
writes the prompt's blocks, which are committed right after it.

`cache_mode="approx"` (bidirectional models, off by default): d3LLM's delayed
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
2, 3, 4, 6, 8, 12, ... blocks (two widths per octave; four from 256 slots on:
`common.block_widths`) or the canvas, with the
LM head only inside that window (every candidate lies there); `forward(keep_below=...)` keeps each row's
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

`cache_mode="window"` (bidirectional models; jdllm's earlier approximation, kept
for comparison, see benchmarks/RESULTS.md): the cache holds K/V for the whole
canvas from the last full forward; a step recomputes only a window of
`max_blocks + 1` blocks (`WINDOW_BLOCKS + 1` without a cap) starting at the first block that is not yet frozen (a
block freezes `cache_delay_iter` steps after it is Completed; with 0 it
freezes with the K/V of its last masked state) and attends to the stale
cached K/V everywhere else, future masks included (the window sees the
cached slots after it through `forward(kv_len=S)`); d3LLM instead recomputes
the whole suffix from its prefix cache's edge (`cache_mode="approx"`). Not
d3LLM's algorithm, but the fastest of the two on the CPU (fewer slots per
step). Every
`refresh_interval` steps, and whenever the active blocks do not fit in the
window, a full forward refreshes everything. Periods and freezing count each
row's own forwards (its NFE), and each row's window sits at its own offset; a
step where some row refreshes runs one whole-canvas forward in which the other
rows keep their cached K/V outside their window. Output may differ from the
exact run (the benchmark measures by how much); `refresh_interval=1` is the
exact run.

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

import jax.numpy as jnp
import numpy as np

from jdllm import errors, inputs
from jdllm.decode import common
from jdllm.decode.multi_block_cache import CACHE_STRATEGIES, WINDOW_BLOCKS
from jdllm.decode.multi_block_states import (ACTIVATED, BLOCK_STATES, COMPLETED, FULLY_ACTIVATED, INACTIVE,
                                             activate_and_add, block_stats, block_view, complete_filled, early_stop,
                                             first_open, frontier, gather, init_blocks, num_blocks, reopen_blocks,
                                             scatter_max)
from jdllm.decode.protocol import Paradigm
from jdllm.sampling import Sample
from jdllm.state import DecodeState, generated_mask, slot_index

CACHE_MODES = ("auto", "none", "exact", "approx", "window")
FORCED_PROGRESS = ("first", "every")
SELECTIONS = ("auto", "llada", "dream")
BIDIRECTIONAL_BLOCK_SIZE = 32  # d3LLM's block size for LLaDA / Dream


@dataclasses.dataclass(frozen=True)
class MultiBlock(Paradigm):
    """d3LLM multi-block decoding (see the module docstring for the exact step).

    block_size: slots per block (block-causal: the attention block grid too); None (default) =
      the model's trained block_size, or 32 (d3LLM's) on a bidirectional model.
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
    cache_mode: "auto" (exact for block-causal models, none for bidirectional ones),
      "none", "exact" (block-causal only), "approx" (d3LLM's delayed prefix
      cache) or "window" (jdllm's windowed variant), both bidirectional only (`cache=` is the
      older name, still accepted).
    cache_delay_iter, refresh_interval: the approximate caches' delay (forwards
      after a block completes before it is cached, >= 0) and full-refresh
      period (forwards, >= 1); d3LLM's chat script uses cache_delay_iter=2.
    """

    name: ClassVar[str] = "multi_block"
    trace_keys: ClassVar[tuple[str, ...]] = ("num_blocks", "block_state", "block_steps")  # what output_trace reads

    block_size: int | None = None
    entropy_threshold: float = 0.9
    block_add_threshold: float = 0.5
    decoded_token_threshold: float = 0.5
    early_stop: bool = True
    max_forwards: int | None = None
    max_blocks: int | None = None
    forced_progress: str = "first"
    selection: str = "auto"
    cache_mode: str = "auto"
    cache_delay_iter: int = 1
    refresh_interval: int = 10000
    cache: dataclasses.InitVar[str | None] = None  # the older name of cache_mode

    def __post_init__(self, cache=None):
        if cache is not None:
            object.__setattr__(self, "cache_mode", cache)
        inputs.normalize_fields(self, ints=("block_size", "max_blocks", "cache_delay_iter", "refresh_interval",
                                            "max_forwards"),
                                reals=("entropy_threshold", "block_add_threshold", "decoded_token_threshold"),
                                flags=("early_stop",), optional=("block_size", "max_blocks", "max_forwards"))
        for name, lo in (("block_size", 1), ("max_blocks", 1), ("cache_delay_iter", 0), ("refresh_interval", 1),
                         ("max_forwards", 1)):
            v = getattr(self, name)
            if v is not None and v < lo:
                raise errors.DecodingConfigError(f"{name}={v!r} must be an integer >= {lo}")
        if not self.entropy_threshold >= 0:
            raise errors.DecodingConfigError(
                f"entropy_threshold={self.entropy_threshold} must be a finite entropy >= 0 (nats)")
        for name in ("block_add_threshold", "decoded_token_threshold"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise errors.DecodingConfigError(f"{name}={v} must be a fraction in [0, 1]")
        if self.forced_progress not in FORCED_PROGRESS:
            raise errors.DecodingConfigError(
                f"forced_progress={self.forced_progress!r} is not one of {FORCED_PROGRESS}")
        if self.selection not in SELECTIONS:
            raise errors.DecodingConfigError(f"selection={self.selection!r} is not one of {SELECTIONS}")
        if self.cache_mode not in CACHE_MODES:
            raise errors.DecodingConfigError(f"cache_mode={self.cache_mode!r} is not one of {CACHE_MODES}")

    # ----------------------------------------------------------------- host side
    def for_model(self, cfg) -> MultiBlock:
        """block_size=None becomes the model's trained block_size (block-causal models) or d3LLM's
        32 (bidirectional ones)."""
        if self.block_size is not None or cfg.attention == "causal":
            return self
        return dataclasses.replace(self, block_size=cfg.block_size if cfg.attention == "block_causal"
                                   else BIDIRECTIONAL_BLOCK_SIZE)

    def validate(self, cfg) -> None:
        common.require_diffusion_model("multi_block", cfg, ("block_causal", "bidirectional"), "jdllm.AR")
        if self.cache_mode == "exact" and cfg.attention != "block_causal":
            raise errors.DecodingConfigError(
                "cache_mode='exact' needs a block-causal model; for bidirectional models use cache_mode='none' "
                "or the approximate cache_mode='approx'")
        if self.cache_mode in ("approx", "window") and cfg.attention != "bidirectional":
            raise errors.DecodingConfigError(
                f"cache_mode={self.cache_mode!r} is for bidirectional models; block-causal models get the exact "
                "cache with cache_mode='exact' (or 'auto')")
        if cfg.attention == "block_causal" and self.block_size != cfg.block_size:
            warnings.warn(f"block_size={self.block_size} differs from the model's trained "
                          f"block_size={cfg.block_size}; quality may suffer", stacklevel=3)

    def reads_kv_cache(self, cfg) -> bool:
        return self.resolved_cache_mode(cfg) != "none"

    def resolved_cache_mode(self, cfg) -> str:
        """The cache mode actually used, a key of `CACHE_STRATEGIES`: "none", "exact", "approx" or "window"."""
        if self.cache_mode == "auto":
            return "exact" if cfg.attention == "block_causal" else "none"
        return self.cache_mode

    def selection_rule(self, cfg) -> str:
        """The reveal rule actually used: "llada" or "dream" (d3LLM's per family under "auto")."""
        if self.selection != "auto":
            return self.selection
        return "dream" if cfg.attention == "bidirectional" and cfg.logit_shift else "llada"

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
        # bidirectional: right-aligned, every row's canvas ends at S = gen_start + max_new_tokens. No
        # forward prefills, but prefill_len = P says what it says for masked_diffusion: S - P bounds
        # every row's generation region, so the slots in flight (`_flight_width`: the LM head's width
        # at every step) are the generation bucket, not the whole canvas (at a 32k prompt the canvas's
        # logits would be S x vocab floats: 16 GiB at a 126k vocabulary)
        P = common.bucket(int(lengths.max()), 16)
        S = P + common.bucket(max_new_tokens, 16, steps_per_octave=4)
        gen_start = np.full(lengths.shape, S - max_new_tokens, np.int32)
        return common.Layout(start=(gen_start - lengths).astype(np.int32), gen_start=gen_start, slots=S,
                             prefill_len=P)

    def row_layout(self, cfg, length: int, max_new: int, slots: int) -> common.Layout:
        """A serving row: the prompt's own layout on the pool canvas; bidirectional models' moved
        right so the row's canvas ends at the pool's last slot, as it ends alone (block-causal
        models' keep their absolute block grid: nothing after a block changes it)."""
        lay = super().row_layout(cfg, length, max_new, slots)
        if cfg.attention == "block_causal":
            return lay
        return common.right_aligned(lay, slots - self.layout(np.asarray([length]), max_new, cfg).slots)

    def max_iterations(self, state: DecodeState) -> int:
        bound = state.slots + 8
        return bound if self.max_forwards is None else min(bound, self.max_forwards + 1)

    def replay_approximation(self) -> str | None:
        if self.cache_mode == "approx":
            return "MultiBlock(cache_mode='approx') is d3LLM's approximate delayed prefix cache"
        if self.cache_mode == "window" and self.refresh_interval != 1:
            return f"MultiBlock(cache_mode='window', refresh_interval={self.refresh_interval}) is an approximate cache"
        return None

    def output_trace(self, extra: dict, row: int) -> dict:
        """Per-row analysis arrays for `Output.trace` (host numpy `extra`)."""
        nb = int(extra["num_blocks"][row])
        return {"block_state": [int(x) for x in extra["block_state"][row, :nb]],
                "block_steps": [[int(y) for y in x] for x in extra["block_steps"][row, :nb]]}

    # ----------------------------------------------------------------- geometry
    def _flight_width(self, ctx, S: int) -> int:
        """Static width of the slots in flight: max_blocks blocks, or the generation region (S -
        prefill_len: block-causal models' blocks after the prompt's whole blocks, bidirectional ones'
        generation bucket, which ends at S, so the plan is then always [S - width, S))."""
        if self.max_blocks is None:
            return S - ctx.prefill_len
        return min(self.max_blocks * self.block_size, S)

    def _grid(self, ctx, state: DecodeState):
        """(base [B], slot index [B, NB*Bs], validity [B, NB, Bs]) of the block grid (`block_view`)."""
        base = state.extra["base"]
        idx, ok = block_view(state, base, num_blocks(ctx, state, self.block_size), self.block_size)
        return base, idx, ok

    # ----------------------------------------------------------------- the step
    def prefill(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        """Set up the block grid (block 0 Fully-Activated); no forward.

        The first step then runs on an empty cache: its window cannot cover the
        prompt, so it takes the full forward, which also fills the cache with
        the prompt's blocks (committed right after it).
        """
        return state.replace(extra=init_blocks(ctx, state, self.block_size))

    def plan(self, ctx, state: DecodeState):
        """Phases 1-3, then the slots in flight: row b's [first open block, + max_blocks blocks)."""
        base, idx, ok = self._grid(ctx, state)
        if self.early_stop:
            state = early_stop(state, idx, ok, base, self.block_size)
        state = activate_and_add(state, idx, ok, decoded_token_threshold=self.decoded_token_threshold,
                                 block_add_threshold=self.block_add_threshold, max_blocks=self.max_blocks)
        _, cand = frontier(state, self.block_size)
        width = self._flight_width(ctx, state.slots)
        p = common.make_plan(state, base + first_open(state.extra["block_state"]) * self.block_size, width)
        return state, dataclasses.replace(p, valid=common.window(cand, p.offset, width))

    def forward(self, params, ctx, state: DecodeState, plan: common.Plan):
        """Phase 4: one forward by the cache mode's strategy (`multi_block_cache`); logits predicting
        the planned slots."""
        active_end, _ = frontier(state, self.block_size)
        rows = jnp.any(plan.valid, axis=-1)  # [B] rows with work in this forward
        strategy = CACHE_STRATEGIES[self.resolved_cache_mode(ctx.model)]
        state, logits = strategy.forward(self, params, ctx, state, plan.slots, active_end)
        return common.count_forward(state, rows), logits

    def reveal(self, ctx, state: DecodeState, plan: common.Plan, logits, bitmask=None) -> DecodeState:
        """Phases 5-7 (module docstring). bitmask: optional packed [B, N, ceil(V/32)] over the plan."""
        _, idx, ok = self._grid(ctx, state)
        _, cand = frontier(state, self.block_size)
        running = ~state.done
        state, s = common.sample_window(ctx, state, logits, plan.offset, bitmask, rows=jnp.any(plan.valid, -1))
        s = to_canvas(s, plan.offset, state.slots)
        s_idx = slot_index(state)
        ent = jnp.where(cand, s.entropy, jnp.inf)  # [B, S]
        sel = select_candidates(cand, s.entropy, ent, s_idx, self.selection_rule(ctx.model), self.entropy_threshold)
        forced = force_progress(state, sel, ent, idx, ok, running, first_only=self.forced_progress == "first")
        # phase 7
        state = common.write_tokens(state, 0, sel | (forced & cand), s)
        state = complete_filled(state, idx, ok)
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
        2. Block states (`reopen_blocks`): a Completed block that has masks again reopens in the
           state it reached before (Fully-Activated or Activated; Inactive when only the EOS fill
           completed it); its Completed stamp and cache counters are cleared. An Activated /
           Fully-Activated block the writes filled becomes Completed (as phase 7).
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
        base, idx, ok = self._grid(ctx, state)
        state = reopen_blocks(state, idx, ok)
        if state.cache is not None:
            edited = remasked | written
            first = jnp.min(jnp.where(edited, s_idx, S), axis=-1)  # [B]
            floor = jnp.where(first < S, base + (first - base) // Bs * Bs, S)
            state = state.replace(cache=state.cache.commit(jnp.minimum(state.cache.length, jnp.maximum(floor, 0))))
        return state


# --------------------------------------------------------------------------- phases 5-6
def to_canvas(s: Sample, offset, S: int) -> Sample:
    """Place a window's Sample [B, W] (offset scalar or [B]) on the whole canvas [B, S]
    (entropy +inf elsewhere)."""
    B = s.token.shape[0]

    def put(x, fill):
        return common.set_window(jnp.full((B, S), fill, x.dtype), offset, x)

    return Sample(token=put(s.token, 0), prob=put(s.prob, 0.0), entropy=put(s.entropy, jnp.inf),
                  logprob=put(s.logprob, 0.0))


def select_candidates(cand, entropy, ent, s_idx, rule: str, threshold: float):
    """Phase 5, [B, S]: "dream": candidates with entropy < threshold; "llada": the lowest-entropy
    candidate (`ent`: entropy at candidates, +inf elsewhere; leftmost among ties) plus every one
    with entropy <= threshold (`s_idx`: slot indices)."""
    if rule == "dream":
        return cand & (entropy < threshold)
    lowest = jnp.argmin(ent, axis=-1)  # [B], leftmost among ties
    return cand & ((entropy <= threshold) | (s_idx == lowest[:, None]))


def force_progress(state: DecodeState, sel, ent, idx, ok, running, *, first_only: bool):
    """Phase 6, [B, S]: the lowest-entropy masked slot of the first (`first_only`) or every
    Fully-Activated block with masks that `sel` gave nothing, in running rows."""
    st = state.extra["block_state"]
    size, dec = block_stats(state, idx, ok)
    view = lambda x: gather(x, idx, ok)  # noqa: E731  [B, NB, Bs]
    masked_v = ~view(state.revealed) & ok
    got = jnp.any(view(sel) & ok, axis=-1)  # [B, NB]
    eligible = (st == FULLY_ACTIVATED) & (dec < size)  # [B, NB]
    if first_only:
        k = jnp.arange(eligible.shape[-1], dtype=jnp.int32)
        eligible = eligible & (k[None] == jnp.argmax(eligible, axis=-1)[:, None])
    need = eligible & ~got & running[:, None]
    pick = jnp.argmin(jnp.where(masked_v, view(ent), jnp.inf), axis=-1)  # [B, NB]
    forced_v = need[..., None] & masked_v & (jnp.arange(ok.shape[-1])[None, None] == pick[..., None])
    return scatter_max(sel, idx, forced_v)


__all__ = ["MultiBlock", "BLOCK_STATES", "CACHE_MODES", "FORCED_PROGRESS", "SELECTIONS", "INACTIVE", "ACTIVATED",
           "FULLY_ACTIVATED", "COMPLETED", "CACHE_STRATEGIES", "WINDOW_BLOCKS"]
