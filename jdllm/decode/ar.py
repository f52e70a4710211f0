"""`ar`: autoregressive decoding, one token per step through the KV cache.

Layout: row b's prompt fills slots [0, len_b) and its generation starts right
after, at gen_start_b = len_b: no left padding, every row at its own position
(per-row cache lengths). The prefill forward covers [0, P) for the whole batch
(P = the prompt bucket; a row's slots past its prompt hold the mask / pad fill,
whose K/V later steps overwrite before anything can see them) and commits
[0, len_b); the logits at len_b - 1 give each row's first token. Each step then
forwards the row's newest token (slot c - 1, committing it) and samples slot c,
the row's first unrevealed slot. N tokens cost N forwards (prefill included)
and step_map is 1, 2, 3, ...
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors
from jdllm.decode import common
from jdllm.decode.protocol import Paradigm
from jdllm.state import DecodeState, generated_mask, slot_index


def first_hole(state: DecodeState) -> jnp.ndarray:
    """[B] int32: each row's first unrevealed generation slot (S - 1 when there is none)."""
    hole = generated_mask(state) & ~state.revealed
    return jnp.min(jnp.where(hole, slot_index(state), state.slots - 1), axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AR(Paradigm):
    """Autoregressive decoding (causal models). No options: sampling lives in `jdllm.Sampling`."""

    name: ClassVar[str] = "ar"
    ragged_lengths: ClassVar[bool] = True
    is_autoregressive: ClassVar[bool] = True
    first_step_in_prefill: ClassVar[bool] = True
    replay_method: ClassVar[str] = "teacher_forcing"

    def validate(self, cfg) -> None:
        if cfg.attention != "causal":
            raise errors.DecodingConfigError(
                f"paradigm 'ar' needs a causal model, this one has attention={cfg.attention!r}; "
                "use jdllm.BlockDiffusion / jdllm.MaskedDiffusion for diffusion models")

    def layout(self, lengths: np.ndarray, max_new_tokens: int, cfg) -> common.Layout:
        lengths = np.asarray(lengths, np.int32)
        P = common.bucket(int(np.max(lengths)), 16)
        G = common.bucket(max_new_tokens, 16, steps_per_octave=4)
        return common.Layout(start=np.zeros_like(lengths), gen_start=lengths, slots=P + G, prefill_len=P)

    def plan(self, ctx, state: DecodeState):
        return state, common.make_plan(state, first_hole(state), 1)

    def prefill(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        P = ctx.prefill_len
        p = common.make_plan(state, state.gen_start, 1)
        state, logits = common.forward_window(params, ctx, state, 0, P, at=p.slots, commit=state.gen_start)
        state = common.count_forward(state, ~state.done)
        return self.reveal(ctx, state, p, logits, bitmask)

    def forward(self, params, ctx, state: DecodeState, plan: common.Plan):
        c = plan.offset  # [B] the slot to sample; its predecessor is the newest token
        state, logits = common.forward_window(params, ctx, state, c - 1, 1, at=plan.slots, commit=c)
        return common.count_forward(state, ~state.done), logits

    def reveal(self, ctx, state: DecodeState, plan: common.Plan, logits, bitmask=None) -> DecodeState:
        state, s = common.sample_window(ctx, state, logits, plan.offset, bitmask)
        state = common.write_tokens(state, plan.offset, common.candidates(state, plan.offset, 1), s)
        return common.finish_rows(state)

    def max_iterations(self, state: DecodeState) -> int:
        return state.slots + 2

    # ----------------------------------------------------------------- constrained decoding
    def pending_width(self, state: DecodeState, offsets: np.ndarray, done: np.ndarray) -> int:
        """Forced tokens a grammar wrote sit between the cache end and the sampled slot: the next
        forward covers them all (one forward for any number of forced tokens)."""
        cached = np.asarray(jax.device_get(state.cache.length))
        return int(np.max(np.where(done, 1, offsets - cached), initial=1))

    def catch_up_forward(self, params, ctx, state: DecodeState, plan: common.Plan, width: int):
        """The step's forward over [cache length, sampled slot), `width` slots (static)."""
        off = jnp.minimum(state.cache.length, state.slots - width)
        state, logits = common.forward_window(params, ctx, state, off, width, at=plan.slots, commit=plan.offset)
        return common.count_forward(state, ~state.done), logits

    # ----------------------------------------------------------------- RL
    def check_step_map(self, steps: np.ndarray, cfg) -> str | None:
        nz = steps[steps > 0]
        if not np.array_equal(nz, np.arange(1, nz.size + 1)):
            return (f"an AR step_map reveals one token per step left to right (1, 2, 3, ...), got "
                    f"{nz[:8].tolist()}...; is it from another paradigm?")
        return None


__all__ = ["AR"]
