"""`multi_block`'s cache modes, one small strategy per mode (what each computes: the "KV cache"
section of `jdllm.decode.multi_block`'s docstring).

`CACHE_STRATEGIES[MultiBlock.resolved_cache_mode(cfg)]` is chosen once; its
`forward(mb, params, ctx, state, at, active_end) -> (state, logits)` is phase 4 of a step:
`mb` the `MultiBlock` config, `at` [B, N] the planned slots the logits [B, N, V] predict,
`active_end` [B] the end of each row's rightmost block in flight. Forwards are counted in
`state.forwards` here and in the NFE by `MultiBlock.forward`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jdllm.decode import common
from jdllm.decode.multi_block_states import (ACTIVATED, COMPLETED, FULLY_ACTIVATED, INACTIVE, block_stats,
                                             block_view, first_open, num_blocks)
from jdllm.model import default_positions, forward
from jdllm.state import DecodeState

WINDOW_BLOCKS = 4  # cache_mode="window" recomputes this many blocks (+ 1) when max_blocks is None


class CacheStrategy:
    """One cache mode: how phase 4's forward reads and writes the KV cache."""

    mode: ClassVar[str] = ""

    def forward(self, mb, params, ctx, state: DecodeState, at, active_end):
        raise NotImplementedError(f"{type(self).__name__}.forward")


def prefix_logits(params, ctx, state: DecodeState, width: int, at):
    """No cache: the model over slots [0, width) alone -> (state, logits predicting `at` [B, N, V])."""
    tokens = state.tokens[:, :width]  # [B, W]
    positions = default_positions(state.start, 0, width)
    idx = jnp.clip(common.head_index(ctx, at, 0), 0, width - 1)
    logits, _ = forward(params, ctx.model, tokens, positions, start=state.start, attn_impl=ctx.attn_impl,
                        logits_at=idx)
    return state.replace(forwards=state.forwards + 1), logits


def suffix_logits(params, ctx, state: DecodeState, lo: int, at):
    """No cache: the model over slots [lo, S) alone (a bidirectional canvas whose running rows all start
    at or after lo) -> (state, logits predicting `at` [B, N, V])."""
    S = state.slots
    positions = default_positions(state.start, lo, S - lo)
    idx = jnp.clip(common.head_index(ctx, at, lo), 0, S - lo - 1)
    logits, _ = forward(params, ctx.model, state.tokens[:, lo:], positions, start=jnp.maximum(state.start - lo, 0),
                        attn_impl=ctx.attn_impl, logits_at=idx)
    return state.replace(forwards=state.forwards + 1), logits


@dataclasses.dataclass(frozen=True)
class NoCache(CacheStrategy):
    """cache_mode="none". Bidirectional: the whole canvas. Block-causal: the prefix up to active_end,
    rounded up to base + 2^i blocks (a few static widths; later slots cannot change these logits)."""

    mode: ClassVar[str] = "none"

    def forward(self, mb, params, ctx, state: DecodeState, at, active_end):
        S, Bs = state.slots, mb.block_size
        if ctx.model.attention != "block_causal":  # a serving pool narrows to [the running rows' start, S)
            need = S - jnp.min(jnp.where(~state.done, state.start, S))
            return common.switch_width(ctx, state, common.suffix_widths(ctx, S), need,
                                       lambda w: lambda st: suffix_logits(params, ctx, st, S - w, at))
        widths, w = [], Bs
        while ctx.prefill_len + w < S:
            widths.append(ctx.prefill_len + w)
            w *= 2
        need = jnp.max(jnp.where(~state.done, active_end, 0))
        return common.switch_width(ctx, state, widths + [S], need,
                                   lambda w: lambda st: prefix_logits(params, ctx, st, w, at))


def window_start(length, S: int, width: int, chunk=0):
    """Where each row's exact-cache window of `width` slots starts: `chunk` windows past its cache
    `length` [B], or ending at the canvas end S when it would run off it (recomputing committed slots
    from their final tokens rewrites the same K/V). One row: a scalar (a slice and an update, not a
    gather / scatter)."""
    start = jnp.minimum(length + chunk * width, S - width)
    return start[0] if length.shape[0] == 1 else start


@dataclasses.dataclass(frozen=True)
class ExactCache(CacheStrategy):
    """cache_mode="exact": a window from each row's cache.length; commit the blocks that were Completed
    before this forward.

    Window widths: 1, 2, 4, ... blocks up to 2 * max_blocks (without a cap: up to the canvas; the
    narrowest that reaches every running row's active end from its own cache length), else the whole
    canvas. Each row's window starts at its own cache length (rows of a batch sit at different
    frontiers, none waits for another); a window that would run off the canvas starts earlier
    instead: it then recomputes some committed slots from their final tokens, which rewrites the
    same K/V.
    """

    mode: ClassVar[str] = "exact"

    def forward(self, mb, params, ctx, state: DecodeState, at, active_end):
        Bs, S = mb.block_size, state.slots
        K = S if mb.max_blocks is None else mb.max_blocks
        base = state.extra["base"]
        running = ~state.done
        first = first_open(state.extra["block_state"])  # [B] at forward time
        L = state.cache.length  # [B]
        new_len = jnp.where(running, jnp.maximum(base + first * Bs, L), L).astype(jnp.int32)
        also = (new_len - 1)[:, None]  # the last committed slot's raw logits

        def commit(st, logits):  # the logits keep their extra row: sliced after the switch (see below)
            N = at.shape[1]
            prev = jnp.where((new_len > L)[:, None], logits[:, N], st.prev_logits)
            return st.replace(cache=st.cache.commit(new_len), prev_logits=prev), logits

        def windowed(width):
            def forward(st):
                st, logits = common.forward_window(params, ctx, st, window_start(L, S, width), width, at=at,
                                                   also=also, use_prev=True)
                return commit(st, logits)
            return forward

        def full(st):
            st, logits = common.forward_window(params, ctx, st, 0, S, at=at, also=also)
            return commit(st, logits)

        # windows no wider than the generation region (S - prefill_len: every later window's need): a
        # wider one serves only a first forward from an empty cache, which the full forward serves as
        # well, so at a 32k prompt and 1k generation the step compiles 6 window shapes instead of 11
        widths, n = [], 1
        while n <= 2 * K and n * Bs < S and n * Bs <= max(S - ctx.prefill_len, Bs):
            widths.append(n * Bs)
            n *= 2
        need = jnp.max(jnp.where(running, active_end - L, 0))  # slots the widest row's window must cover
        keep = common.compiled_widths(ctx, state.batch, widths + [S])
        if common.reads_cache_in_place(ctx) and len(keep) > 2:
            state, logits = self.chunked(params, ctx, state, keep[0], need, at, also)
            state, logits = commit(state, logits)
        else:
            # the branches return the logits with the last committed slot's row appended, cut here: a cut
            # inside a branch is a copy of the [B, N, V] logits (the branch's result), outside it fuses
            # into the sampling that reads them (8B, 288 slots: 139 MiB of float32 per step)
            state, logits = common.switch_width(ctx, state, widths + [S], need,
                                                lambda w: windowed(w) if w < S else full)
        return state, logits[:, :at.shape[1]]

    @staticmethod
    def chunked(params, ctx, state: DecodeState, width: int, need, at, also):
        """The window of `need` slots from each row's cache length as consecutive forwards of `width`
        slots (the narrowest compiled width) in a while loop: the first as the narrow window (the slot
        before it from prev_logits), each later one `width` further (or ending at the canvas end), its
        logits taken for the slots of `at` / `also` it holds. Exact for block-causal attention: the
        chunks start on block boundaries (cache lengths and `width` are whole blocks), so a chunk's
        keys are in the cache (earlier chunks) or in the chunk itself, as in one wide window.

        Why not the switch over widths: with more than two branches XLA copies the KV cache into and
        out of the conditional on every step (`common.switch_width`; multi_block exact at a 32k prompt
        on the Pallas kernels: 16.5 GiB per step, 54.6 ms per forward on an H200 against 13.6 for
        block_diffusion). A while loop carries the cache in place."""
        S, L = state.slots, state.cache.length
        state, logits = common.forward_window(params, ctx, state, window_start(L, S, width), width, at=at,
                                              also=also, use_prev=True)

        def more(carry):
            c, st, logits = carry
            o = window_start(L, S, width, c)
            st, lg = common.forward_window(params, ctx, st, o, width, at=at, also=also)
            rel = jnp.concatenate([common.head_index(ctx, at, o),
                                   also - common.rows_of(st, o)[:, None]], axis=1)  # [B, N + 1]
            return c + 1, st, jnp.where(((rel >= 0) & (rel < width))[..., None], lg, logits)

        chunks = jnp.maximum(-(-need // width), 1)
        _, state, logits = jax.lax.while_loop(lambda cr: cr[0] < chunks, more, (jnp.int32(1), state, logits))
        return state, logits


@dataclasses.dataclass(frozen=True)
class ApproxCache(CacheStrategy):
    """cache_mode="approx": d3LLM's delayed prefix cache (`generate_multi_block_kv_cache`), per row (its
    own base, edge, forward count and refresh period). One
    forward for the batch: the window ends at S and starts at or before every running row's own
    start (its cache edge, or 0 for a full forward); `keep_below` keeps each row's cached prefix K/V
    as they are, stale included, so a row computes what it computes alone."""

    mode: ClassVar[str] = "approx"

    def forward(self, mb, params, ctx, state: DecodeState, at, active_end):
        Bs, S = mb.block_size, state.slots
        base = state.extra["base"]
        NB = num_blocks(ctx, state, Bs)
        idx, ok = block_view(state, base, NB, Bs)
        size, dec = block_stats(state, idx, ok)
        st = state.extra["block_state"]
        running = ~state.done
        n = state.nfe + 1  # [B] the row's forward number (d3LLM's nfe)
        edge = state.cache.length  # [B]
        ends = jnp.minimum(base[:, None] + Bs * (jnp.arange(NB, dtype=jnp.int32) + 1), S)  # [B, NB]
        # the caching scan: the prompt (complete at nfe 0), then the added blocks, in order
        complete = (st != INACTIVE) & (size > 0) & (dec >= size)  # [B, NB]
        seen = state.extra["scanned_at"]  # [B, NB] d3LLM's completed_at_nfe (-1: None)
        # blocks the EOS early stop completed without their being added: d3LLM creates them
        # complete at that forward and marks them cached; the scan passes them after the delay,
        # caching nothing, and they never count as stabilising
        bst = state.extra["block_steps"]
        eos = (st == COMPLETED) & (bst[..., ACTIVATED - 1] < 0) & (bst[..., FULLY_ACTIVATED - 1] < 0)
        seen = jnp.where(running[:, None] & eos & (seen < 0), n[:, None], seen)
        since = jnp.where(seen >= 0, n[:, None] - seen, 0)
        ripe = jnp.concatenate([(n >= mb.cache_delay_iter)[:, None],
                                complete & (since >= mb.cache_delay_iter)], axis=-1)  # [B, 1 + NB]
        col_end = jnp.concatenate([base[:, None], ends], axis=-1)  # [B, 1 + NB]
        below = col_end <= edge[:, None]
        eos_col = jnp.concatenate([jnp.zeros_like(eos[:, :1]), eos], axis=-1)
        prefix = lambda go: jnp.cumprod(go.astype(jnp.int32), axis=-1) > 0  # noqa: E731
        if ctx.model.logit_shift:
            # d3LLM's Dream scan goes on past complete blocks still inside their delay (and past the
            # blocks after an EOS, marked cached there) and stops only at masks; it caches the ripe ones
            # (ripeness cannot skip a block: a block is first scanned no earlier than the one before it)
            clear = prefix(below | jnp.concatenate([jnp.ones_like(eos[:, :1]), complete | eos], axis=-1))
            reached = jnp.concatenate([jnp.ones_like(clear[:, :1]), clear[:, :-1]], axis=-1)[:, 1:]
            caches = clear & ripe & ~eos_col
        else:  # LLaDA's scan stops at the first block that is not ripe
            passed = prefix(below | ripe)
            reached = jnp.concatenate([jnp.ones_like(passed[:, :1]), passed[:, :-1]], axis=-1)[:, 1:]
            caches = passed & ~eos_col
        new_edge = jnp.maximum(edge, jnp.max(jnp.where(caches, col_end, 0), axis=-1))
        seen = jnp.where(running[:, None] & reached & complete & (ends > edge[:, None]) & (seen < 0),
                         n[:, None], seen)
        stabilising = jnp.any((seen >= 0) & ~eos & (ends > new_edge[:, None]), axis=-1) | (base > new_edge)
        suffix = (new_edge > edge) | ((edge > 0) & ~stabilising & (n % mb.refresh_interval != 0))
        fresh = state.start if ctx.own_layouts else jnp.zeros_like(edge)  # a refresh: [start, S) in a pool
        floor = jnp.where(running, jnp.where(suffix, edge, fresh), S).astype(jnp.int32)  # [B] first slot recomputed
        commit = jnp.where(running, new_edge, edge)
        state = state.replace(extra={**state.extra, "scanned_at": seen})
        if ctx.model.logit_shift:  # Dream shifts within the forward: a suffix's first slot predicts itself
            own = (running & suffix)[:, None] & (at == floor[:, None])
            at = jnp.where(own, at + 1, at)  # the head then reads slot `floor`'s own output
        # window widths: the narrowest of `common.block_widths` that reaches every floor. A suffix starts
        # at a row's cache edge, which is 0 (a refresh: the whole canvas, width S) or at least the row's
        # base >= prefill_len, so outside a serving pool no suffix is wider than the generation region
        # and the widths between it and S would be compiled for nothing (P128 + G256: 320 of 32..384)
        widths = common.block_widths(Bs, S)
        if not ctx.own_layouts:
            widths = [w for w in widths if w <= max(S - ctx.prefill_len, Bs)] + [S]
        N = at.shape[1]
        tail = mb.max_blocks is None  # the planned slots are [S - N, S) (`MultiBlock._flight_width`)

        def suffix_forward(width, head=True):  # head False: hidden states for `switch_width`'s chain
            if not tail or width >= N:  # the head runs at every planned slot
                return lambda s_: common.forward_window(params, ctx, s_, S - width, width, at=at, kv_len=S,
                                                        keep_below=floor, commit=commit, head=head)

            def run(s_):  # the head runs only inside the window: every candidate is there (>= its row's floor)
                s_, out = common.forward_window(params, ctx, s_, S - width, width, at=at[:, N - width:],
                                                kv_len=S, keep_below=floor, commit=commit, head=head)
                pad = jnp.zeros((s_.batch, N - width, out.shape[-1]), out.dtype)  # zero states: zero logits
                return s_, jnp.concatenate([pad, out], axis=1)
            return run

        return common.switch_width(ctx, state, widths, S - jnp.min(floor), suffix_forward,
                                   hidden_of=lambda w: suffix_forward(w, head=False), params=params)


@dataclasses.dataclass(frozen=True)
class WindowCache(CacheStrategy):
    """cache_mode="window": jdllm's windowed approximation, per row: stale K/V outside a window of
    max_blocks + 1 blocks from the row's first block not yet frozen; a full forward every
    refresh_interval of the row's forwards or when its active blocks do not fit. Periods and
    freezing count the row's own forwards (its NFE), so a row decodes as it does alone.

    One forward serves the batch: when no running row refreshes, each row's window at its own offset
    (the cached canvas visible around it); when some row refreshes, the whole canvas, where every
    other row keeps its cached K/V outside its window (`forward(keep_below=, keep_from=)`). The cost:
    rows refreshing at different steps make more of the batch's forwards whole-canvas ones."""

    mode: ClassVar[str] = "window"

    def forward(self, mb, params, ctx, state: DecodeState, at, active_end):
        Bs, S = mb.block_size, state.slots
        K = WINDOW_BLOCKS if mb.max_blocks is None else mb.max_blocks
        base = state.extra["base"]
        lead = int(ctx.model.logit_shift)  # shifted logits: the slot before the window predicts its first
        W = min((K + 1) * Bs + lead, S)
        running = ~state.done
        st = state.extra["block_state"]
        NB = st.shape[-1]
        k = jnp.arange(NB, dtype=jnp.int32)
        done_at = state.extra["completed_at"]
        frozen = (st == COMPLETED) & (done_at >= 0) & (state.nfe[:, None] - done_at >= mb.cache_delay_iter)
        first_live = jnp.min(jnp.where(frozen, NB, k), axis=-1)  # [B] first block not frozen
        offset = jnp.clip(base + first_live * Bs - lead, 0, S - W).astype(jnp.int32)  # [B]
        fits = active_end <= offset + W
        refresh = state.nfe % mb.refresh_interval == 0  # a row's first forward always refreshes
        full_rows = running & (refresh | ~fits)

        def windowed(s_):
            return common.forward_window(params, ctx, s_, offset, W, at=at, kv_len=S)

        def full(s_):  # the refreshing rows write the whole canvas, the others only their window
            window_rows = running & ~full_rows
            below = jnp.where(full_rows, 0, jnp.where(window_rows, offset, S))
            above = jnp.where(full_rows, S, jnp.where(window_rows, offset + W, S))
            return common.forward_window(params, ctx, s_, 0, S, at=at, keep_below=below, keep_from=above)

        return jax.lax.cond(jnp.any(full_rows), full, windowed, state)


CACHE_STRATEGIES: dict[str, CacheStrategy] = {c.mode: c() for c in (NoCache, ExactCache, ApproxCache, WindowCache)}
"""mode -> its strategy (`MultiBlock.resolved_cache_mode(cfg)` picks one)."""

__all__ = ["CacheStrategy", "NoCache", "ExactCache", "ApproxCache", "WindowCache", "CACHE_STRATEGIES",
           "WINDOW_BLOCKS", "prefix_logits", "suffix_logits", "window_start"]
