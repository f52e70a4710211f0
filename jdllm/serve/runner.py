"""The serving runner: the device side of the engine.

It owns the pool (one `DecodeState` of the engine's rows on a fixed canvas), the jitted pieces
that change it and the constraint tables, and carries out a `SchedulerOutput`
(`jdllm.serve.scheduler`): close aborted rows, start a drained batch or admit joining rows, run
the round's steps, and return the host copy of what the output processor reads.

- A joining row (`admit`) is built exactly as `jdllm.generate` builds that prompt alone (the
  paradigm's `row_layout`, on the pool canvas, its own seed and stop ids) and merged into its row
  (`merge_row`), in one jitted call with the pool donated. Rows joining in the same round with the
  same prompt-length bucket are prefilled together, in groups of `ADMIT_GROUPS` sizes (1, 4, 16,
  64): a burst of 64 requests is one batched forward, not 64. The rows are traced values and the
  prefill compiles once per prompt-length bucket and group size, so requests come and go without
  recompiles.
- A drained batch (`start_batch`) is built by `jdllm.api.prepare(..., max_rows=)`, exactly as
  `generate` builds that batch, and prefilled: one compile per batch shape bucket.
- A round is up to n steps of the whole pool (`loop.step_n`). A finished row takes part in the
  batched forward until an admission reuses it (it reveals nothing). A round also returns its
  host view (the arrays the output processor reads, copies of their own), whose transfer starts
  at once: the engine reads it while the next round runs.

Constraints: with constraint_states > 0 every row carries an on-device token-DFA table
(`DecodeState.constraint`) padded to fixed buckets; a free row's table allows everything, so
constrained and free requests share one compiled step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import compile_progress
from jdllm.api import params_for, prepare, to_host, trace_arrays
from jdllm.constraints.dfa_device import stack
from jdllm.decode import common, loop
from jdllm.inputs import to_device
from jdllm.model import KVCache
from jdllm.sharding import auto_axes
from jdllm.state import ABORT, DecodeState

STOP_WIDTH = 8  # stop ids a request may carry (the pool's stop_ids width)
ADMIT_GROUPS = (1, 4, 16, 64)  # joining rows prefilled together: these counts (a bigger group is split)
HOST_FIELDS = ("tokens", "revealed", "step_map", "logprobs", "gen_start", "limit", "end", "done", "finish", "nfe")


def merge_row(pool: DecodeState, new: DecodeState, row) -> DecodeState:
    """`pool` with its rows `row` replaced by `new`'s rows, in order: `row` a traced int (one row) or
    [k] ints (new has k rows), so no recompile per row.

    Every per-row field (canvas, positions, sampling, stop ids, PRNG key, counters, the row's KV
    cache and prev_logits, paradigm `extra` arrays, on-device constraint tables) is copied; a
    `KVCache` anywhere (the state's, or one a paradigm keeps in `extra`, e.g. ar_spec's draft
    cache) along its batch axis 1; batch scalars (`forwards`, `iteration`) stay the pool's.
    """
    rows = jnp.reshape(jnp.asarray(row, jnp.int32), (-1,))

    def put(p, n):
        if isinstance(p, KVCache):
            def at(a, b):
                return a.at[:, rows].set(b)
            scales = {} if p.k_scale is None else dict(k_scale=at(p.k_scale, n.k_scale), v_scale=at(p.v_scale, n.v_scale))
            return dataclasses.replace(p, k=at(p.k, n.k), v=at(p.v, n.v),
                                       length=p.length.at[rows].set(n.length), **scales)
        return p if p.ndim == 0 else p.at[rows].set(n)

    rest = {f.name: getattr(pool, f.name) for f in dataclasses.fields(pool)
            if f.name not in ("forwards", "iteration")}
    fresh = {k: getattr(new, k) for k in rest}
    merged = jax.tree.map(put, rest, fresh, is_leaf=lambda x: isinstance(x, KVCache))
    return pool.replace(**merged)


# --------------------------------------------------------------------------- jitted pieces
def admit_row(params, pool: DecodeState, fresh: DecodeState, row, *, paradigm, ctx):
    """Prefill `fresh` (k joining rows on the pool's canvas, one prompt-length bucket: their
    context) in one batched forward and merge them into the pool's rows `row` [k]. On a mesh the
    joining rows are left to XLA (a few rows do not split over `data`); the merged pool is pinned
    to its shardings."""
    new = loop.prefill(params, fresh, paradigm=paradigm, ctx=dataclasses.replace(ctx, placement=None))
    return common.constrain(ctx, merge_row(pool, new, row))


def host_view(paradigm, pool: DecodeState) -> dict:
    """What the output processor reads of a pool (`HOST_FIELDS`, and under "extra" the arrays
    `Paradigm.output_trace` reads, or None)."""
    fields = {k: getattr(pool, k) for k in HOST_FIELDS}
    fields["extra"] = trace_arrays(paradigm, pool.extra)
    return fields


def run_round(params, pool: DecodeState, n, *, paradigm, ctx):
    """Up to n steps for the whole pool (the iteration guard counts per round: the pool lives on).
    Returns (pool, its host view): the view is arrays of their own, so they outlive the pool's
    donation to the next round while the host reads them."""
    pool = pool.replace(iteration=jnp.zeros((), jnp.int32))
    pool = loop.step_n(params, pool, n, paradigm=paradigm, ctx=ctx)
    return pool, jax.tree.map(jnp.copy, host_view(paradigm, pool))


def abort_rows(pool: DecodeState, rows):
    """Rows [B] (bool) still running finish as ABORT (client gone)."""
    return common.close_rows(pool, rows & ~pool.done, ABORT)


def _idle_extra(params, pool: DecodeState, paradigm, ctx) -> dict:
    """Zeros shaped like the `extra` the paradigm's prefill sets (ar_spec: counters, draft cache),
    so a row's merge finds the same structure in the pool (traced only, nothing runs)."""
    ctx1 = dataclasses.replace(ctx, prefill_len=1)
    shapes = jax.eval_shape(auto_axes(lambda p, s: paradigm.prefill(p, ctx1, s).extra, ctx.placement), params, pool)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


@functools.lru_cache(maxsize=None)
def _compiled(compiler_options: tuple = ()):
    opts = dict(compiler_options) or None
    static = ("paradigm", "ctx")
    return dict(admit=jax.jit(auto_axes(admit_row), static_argnames=static, donate_argnames=("pool",),
                              compiler_options=opts),
                round=jax.jit(auto_axes(run_round), static_argnames=static, donate_argnames=("pool",),
                              compiler_options=opts),
                close=jax.jit(abort_rows, donate_argnames=("pool",), compiler_options=opts),
                buffers=jax.jit(common.with_buffers, static_argnums=(1,), compiler_options=opts),
                prefill=loop.compiled_steps(compiler_options)["prefill"])


# --------------------------------------------------------------------------- the runner
class Runner:
    """The pool of `rows` rows on a `slots`-wide canvas for one model and paradigm, and the calls
    that change it. prefill_len: the pool layout's (`Paradigm.pool_layout`), the rounds'
    `DecodeCtx.prefill_len`. constraint_states / constraint_classes: the DFA table buckets (0: none)."""

    def __init__(self, model, paradigm, *, rows: int, slots: int, prefill_len: int = 0, constraint_states: int = 0,
                 constraint_classes: int = 64, compiler_options: tuple = ()):
        self.model, self.paradigm, self.cfg = model, paradigm, model.config
        self.rows, self.slots = rows, slots
        self.constraint_states, self.constraint_classes = constraint_states, constraint_classes
        self.ctx = common.DecodeCtx(model=paradigm.attention_config(self.cfg), attn_impl=model.forward_impl,
                                    prefill_len=0, placement=model.placement)
        # the context rounds run with: the pool layout's prefill_len (S - prefill_len bounds every
        # row's generation region), rows on their own layouts; a drained batch brings its own
        self.round_ctx = dataclasses.replace(self.ctx, prefill_len=int(prefill_len), own_layouts=True)
        self.fns = _compiled(compiler_options)
        self.params = params_for(model, paradigm)  # ar_spec: the draft's parameters ride along
        self.pool = self._idle_pool()

    def _idle_pool(self) -> DecodeState:
        R = self.rows
        lay = common.Layout(start=np.zeros(R, np.int32), gen_start=np.ones(R, np.int32), slots=self.slots,
                            prefill_len=0)
        idle = common.new_state(self.cfg, [np.zeros(1, np.int32)] * R, lay, 1, stop_ids=[(-1,) * STOP_WIDTH] * R,
                                active=np.zeros(R, bool))
        if self.constraint_states:
            idle = idle.replace(constraint=self.tables([None] * R, self.slots))
        pool = self.fns["buffers"](self.params, self.cfg, idle)
        pool = pool.replace(extra=_idle_extra(self.params, pool, self.paradigm, self.ctx))
        placement = self.model.placement
        return pool if placement is None else placement.place_state(pool)

    def tables(self, dfas: list, slots: int):
        """On-device DFA tables for rows with these DFAs (None: allow everything)."""
        return stack(dfas, self.cfg.vocab_size, self.constraint_states, self.constraint_classes, slots=slots)

    def execute(self, out, steps: int) -> dict | None:
        """Carry out one `SchedulerOutput`: everything is dispatched, nothing waited for. Returns
        the round's host view (device arrays whose copy to the host has started: `to_host` them
        when needed) after its `steps` steps, or None when no row is running."""
        if out.close_rows:
            mask = np.zeros(self.pool.batch, bool)
            mask[list(out.close_rows)] = True
            self.close(mask)
        if out.start_batch:
            self.start_batch(out.start_batch)
        if out.admit:
            self.admit_many(out.admit)
        if not out.run_round:
            return None
        view = self.step(steps)
        for a in jax.tree.leaves(view):
            if a.is_fully_addressable:  # (a multi-host array is gathered by to_host)
                a.copy_to_host_async()
        return view

    def close(self, rows: np.ndarray) -> None:
        """Rows [B] (bool) still running finish as ABORT."""
        self.pool = self.fns["close"](self.pool, to_device(rows))

    def close_all(self) -> None:
        self.close(np.ones(self.pool.batch, bool))

    def start_batch(self, reqs) -> None:
        """A drained pool's new batch: request i in row i, built as `generate` builds it, prefilled."""
        settings = [dataclasses.replace(r.sampling, stop_token_ids=r.stop_ids) for r in reqs]
        prep = prepare(self.model, [r.prompt_ids for r in reqs], self.paradigm, settings, max_rows=self.rows)
        state, self.round_ctx = prep.state, prep.ctx
        if self.constraint_states:
            dfas = [r.dfa for r in reqs] + [None] * (state.batch - len(reqs))
            state = state.replace(constraint=self.tables(dfas, state.slots))
        with compile_progress.watch(self.fns["prefill"], f"{self.paradigm.name} prefill", state,
                                    (self.paradigm, self.round_ctx)):
            self.pool = self.fns["prefill"](self.params, state, paradigm=self.paradigm, ctx=self.round_ctx)

    def admit(self, req, row: int) -> None:
        """Prefill `req` alone on the pool canvas and merge it into `row`."""
        self.admit_many([(req, row)])

    def admit_many(self, pairs) -> None:
        """Prefill joining (request, row) pairs and merge each into its row. Requests of one
        prompt-length bucket are prefilled together, in groups of ADMIT_GROUPS sizes (64 arriving
        at once: one batched forward, not 64), each row built exactly as `generate` builds its prompt
        alone (its own layout, seed and stop ids); at most len(ADMIT_GROUPS) compiles per bucket."""
        by_len: dict = {}
        for req, row in pairs:
            s = req.sampling
            lay = self.paradigm.row_layout(self.cfg, len(req.prompt_ids), s.max_new_tokens, self.slots)
            by_len.setdefault(int(lay.prefill_len), []).append((req, row, lay))
        for prefill_len, group in by_len.items():
            while group:
                k = max(g for g in ADMIT_GROUPS if g <= len(group))
                self._admit_group(group[:k], prefill_len)
                group = group[k:]

    def _admit_group(self, group, prefill_len: int) -> None:
        reqs = [req for req, _, _ in group]
        lay = common.Layout(start=np.concatenate([row_lay.start for _, _, row_lay in group]),
                            gen_start=np.concatenate([row_lay.gen_start for _, _, row_lay in group]),
                            slots=self.slots, prefill_len=prefill_len)
        stops = [r.stop_ids + (-1,) * (STOP_WIDTH - len(r.stop_ids)) for r in reqs]
        fresh = common.new_state(self.cfg, [np.asarray(r.prompt_ids, np.int32) for r in reqs], lay,
                                 [r.sampling.max_new_tokens for r in reqs], settings=[r.sampling for r in reqs],
                                 stop_ids=stops, seed=[r.sampling.seed for r in reqs], stream=0)
        if self.constraint_states:
            fresh = fresh.replace(constraint=self.tables([r.dfa for r in reqs], self.slots))
        ctx = dataclasses.replace(self.ctx, prefill_len=prefill_len)
        key = (self.paradigm, ctx, self.pool.tokens.shape)
        rows = np.asarray([row for _, row, _ in group], np.int32)
        with compile_progress.watch(self.fns["admit"], f"{self.paradigm.name} prefill", fresh, key):
            self.pool = self.fns["admit"](self.params, self.pool, fresh, rows, paradigm=self.paradigm, ctx=ctx)

    def step(self, steps: int) -> dict:
        """Up to `steps` steps of the whole pool; returns the pool's host view after them (device
        arrays, dispatched: nothing is waited for)."""
        with compile_progress.watch(self.fns["round"], f"{self.paradigm.name} step", self.pool,
                                    (self.paradigm, self.round_ctx)):
            self.pool, view = self.fns["round"](self.params, self.pool, np.int32(steps), paradigm=self.paradigm,
                                                ctx=self.round_ctx)
        return view

    def host(self) -> dict:
        """NumPy copies of what the output processor reads of the pool now (waits for it)."""
        return to_host(host_view(self.paradigm, self.pool))


__all__ = ["Runner", "merge_row", "STOP_WIDTH"]
