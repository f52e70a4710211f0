"""`multi_block`'s block grid and block-state machine (see `jdllm.decode.multi_block`'s docstring).

Block k of row b covers slots [base[b] + k * block_size, base[b] + (k + 1) * block_size) (each row
its own base: rows of a serving pool sit on their own layouts); its state
moves Inactive -> Activated -> Fully-Activated -> Completed. `state.extra` holds
`block_state` [B, NB], `block_steps` [B, NB, 3] (the step each state was entered, -1 = never)
and the approximate caches' counters `completed_at` / `scanned_at` [B, NB]. Pure functions.
"""

from __future__ import annotations

import jax.numpy as jnp

from jdllm.decode import common
from jdllm.state import DecodeState, generated_mask, slot_index

INACTIVE, ACTIVATED, FULLY_ACTIVATED, COMPLETED = 0, 1, 2, 3
BLOCK_STATES = ("inactive", "activated", "fully_activated", "completed")


# --------------------------------------------------------------------------- the grid
def num_blocks(ctx, state: DecodeState, block_size: int) -> int:
    """Static number of block columns NB: the canvas's, ceil(S / block_size), which covers every
    row's generation from any base (the same for a row prefilled alone and the pool it joins)."""
    return -(-state.slots // block_size)


def row_base(ctx, state: DecodeState, block_size: int):
    """[B] each row's first decode block: block-causal models its first block on the absolute grid
    after the prompt's whole blocks (the layout's prefill_len alone), bidirectional ones its first
    generated slot."""
    if ctx.model.attention == "block_causal":
        return (state.gen_start // block_size * block_size).astype(jnp.int32)
    return state.gen_start.astype(jnp.int32)


def block_view(state: DecodeState, base, NB: int, block_size: int):
    """Slot index [B, NB*Bs] (clipped into the canvas) and validity [B, NB, Bs] of the block grid
    of rows starting at base [B]."""
    Bs, S = block_size, state.slots
    raw = jnp.asarray(base, jnp.int32).reshape(-1, 1) + jnp.arange(NB * Bs, dtype=jnp.int32)  # [B, NB*Bs]
    raw = jnp.broadcast_to(raw, (state.batch, NB * Bs))
    ok = (raw < state.limit[:, None]) & (raw < S)  # [B, NB*Bs]
    return jnp.minimum(raw, S - 1), ok.reshape(-1, NB, Bs)


def gather(x, idx, ok):
    """x [B, S] read on the block grid (`block_view`'s idx [B, NB*Bs]) -> [B, NB, Bs]."""
    return jnp.take_along_axis(x, idx, axis=1).reshape(ok.shape)


def scatter_max(like, idx, values):
    """[B, S] bool `like`-shaped zeros with values [B, NB, Bs] put back on the canvas (or-ed)."""
    rows = jnp.arange(like.shape[0], dtype=jnp.int32)[:, None]
    return jnp.zeros_like(like).at[rows, idx].max(values.reshape(like.shape[0], -1))


def block_stats(state: DecodeState, idx, ok):
    """(size, decoded) per block [B, NB]: slots below the limit, and those holding a token."""
    rev = gather(state.revealed, idx, ok) & ok  # [B, NB, Bs]
    return jnp.sum(ok, -1).astype(jnp.int32), jnp.sum(rev, -1).astype(jnp.int32)


def reached(decoded, size, threshold: float):
    """progress = decoded / size >= threshold, per block [B, NB]."""
    return decoded.astype(jnp.float32) >= jnp.float32(threshold) * size.astype(jnp.float32)


def stamp(steps_arr, old, new, step_no):
    """Record step_no [B] for blocks entering states 1..3 (first entry only)."""
    cols = []
    for s in (ACTIVATED, FULLY_ACTIVATED, COMPLETED):
        col = steps_arr[..., s - 1]
        hit = (new == s) & (old != s) & (col < 0)
        cols.append(jnp.where(hit, step_no[:, None], col))
    return jnp.stack(cols, axis=-1)


def first_open(st):
    """First block that is not Completed [B] (NB when all are)."""
    NB = st.shape[-1]
    k = jnp.arange(NB, dtype=jnp.int32)
    return jnp.min(jnp.where(st != COMPLETED, k, NB), axis=-1).astype(jnp.int32)


def init_blocks(ctx, state: DecodeState, block_size: int) -> dict:
    """The `state.extra` of a fresh decode: block 0 Fully-Activated at step 0, the rest Inactive;
    each row's `base` [B]."""
    B = state.batch
    base = row_base(ctx, state, block_size)
    NB = num_blocks(ctx, state, block_size)
    _, ok = block_view(state, base, NB, block_size)
    num = jnp.sum(jnp.any(ok, -1), -1).astype(jnp.int32)
    st = jnp.zeros((B, NB), jnp.int32).at[:, 0].set(FULLY_ACTIVATED)
    bsteps = jnp.full((B, NB, 3), -1, jnp.int32).at[:, 0, FULLY_ACTIVATED - 1].set(0)
    return dict(block_state=st, block_steps=bsteps, base=base, num_blocks=num,
                completed_at=jnp.full((B, NB), -1, jnp.int32), scanned_at=jnp.full((B, NB), -1, jnp.int32))


# --------------------------------------------------------------------------- phases 1-3
def early_stop(state: DecodeState, idx, ok, base, block_size: int) -> DecodeState:
    """Phase 1: fill every generation slot after the leftmost revealed stop token with it; blocks
    wholly after it, and added blocks left without masks, become Completed; rows that can stop, stop."""
    s = slot_index(state)
    S = state.slots
    gen = generated_mask(state)
    is_eos = gen & state.revealed & common.is_stop_token(state)
    first = jnp.min(jnp.where(is_eos, s, S), axis=-1)  # [B]
    eos = jnp.take_along_axis(state.tokens, jnp.minimum(first, S - 1)[:, None], axis=-1)  # [B, 1]
    fill = gen & (s > first[:, None]) & ~state.done[:, None]
    state = state.replace(tokens=jnp.where(fill, eos, state.tokens), revealed=state.revealed | fill,
                          step_map=jnp.where(fill, 0, state.step_map),
                          logprobs=jnp.where(fill, 0.0, state.logprobs))
    st = state.extra["block_state"]
    NB, Bs = st.shape[-1], block_size
    block_start = jnp.asarray(base, jnp.int32).reshape(-1, 1) + Bs * jnp.arange(NB, dtype=jnp.int32)  # [B, NB]
    exists = jnp.any(ok, -1)
    after = (block_start > first[:, None]) & exists & ~state.done[:, None]
    new = jnp.where(after, COMPLETED, st)
    size, dec = block_stats(state, idx, ok)
    new = jnp.where(((new == ACTIVATED) | (new == FULLY_ACTIVATED)) & (dec >= size), COMPLETED, new)
    bsteps = stamp(state.extra["block_steps"], st, new, state.steps)
    state = state.replace(extra={**state.extra, "block_state": new, "block_steps": bsteps})
    return common.finish_rows(state)


def activate_and_add(state: DecodeState, idx, ok, *, decoded_token_threshold: float,
                     block_add_threshold: float, max_blocks: int | None) -> DecodeState:
    """Phases 2-3: activation by the predecessor's progress, then adding the next block."""
    st = state.extra["block_state"]
    NB = st.shape[-1]
    k = jnp.arange(NB, dtype=jnp.int32)
    size, dec = block_stats(state, idx, ok)
    exists = size > 0
    passed = reached(dec, size, decoded_token_threshold)  # [B, NB]
    pred_passed = jnp.concatenate([jnp.ones_like(passed[:, :1]), passed[:, :-1]], axis=-1)
    running = ~state.done[:, None]
    new = jnp.where((st == ACTIVATED) & pred_passed & running, FULLY_ACTIVATED, st)
    # adding: the newest added block decides
    last = jnp.max(jnp.where((new != INACTIVE) & exists, k, -1), axis=-1)  # [B]
    li = jnp.maximum(last, 0)[:, None]
    at = lambda x: jnp.take_along_axis(x, li, axis=-1)[:, 0]  # noqa: E731
    last_size, last_dec = at(size), at(dec)
    trigger = reached(last_dec, last_size, block_add_threshold) | (last_dec >= last_size)
    nxt = last + 1
    nxt_ok = (nxt < NB) & jnp.take_along_axis(
        jnp.concatenate([exists, jnp.zeros_like(exists[:, :1])], -1), jnp.minimum(nxt, NB)[:, None], -1)[:, 0]
    cap = True if max_blocks is None else nxt < first_open(new) + max_blocks
    add = trigger & nxt_ok & cap & (last >= 0) & ~state.done
    kind = jnp.where(reached(last_dec, last_size, decoded_token_threshold), FULLY_ACTIVATED, ACTIVATED)
    new = jnp.where(add[:, None] & (k[None] == nxt[:, None]) & (new == INACTIVE), kind[:, None], new)
    bsteps = stamp(state.extra["block_steps"], st, new, state.steps + 1)
    return state.replace(extra={**state.extra, "block_state": new, "block_steps": bsteps})


def frontier(state: DecodeState, block_size: int):
    """(active_end [B], candidate slots [B, S]): masked generation slots of running rows before
    the end of their rightmost Activated / Fully-Activated block."""
    st = state.extra["block_state"]
    k = jnp.arange(st.shape[-1], dtype=jnp.int32)
    in_flight = (st == ACTIVATED) | (st == FULLY_ACTIVATED)
    newest = jnp.max(jnp.where(in_flight, k, -1), axis=-1)  # [B]
    active_end = state.extra["base"] + (newest + 1) * block_size  # [B]; = base when nothing is in flight
    cand = (generated_mask(state) & ~state.revealed & ~state.done[:, None]
            & (slot_index(state) < active_end[:, None]))
    return active_end, cand


# --------------------------------------------------------------------------- phase 7 and host edits
def complete_filled(state: DecodeState, idx, ok) -> DecodeState:
    """Phase 7's end: Activated / Fully-Activated blocks without masks become Completed (stamped
    with this step; `completed_at` records the row's forward count, its NFE)."""
    st = state.extra["block_state"]
    size, dec = block_stats(state, idx, ok)
    new = jnp.where(((st == ACTIVATED) | (st == FULLY_ACTIVATED)) & (dec >= size), COMPLETED, st)
    bsteps = stamp(state.extra["block_steps"], st, new, state.steps)
    done_at = state.extra["completed_at"]
    done_at = jnp.where((new == COMPLETED) & (done_at < 0), state.nfe[:, None], done_at)
    return state.replace(extra={**state.extra, "block_state": new, "block_steps": bsteps,
                                "completed_at": done_at})


def reopen_blocks(state: DecodeState, idx, ok) -> DecodeState:
    """After a host edit: a Completed block with masks again reopens in the state it reached before
    (Fully-Activated or Activated; Inactive when only the EOS fill completed it), its Completed stamp
    and cache counters cleared; an Activated / Fully-Activated block the edits filled is Completed."""
    size, dec = block_stats(state, idx, ok)
    st, bst = state.extra["block_state"], state.extra["block_steps"]
    reopen = (st == COMPLETED) & (dec < size)  # [B, NB]
    was = jnp.where(bst[..., FULLY_ACTIVATED - 1] >= 0, FULLY_ACTIVATED,
                    jnp.where(bst[..., ACTIVATED - 1] >= 0, ACTIVATED, INACTIVE))
    new = jnp.where(reopen, was, st)
    new = jnp.where(((new == ACTIVATED) | (new == FULLY_ACTIVATED)) & (dec >= size) & (size > 0), COMPLETED, new)
    bst = bst.at[..., COMPLETED - 1].set(jnp.where(reopen, -1, bst[..., COMPLETED - 1]))
    bst = stamp(bst, st, new, state.steps)
    extra = {**state.extra, "block_state": new, "block_steps": bst,
             "completed_at": jnp.where(reopen, -1, state.extra["completed_at"]),
             "scanned_at": jnp.where(reopen, -1, state.extra["scanned_at"])}
    return state.replace(extra=extra)


__all__ = ["INACTIVE", "ACTIVATED", "FULLY_ACTIVATED", "COMPLETED", "BLOCK_STATES", "num_blocks", "block_view",
           "row_base", "gather", "scatter_max", "block_stats", "reached", "stamp", "first_open", "init_blocks", "early_stop", "activate_and_add",
           "frontier", "complete_filled", "reopen_blocks"]
