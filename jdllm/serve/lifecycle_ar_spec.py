"""The serving lifecycle of `ar_spec` (speculative AR decoding): join at any scheduling round.

An ar_spec row is as independent as an AR row: its first unrevealed slot, its target KV-cache
length and (proposer "draft_model") its draft KV cache are all per row, and a verification
rolls both caches back per row. So a request joins between any two steps of its neighbours:
its row is built as `jdllm.generate` builds it for that prompt alone (the paradigm's own
`layout`, on the pool's wider canvas), prefilled alone (target and draft caches; the prefill
takes no step here) and merged into a free row. The state it carries beyond the common fields
lives in `state.extra`: the counters (`proposed`, `accepted`, `draft_forwards`), the last
drafts and, with a draft model, `draft_cache` (a `KVCache`, batch axis 1) and `q` (the draft's
distributions). `merge_row` copies all of them into the row, the draft cache along its batch
axis, so the draft's cache rides with the row.

Reindexing: none. A finished row stays `done` in place (it proposes nothing: its draft count is
0, and verifies nothing; it still takes part in the batched target and draft forwards) until
an admission overwrites every per-row field, the draft cache included.

The draft model's parameters travel with the target's (`Speculative.bind_params`), which the
engine does for every paradigm (`jdllm.api.params_for`).
"""

from __future__ import annotations

import dataclasses

from jdllm.serve.lifecycle import RowJoin


@dataclasses.dataclass(frozen=True)
class SpecJoin(RowJoin):
    """ar_spec: join at any round, the draft cache and draft counters carried in the row's extra."""

    rule: str = "any round (draft cache rides along)"


__all__ = ["SpecJoin"]
