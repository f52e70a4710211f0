"""`block_diffusion`: SDAR / lmdeploy block-by-block denoising on block-causal models.

Layout (one slot grid for the batch): with nb_b = len_b // B whole prompt
blocks and N = bucket(max(1, max_b nb_b)), row b is left-padded by
B * (N - nb_b) so every row's prompt blocks end at slot N * B and every row's
first decode block is slot block N; the prompt remainder (len_b % B tokens)
sits pre-revealed at the start of that block and generation starts right
after it. Slot blocks then coincide with each row's own position blocks, so a
row in a batch computes exactly what it computes alone.

Each block starts all-mask and is denoised with the block as the active
window against the cached prefix; every step reveals some masked positions
(the strategy decides which) until the block is full. Each row moves to its
next block as soon as it has filled its current one (per-row cache lengths:
rows of a batch sit in different blocks, none waits for another).

KV commit: a filled block's clean K/V must enter the cache. Unfused (SDAR,
lmdeploy) that costs one forward over the clean block. Fused (the default)
the commit of block b rides on the first denoising forward of block b + 1: one
forward over both blocks (2B slots, block-causal, so block b does not see
b + 1 and its K/V equal the unfused commit's), then `cache.commit(+B)`. The
prompt's blocks are fused the same way with the first block's first step.
Same tokens, one forward fewer per block. Only that first step pays the
two-block window; the block's other steps run the block alone against the
cache (see `BlockDiffusion.forward`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from jdllm import errors, inputs
from jdllm.decode import common
from jdllm.decode.protocol import Paradigm
from jdllm.state import DecodeState, generated_mask, slot_index

STRATEGIES = ("low_confidence_static", "low_confidence_dynamic", "sequential", "entropy_bounded")
DYNAMIC_MINIMUMS = ("lmdeploy", "sdar")


@dataclasses.dataclass(frozen=True)
class BlockDiffusion(Paradigm):
    """Block diffusion decoding.

    block_length: slots per block; None (default) = the model's trained block_size.
    denoising_steps: steps per block for `low_confidence_static` / `sequential`
      (k = block_length / denoising_steps tokens per step) and the per-step
      minimum k of `low_confidence_dynamic` with dynamic_minimum="sdar"; must
      divide block_length. The other strategies reveal >= 1 token per step.
    strategy: `low_confidence_static` (top-k confidence), `low_confidence_dynamic`
      (every masked token above confidence_threshold, with a per-step minimum:
      see dynamic_minimum), `sequential` (first k masked, left to right),
      `entropy_bounded` (lowest-entropy first while the summed entropy stays
      below eb_threshold; the lowest one always).
    dynamic_minimum: the minimum of `low_confidence_dynamic`, named after its source.
      "lmdeploy" (default): the most confident masked token plus every one with
      confidence >= confidence_threshold (lmdeploy / JetEngine, SDAR's serving
      engines: at least one token per step, so a confident block finishes in
      fewer steps). "sdar": SDAR's `block_diffusion_generate` (generate.py):
      every masked token with confidence > confidence_threshold if there are at
      least k of them, else the k most confident (k = block_length /
      denoising_steps), so a block never takes more than denoising_steps steps.
      The default stays "lmdeploy" because that is what jdllm has always done
      and what SDAR is served with; "sdar" reproduces SDAR's reference script.
    confidence_threshold: in (0, 1]. eb_threshold: entropy budget in nats, > 0.
    fuse_commit: fuse each block's KV commit into the next block's first step.
    """

    name: ClassVar[str] = "block_diffusion"
    ragged_lengths: ClassVar[bool] = True
    first_step_in_prefill: ClassVar[bool] = True
    replay_method: ClassVar[str] = "packed"
    STRATEGIES: ClassVar[tuple[str, ...]] = STRATEGIES
    DYNAMIC_MINIMUMS: ClassVar[tuple[str, ...]] = DYNAMIC_MINIMUMS

    block_length: int | None = None
    denoising_steps: int = 4
    strategy: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.9
    eb_threshold: float = 0.35
    fuse_commit: bool = True
    dynamic_minimum: str = "lmdeploy"

    def __post_init__(self):
        inputs.normalize_fields(self, ints=("block_length", "denoising_steps"),
                                reals=("confidence_threshold", "eb_threshold"), flags=("fuse_commit",),
                                optional=("block_length",))
        B, s = self.block_length, self.denoising_steps
        if B is not None and B < 1:
            raise errors.DecodingConfigError(f"block_length={B} must be an integer >= 1 (or None: the model's)")
        if s < 1 or (B is not None and (s > B or B % s)):
            raise errors.DecodingConfigError(
                f"denoising_steps={s} must be an integer in [1, block_length={B}] that divides block_length")
        if self.strategy not in STRATEGIES:
            raise errors.DecodingConfigError(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if self.dynamic_minimum not in DYNAMIC_MINIMUMS:
            raise errors.DecodingConfigError(
                f"dynamic_minimum={self.dynamic_minimum!r} is not one of {DYNAMIC_MINIMUMS} "
                "(lmdeploy: top-1 plus all >= threshold; sdar: all > threshold, at least block_length / "
                "denoising_steps)")
        if not 0 < self.confidence_threshold <= 1:
            raise errors.DecodingConfigError(
                f"confidence_threshold={self.confidence_threshold} must be in (0, 1]")
        if not self.eb_threshold > 0:
            raise errors.DecodingConfigError(f"eb_threshold={self.eb_threshold} must be > 0 (nats)")

    # ----------------------------------------------------------------- host side
    def for_model(self, cfg) -> BlockDiffusion:
        """block_length=None becomes the model's trained block_size."""
        if self.block_length is not None or cfg.attention != "block_causal":  # validate refuses the others
            return self
        try:
            return dataclasses.replace(self, block_length=cfg.block_size)
        except errors.DecodingConfigError as e:
            raise errors.DecodingConfigError(f"{e} (block_length: the model's block_size={cfg.block_size}); "
                                             "give denoising_steps a divisor of it") from None

    def validate(self, cfg) -> None:
        common.require_diffusion_model("block_diffusion", cfg, ("block_causal",),
                                       "jdllm.MaskedDiffusion for bidirectional models")
        if self.block_length != cfg.block_size:
            warnings.warn(f"block_length={self.block_length} differs from the model's trained "
                          f"block_size={cfg.block_size}; quality may suffer", stacklevel=3)

    def attention_config(self, cfg):
        """The forward's config: attention blocks follow block_length."""
        return cfg if cfg.block_size == self.block_length else cfg.replace(block_size=self.block_length)

    def layout(self, lengths: np.ndarray, max_new_tokens: int, cfg) -> common.Layout:
        B = self.block_length
        lengths = np.asarray(lengths, np.int64)
        nb = lengths // B
        N = common.bucket(int(nb.max()), 1)  # >= 1: a step's window reaches one block back
        gen_blocks = common.bucket(-(-(B - 1 + max_new_tokens) // B), 1, steps_per_octave=4)
        start = (B * (N - nb)).astype(np.int32)
        gen_start = (N * B + lengths % B).astype(np.int32)
        # no block past the last generation block: every window ends at its block's end (the
        # commit rides on the next block's first step, and a row is done once its last block fills)
        return common.Layout(start=start, gen_start=gen_start, slots=(N + gen_blocks) * B,
                             prefill_len=N * B)

    def max_iterations(self, state: DecodeState) -> int:
        return state.batch * state.slots + state.slots // self.block_length + 8

    def constraint_block(self) -> int:
        """Tokens a grammar forces fill at most the current block (the next one is not planned yet)."""
        return self.block_length

    def check_step_map(self, steps: np.ndarray, cfg) -> str | None:
        """Blocks fill one after another: no block's first step before the previous one's last."""
        blocks = steps.reshape(-1, cfg.block_size)
        lo = np.where(blocks > 0, blocks, np.iinfo(np.int32).max).min(axis=1)
        hi = blocks.max(axis=1)
        used = hi > 0
        if np.any(lo[used][1:] <= hi[used][:-1]):
            return ("step_map interleaves blocks (a block starts before the one before it is full); block "
                    "diffusion fills blocks one by one: is it from another paradigm (multi_block)?")
        return None

    # ----------------------------------------------------------------- device side
    def _current_block(self, state: DecodeState) -> jnp.ndarray:
        """[B] first slot of each row's current block: the block of its first masked generation slot."""
        W = self.block_length
        hole = generated_mask(state) & ~state.revealed
        first = jnp.min(jnp.where(hole, slot_index(state), state.slots - W), axis=-1)
        return (first // W * W).astype(jnp.int32)

    def plan(self, ctx, state: DecodeState):
        """Each row's current block. Unfused, a row whose previous block is not committed yet
        (its cache length is short of the block) has nothing to reveal: its next forward commits."""
        p = common.make_plan(state, self._current_block(state), self.block_length)
        if not self.fuse_commit and state.cache is not None:
            p = dataclasses.replace(p, valid=p.valid & (state.cache.length >= p.offset)[:, None])
        return state, p

    def reveal(self, ctx, state: DecodeState, plan: common.Plan, logits, bitmask=None) -> DecodeState:
        """Reveal some masked positions of the planned block from logits [B, W, V] predicting it.

        Only `plan.valid` slots are candidates (unfused: none while the forward was a pure commit).
        """
        W, c = self.block_length, plan.offset
        cand = common.candidates(state, c, W) & plan.valid  # [B, W]
        state, s = common.sample_window(ctx, state, logits, c, bitmask, rows=jnp.any(cand, axis=-1))
        k = W // self.denoising_steps
        if self.strategy == "low_confidence_static":
            sel = common.select_top_k(cand, s.prob, k)
        elif self.strategy == "low_confidence_dynamic" and self.dynamic_minimum == "sdar":
            # SDAR generate.py: all with confidence > threshold if at least k, else the top k
            high = cand & (s.prob > self.confidence_threshold)
            enough = jnp.sum(high, axis=-1, keepdims=True) >= k
            sel = jnp.where(enough, high, common.select_top_k(cand, s.prob, k))
        elif self.strategy == "low_confidence_dynamic":
            sel = common.select_threshold(cand, s.prob, self.confidence_threshold)
        elif self.strategy == "sequential":
            sel = common.select_first_k(cand, k)
        else:
            sel = common.select_entropy_bounded(cand, s.entropy, self.eb_threshold)
        state = common.write_tokens(state, c, sel, s)
        return common.finish_rows(state)

    def prefill(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        P, W = ctx.prefill_len, self.block_length  # P >= W: the layout keeps one prompt block at least
        if self.fuse_commit:
            # prompt blocks + first decode block in one forward; commit the prompt blocks
            p = common.make_plan(state, P, W)
            state, logits = common.forward_window(params, ctx, state, 0, P + W, at=p.slots, commit=P)
            state = common.count_forward(state, ~state.done)
            return self.reveal(ctx, state, p, logits, bitmask)
        p = common.make_plan(state, P - 1, 1)  # no token is chosen: the logits are not used
        state, _ = common.forward_window(params, ctx, state, 0, P, at=p.slots, commit=P)
        return common.count_forward(state, ~state.done & (state.start < P))

    def forward(self, params, ctx, state: DecodeState, plan: common.Plan):
        """One forward per row at its current block c; the window is [c - W, c + W) on the steps that
        commit and [c, c + W) on the others (one window shape for the whole batch per step).

        A row whose previous block is filled but not committed yet (cache
        length c - W: its first step in block c) needs the wide window: the
        previous block, clean, is recomputed in front of the current one
        (block-causal: it never sees the second half), its K/V written, and
        the commit to c keeps them: the commit rides on the next block's first
        denoising step (fused); unfused, that step only commits (one extra
        forward, as in SDAR). Every other step runs the current block alone
        against the cache (a shifted-logit model: with the slot before it,
        whose logits predict the block's first slot), so a block of W slots decoded in s steps costs one
        2W-slot forward and s - 1 W-slot ones, not s 2W-slot ones. When some
        rows of a batch commit and others do not, the wide window runs for all;
        the others rewrite their cached previous block from the same clean
        tokens and visible keys (the values already there, up to rounding).
        """
        W, c = self.block_length, plan.offset
        shift = int(ctx.model.logit_shift)  # a shifted model predicts slot c from c - 1: keep it in the window
        # the narrow window's K/V (the block's, uncommitted) are recomputed by the block's next step or
        # by the wide window that commits it, so nobody reads them: on the XLA attention they are not
        # written (there two writing branches made XLA copy the whole cache every step); on the Pallas
        # kernels they are, because there the switch updates the cache in place only when both
        # branches write it (`common.switch_width`; a passing branch copied the whole cache: 7 GiB on
        # an 8B wide step at batch 32). Not for a shifted model, whose narrow window would rewrite its
        # committed slot c - 1 (from the same tokens, up to rounding)
        narrow_writes = common.reads_cache_in_place(ctx) and not shift

        def window_forward(width):  # the wide window starts at the previous block, the narrow one at this block
            wide = width == 2 * W
            lo = c - W if wide else c - shift
            return lambda st: common.forward_window(params, ctx, st, lo, width, at=plan.slots, commit=c,
                                                    write_cache=wide or narrow_writes)

        commits = jnp.any((state.cache.length < c) & ~state.done)
        # on a GPU at small batch both shapes cost one read of the weights: only the wide one compiles
        state, logits = common.switch_width(ctx, state, (W + shift, 2 * W), jnp.where(commits, 2 * W, W + shift),
                                            window_forward)
        return common.count_forward(state, ~state.done), logits


__all__ = ["BlockDiffusion", "STRATEGIES", "DYNAMIC_MINIMUMS"]
