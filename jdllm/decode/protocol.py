"""The `Paradigm` protocol: everything a decoding paradigm is, in one class.

A paradigm is one frozen dataclass in one file under `jdllm/decode/`, subclassing
`Paradigm`, plus one line in `PARADIGMS` (or a `register(cls)` call). Its instances are
the paradigm's configuration (hashable: a jit static argument). Everything that
differs by paradigm is a member here, so serving (`jdllm.serve`), constraints
(`jdllm.constraints`), RL (`jdllm.rl`) and the CLI call members and never ask a
paradigm's name. Optional members have defaults that fit a paradigm with no special
needs; the required ones raise `NotImplementedError`.

The step
========
Rows are independent: each has its own positions, KV-cache length, sampling settings,
stop ids and PRNG stream (`jdllm.state.DecodeState`). A step is split where a host
must see it, and the same pieces make both the one-jit `lax.while_loop`
(`jdllm.decode.loop.run`) and the host-driven steps (`loop.compiled_steps()`):

    layout(lengths, max_new_tokens, cfg) -> common.Layout    host: where each row lives
    prefill(params, ctx, state, bitmask=None) -> state        the first forward(s)
    plan(ctx, state) -> (state, common.Plan)                  the slots the step chooses tokens for
    forward(params, ctx, state, plan) -> (state, logits)      logits [B, N, V] predicting plan.slots
    reveal(ctx, state, plan, logits, bitmask=None) -> state   sample, choose, write, finish rows

Every function that takes a `DecodeState` returns it first.

State contract (`jdllm.state`): keep every per-row quantity per row; reveal tokens only
through `common.write_tokens` (step_map and log-probs follow one rule); count every forward
(`common.forward_window` bumps `state.forwards`, the paradigm calls
`common.count_forward(state, rows)` for the rows that took part, prefill and commit
passes included); call `common.finish_rows` after revealing; never touch a done row's
tokens; keep paradigm-only arrays in `state.extra`, set up in `prefill` (the while_loop
carry keeps one structure); advance a row's PRNG stream only where it samples for real.
Shared pieces live in `jdllm/decode/common.py`; `ar.py` is the smallest complete
example.

Testing a paradigm: a plain-loop reference (full forward every step, no cache, numpy)
beside `tests/reference_decoders.py`; jdllm must match it token for token and step for
step under greedy decoding, at batch 1 and on a batch of different-length prompts.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import numpy as np

from jdllm.decode import common


class Paradigm:
    """Base class of every paradigm config (see the module docstring). Subclasses are frozen
    dataclasses; class attributes below are per-paradigm constants, methods the hooks."""

    # ------------------------------------------------------------------ identity and traits
    name: ClassVar[str] = ""
    """Registry name ("ar", "block_diffusion", ...): what the CLI and the server's /health say."""

    ragged_lengths: ClassVar[bool] = False
    """Rows of one batch may ask for different max_new_tokens."""

    is_autoregressive: ClassVar[bool] = False
    """Tokens are revealed left to right, one position after another (its trajectory's
    likelihood is the causal one: a tunix learner can score it, RL replays it by teacher forcing)."""

    trace_keys: ClassVar[tuple[str, ...]] = ()
    """The `state.extra` arrays `output_trace` reads (fetched to the host); () keeps no trace."""

    # ------------------------------------------------------------------ host side
    def for_model(self, cfg) -> Paradigm:
        """This config with the fields it leaves to the model filled in from `cfg` (block_diffusion's
        block_length=None: the model's block_size); runs before `validate`, and every later hook
        sees the result. Default: self."""
        return self

    def validate(self, cfg) -> None:
        """Checks against the model config (e.g. a mask token is required), raising
        `jdllm.errors.DecodingConfigError`; runs before anything compiles. Range checks of the
        paradigm's own fields belong in `__post_init__`."""

    def validate_model(self, model) -> None:
        """Checks that need the whole model (ar_spec: the draft's tokenizer)."""

    def layout(self, lengths: np.ndarray, max_new_tokens: int, cfg) -> common.Layout:
        """Host-side geometry of a batch: each row's `start` and `gen_start`, the canvas size and
        `prefill_len`, rounded up to shape buckets (`common.bucket`) so similar inputs share a
        compile."""
        raise NotImplementedError(f"{type(self).__name__}.layout")

    def attention_config(self, cfg):
        """The model config the forward runs with (block_diffusion: attention blocks follow its
        block_length). Default: cfg."""
        return cfg

    def bind_params(self, params):
        """The parameters the decode takes: the model's plus what the paradigm brings (ar_spec's
        draft model under "draft"). Default: the model's."""
        return params

    def max_iterations(self, state) -> int:
        """A static bound on loop iterations (a guard; rows still running then finish ABORT)."""
        return 2 * state.slots + 8

    def output_trace(self, extra: dict, row: int) -> dict:
        """Per-row analysis for `Output.trace`, from the host copy of the `trace_keys` arrays."""
        return {}

    # ------------------------------------------------------------------ the step (device side, pure)
    def prefill(self, params, ctx, state, bitmask=None):
        """The first forward(s): the prompt into the KV cache (allocated by `loop.prefill`). It may
        also take the first step (`first_step_in_prefill`; `bitmask` then masks `plan(state).slots`)
        or only set up `state.extra` and leave the first forward to the first step."""
        raise NotImplementedError(f"{type(self).__name__}.prefill")

    def plan(self, ctx, state):
        """(state, `common.Plan`): the slots the next step chooses tokens for. May update
        bookkeeping (block states); no forward, no sampling. Call it once per step."""
        raise NotImplementedError(f"{type(self).__name__}.plan")

    def forward(self, params, ctx, state, plan):
        """(state, logits [B, N, V] float32 predicting `plan.slots`): the step's model forward(s),
        K/V written and committed as the paradigm decides, forwards counted."""
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def reveal(self, ctx, state, plan, logits, bitmask=None):
        """Sample the planned slots (optional packed int32 bitmask [B, N, ceil(V/32)]), choose
        which to reveal, write them (`common.write_tokens`) and finish rows (`common.finish_rows`)."""
        raise NotImplementedError(f"{type(self).__name__}.reveal")

    def rewind(self, ctx, state, before, remasked, written):
        """Bookkeeping after a host edited slots between steps (a grammar matcher re-masked
        [B, S] `remasked` or wrote forced `written` tokens; `before`: the state the edits were
        applied to). The canvas, step_map and the committed cache length are already updated;
        a paradigm with more state (multi_block's block states) updates it here. Pure."""
        return state

    # ------------------------------------------------------------------ serving
    joins_running_batch: ClassVar[bool] = True
    """A request may join a running batch at any scheduling round: its row is laid out as for its
    prompt alone on the pool's canvas, prefilled (with the round's other joining rows) and merged
    into a free row (`jdllm.serve`); the step must then let each row
    follow its own schedule (every bundled paradigm does). False: rows share one canvas schedule,
    so requests start together once the batch has drained (a paradigm may make it a property
    when it depends on the configuration)."""

    def pool_layout(self, cfg, max_prompt: int, max_new: int) -> common.Layout:
        """The layout of a serving pool: that of the longest prompt with the longest generation
        (the layout is monotone in both). Its `slots` is the canvas every row lives on; its
        `prefill_len` is the pool's rounds' `DecodeCtx.prefill_len`."""
        return self.layout(np.asarray([max_prompt]), max_new, cfg)

    def pool_slots(self, cfg, max_prompt: int, max_new: int) -> int:
        """The canvas every row of a serving pool lives on (`pool_layout`'s)."""
        return int(self.pool_layout(cfg, max_prompt, max_new).slots)

    def row_layout(self, cfg, length: int, max_new: int, slots: int) -> common.Layout:
        """One joining row's geometry: its own layout for the prompt alone, on the pool canvas."""
        from jdllm import errors  # noqa: PLC0415 (errors imports nothing of decode; kept local to the hook)

        lay = self.layout(np.asarray([length]), max_new, cfg)
        if lay.slots > slots:
            raise errors.SequenceTooLongError(f"a prompt of {length} tokens with max_new_tokens={max_new} "
                                              f"needs {lay.slots} slots, the pool has {slots}")
        return lay._replace(slots=slots)

    # ------------------------------------------------------------------ host-driven constraints
    first_step_in_prefill: ClassVar[bool] = False
    """`prefill` also takes the first step (it samples `plan(state).slots` and takes a bitmask)."""

    fast_forward: ClassVar[bool] = True
    """Tokens a grammar forces may be written without sampling (jump-forward)."""

    def constraint_block(self) -> int | None:
        """The block a grammar's forced tokens may fill at most (block_diffusion: its block), or
        None (any later slot)."""
        return None

    def pending_width(self, state, offsets: np.ndarray, done: np.ndarray) -> int:
        """Host side, constrained decoding: the window the next forward needs to bring forced tokens
        into the cache, given the planned offsets [B] (AR: the slots between the cache end and the
        sampled slot), or 1: the step's own forward."""
        return 1

    def catch_up_forward(self, params, ctx, state, plan, width: int):
        """(state, logits): a forward over [cache length, plan.offset) of static `width` that also
        predicts the planned slots (forced tokens enter the cache in the forward that predicts the
        next one). Only called when `pending_width` > 1."""
        raise NotImplementedError(f"{type(self).__name__} takes no forced tokens into its cache")

    def constraint_masks(self, controller, state, plan, done: np.ndarray) -> np.ndarray:
        """Host side: the packed token bitmask for `reveal`, from a grammar `controller`
        (`jdllm.constraints.guidance.Controller`). Default: the exact mask at the row's frontier
        for the planned slots; ar_spec masks each draft slot as it stands after the drafts."""
        import jax  # noqa: PLC0415

        return controller.sample_mask(np.asarray(jax.device_get(plan.offset)), plan.width, done)

    # ------------------------------------------------------------------ RL
    replay_method: ClassVar[str] = "per_step"
    """How `jdllm.rl.trajectory_logprobs` replays a rollout by default: "teacher_forcing" (one
    causal forward), "packed" (block diffusion's one-pass packing) or "per_step"."""

    def replay_approximation(self) -> str | None:
        """Why this configuration's decode logits are not the exact forward's (an approximate cache)
        so replay can only approximate them, or None."""
        return None

    def reads_kv_cache(self, cfg) -> bool:
        """Whether the decode attends to cached keys and values (so an int8 KV cache changes its
        logits and a replay can only approximate them). Default: True."""
        return True

    def replay_refusal(self) -> str | None:
        """Why a rollout of this configuration can never be replayed (classifier-free guidance),
        or None."""
        return None

    def check_step_map(self, steps: np.ndarray, cfg) -> str | None:
        """Host side: what is wrong with one row's step_map [S] (1-based, 0 = not generated) for
        this paradigm, or None (the generic checks run first)."""
        return None

    def baseline(self) -> "Paradigm | None":
        """A paradigm `jdllm bench` also times on the same prompts for comparison (ar_spec: plain AR)."""
        return None


# --------------------------------------------------------------------------- registry
PARADIGMS: dict[str, Any] = {
    "ar": "jdllm.decode.ar:AR",
    "block_diffusion": "jdllm.decode.block_diffusion:BlockDiffusion",
    "multi_block": "jdllm.decode.multi_block:MultiBlock",
    "masked_diffusion": "jdllm.decode.masked_diffusion:MaskedDiffusion",
    "ar_spec": "jdllm.decode.ar_spec:Speculative",
}
"""name -> "module:Class" (imported when first asked for) or the class itself."""


def register(cls):
    """Add a `Paradigm` subclass to the registry under `cls.name` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Paradigm)) or not cls.name:
        raise TypeError(f"{cls!r} is not a Paradigm subclass with a name")
    PARADIGMS[cls.name] = cls
    return cls


def paradigm_class(name: str):
    """The config class registered under `name` (imports its module)."""
    from jdllm import errors  # noqa: PLC0415

    if name not in PARADIGMS:
        raise errors.DecodingConfigError(f"paradigm {name!r} is not one of {sorted(PARADIGMS)}")
    entry = PARADIGMS[name]
    if isinstance(entry, str):
        mod, cls = entry.split(":")
        entry = getattr(importlib.import_module(mod), cls)
    return entry


def available_paradigms() -> dict:
    """name -> config class, for every registered paradigm whose module imports."""
    out = {}
    for name in PARADIGMS:
        try:
            out[name] = paradigm_class(name)
        except ImportError:
            continue
    return out


__all__ = ["Paradigm", "PARADIGMS", "register", "paradigm_class", "available_paradigms"]
