"""The prefix / dual cache forwards of `MaskedDiffusion` (Fast-dLLM), one for a batch whose rows
each follow their own block schedule, and the whole-canvas forward without a cache. `par` is the
`MaskedDiffusion` config; see `jdllm/decode/masked_diffusion.py`'s docstring for the caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdllm.decode import common
from jdllm.model import default_positions, forward
from jdllm.state import DecodeState, slot_index


def full_logits(par, params, ctx, state: DecodeState, at, lo: int = 0):
    """(state, logits [B, N, V] at canvas slots `at` [B, N]) of a forward over slots [lo, S) alone,
    no cache (with classifier-free guidance: the mix of the two forwards). lo > 0 only where every
    row that matters starts at or after it (slots before a row's start are padding it never sees)."""
    S = state.slots
    toks = state.tokens[:, lo:]
    pos = default_positions(state.start, lo, S - lo)
    start = jnp.maximum(state.start - lo, 0)
    at = jnp.clip(at - lo, 0, S - lo - 1)
    if par.cfg_scale > 0:
        prompt = slot_index(state)[:, lo:] < state.gen_start[:, None]
        un = jnp.where(prompt, jnp.int32(ctx.model.mask_token_id), toks)
        both, _ = forward(params, ctx.model, jnp.concatenate([toks, un]), jnp.concatenate([pos, pos]),
                          start=jnp.concatenate([start, start]), attn_impl=ctx.attn_impl,
                          logits_at=jnp.concatenate([at, at]))
        cond, unc = both[:state.batch], both[state.batch:]
        return state.replace(forwards=state.forwards + 2), unc + (par.cfg_scale + 1.0) * (cond - unc)
    raw, _ = forward(params, ctx.model, toks, pos, start=start, attn_impl=ctx.attn_impl, logits_at=at)
    return state.replace(forwards=state.forwards + 1), raw


def cached_logits(params, ctx, state: DecodeState, lo, width: int, at, *, kv_len=None,
                  keep_below=None, keep_from=None, write_cache: bool = True, head: bool = True):
    """(state, logits [B, N, V] at canvas slots `at`) of a forward over [lo, lo + width) (lo:
    scalar or [B]) against the cache, writing the window's K/V except where kept (write_cache=False:
    nothing written, for a window nobody reads back; see `refresh_or_window`). head False: the
    final-normed hidden states [B, N, D] instead (`common.switch_width`'s `hidden_of`)."""
    toks = common.window(state.tokens, lo, width)
    pos = default_positions(state.start, lo, width)
    idx = jnp.clip(at - jnp.asarray(lo, jnp.int32).reshape(-1, 1), 0, width - 1)
    raw, cache = forward(params, ctx.model, toks, pos, start=state.start, cache=state.cache, offset=lo,
                         attn_impl=ctx.attn_impl, kv_len=kv_len, logits_at=idx, keep_below=keep_below,
                         keep_from=keep_from, write_cache=write_cache, head=head)
    return state.replace(cache=cache if write_cache else state.cache, forwards=state.forwards + 1), raw


def refresh_or_window(par, params, ctx, state: DecodeState, plan: common.Plan, at, work):
    """prefix / dual cache, per row: a working row at its block's first step refreshes (its whole
    canvas: K/V written, logits from the full forward), the others run [block start - shift, S)
    (prefix) or their block alone with the cached suffix visible (dual) against their own cache.

    One forward serves the batch: when every working row runs its window, the narrowest one that
    holds them (prefix: the static widths of a batch whose rows share the prompt bucket; dual: each
    row's block at its own offset); when some row refreshes, the whole canvas. Every row keeps its
    cached K/V outside what it recomputes alone (`forward(keep_below=, keep_from=)`), so each row
    computes what it computes alone. The cost: rows that joined at other times refresh at other
    steps, and each refresh makes that step's forward a whole-canvas one for the batch.

    On the Pallas kernels (`common.reads_cache_in_place`) a step where no row refreshes writes its
    K/V back although nobody reads them (the row's next step recomputes its window, or its block;
    its next block's refresh rewrites the canvas; a refresh keeps other rows' K/V only outside what
    they recompute): XLA updates a cache in place under a conditional only when every branch
    writes it, reads it only after writing, and hands it out behind an optimization barrier; a
    branch passing it through, or reading it before writing, made XLA copy the whole cache two to
    four times per step. So dual's block steps write their block, and prefix runs one switch over
    its widths whose every branch writes (a refresh is the widest need: its floor is 0, or the
    row's start in a serving pool); the slots a row keeps are dropped from the write, not read
    back (`jdllm.model.write_rows(keep=)`). One row alone rewrites the whole canvas when it
    refreshes, so its refresh keeps nothing. 8B, P128 + G256 on an H100 (deviceless compile,
    `benchmarks/gpu_program.py`): dual 576-768 MiB of copies per step before, none now; prefix
    192 MiB in the loop body and 640 on its worst step before, none now. On the XLA attention
    (the CPU) a window step writes nothing: its attention reads a copy of the cut of each layer's
    cache it needs anyway, and there the writing variant costs whole-cache copies."""
    S, W = state.slots, plan.width
    shift = int(ctx.model.logit_shift)
    refresh = work & (state.extra["i"] == 0)  # [B]
    b0 = par._block_start(state)  # [B]
    lo = b0 - shift  # [B] a window row's first recomputed slot
    # a refreshing row rewrites [its start, S) (a serving pool), or the whole canvas (padding included)
    fresh = state.start if ctx.own_layouts else jnp.zeros_like(state.start)
    if par.cache_mode == "prefix":
        floor = jnp.where(work, jnp.where(refresh, fresh, lo), S).astype(jnp.int32)
        P = ctx.prefill_len
        widths = sorted(set(common.suffix_widths(ctx, S)) | {S - (P + k * W - shift) for k in
                                                              range(max((S - P) // W, 1))
                                                              if 0 < S - (P + k * W - shift) <= S})

        # one row alone recomputes its whole window: nothing in it to keep (and no per-layer select)
        keep = floor if state.batch > 1 or ctx.own_layouts else None

        def suffix(width, write, head=True):
            return lambda st: cached_logits(params, ctx, st, S - width, width, at, keep_below=keep,
                                            write_cache=write, head=head)

        if common.reads_cache_in_place(ctx):
            # the kernels: one switch of writers (a refresh is the widest need, floor 0 or the row's
            # start): the window steps write back what their next step recomputes (docstring)
            return common.switch_width(ctx, state, widths, S - jnp.min(floor), lambda w: suffix(w, True),
                                       hidden_of=lambda w: suffix(w, True, head=False), params=params)

        def refreshing(st):  # some row refreshes: the window's K/V are written (generate: the whole canvas)
            return common.switch_width(ctx, st, widths if ctx.own_layouts else [S], S - jnp.min(floor),
                                       lambda w: suffix(w, True))

        def windows(st):  # every row in its window: K/V the next step recomputes, not written back
            return common.switch_width(ctx, st, widths, S - jnp.min(floor), lambda w: suffix(w, False))

        return jax.lax.cond(jnp.any(refresh), refreshing, windows, state)

    hi = b0 + par._rows(state)[0]  # [B] the block's end (one block: the canvas end)

    below = jnp.where(refresh, fresh, jnp.where(work, lo, S)).astype(jnp.int32)
    above = jnp.where(refresh, S, jnp.where(work, hi, S)).astype(jnp.int32)

    alone = state.batch == 1 and not ctx.own_layouts  # one row refreshing rewrites the whole canvas
    writes = common.reads_cache_in_place(ctx)  # the kernels: block steps write back (docstring)

    def full(st):  # dual, some row refreshes: the others keep everything outside their block
        def refresh_at(w, head=True):
            return lambda s_: cached_logits(params, ctx, s_, S - w, w, at, keep_below=None if alone else below,
                                            keep_from=None if alone else above, head=head)
        return common.switch_width(ctx, st, common.suffix_widths(ctx, S), S - jnp.min(below), refresh_at,
                                   hidden_of=lambda w: refresh_at(w, head=False), params=params)

    def blocks(st):  # dual, every row in its block: the block alone, the cached suffix visible
        if par.block_length is not None:  # each row's block at its own offset
            # one row: a scalar offset (a window slice and update, not a per-row gather / scatter)
            return cached_logits(params, ctx, st, lo[0] if st.batch == 1 else lo, W + shift, at, kv_len=S,
                                       write_cache=writes)
        # one block per row, ending at the canvas end: the widest row's, the others keep their prefix
        return cached_logits(params, ctx, st, S - W - shift, W + shift, at,
                                   keep_below=jnp.where(work, lo, S).astype(jnp.int32), write_cache=False)

    if writes and par.block_length is not None:
        full, blocks = common.in_place(full), common.in_place(blocks)
    return jax.lax.cond(jnp.any(refresh), full, blocks, state)


__all__ = ["full_logits", "cached_logits", "refresh_or_window"]
