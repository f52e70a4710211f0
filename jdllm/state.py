"""DecodeState: the immutable pytree every decoding paradigm carries through the loop.

Every row has a canvas of slots [0, S). Row b's real tokens start at
`start[b]` (earlier slots are left padding the masking rule hides), its
generation starts at `gen_start[b]` and may not reach `limit[b]`
(= gen_start + max_new_tokens). RoPE positions are `slot - start[b]`. Rows are
independent: each has its own cache length (`cache.length[b]`), sampling
settings, stop ids and PRNG stream, so a row can advance by several slots in
one step, rewind, or sit at a different position from its neighbours.

A paradigm reads and replaces fields with `dataclasses.replace`; fields a
paradigm needs beyond these (block states, a commit flag) go in `extra`, a dict
of arrays, so adding one touches only that paradigm's file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jdllm.model import KVCache
from jdllm.sampling import RowSampling

# finish codes (per row); api.py turns them into strings.
# ABORT: stopped by the iteration guard or a forward budget (`max_forwards`) before
# finishing. INVALID: no token could be drawn (every allowed logit was -inf or the
# logits were not finite: a constraint that allows nothing, or broken weights).
RUNNING, STOP, LENGTH, ABORT, INVALID = 0, 1, 2, 3, 4
FINISH_REASONS = {RUNNING: None, STOP: "stop", LENGTH: "length", ABORT: "abort", INVALID: "invalid"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything a decoding step reads or writes. Shapes: B rows, S slots, V vocab."""

    tokens: jax.Array  # [B, S] int32 canvas: prompt, generated tokens, mask id where unrevealed
    revealed: jax.Array  # [B, S] bool: slot holds a real token (prompt or generated)
    step_map: jax.Array  # [B, S] int32: 1-based step a generated token was revealed in; 0 elsewhere
    logprobs: jax.Array  # [B, S] float32: log-prob of a generated token at reveal time
    start: jax.Array  # [B] int32: first real slot (left padding before it)
    gen_start: jax.Array  # [B] int32: first generated slot
    limit: jax.Array  # [B] int32: generation may use slots [gen_start, limit)
    steps: jax.Array  # [B] int32: steps that revealed >= 1 token so far (the step_map counter)
    nfe: jax.Array  # [B] int32: model forwards this row took part in (prefill and commits included)
    done: jax.Array  # [B] bool
    finish: jax.Array  # [B] int32: RUNNING / STOP / LENGTH / ABORT / INVALID
    end: jax.Array  # [B] int32: one past the last slot to return (set when a row finishes)
    key: jax.Array  # [B] typed PRNG keys, one stream per row
    sampling: RowSampling  # [B] temperature / top_k / top_p, data (a new value does not recompile)
    stop_ids: jax.Array  # [B, NS] int32: each row's stop tokens, -1 = unused
    cache: KVCache | None  # [layers, B, S, kv_heads, head_dim], length [B]; None until `loop.prefill`
    prev_logits: jax.Array | None  # [B, V] float32: raw logits of the slot before the window; None until prefill
    forwards: jax.Array  # [] int32: forwards the batch ran
    iteration: jax.Array  # [] int32: loop iterations run (a termination guard)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # paradigm-owned arrays
    # on-device constraint tables (jdllm.constraints.dfa_device.DFATables) or None (unconstrained:
    # nothing extra is traced); sample_window masks with it and reveal keeps reveals jointly valid
    constraint: Any = None

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def slots(self) -> int:
        return self.tokens.shape[1]

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)


def slot_index(state: DecodeState) -> jax.Array:
    """[1, S] int32 slot numbers, for broadcasting against per-row bounds."""
    return jnp.arange(state.slots, dtype=jnp.int32)[None, :]


def generated_mask(state: DecodeState) -> jax.Array:
    """[B, S] bool: slots inside each row's generation range."""
    s = slot_index(state)
    return (s >= state.gen_start[:, None]) & (s < state.limit[:, None])
