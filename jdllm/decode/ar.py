"""`ar`: autoregressive decoding, one token per step through the KV cache.

Layout: every prompt ends at slot P (the prompt bucket), left-padded before
its start; generation fills slots P, P + 1, ... The prefill forward covers
[0, P) and its last logits give the token at P; each step then forwards the
newest token (committing it to the cache) and samples the next. N tokens cost
N forwards (prefill included) and step_map is 1, 2, 3, ...
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from jdllm import errors
from jdllm.decode import common
from jdllm.state import DecodeState


@dataclasses.dataclass(frozen=True)
class AR:
    """Autoregressive decoding (causal models). No options: sampling lives in `jdllm.Sampling`."""

    name: ClassVar[str] = "ar"

    def validate(self, cfg) -> None:
        if cfg.attention != "causal":
            raise errors.DecodingConfigError(
                f"paradigm 'ar' needs a causal model, this one has attention={cfg.attention!r}; "
                "use jdllm.BlockDiffusion / jdllm.MaskedDiffusion for diffusion models")

    def layout(self, lengths: np.ndarray, max_new_tokens: int, cfg) -> common.Layout:
        P = common.bucket(int(np.max(lengths)), 16)
        G = common.bucket(max_new_tokens, 16, steps_per_octave=4)
        start = (P - np.asarray(lengths)).astype(np.int32)
        return common.Layout(start=start, gen_start=np.full_like(start, P), slots=P + G, prefill_len=P)

    def _sample_next(self, ctx, state: DecodeState, last_logits, slot, bitmask) -> DecodeState:
        """Sample the token at `slot` from the previous slot's logits [B, V]."""
        state, s = common.sample_window(ctx, state, last_logits[:, None], bitmask)
        state = common.reveal(state, slot, common.candidates(state, slot, 1), s)
        return common.finish_rows(state, ctx.stop_ids)

    def prefill(self, params, ctx, state: DecodeState) -> DecodeState:
        P = ctx.prefill_len
        logits, state = common.forward_window(params, ctx, state, 0, P, commit=P)  # [B, P, V]
        state = common.count_forward(state, ~state.done)
        return self._sample_next(ctx, state, logits[:, -1], P, None)

    def step(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        n = state.cache.length  # the newest token sits at slot n
        logits, state = common.forward_window(params, ctx, state, n, 1, commit=n + 1)  # [B, 1, V]
        state = common.count_forward(state, ~state.done)
        return self._sample_next(ctx, state, logits[:, 0], n + 1, bitmask)

    def max_iterations(self, state: DecodeState) -> int:
        return state.slots + 2


__all__ = ["AR"]
