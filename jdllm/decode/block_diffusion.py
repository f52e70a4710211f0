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
(the strategy decides which) until the block is full. The batch moves to the
next block once every running row has filled the current one (rows that
finish early idle: no reveal, no step, no NFE).

KV commit: a filled block's clean K/V must enter the cache. Unfused (SDAR,
lmdeploy) that costs one forward over the clean block. Fused (the default)
the commit of block b rides on the first denoising forward of block b + 1: one
forward over both blocks (2B slots, block-causal, so block b does not see
b + 1 and its K/V equal the unfused commit's), then `cache.commit(+B)`. The
prompt's blocks are fused the same way with the first block's first step.
Same tokens, one forward fewer per block. Every step runs the same two-block
window shape (see `BlockDiffusion.step`), so the loop body has no branch and
the cache is updated in place.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from jdllm import errors
from jdllm.decode import common
from jdllm.state import DecodeState

STRATEGIES = ("low_confidence_static", "low_confidence_dynamic", "sequential", "entropy_bounded")


@dataclasses.dataclass(frozen=True)
class BlockDiffusion:
    """Block diffusion decoding.

    block_length: slots per block (the model's trained block_size, normally).
    denoising_steps: steps per block for `low_confidence_static` / `sequential`
      (k = block_length / denoising_steps tokens per step); must divide
      block_length. The other strategies reveal >= 1 token per step.
    strategy: `low_confidence_static` (top-k confidence), `low_confidence_dynamic`
      (the most confident masked token plus every one with confidence >=
      confidence_threshold), `sequential` (first k masked, left to right),
      `entropy_bounded` (lowest-entropy first while the summed entropy stays
      below eb_threshold; the lowest one always).
    confidence_threshold: in (0, 1]. eb_threshold: entropy budget in nats, > 0.
    fuse_commit: fuse each block's KV commit into the next block's first step.
    """

    name: ClassVar[str] = "block_diffusion"
    STRATEGIES: ClassVar[tuple[str, ...]] = STRATEGIES

    block_length: int = 4
    denoising_steps: int = 4
    strategy: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.9
    eb_threshold: float = 0.35
    fuse_commit: bool = True

    def __post_init__(self):
        if int(self.block_length) != self.block_length or self.block_length < 1:
            raise errors.DecodingConfigError(f"block_length={self.block_length} must be an integer >= 1")
        s = self.denoising_steps
        if int(s) != s or not 1 <= s <= self.block_length or self.block_length % s:
            raise errors.DecodingConfigError(
                f"denoising_steps={s} must be an integer in [1, block_length={self.block_length}] "
                f"that divides block_length")
        if self.strategy not in STRATEGIES:
            raise errors.DecodingConfigError(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if not 0 < self.confidence_threshold <= 1:
            raise errors.DecodingConfigError(
                f"confidence_threshold={self.confidence_threshold} must be in (0, 1]")
        if not self.eb_threshold > 0:
            raise errors.DecodingConfigError(f"eb_threshold={self.eb_threshold} must be > 0 (nats)")

    # ----------------------------------------------------------------- host side
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
        return common.Layout(start=start, gen_start=gen_start, slots=(N + gen_blocks + 1) * B,
                             prefill_len=N * B)

    def max_iterations(self, state: DecodeState) -> int:
        return state.batch * state.slots + state.slots // self.block_length + 8

    # ----------------------------------------------------------------- device side
    def _denoise(self, ctx, state: DecodeState, logits, offset, bitmask, allow=None) -> DecodeState:
        """Reveal some masked positions of the block at `offset` from aligned logits [B, W, V].

        allow ([] bool, optional): False turns the step into a pure commit (no reveal).
        """
        W = self.block_length
        cand = common.candidates(state, offset, W)  # [B, W]
        if allow is not None:
            cand = cand & allow
        state, s = common.sample_window(ctx, state, logits, bitmask, rows=jnp.any(cand, axis=-1))
        k = W // self.denoising_steps
        if self.strategy == "low_confidence_static":
            sel = common.select_top_k(cand, s.prob, k)
        elif self.strategy == "low_confidence_dynamic":
            sel = common.select_threshold(cand, s.prob, self.confidence_threshold)
        elif self.strategy == "sequential":
            sel = common.select_first_k(cand, k)
        else:
            sel = common.select_entropy_bounded(cand, s.entropy, self.eb_threshold)
        state = common.reveal(state, offset, sel, s)
        return common.finish_rows(state, ctx.stop_ids)

    def prefill(self, params, ctx, state: DecodeState) -> DecodeState:
        P, W = ctx.prefill_len, self.block_length  # P >= W: the layout keeps one prompt block at least
        if self.fuse_commit:
            # prompt blocks + first decode block in one forward; commit the prompt blocks
            logits, state = common.forward_window(params, ctx, state, 0, P + W, commit=P)
            state = common.count_forward(state, ~state.done)
            al = common.aligned(ctx, logits, state.prev_logits)[:, P:]
            return self._denoise(ctx, state, al, P, None)
        logits, state = common.forward_window(params, ctx, state, 0, P, commit=P)
        return common.count_forward(state, ~state.done & (state.start < P))

    def step(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        """One forward over two blocks, [L - W, L + W) or, once the block is full, [L, L + 2W).

        The current block (slots [L, L + W), L = cache.length) is always the
        window's second half. While it has masked slots the first half is the
        committed previous block, recomputed from the same clean tokens and
        the same visible keys (block-causal: it never sees the second half),
        so its cached K/V are rewritten with the values already there (bit for
        bit when the committing forward had this window shape; up to float
        rounding right after the prefill). Once every running row has filled the
        current block, the window moves up one block: its first half is the
        clean block, whose K/V this forward writes and `cache.commit` keeps,
        and its second half is the next block's first denoising step (fused);
        unfused, that step only commits (one extra forward, as in SDAR). One
        window shape for every step: no `lax.cond`, so the KV cache is updated
        in place. The raw logits of the first half's last slot predict the
        second half's first token on shifted-logit models.
        """
        W = self.block_length
        L = state.cache.length
        has_work = jnp.any(common.candidates(state, L, W), axis=-1)  # [B]
        full = ~jnp.any(has_work)  # every running row has filled the current block
        w0 = jnp.where(full, L, L - W)
        logits, state = common.forward_window(params, ctx, state, w0, 2 * W,
                                              commit=jnp.where(full, L + W, L))  # [B, 2W, V]
        state = common.count_forward(state, jnp.where(full, ~state.done, has_work))
        al = common.aligned(ctx, logits, state.prev_logits)[:, W:]
        allow = None if self.fuse_commit else ~full
        return self._denoise(ctx, state, al, w0 + W, bitmask, allow)


__all__ = ["BlockDiffusion", "STRATEGIES"]
