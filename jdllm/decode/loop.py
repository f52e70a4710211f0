"""The decode loop: `prefill`, then `lax.while_loop(not all done, step)`, in one jit, and
the same pieces for a host that drives the loop itself.

Engine shape
============

Rows are independent. Each row has its own canvas positions (`start`,
`gen_start`, `limit`), its own KV-cache length (`cache.length[b]`), its own
sampling settings (`state.sampling`: temperature / top_k / top_p as [B] data,
so a new value never recompiles), stop ids (`state.stop_ids`) and PRNG stream.
A row can therefore advance by several slots in one step, rewind (lower its
cache length and re-mask slots), or sit at a different position from its
neighbours. Everything a row returns is decided on the device: `finish`
(STOP / LENGTH / ABORT / INVALID, see `jdllm.state`) and `end` (one past the
last slot to return).

Entry points (all pure; `compiled` / `decode` / `step_n` are their jitted forms):

    run(params, state)            prefill + while_loop(step) + finalize: the default path
    prefill(params, state, bitmask=None)  allocate the KV cache, then the paradigm's prefill
    plan(state) -> (state, Plan)  the slots the next step chooses tokens for
    forward(params, state, plan)  -> (state, logits [B, N, V]) for exactly those slots
    reveal(state, plan, logits, bitmask=None) -> state
    step(params, state, bitmask)  plan -> forward -> reveal, counted as one iteration
    step_n(params, state, n)      up to n steps on the device (stops early when all rows are done)
    finalize(state)               rows still running become ABORT (with their end)

A host that must see every step (a grammar matcher, a serving scheduler)
calls `plan`, builds masks for `plan.slots` while `forward` runs, then
`reveal` with them; the on-device loop composes the very same functions, so
the two paths cannot drift apart. (`plan` may update bookkeeping, e.g.
multi_block's block states: call it once per step, so after `plan` use
`forward` + `reveal`, not `step`, which plans again.) The jitted pieces
donate the state they take: keep the one they return.

Paradigm protocol
=================

A paradigm is one file in `jdllm/decode/` holding a frozen, hashable config
dataclass (it is a jit static argument) with these members:

    name: ClassVar[str]
        The registry name ("ar", "block_diffusion", ...). Add the file to
        `PARADIGMS` below; the CLI and `generate` find it there.

    __post_init__(self)
        Range checks of its own fields -> `jdllm.errors.DecodingConfigError`
        naming the value and the accepted range. Runs before anything compiles.

    validate(self, cfg: ModelConfig) -> None
        Checks against the model (e.g. a mask token is required, block length
        vs the model's block_size: warn with `warnings.warn`). Host-side.

    layout(self, lengths: np.ndarray, max_new_tokens: int, cfg) -> common.Layout
        Host-side geometry: where each row starts (`start`), where its
        generation starts (`gen_start`), the canvas size S and `prefill_len`
        (the static number of leading slots its prefill covers). Round S and
        prefill_len up to buckets (`common.bucket`) so similar inputs share a
        compile. `common.new_state` then builds the DecodeState from it.
        `ragged_lengths: ClassVar[bool]` (optional, default False): rows may
        have different max_new_tokens.

    prefill(self, params, ctx, state, bitmask=None) -> DecodeState
        The first forward(s): the prompt into the KV cache (which `loop.prefill`
        has allocated). It may also take the first decoding step through the
        same `plan` / `reveal` (bitmask for `plan(state).slots`), or set up
        `state.extra` and leave the first forward to `step`. Pure.

    plan(self, ctx, state) -> (DecodeState, common.Plan)
        Decide what the next step works on and return the slots it will choose
        tokens for (`common.make_plan(state, offset, width)`: row b's
        [offset[b], offset[b] + N), N static). May update bookkeeping in the
        state (block states, the current block). No forward, no sampling.

    forward(self, params, ctx, state, plan) -> (DecodeState, logits [B, N, V])
        The step's model forward: writes K/V into the cache, commits what is
        final, counts NFE, and returns the float32 logits *predicting* the
        planned slots (`common.forward_window(..., at=plan.slots)`: the LM head
        runs only there).

    reveal(self, ctx, state, plan, logits, bitmask=None) -> DecodeState
        Sample the planned slots (`common.sample_window`, with the optional
        packed int32 bitmask [B, N, ceil(V/32)]), choose which to reveal
        (`common.candidates` / `select_*`), write them (`common.reveal`) and
        finish rows (`common.finish_rows`).

    attention_config(self, cfg) -> ModelConfig   (optional)
        The config the forward runs with, e.g. block_diffusion sets the
        attention block grid to its block_length. Default: cfg.

    max_iterations(self, state) -> int   (optional)
        A static bound on loop iterations (a guard; default 2 * S + 8). Rows
        still running when it is hit finish as ABORT.

    output_trace(self, extra, row) -> dict   (optional)
        Per-row analysis arrays for `Output.trace`.

State contract (see jdllm/state.py): a step must
  - keep every per-row quantity per row: offsets and cache lengths are [B]
    where rows may differ (`common.window` / `set_window` / `forward_window` /
    `reveal` take a scalar or [B] offset);
  - reveal tokens only through `common.reveal` (so step_map and log-probs
    follow one rule: 1-based, the per-row counter advances only on steps that
    reveal >= 1 token, tokens revealed together share a number, log-prob of
    the distribution actually sampled from, float32; a slot with no drawable
    token finishes its row as INVALID instead of writing NaN);
  - count every forward: `common.forward_window` bumps `state.forwards`
    (batch) and the paradigm calls `common.count_forward(state, rows)` for the
    rows that had work in it (prefill and KV-commit passes included), so a row
    in a batch reports the NFE it would report alone;
  - call `common.finish_rows(state)` after revealing (or `close_rows` with a
    finish code); the loop ends when every row is done;
  - never touch a done row's tokens (`common.candidates` excludes done rows);
  - keep paradigm-only arrays in `state.extra` (a dict) and set them in
    `prefill` (the while_loop carry must keep one structure);
  - advance a row's PRNG stream only when it samples for real
    (`common.sample_window(..., rows=...)`), so sampled rows too do not
    depend on the rest of the batch.

Shared pieces for all of this live in `jdllm/decode/common.py`. `ar.py` is the
smallest complete example, `block_diffusion.py` one whose rows move through
blocks at their own pace.

Testing a paradigm: a plain-loop reference (full forward every step, no cache,
numpy) beside `tests/reference_decoders.py`; jdllm must match it token for
token and step for step under greedy decoding, batch 1 and a batch of
different-length prompts. `tests/decode_fixtures.py` has tiny peaked models
and the `fast_compile` fixture.
"""

from __future__ import annotations

import collections
import functools
import importlib

import jax
import jax.numpy as jnp

from jdllm.decode import common
from jdllm.decode.common import DecodeCtx
from jdllm.model import unstack_layers
from jdllm.state import DecodeState

# registry: paradigm name -> "module:ConfigClass"
PARADIGMS = {
    "ar": "jdllm.decode.ar:AR",
    "block_diffusion": "jdllm.decode.block_diffusion:BlockDiffusion",
    "multi_block": "jdllm.decode.multi_block:MultiBlock",
    "masked_diffusion": "jdllm.decode.masked_diffusion:MaskedDiffusion",
    "ar_spec": "jdllm.decode.ar_spec:Speculative",
}

# traces of `run` per paradigm name: a test checks a second call does not retrace
TRACES: collections.Counter = collections.Counter()


def paradigm_class(name: str):
    """The config class registered under `name` (imports its module)."""
    from jdllm import errors  # noqa: PLC0415

    if name not in PARADIGMS:
        raise errors.DecodingConfigError(f"paradigm {name!r} is not one of {sorted(PARADIGMS)}")
    mod, cls = PARADIGMS[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def available_paradigms() -> dict:
    """name -> config class, for the paradigms whose module exists in this checkout."""
    out = {}
    for name in PARADIGMS:
        try:
            out[name] = paradigm_class(name)
        except ImportError:
            continue
    return out


def max_iterations(paradigm, state: DecodeState) -> int:
    fn = getattr(paradigm, "max_iterations", None)
    return int(fn(state)) if fn is not None else 2 * state.slots + 8


def prefill(params, state: DecodeState, bitmask=None, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Allocate the KV cache (parameters' dtype) and run the paradigm's prefill (bitmask: for the
    slots `plan(state)` names, where the prefill also takes the first step)."""
    params = layers_for(params, ctx)
    state = common.constrain(ctx, common.with_buffers(params, ctx.model, state))
    return common.constrain(ctx, paradigm.prefill(params, ctx, state, bitmask))


def plan(state: DecodeState, *, paradigm, ctx: DecodeCtx) -> tuple[DecodeState, common.Plan]:
    """The state the next step starts from and the slots it chooses tokens for (no forward)."""
    return paradigm.plan(ctx, state)


def forward(params, state: DecodeState, plan: common.Plan, *, paradigm, ctx: DecodeCtx):
    """The step's forward: (state, logits [B, N, V] predicting `plan.slots`)."""
    return paradigm.forward(layers_for(params, ctx), ctx, state, plan)


def reveal(state: DecodeState, plan: common.Plan, logits, bitmask=None, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Sample and reveal the planned slots (bitmask [B, N, ceil(V/32)] optional); ends the iteration."""
    state = paradigm.reveal(ctx, state, plan, logits, bitmask)
    return state.replace(iteration=state.iteration + 1)


def step(params, state: DecodeState, bitmask=None, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """One iteration: plan -> forward -> reveal (what the on-device loop runs)."""
    state, p = plan(state, paradigm=paradigm, ctx=ctx)
    state, logits = forward(params, state, p, paradigm=paradigm, ctx=ctx)
    return reveal(state, p, logits, bitmask, paradigm=paradigm, ctx=ctx)


def _loop(params, state: DecodeState, paradigm, ctx: DecodeCtx, bound) -> DecodeState:
    def cond(s: DecodeState):
        return ~jnp.all(s.done) & (s.iteration < bound)

    return jax.lax.while_loop(cond, lambda s: common.constrain(ctx, step(params, s, paradigm=paradigm, ctx=ctx)),
                              state)


def step_n(params, state: DecodeState, n, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Up to n more iterations on the device (fewer when every row is done or the guard is hit)."""
    bound = jnp.minimum(state.iteration + jnp.asarray(n, jnp.int32), max_iterations(paradigm, state))
    return _loop(layers_for(params, ctx), state, paradigm, ctx, bound)


def finalize(state: DecodeState) -> DecodeState:
    """Rows still running once the loop ends (iteration guard hit) finish as ABORT."""
    return common.abort_running(state)


def run(params, state: DecodeState, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Prefill, then step until every row is done, then finalize. Pure: usable inside a user's jit / vmap.

    NFE counts every model forward a row took part in, prefill and KV-commit
    passes included (`state.nfe` per row, `state.forwards` for the batch).
    The input state is not consumed (it holds no cache), so it can be reused.
    """
    TRACES[paradigm.name] += 1
    params = layers_for(params, ctx)  # sliced once here, not on every step of the loop
    state = prefill(params, state, paradigm=paradigm, ctx=ctx)
    state = _loop(params, state, paradigm, ctx, max_iterations(paradigm, state))
    return finalize(state)


UNROLL_LAYERS_ON = ("cpu",)  # backends where `run` splits *stacked* params per layer inside the jit


def unroll_layers(ctx: DecodeCtx) -> bool:
    """Whether `run` splits stacked layer weights apart before its loop (`jdllm.model.unstack_layers`).

    The params `jdllm.load` returns are already per layer: every backend then runs the layers as
    straight-line code reading each weight in place, and this matters only for params a caller
    keeps stacked (`init_params`, `stack_layers`, a training loop's own). On the CPU without a mesh
    those are split inside the jit once per call (a scanned layer's weights are copied out of the
    stack on every step: ~20% of an AR step at hidden 512). Elsewhere they run through `lax.scan`:
    splitting them inside the jit would hold the weights twice (on a GPU, load per-layer params
    instead: a scan copies every layer's weights on every step, 2.5-3x slower at batch 1)."""
    return jax.default_backend() in UNROLL_LAYERS_ON and ctx.placement is None


def layers_for(params, ctx: DecodeCtx):
    """params as this context runs them: where `unroll_layers`, each stack of layer weights (the
    model's and a draft model's riding along) split per layer; a no-op on per-layer params. Every
    entry point that runs a forward (`run`, `prefill`, `forward`, `step_n`; the serving engine's
    rounds and the host-driven steps through them) calls it, so they all compute the same graph as
    `generate` (in bfloat16 the scanned and the unrolled layers round differently)."""
    if not unroll_layers(ctx):
        return params
    return {k: unstack_layers(v) if isinstance(v, dict) and "layers" in v else v
            for k, v in unstack_layers(params).items()}


def _jit(fn, static=("paradigm", "ctx"), donate=(), compiler_options=()):
    return jax.jit(fn, static_argnames=static, donate_argnames=donate,
                   compiler_options=dict(compiler_options) or None)


@functools.lru_cache(maxsize=None)
def compiled(compiler_options: tuple[tuple[str, object], ...] = ()):
    """`run` under jax.jit: one compile per (paradigm config, context, shape bucket).

    The input state carries no KV cache (prefill allocates it), so it is not
    donated and a prepared state can be decoded again.
    compiler_options: XLA options as (name, value) pairs, e.g.
    (("xla_backend_optimization_level", 0),) to trade run time for compile time.
    """
    return _jit(run, compiler_options=compiler_options)


@functools.lru_cache(maxsize=None)
def compiled_steps(compiler_options: tuple[tuple[str, object], ...] = ()) -> dict:
    """The host-driven pieces under jax.jit: prefill, plan, forward, reveal, step, step_n, finalize.

    State-in, state-out pieces donate the state (the KV cache is updated in
    place): keep using the returned state, not the one passed in.
    """
    opts = compiler_options
    return dict(prefill=_jit(prefill, compiler_options=opts),
                plan=_jit(plan, donate=("state",), compiler_options=opts),
                forward=_jit(forward, donate=("state",), compiler_options=opts),
                reveal=_jit(reveal, donate=("state",), compiler_options=opts),
                step=_jit(step, donate=("state",), compiler_options=opts),
                step_n=_jit(step_n, donate=("state",), compiler_options=opts),
                finalize=_jit(finalize, static=(), donate=("state",), compiler_options=opts))


decode = compiled()  # what jdllm.generate calls
