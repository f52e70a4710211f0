"""Pieces every paradigm shares: the static context, state construction, the
window forward, sampling a window, choosing which masked positions to reveal,
writing a reveal into the state (tokens, step_map, log-probs) and the per-row
stop rule.

A paradigm's `step` is usually: `forward_window` -> `aligned` -> `sample_window`
-> one of the `select_*` rules on `candidates` -> `reveal` -> `finish_rows`,
plus `count_forward` for the rows that took part in the forward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdllm.config import ModelConfig
from jdllm.model import KVCache, aligned_logits, default_positions, forward
from jdllm.sampling import Sample, apply_token_bitmask, exclude_token, row_keys, sample_rows, split_rows
from jdllm.state import LENGTH, RUNNING, STOP, DecodeState, generated_mask, slot_index


# --------------------------------------------------------------------------- static context
@dataclasses.dataclass(frozen=True)
class DecodeCtx:
    """Static (hashable) settings of one compiled decode: a jit static argument.

    prefill_len is layout-derived: how many leading slots the paradigm prefills
    (AR: the prompt bucket; block_diffusion: the whole prompt blocks). Seeds and
    max_new_tokens are data in the state, not here, so they never retrace.
    """

    model: ModelConfig
    attn_impl: str = "auto"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    prefill_len: int = 0


class Layout(NamedTuple):
    """Where each row lives on the slot grid (host numpy, from prompt lengths)."""

    start: np.ndarray  # [B] first real slot
    gen_start: np.ndarray  # [B] first generated slot
    slots: int  # canvas size S
    prefill_len: int  # leading slots the paradigm's prefill covers


def bucket(n: int, minimum: int = 1, steps_per_octave: int = 1) -> int:
    """Round max(n, minimum) up to a shape bucket (0 stays 0 when minimum is 0).

    steps_per_octave 1: the next power of two. k > 1: the next multiple of
    2^(octave) / k inside the octave, so at most ~1/k of the slots are wasted
    (more buckets, hence more compiles, but shorter canvases for long outputs).
    """
    n = max(int(n), int(minimum))
    if n == 0:
        return 0
    pow2 = 1 << (n - 1).bit_length()
    step = max(1, (pow2 // 2) // max(1, int(steps_per_octave)))
    return -(-n // step) * step


def require_diffusion_model(paradigm: str, cfg: ModelConfig, attention: tuple[str, ...], alternative: str) -> None:
    """Host-side check shared by the diffusion paradigms' `validate`: a mask token and an attention kind."""
    from jdllm import errors  # noqa: PLC0415

    if cfg.mask_token_id is None:
        raise errors.DecodingConfigError(
            f"paradigm {paradigm!r} needs a model with a mask token (mask_token_id is None); "
            "use jdllm.AR for autoregressive models")
    if cfg.attention not in attention:
        kinds = " or ".join(a.replace("_", "-") for a in attention)
        raise errors.DecodingConfigError(
            f"paradigm {paradigm!r} needs a {kinds} model, this one has attention={cfg.attention!r}; "
            f"use {alternative}")


# --------------------------------------------------------------------------- state construction
def new_state(cfg: ModelConfig, prompts: list[np.ndarray], layout: Layout, max_new_tokens: int, *,
              seed: int, active: np.ndarray | None = None, dtype=jnp.float32) -> DecodeState:
    """Initial state: prompts placed at [start, start + len), generation slots hold the mask token.

    `active` [B] bool: False marks batch-padding rows (done from the start, never returned).
    """
    B, S = len(prompts), layout.slots
    fill = cfg.mask_token_id if cfg.mask_token_id is not None else (cfg.pad_token_id or 0)
    tokens = np.full((B, S), fill, np.int32)
    revealed = np.zeros((B, S), bool)
    for b, p in enumerate(prompts):
        s0 = int(layout.start[b])
        tokens[b, s0:s0 + len(p)] = p
        revealed[b, s0:s0 + len(p)] = True
    gen_start = np.asarray(layout.gen_start, np.int32)
    limit = np.minimum(gen_start + int(max_new_tokens), S).astype(np.int32)
    active = np.ones((B,), bool) if active is None else np.asarray(active, bool)
    fresh = _fresh_arrays(np.uint32(seed), cfg=cfg, batch=B, slots=S, dtype=jnp.dtype(dtype).name)
    return DecodeState(
        tokens=jnp.asarray(tokens),
        revealed=jnp.asarray(revealed),
        start=jnp.asarray(layout.start, jnp.int32),
        gen_start=jnp.asarray(gen_start),
        limit=jnp.asarray(limit),
        done=jnp.asarray(~active),
        **fresh,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "slots", "dtype"))
def _fresh_arrays(seed, *, cfg: ModelConfig, batch: int, slots: int, dtype: str) -> dict:
    """The state's zero-initialised fields and PRNG keys, made in one compiled call (cheap per call)."""
    B, S = batch, slots
    return dict(
        step_map=jnp.zeros((B, S), jnp.int32),
        logprobs=jnp.zeros((B, S), jnp.float32),
        steps=jnp.zeros((B,), jnp.int32),
        nfe=jnp.zeros((B,), jnp.int32),
        finish=jnp.zeros((B,), jnp.int32),
        key=row_keys(seed, B),
        cache=KVCache.empty(cfg, B, S, jnp.dtype(dtype)),
        prev_logits=jnp.zeros((B, cfg.vocab_size), jnp.float32),
        forwards=jnp.zeros((), jnp.int32),
        iteration=jnp.zeros((), jnp.int32),
    )


# --------------------------------------------------------------------------- windows
def window(x: jax.Array, offset, width: int) -> jax.Array:
    """x[:, offset:offset + width] for x [B, S, ...] with a traced offset."""
    return jax.lax.dynamic_slice_in_dim(x, offset, width, axis=1)


def set_window(x: jax.Array, offset, value: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), offset, axis=1)


def forward_window(params, ctx: DecodeCtx, state: DecodeState, offset, width: int, *,
                   commit=None) -> tuple[jax.Array, DecodeState]:
    """One model forward over slots [offset, offset + width) against the cache.

    The window's K/V are written into the cache; `commit` (a slot count) marks
    slots [0, commit) as committed afterwards. Returns raw logits [B, W, V]
    (position p predicts p, or p + 1 for shifted / causal models) and the state
    with the cache and the batch forward counter updated. Per-row NFE is the
    caller's to count (`count_forward`), since only the caller knows which rows
    had work in this forward.
    """
    tokens = window(state.tokens, offset, width)  # [B, W]
    positions = default_positions(state.start, offset, width)
    logits, cache = forward(params, ctx.model, tokens, positions, start=state.start, cache=state.cache,
                            offset=offset, attn_impl=ctx.attn_impl)
    if commit is not None:
        cache = cache.commit(commit)
    return logits, state.replace(cache=cache, forwards=state.forwards + 1)


def aligned(ctx: DecodeCtx, logits: jax.Array, prev_last: jax.Array) -> jax.Array:
    """Logits predicting the token *at* each window position [B, W, V].

    Shifted-logit models (Dream, Fast-dLLM v2) take position 0 from `prev_last`
    [B, V], the raw logits of the slot before the window; same-position models
    use `logits` as is.
    """
    return aligned_logits(logits, ctx.model, prev_last)


def count_forward(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Add one forward to the NFE of rows [B] (bool) that took part in it."""
    return state.replace(nfe=state.nfe + rows.astype(jnp.int32))


# --------------------------------------------------------------------------- sampling a window
def sample_window(ctx: DecodeCtx, state: DecodeState, logits: jax.Array,
                  bitmask: jax.Array | None = None, rows: jax.Array | None = None
                  ) -> tuple[DecodeState, Sample]:
    """Sample every position of aligned logits [B, W, V].

    The mask token is excluded; `bitmask` [B, W, ceil(V/32)] (packed int32,
    optional) removes the tokens a constraint disallows. Each row's PRNG
    stream advances only where `rows` [B] (default: running rows) is True, so
    a row's samples do not depend on what the rest of the batch is doing.
    """
    z = exclude_token(logits, ctx.model.mask_token_id)
    if bitmask is not None:
        z = apply_token_bitmask(z, bitmask)
    keys, step_keys = split_rows(state.key)
    rows = ~state.done if rows is None else rows
    keep = jax.random.key_data(state.key)
    keys = jax.random.wrap_key_data(
        jnp.where(rows[:, None], jax.random.key_data(keys), keep), impl=jax.random.key_impl(state.key))
    s = sample_rows(z, step_keys, temperature=ctx.temperature, top_k=ctx.top_k, top_p=ctx.top_p)
    return state.replace(key=keys), s


def candidates(state: DecodeState, offset, width: int) -> jax.Array:
    """[B, W] bool: masked generation slots of running rows inside the window."""
    gen = window(generated_mask(state), offset, width)
    hidden = ~window(state.revealed, offset, width)
    return gen & hidden & ~state.done[:, None]


# --------------------------------------------------------------------------- which positions to reveal
def rank(score: jax.Array, cand: jax.Array, *, descending: bool = True) -> jax.Array:
    """[B, W] int32 rank of each candidate by score (0 = best); ties go to the leftmost.

    Non-candidates get rank W. Quadratic in W, which is a block or a few.
    """
    W = score.shape[-1]
    s = score if descending else -score
    s = jnp.where(cand, s, -jnp.inf)
    i = jnp.arange(W)
    better = (s[:, None, :] > s[:, :, None]) | ((s[:, None, :] == s[:, :, None]) & (i[None, :] < i[:, None]))
    r = jnp.sum(better & cand[:, None, :], axis=-1).astype(jnp.int32)  # [B, W]
    return jnp.where(cand, r, W)


def select_top_k(cand: jax.Array, score: jax.Array, k) -> jax.Array:
    """The k highest-scoring candidates per row (all of them if fewer). k: int or [B]."""
    k = jnp.asarray(k, jnp.int32)
    k = k[:, None] if k.ndim == 1 else k
    return cand & (rank(score, cand) < k)


def select_first_k(cand: jax.Array, k) -> jax.Array:
    """The k leftmost candidates per row."""
    k = jnp.asarray(k, jnp.int32)
    k = k[:, None] if k.ndim == 1 else k
    before = jnp.cumsum(cand.astype(jnp.int32), axis=-1) - cand.astype(jnp.int32)
    return cand & (before < k)


def select_threshold(cand: jax.Array, conf: jax.Array, threshold: float) -> jax.Array:
    """Every candidate with conf >= threshold, plus the most confident one (progress)."""
    return cand & ((conf >= threshold) | (rank(conf, cand) == 0))


def select_entropy_bounded(cand: jax.Array, entropy: jax.Array, bound: float) -> jax.Array:
    """Candidates in ascending-entropy order while the running entropy sum stays < bound.

    The lowest-entropy candidate is always taken (SDAR / JetEngine `eb_threshold`).
    """
    r = rank(entropy, cand, descending=False)  # [B, W]
    ent = jnp.where(cand, entropy, 0.0)
    upto = (r[:, None, :] <= r[:, :, None]) & cand[:, None, :]  # [B, i, j]: j ranks at or before i
    cum = jnp.sum(jnp.where(upto, ent[:, None, :], 0.0), axis=-1)  # [B, W]
    return cand & ((cum < bound) | (r == 0))


# --------------------------------------------------------------------------- writing a reveal
def reveal(state: DecodeState, offset, sel: jax.Array, s: Sample) -> DecodeState:
    """Write the selected sampled tokens [B, W] into the window at `offset`.

    Rows revealing >= 1 token advance their step counter and stamp the new
    step number into step_map; their log-probs are stored at reveal time.
    """
    any_new = jnp.any(sel, axis=-1)  # [B]
    steps = state.steps + any_new.astype(jnp.int32)
    tok = jnp.where(sel, s.token, window(state.tokens, offset, sel.shape[1]))
    smap = jnp.where(sel, steps[:, None], window(state.step_map, offset, sel.shape[1]))
    lp = jnp.where(sel, s.logprob, window(state.logprobs, offset, sel.shape[1]))
    rev = sel | window(state.revealed, offset, sel.shape[1])
    return state.replace(
        tokens=set_window(state.tokens, offset, tok),
        step_map=set_window(state.step_map, offset, smap),
        logprobs=set_window(state.logprobs, offset, lp),
        revealed=set_window(state.revealed, offset, rev),
        steps=steps,
    )


# --------------------------------------------------------------------------- stopping
def stop_end(state: DecodeState, stop_ids: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Per row: (stopped [B] bool, end [B] int32 = one past the last slot to return).

    A row has stopped once some revealed stop token has every generation slot
    before it revealed; the first such token ends the row. Otherwise the row's
    end is its first unrevealed generation slot.
    """
    s = slot_index(state)
    gen = generated_mask(state)
    hole = gen & ~state.revealed
    S = state.slots
    first_hole = jnp.min(jnp.where(hole, s, S), axis=-1)  # [B]
    if stop_ids:
        is_stop = gen & state.revealed & jnp.isin(state.tokens, jnp.asarray(stop_ids, jnp.int32))
        first_stop = jnp.min(jnp.where(is_stop, s, S), axis=-1)
    else:
        first_stop = jnp.full_like(first_hole, S)
    stopped = first_stop < first_hole
    end = jnp.where(stopped, first_stop + 1, jnp.minimum(first_hole, state.limit))
    return stopped, end.astype(jnp.int32)


def finish_rows(state: DecodeState, stop_ids: tuple[int, ...]) -> DecodeState:
    """Mark rows done: a stop token reached (STOP) or every generation slot revealed (LENGTH)."""
    stopped, end = stop_end(state, stop_ids)
    full = end >= state.limit
    newly = ~state.done & (stopped | full)
    finish = jnp.where(newly, jnp.where(stopped, STOP, LENGTH), state.finish)
    return state.replace(done=state.done | newly, finish=finish.astype(jnp.int32))


__all__ = ["DecodeCtx", "Layout", "bucket", "new_state", "window", "set_window", "forward_window",
           "aligned", "count_forward", "sample_window", "candidates", "rank", "select_top_k",
           "select_first_k", "select_threshold", "select_entropy_bounded", "reveal", "stop_end",
           "finish_rows", "RUNNING", "STOP", "LENGTH"]
