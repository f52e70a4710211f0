"""Pieces every paradigm shares: the static context, state construction, the
step plan, the window forward (LM head only at the planned slots), sampling,
choosing which masked positions to reveal, writing a reveal into the state
(tokens, step_map, log-probs) and the per-row stop rule.

A paradigm's step is `plan` (which slots it will choose tokens for) ->
`forward` (`forward_window`: logits for exactly those slots) -> `reveal`
(`sample_window` -> one of the `select_*` rules on `candidates` -> `write_tokens`
-> `finish_rows`, plus `count_forward` for the rows that took part).

Offsets may be one slot for the batch (lockstep paradigms) or [B] (each row at
its own position); `window`, `set_window`, `forward_window`, `candidates` and
`write_tokens` take either.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors
from jdllm.config import ModelConfig
from jdllm.inputs import to_device
from jdllm.model import KVCache, default_positions, forward, head_logits, predicts_next, write_rows
from jdllm.sampling import RowSampling, Sample, apply_token_bitmask, exclude_token, row_keys, sample_rows, split_rows
from jdllm.state import ABORT, INVALID, LENGTH, RUNNING, STOP, DecodeState, generated_mask, slot_index
from pallas_kernels import resolve_impl
from pallas_kernels.common import env_count


# --------------------------------------------------------------------------- static context
@dataclasses.dataclass(frozen=True)
class DecodeCtx:
    """Static (hashable) settings of one compiled decode: a jit static argument.

    prefill_len is layout-derived: how many leading slots the paradigm prefills
    (AR: the prompt bucket; block_diffusion: the whole prompt blocks). A serving pool's rounds
    (rows each on their own layout, `Paradigm.row_layout`) run with the pool layout's
    (`Paradigm.pool_layout`, the longest prompt's): S - prefill_len then bounds every row's
    generation region, which is what the step functions read it for. Sampling
    settings, stop ids, seeds and max_new_tokens are per-row data in the state,
    not here, so changing them never retraces.

    own_layouts: the rows sit on their own layouts on a canvas sized for the longest request (a
    serving pool), so a row may need far fewer slots than the canvas: a whole-canvas forward of a
    bidirectional model may then narrow to the slots the running rows use (`suffix_widths`), at the
    cost of compiling those narrower shapes too (a `generate` batch, laid out to fit, never uses
    them, so it does not compile them).
    """

    model: ModelConfig
    attn_impl: Any = "auto"  # an impl name, or pallas_kernels.ShardedAttention under a mesh
    prefill_len: int = 0
    placement: Any = None  # jdllm.sharding.Placement: the state and cache stay on its mesh
    # forwards over at most this many tokens (batch x window) compile as one window shape (see
    # `switch_width`); None: `weight_bound_tokens()` for the backend
    merge_tokens: int | None = None
    own_layouts: bool = False


def constrain(ctx: DecodeCtx, state: DecodeState) -> DecodeState:
    """The state pinned to the mesh shardings of `ctx.placement` (unchanged without one)."""
    return state if ctx.placement is None else ctx.placement.constrain_state(state)


class Layout(NamedTuple):
    """Where each row lives on the slot grid (host numpy, from prompt lengths)."""

    start: np.ndarray  # [B] first real slot
    gen_start: np.ndarray  # [B] first generated slot
    slots: int  # canvas size S
    prefill_len: int  # leading slots the paradigm's prefill covers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """The slots a step will choose tokens for: row b's [offset[b], offset[b] + N).

    `valid` [B, N] marks the masked generation slots among them (the ones a
    reveal may fill). A constraint supplies its packed bitmask
    [B, N, ceil(V/32)] in this order; the forward computes logits only here.
    """

    offset: jax.Array  # [B] int32, clamped so the window fits the canvas
    valid: jax.Array  # [B, N] bool

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    @property
    def slots(self) -> jax.Array:
        """[B, N] int32 canvas slots."""
        return self.offset[:, None] + jnp.arange(self.width, dtype=jnp.int32)


def right_aligned(layout: Layout, shift: int) -> Layout:
    """`layout` moved `shift` slots right on its canvas (a serving row of a bidirectional model: its
    canvas then ends at the pool canvas's end, as it ends at its own alone, so a forward over the
    pool canvas sees exactly the slots it sees alone; RoPE positions, slot - start, are unchanged)."""
    return layout._replace(start=layout.start + shift, gen_start=layout.gen_start + shift,
                           prefill_len=layout.prefill_len + shift if layout.prefill_len else 0)


def make_plan(state: DecodeState, offset, width: int) -> Plan:
    """Plan over slots [offset, offset + width) of each row (offset: scalar or [B])."""
    off = jnp.clip(jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (state.batch,)), 0, state.slots - width)
    return Plan(offset=off, valid=candidates(state, off, width))


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
def fill_token(cfg) -> int:
    """What an unrevealed canvas slot holds: the mask token, else the pad token (else 0)."""
    return cfg.mask_token_id if cfg.mask_token_id is not None else (cfg.pad_token_id or 0)


def new_state(cfg: ModelConfig, prompts: list[np.ndarray], layout: Layout, max_new_tokens, *,
              settings=None, stop_ids=(), seed=0, stream=None, active: np.ndarray | None = None) -> DecodeState:
    """Initial state: prompts placed at [start, start + len), generation slots hold the mask token.

    max_new_tokens: one int or one per row. settings: one `jdllm.Sampling` per
    row (temperature / top_k / top_p; default greedy). stop_ids: one tuple for
    every row or a list of tuples, one per row. seed / stream: row b draws from
    fold_in(key(seed[b]), stream[b]) (an int or [B]; stream default: b).
    `active` [B] bool: False marks batch-padding rows (done from the start,
    never returned). The KV cache is made by `loop.prefill`, so this state is
    small and can be reused.
    """
    from jdllm.sampling import Sampling  # noqa: PLC0415

    B, S = len(prompts), layout.slots
    tokens = np.full((B, S), fill_token(cfg), np.int32)
    revealed = np.zeros((B, S), bool)
    for b, p in enumerate(prompts):
        s0 = int(layout.start[b])
        tokens[b, s0:s0 + len(p)] = p
        revealed[b, s0:s0 + len(p)] = True
    gen_start = np.asarray(layout.gen_start, np.int32)
    limit = np.minimum(gen_start + np.broadcast_to(np.asarray(max_new_tokens, np.int64), (B,)), S).astype(np.int32)
    active = np.ones((B,), bool) if active is None else np.asarray(active, bool)
    settings = [Sampling()] * B if settings is None else list(settings)
    if stop_ids and not isinstance(stop_ids[0], (tuple, list, np.ndarray)):
        stop_ids = [tuple(stop_ids)] * B
    rows_stop = [tuple(r) for r in stop_ids] if stop_ids else [()] * B
    NS = bucket(max(len(r) for r in rows_stop), 1)
    stops = np.full((B, NS), -1, np.int32)
    for b, r in enumerate(rows_stop):
        stops[b, :len(r)] = r
    seeds = np.broadcast_to(np.asarray(seed, np.uint32), (B,))
    streams = np.arange(B, dtype=np.uint32) if stream is None else np.broadcast_to(np.asarray(stream, np.uint32), (B,))
    return DecodeState(
        tokens=to_device(tokens),
        revealed=to_device(revealed),
        start=to_device(layout.start, np.int32),
        gen_start=to_device(gen_start),
        limit=to_device(limit),
        done=to_device(~active),
        sampling=RowSampling.of(settings),
        stop_ids=to_device(stops),
        **_fresh_arrays(to_device(seeds), to_device(streams), batch=B, slots=S),
    )


@functools.partial(jax.jit, static_argnames=("batch", "slots"))
def _fresh_arrays(seeds, streams, *, batch: int, slots: int) -> dict:
    """The state's zero-initialised fields and PRNG keys, made in one compiled call (cheap per call)."""
    B, S = batch, slots
    return dict(
        step_map=jnp.zeros((B, S), jnp.int32),
        logprobs=jnp.zeros((B, S), jnp.float32),
        steps=jnp.zeros((B,), jnp.int32),
        nfe=jnp.zeros((B,), jnp.int32),
        finish=jnp.zeros((B,), jnp.int32),
        end=jnp.zeros((B,), jnp.int32),
        key=row_keys(seeds, stream=streams),
        cache=None,
        prev_logits=None,
        forwards=jnp.zeros((), jnp.int32),
        iteration=jnp.zeros((), jnp.int32),
    )


def with_buffers(params, cfg: ModelConfig, state: DecodeState) -> DecodeState:
    """The state with its KV cache (in the parameters' dtype) and prev_logits allocated, if not yet."""
    if state.cache is not None:
        return state
    dtype = params["embed"].dtype
    return state.replace(cache=KVCache.empty(cfg, state.batch, state.slots, dtype),
                         prev_logits=jnp.zeros((state.batch, cfg.vocab_size), jnp.float32))


# --------------------------------------------------------------------------- windows
def rows_of(state: DecodeState, offset) -> jax.Array:
    """Offset (scalar or [B]) as [B] int32."""
    return jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (state.batch,))


def window(x: jax.Array, offset, width: int) -> jax.Array:
    """x[:, offset:offset + width] for x [B, S, ...]; offset scalar or [B] (clamped into S)."""
    offset = jnp.asarray(offset, jnp.int32)
    if offset.ndim == 0:
        return jax.lax.dynamic_slice_in_dim(x, offset, width, axis=1)
    idx = jnp.clip(offset, 0, x.shape[1] - width)[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def set_window(x: jax.Array, offset, value: jax.Array) -> jax.Array:
    """x with value [B, W, ...] written at [offset, offset + W) of each row (offset scalar or [B])."""
    return write_rows(x, value, offset)


def head_index(ctx: DecodeCtx, slots: jax.Array, offset) -> jax.Array:
    """[B, N] window position whose logits predict canvas `slots` (negative: the slot before the window)."""
    return slots - predicts_next(ctx.model) - jnp.asarray(offset, jnp.int32).reshape(-1, 1)


def forward_window(params, ctx: DecodeCtx, state: DecodeState, offset, width: int, *, at: jax.Array,
                   commit=None, also: jax.Array | None = None, kv_len=None,
                   use_prev: bool = False, keep_below=None, keep_from=None, write_cache: bool = True,
                   head: bool = True) -> tuple[DecodeState, jax.Array]:
    """One model forward over slots [offset, offset + width) against the cache.

    at [B, N]: the canvas slots whose tokens this step chooses. Returns (state,
    the logits *predicting* them [B, N, V] (float32; the LM head runs only there:
    for next-token models those of the slot before; with `use_prev`, a slot at
    the window start takes the logits of the slot before the window from
    `state.prev_logits`). also [B, M], optional: canvas slots whose
    raw logits are appended after the N (a shifted model keeps the last
    committed slot's). The window's K/V are written into the cache; `commit`
    (scalar or [B]) then marks [0, commit) as committed. kv_len: as in
    `jdllm.model.forward` (default: the window end); so are keep_below and keep_from ([B]:
    cached K/V below / at or after them are kept, not overwritten). Per-row NFE is the
    caller's to count (`count_forward`). head False: the final-normed hidden states [B, N, D]
    instead of the logits (`switch_width`'s `hidden_of`; not with use_prev or also).
    """
    if not head and (use_prev or also is not None):
        raise ValueError("forward_window(head=False) returns hidden states: no use_prev / also rows")
    tokens = window(state.tokens, offset, width)  # [B, W]
    positions = default_positions(state.start, offset, width)
    off = rows_of(state, offset)
    src = head_index(ctx, at, off)
    idx = jnp.clip(src, 0, width - 1)
    if also is not None:
        idx = jnp.concatenate([idx, jnp.clip(also - off[:, None], 0, width - 1)], axis=1)
    logits, cache = forward(params, ctx.model, tokens, positions, start=state.start, cache=state.cache,
                            offset=offset, attn_impl=ctx.attn_impl, logits_at=idx, kv_len=kv_len,
                            keep_below=keep_below, keep_from=keep_from, write_cache=write_cache, head=head)
    N = at.shape[1]
    if use_prev and predicts_next(ctx.model):
        first = jnp.where((src < 0)[..., None], state.prev_logits[:, None], logits[:, :N])
        logits = first if also is None else jnp.concatenate([first, logits[:, N:]], axis=1)
    if commit is not None:
        cache = cache.commit(commit)
    return state.replace(cache=cache, forwards=state.forwards + 1), logits


GPU_WEIGHT_BOUND_TOKENS = 256  # an H100 reads bf16 weights at ~2.5 TB/s and multiplies at ~750 TFLOP/s
MERGE_TOKENS_ENV = "JDLLM_MERGE_TOKENS"


def weight_bound_tokens(ctx: DecodeCtx) -> int:
    """How many tokens (batch x window) a forward may hold and still cost what reading the weights
    costs. On a GPU that is a few hundred (arithmetic intensity ~ tokens FLOP per weight byte against
    the ~300 FLOP/byte ridge of an H100), so a paradigm's narrower window shapes gain nothing and
    each costs another whole-model compile; on the CPU every token costs time: 0.

    `DecodeCtx.merge_tokens` sets it for one decode; the environment's `JDLLM_MERGE_TOKENS=N` (read
    when a program is traced) for the process, on any backend: benchmarks/gpu.py times it as a
    variant (`--xla-flags-variants "" JDLLM_MERGE_TOKENS=128`). At 256 tokens an 8B forward's matmuls
    are at the H100's ridge (754 TFLOP/s over 3.05 TB/s: 247 FLOP per weight byte), where they reach
    neither limit: multi_block approx, whose suffixes all run 256 wide at batch 1, spent 6.77 ms a
    forward in matmuls against AR's 5.15."""
    if ctx.merge_tokens is not None:
        return int(ctx.merge_tokens)
    fixed = env_count(MERGE_TOKENS_ENV, 0)
    if fixed is not None:
        return fixed
    return GPU_WEIGHT_BOUND_TOKENS if jax.default_backend() == "gpu" else 0


def compiled_widths(ctx: DecodeCtx, batch: int, widths) -> list[int]:
    """The window widths a step compiles out of the ascending static `widths`: all of them, except
    that those whose forward is weight-bound (batch x width <= `weight_bound_tokens`) collapse into
    the widest of them, which covers every need they cover."""
    widths = sorted(set(int(w) for w in widths))
    small = [w for w in widths if batch * w <= weight_bound_tokens(ctx)]
    return ([small[-1]] if small else []) + [w for w in widths if batch * w > weight_bound_tokens(ctx)]


def switch_width(ctx: DecodeCtx, state: DecodeState, widths, need, forward_of, hidden_of=None, params=None):
    """`forward_of(width)(state)` for the narrowest compiled width (`compiled_widths`) >= need (a traced
    scalar; the widest when none is): one forward per window shape the paradigm distinguishes,
    under a `lax.switch`, or a plain call when one shape remains. A wider window than needed gives
    the same logits (it recomputes slots whose K/V the cache already holds, from the same tokens).

    On the Pallas kernels (`reads_cache_in_place`) each branch hands its result out behind
    `lax.optimization_barrier`: with it, XLA updates the KV cache in place under a two-way switch
    whose branches both write it (and read it only after writing); without it, it copied the whole
    cache into and out of the branch on every step (multi_block exact, 8B on an H100, deviceless
    compile: 416 MiB per step at P128 + G256). The XLA attention's programs (the CPU's) keep
    their form.

    More than two widths on the kernels, where the caller gives `hidden_of(width)(state) -> (state,
    final-normed hidden states [B, N, D])` (`forward(head=False)`) and the `params` whose LM head
    turns them into logits: a switch of three or more branches copies the cache whatever they do,
    so the widths run as `in_turn`'s chain of two-way conditionals instead, the LM head after it."""
    keep = compiled_widths(ctx, state.batch, widths)
    if len(keep) == 1:
        return forward_of(keep[0])(state)
    branch = jnp.sum(need > jnp.asarray(keep[:-1], jnp.int32)).astype(jnp.int32)
    if not reads_cache_in_place(ctx):
        return jax.lax.switch(branch, [forward_of(w) for w in keep], state)
    if len(keep) > 2 and hidden_of is not None and state.cache is not None:
        state, hidden = in_turn(branch, [hidden_of(w) for w in keep], state)
        return state, head_logits(params, ctx.model, hidden, ctx.attn_impl)
    return jax.lax.switch(branch, [in_place(forward_of(w)) for w in keep], state)


def in_turn(branch, forwards, state: DecodeState):
    """`forwards[branch](state)` -> (state, hidden), with the KV cache updated in place: one two-way
    conditional per forward, in turn, each beside a branch that writes one slot of the cache.

    XLA updates a buffer in place under a conditional when both of its branches write it (behind an
    optimization barrier) and read it only after writing; a switch of three or more such branches
    still copies it (`benchmarks/gpu_program.py --conditionals`: 4 copies in the loop; these chains:
    0). The branch not taken writes the slot's original value (the last slot, layer 0, every row,
    read before the chain): a chain's forward sees the cache as it was. The forward that runs
    hands out that slot as it left it, and it is written back after the chain, over what the
    conditionals after it wrote. The hidden states of the branches not taken are zeros, and only
    the taken branch's are kept; NFE counts only the forward that ran. 8B, batch 4, P128 + G256,
    deviceless H100 compile: multi_block approx moved 768 MiB of cache copies in its loop body and
    2.2 GiB on its worst step; Fast-dLLM prefix 768 MiB and 1.7 GiB."""
    cache = state.cache
    slot = cache.k.shape[2] - 1
    # the arrays the forwards write (an int8 cache's scales too), each [layers, B, S, ...]
    names = ("k", "v") + (() if cache.k_scale is None else ("k_scale", "v_scale"))

    def last(c):  # layer 0's last slot of every row of each array: [1, B, 1, ...]
        return tuple(jax.lax.slice_in_dim(jax.lax.slice_in_dim(getattr(c, n), 0, 1, axis=0), slot, slot + 1, axis=2)
                     for n in names)

    def put(c, kv):
        return dataclasses.replace(c, **{n: jax.lax.dynamic_update_slice(getattr(c, n), x, (0, 0, slot) + (0,) * (x.ndim - 3))
                                         for n, x in zip(names, kv)})

    orig = last(cache)
    hidden_shape = jax.eval_shape(lambda st: forwards[0](st)[1], state)
    hidden, after = None, None
    for j, fwd in enumerate(forwards):
        def taken(st, kv, fwd=fwd):
            st, h = fwd(st)
            return st, h, last(st.cache)

        def other(st, kv):
            return st.replace(cache=put(st.cache, kv)), jnp.zeros(hidden_shape.shape, hidden_shape.dtype), kv

        state, h, kv = jax.lax.cond(branch == j, in_place(taken), in_place(other), state, orig)
        hidden = h if hidden is None else jnp.where(branch == j, h, hidden)
        after = kv if after is None else jax.tree.map(lambda x, y: jnp.where(branch == j, x, y), kv, after)
    return state.replace(cache=put(state.cache, after)), hidden


def reads_cache_in_place(ctx: DecodeCtx) -> bool:
    """Whether the model's attention reads the stacked KV cache where it lies (the Pallas kernels,
    `pallas_kernels.attention(layer=)`), so a step's conditionals keep the cache in place when
    their branches all write it (`in_place`); the XLA attention copies the cut of each layer it
    reads instead."""
    return resolve_impl(ctx.attn_impl) == "pallas"


def in_place(branch):
    """A conditional's branch whose result leaves behind an optimization barrier (`switch_width`)."""
    return lambda *operands: jax.lax.optimization_barrier(branch(*operands))


FINE_WIDTHS_FROM = 256  # slots: window widths this wide or wider come four per octave


def block_widths(unit: int, S: int, fine_from: int = FINE_WIDTHS_FROM) -> list[int]:
    """Static window widths ending at the canvas end S, in whole `unit`s (blocks): 1, 2, 3, 4, 6,
    8, 12, ... units (two per octave: a window of whole units runs at most 1/2 more slots than it
    needs) and, from the octave starting at max(fine_from, 8 units) on, four per octave (at most
    1/4 more), then S itself. Long generations spend most of their forwards on wide
    windows, where each wasted slot costs a whole token's matmuls; the narrow octaves stay coarse
    because every width is a whole-model forward to compile. d3LLM KV cache at gen 512 (prompt
    32, block 32): the forwards ran 8.8% more slots than needed with two widths per octave, 3.6%
    with four from 256 on (11 widths instead of 9)."""
    out = {int(S)}
    for i in range(int(S).bit_length()):
        p = unit << i
        if p >= S:
            break
        per = 4 if p >= max(fine_from, 8 * unit) else 2
        out.update(w for w in (p + j * p // per for j in range(per)) if w % unit == 0 and w < S)
    return sorted(out)


def suffix_widths(ctx: DecodeCtx, S: int) -> list[int]:
    """The widths of a window ending at the canvas end S that a whole-canvas forward may narrow to:
    just S, except in a serving pool (`DecodeCtx.own_layouts`), where rows right-aligned on the
    canvas need only [their start, S): also the half-octave buckets (16, 24, 32, 48, 64, 96, ...)
    from S / 4 (at least 16) below S, so a step computes at most ~1.5x the slots its widest row
    needs, in at most five compiled shapes."""
    if not ctx.own_layouts:
        return [S]
    lo = max(16, S // 4)
    return sorted({w for w in (bucket(n, 16, steps_per_octave=2) for n in range(lo, S)) if w < S} | {S})


def count_forward(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Add one forward to the NFE of rows [B] (bool) that took part in it."""
    return state.replace(nfe=state.nfe + rows.astype(jnp.int32))


# --------------------------------------------------------------------------- sampling a window
def sample_window(ctx: DecodeCtx, state: DecodeState, logits: jax.Array, offset,
                  bitmask: jax.Array | None = None, rows: jax.Array | None = None
                  ) -> tuple[DecodeState, Sample]:
    """Sample logits [B, W, V] predicting slots [offset, offset + W) (offset scalar or [B]).

    The mask token is excluded; `bitmask` [B, W, ceil(V/32)] (packed int32,
    optional) removes the tokens a constraint disallows. Each row uses its own
    settings (`state.sampling`) and draws the token at position q (slot -
    start) with fold_in(step key, q), so a draw depends neither on the
    window's shape nor on the row's left padding. The row's PRNG stream
    advances only where `rows` [B] (default: running rows) is True, so a row's
    samples do not depend on what the rest of the batch is doing.
    """
    z = allowed_logits(ctx, logits, bitmask)
    state, z = constrain_logits(state, z, offset)
    state, step_keys = advance_keys(state, rows)
    W = z.shape[1]
    pos = rows_of(state, offset)[:, None] + jnp.arange(W, dtype=jnp.int32) - state.start[:, None]
    sp = state.sampling
    s = sample_rows(z, step_keys, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, slots=pos)
    return state, s


def allowed_logits(ctx: DecodeCtx, logits: jax.Array, bitmask: jax.Array | None = None) -> jax.Array:
    """Logits [B, W, V] with the mask token and (optional packed bitmask) disallowed tokens at -inf."""
    z = exclude_token(logits, ctx.model.mask_token_id)
    return z if bitmask is None else apply_token_bitmask(z, bitmask)


def advance_keys(state: DecodeState, rows: jax.Array | None = None) -> tuple[DecodeState, jax.Array]:
    """Split the PRNG stream of rows [B] (default: running rows): (state with their next keys,
    step keys [B] to draw this step's randomness from). Other rows keep their key."""
    keys, step_keys = split_rows(state.key)
    rows = ~state.done if rows is None else rows
    keep = jax.random.key_data(state.key)
    keys = jax.random.wrap_key_data(
        jnp.where(rows[:, None], jax.random.key_data(keys), keep), impl=jax.random.key_impl(state.key))
    return state.replace(key=keys), step_keys


def constrain_logits(state: DecodeState, logits: jax.Array, offset) -> tuple[DecodeState, jax.Array]:
    """(state, logits [B, W, V] predicting slots [offset, offset + W) with the tokens an on-device
    constraint (`state.constraint`) rules out set to -inf); unchanged (nothing traced) without one."""
    if state.constraint is None:
        return state, logits
    tab, logits = state.constraint.mask_logits(state, logits, offset)
    return state.replace(constraint=tab), logits


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
def write_tokens(state: DecodeState, offset, sel: jax.Array, s: Sample) -> DecodeState:
    """Write the selected sampled tokens [B, W] into the window at `offset` (scalar or [B]).

    Rows revealing >= 1 token advance their step counter and stamp the new
    step number into step_map; their log-probs are stored at reveal time. A
    row that selected a slot where no token could be drawn (log-prob -inf: a
    constraint allowed nothing, or the logits were not finite) reveals nothing
    and gets finish code INVALID, which the next `finish_rows` closes. With an on-device
    constraint (`state.constraint`) the selection is first cut to reveals that complete together.
    """
    if state.constraint is not None:  # tokens revealed together must complete together
        sel = state.constraint.joint(state, offset, sel, s.token, s.prob)
    invalid = jnp.any(sel & ~(s.logprob > -jnp.inf), axis=-1)  # [B]
    sel = sel & ~invalid[:, None]
    any_new = jnp.any(sel, axis=-1)  # [B]
    steps = state.steps + any_new.astype(jnp.int32)
    W = sel.shape[1]
    tok = jnp.where(sel, s.token, window(state.tokens, offset, W))
    smap = jnp.where(sel, steps[:, None], window(state.step_map, offset, W))
    lp = jnp.where(sel, s.logprob, window(state.logprobs, offset, W))
    rev = sel | window(state.revealed, offset, W)
    state = state.replace(
        tokens=set_window(state.tokens, offset, tok),
        step_map=set_window(state.step_map, offset, smap),
        logprobs=set_window(state.logprobs, offset, lp),
        revealed=set_window(state.revealed, offset, rev),
        steps=steps,
        finish=jnp.where(invalid & ~state.done, INVALID, state.finish),
    )
    return state


# --------------------------------------------------------------------------- stopping
def is_stop_token(state: DecodeState) -> jax.Array:
    """[B, S] bool: slot holds one of its row's stop ids (`state.stop_ids`, -1 = unused)."""
    return jnp.any(state.tokens[:, :, None] == state.stop_ids[:, None, :], axis=-1)


def stop_end(state: DecodeState) -> tuple[jax.Array, jax.Array]:
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
    first_stop = jnp.min(jnp.where(gen & state.revealed & is_stop_token(state), s, S), axis=-1)
    stopped = first_stop < first_hole
    end = jnp.where(stopped, first_stop + 1, jnp.minimum(first_hole, state.limit))
    return stopped, end.astype(jnp.int32)


def close_rows(state: DecodeState, rows: jax.Array, code, end=None) -> DecodeState:
    """Finish rows [B] (bool) with finish code `code` (scalar or [B]); their `end` is fixed here
    (`stop_end`'s, unless the caller has it already)."""
    end = stop_end(state)[1] if end is None else end
    return state.replace(done=state.done | rows, finish=jnp.where(rows, code, state.finish).astype(jnp.int32),
                         end=jnp.where(rows, end, state.end))


def finish_rows(state: DecodeState) -> DecodeState:
    """Mark rows done: a stop token reached (STOP), every generation slot revealed (LENGTH), or
    `reveal` found no drawable token (INVALID, already in `finish`)."""
    stopped, end = stop_end(state)
    invalid = state.finish == INVALID
    newly = ~state.done & (stopped | (end >= state.limit) | invalid)
    return close_rows(state, newly, jnp.where(invalid, INVALID, jnp.where(stopped, STOP, LENGTH)), end)


def abort_running(state: DecodeState) -> DecodeState:
    """Finish every row still running as ABORT (the loop's iteration guard, a forward budget)."""
    return close_rows(state, ~state.done, ABORT)


__all__ = ["DecodeCtx", "Layout", "Plan", "right_aligned", "make_plan", "bucket", "fill_token", "new_state",
           "with_buffers", "window", "set_window", "forward_window", "suffix_widths", "block_widths", "count_forward",
           "switch_width", "in_turn", "in_place", "reads_cache_in_place",
           "sample_window", "allowed_logits", "advance_keys",
           "constrain_logits", "candidates", "rank",
           "select_top_k", "select_first_k", "select_threshold", "select_entropy_bounded",
           "is_stop_token", "stop_end", "close_rows", "finish_rows", "abort_running", "RUNNING", "STOP",
           "LENGTH", "ABORT", "INVALID"]
