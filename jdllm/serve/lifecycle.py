"""Per-paradigm request lifecycles for the serving engine: where a request may join the running
pool, what state it carries in, how its row is placed on the pool's canvas.

The scheduler (`jdllm.serve.engine`) knows nothing about paradigms; it asks the lifecycle of the
engine's paradigm. A lifecycle is picked by the paradigm's registry name (`LIFECYCLES`); a
paradigm with state of its own to carry has its own file (`lifecycle_ar_spec.SpecJoin`: ar_spec
joins at any round, its draft KV cache riding along in the row's `extra`).

`RowJoin` (ar, block_diffusion): rows are fully independent in these paradigms (per-row
positions, cache length, block grid and PRNG stream), so a request joins at any scheduling round.
Its row is built exactly as `jdllm.generate` builds it for that prompt alone (the paradigm's own
`layout` for one row), only on the pool's wider canvas, prefilled on its own (the paradigm's
`prefill`, which for both also takes the row's first step) and merged into a free row of the
running batch (`merge_row`); the other rows keep their state. AR: any step. Block diffusion: the
row brings its own block grid (its left padding puts its prompt blocks where they are when it
runs alone), so joining between any two steps of its neighbours is exact. Reindexing is not
needed: a finished row stays `done` in place (it reveals nothing and costs only its share of the
batched forward) until the next admission overwrites it.

`DrainJoin` (masked_diffusion, multi_block): their rows share one canvas schedule (masked
diffusion's lockstep window over a common prefill length, multi_block's block grid and its
prefill length), so a row cannot join a running batch without re-planning its neighbours.
Requests join only when the pool has drained: the waiting ones (up to the pool size, FIFO among
those asking for the head request's max_new_tokens, since these paradigms decode a batch to one
length) start together as one batch built by `jdllm.api.prepare`, exactly as `jdllm.generate`
builds that batch. Each drained batch compiles once per shape bucket (batch, prompt, generation),
not once per request; they still stream (the revealed prefix) between rounds.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import numpy as np

from jdllm import errors
from jdllm.decode import common
from jdllm.model import KVCache
from jdllm.state import DecodeState


@dataclasses.dataclass(frozen=True)
class RowJoin:
    """Join at any round: prefill the row alone on the pool canvas, then merge it into a free row."""

    rule: str = "any round"

    def pool_slots(self, paradigm, cfg, max_prompt: int, max_new: int) -> int:
        """The canvas every row of the pool lives on: wide enough for the longest prompt bucket
        plus the longest generation the engine accepts (the paradigm's layout is monotone in both)."""
        return int(paradigm.layout(np.asarray([max_prompt]), max_new, cfg).slots)

    def row_layout(self, paradigm, cfg, length: int, max_new: int, slots: int) -> common.Layout:
        """One row's geometry: the paradigm's own layout for the prompt alone, on the pool canvas."""
        lay = paradigm.layout(np.asarray([length]), max_new, cfg)
        if lay.slots > slots:  # the engine checks lengths first; this guards the invariant
            raise errors.SequenceTooLongError(f"a prompt of {length} tokens with max_new_tokens={max_new} "
                                              f"needs {lay.slots} slots, the pool has {slots}")
        return lay._replace(slots=slots)


@dataclasses.dataclass(frozen=True)
class DrainJoin:
    """Join only when the pool has drained; a batch starts together, built as `generate` builds it."""

    rule: str = "when the batch drains"

    def pool_slots(self, paradigm, cfg, max_prompt: int, max_new: int) -> int:
        return int(paradigm.layout(np.asarray([max_prompt]), max_new, cfg).slots)

    def take(self, waiting: list, capacity: int) -> list:
        """The requests that start together: FIFO, those with the head's max_new_tokens."""
        if not waiting:
            return []
        n = waiting[0].sampling.max_new_tokens
        return [r for r in waiting if r.sampling.max_new_tokens == n][:capacity]

    def batch(self, model, paradigm, reqs: list, max_rows: int | None = None):
        """(state, ctx) for these requests as one batch (`jdllm.api.prepare`, token-id prompts) of at
        most `max_rows` rows (the engine's pool)."""
        from jdllm.api import prepare  # noqa: PLC0415

        settings = [dataclasses.replace(r.sampling, stop_token_ids=r.stop_ids) for r in reqs]
        prep = prepare(model, [r.prompt_ids for r in reqs], paradigm, settings, max_rows=max_rows)
        return prep.state, prep.ctx


# paradigm name -> "module:Class" of its lifecycle (a paradigm with its own file imports this one)
LIFECYCLES = {"ar": "jdllm.serve.lifecycle:RowJoin", "block_diffusion": "jdllm.serve.lifecycle:RowJoin",
              "masked_diffusion": "jdllm.serve.lifecycle:DrainJoin", "multi_block": "jdllm.serve.lifecycle:DrainJoin",
              "ar_spec": "jdllm.serve.lifecycle_ar_spec:SpecJoin"}


def lifecycle_for(paradigm):
    """The lifecycle of a paradigm config, or DecodingConfigError naming the paradigms served."""
    name = getattr(paradigm, "name", None)
    if name not in LIFECYCLES:
        raise errors.DecodingConfigError(
            f"paradigm {name!r} cannot be served yet (continuous batching supports {sorted(LIFECYCLES)}); "
            "use jdllm.generate for it")
    mod, cls = LIFECYCLES[name].split(":")
    return getattr(importlib.import_module(mod), cls)()


def merge_row(pool: DecodeState, new: DecodeState, row) -> DecodeState:
    """`pool` with its row `row` (a traced int: no recompile per row) replaced by `new`'s only row.

    Every per-row field (canvas, positions, sampling, stop ids, PRNG key, counters, the row's KV
    cache and prev_logits, paradigm `extra` arrays, on-device constraint tables) is copied; a
    `KVCache` anywhere (the state's, or one a paradigm keeps in `extra`, e.g. ar_spec's draft
    cache) along its batch axis 1; batch scalars (`forwards`, `iteration`) stay the pool's.
    """
    def put(p, n):
        if isinstance(p, KVCache):
            return dataclasses.replace(p, k=p.k.at[:, row].set(n.k[:, 0]), v=p.v.at[:, row].set(n.v[:, 0]),
                                       length=p.length.at[row].set(n.length[0]))
        return p if p.ndim == 0 else p.at[row].set(n[0])

    rest = {f.name: getattr(pool, f.name) for f in dataclasses.fields(pool)
            if f.name not in ("forwards", "iteration")}
    fresh = {k: getattr(new, k) for k in rest}
    merged = jax.tree.map(put, rest, fresh, is_leaf=lambda x: isinstance(x, KVCache))
    return pool.replace(**merged)


__all__ = ["RowJoin", "DrainJoin", "LIFECYCLES", "lifecycle_for", "merge_row"]
