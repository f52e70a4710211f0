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

Entry points (all pure; `compiled()` and `compiled_steps()` give their jitted forms):

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

The paradigm protocol (what `paradigm` must provide: `layout`, `prefill`, `plan`,
`forward`, `reveal` and the optional members) is `jdllm.decode.protocol.Paradigm`;
the registry of names is `protocol.PARADIGMS`.

Each entry point taking `ctx` also takes arrays typed on a mesh with Explicit axes (`jax.make_mesh`'s
default): it then runs with those axes treated as Auto and returns arrays typed on that mesh
(`jdllm.sharding.auto_axes`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from jdllm.decode import common
from jdllm.decode.common import DecodeCtx
from jdllm.decode.protocol import PARADIGMS, available_paradigms, paradigm_class  # noqa: F401 (re-exported)
from jdllm.model import check_params, unstack_layers
from jdllm.sharding import auto_axes
from jdllm.state import DecodeState


@auto_axes
def prefill(params, state: DecodeState, bitmask=None, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Allocate the KV cache (parameters' dtype) and run the paradigm's prefill (bitmask: for the
    slots `plan(state)` names, where the prefill also takes the first step)."""
    params = layers_for(params, ctx)
    state = common.constrain(ctx, common.with_buffers(params, ctx.model, state))
    return common.constrain(ctx, paradigm.prefill(params, ctx, state, bitmask))


@auto_axes
def plan(state: DecodeState, *, paradigm, ctx: DecodeCtx) -> tuple[DecodeState, common.Plan]:
    """The state the next step starts from and the slots it chooses tokens for (no forward)."""
    return paradigm.plan(ctx, state)


@auto_axes
def forward(params, state: DecodeState, plan: common.Plan, *, paradigm, ctx: DecodeCtx):
    """The step's forward: (state, logits [B, N, V] predicting `plan.slots`)."""
    return paradigm.forward(layers_for(params, ctx), ctx, state, plan)


@auto_axes
def reveal(state: DecodeState, plan: common.Plan, logits, bitmask=None, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Sample and reveal the planned slots (bitmask [B, N, ceil(V/32)] optional); ends the iteration."""
    state = paradigm.reveal(ctx, state, plan, logits, bitmask)
    return state.replace(iteration=state.iteration + 1)


@auto_axes
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


@auto_axes
def step_n(params, state: DecodeState, n, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Up to n more iterations on the device (fewer when every row is done or the guard is hit)."""
    bound = jnp.minimum(state.iteration + jnp.asarray(n, jnp.int32), paradigm.max_iterations(state))
    return _loop(layers_for(params, ctx), state, paradigm, ctx, bound)


def finalize(state: DecodeState) -> DecodeState:
    """Rows still running once the loop ends (iteration guard hit) finish as ABORT."""
    return common.abort_running(state)


@auto_axes
def run(params, state: DecodeState, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Prefill, then step until every row is done, then finalize. Pure: usable inside a user's jit / vmap.

    NFE counts every model forward a row took part in, prefill and KV-commit
    passes included (`state.nfe` per row, `state.forwards` for the batch).
    The input state is not consumed (it holds no cache), so it can be reused.
    """
    params = layers_for(params, ctx)  # sliced once here, not on every step of the loop
    state = prefill(params, state, paradigm=paradigm, ctx=ctx)
    state = _loop(params, state, paradigm, ctx, paradigm.max_iterations(state))
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
    `generate` (in bfloat16 the scanned and the unrolled layers round differently). Params of
    another model than the context's are a ConfigError here (static shapes: free under jit)."""
    check_params(params, ctx.model, allow_extra=True)
    if not unroll_layers(ctx):
        return params
    return {k: unstack_layers(v) if isinstance(v, dict) and "layers" in v else v
            for k, v in unstack_layers(params).items()}


def _jit(fn, static=("paradigm", "ctx"), donate=(), compiler_options=()):
    return jax.jit(fn, static_argnames=static, donate_argnames=donate,
                   compiler_options=dict(compiler_options) or None)


_OPTIONS: contextvars.ContextVar[tuple] = contextvars.ContextVar("jdllm_compiler_options", default=())


@contextlib.contextmanager
def compiler_options(**options):
    """XLA compiler options for the decode programs jdllm compiles inside this block (`jdllm.compiler_options`).

        with jdllm.compiler_options(xla_backend_optimization_level=0):   # the CPU: compile fast, run slower
            jdllm.generate(...)

    On the CPU, xla_cpu_use_fusion_emitters=False beside that level shortens the compile again
    (jaxlib 0.10.2: multi_block's program 2.3 -> 1.5 s on the tests' 2-layer model, AR's first call
    on a 4-layer hidden-128 model 2.6 -> 1.5 s, the same tokens; benchmarks/RESULTS.md, "XLA:CPU's
    fusion emitters off"); at XLA's default level it changes little. Unlike XLA_FLAGS they apply
    per compile, to jdllm's own programs only (`generate`, the constrained paths, a serving engine
    built inside the block), and nest (inner values win).
    On a GPU, e.g. xla_gpu_autotune_level=0 skips GEMM autotuning (a shorter first call)."""
    token = _OPTIONS.set(tuple(sorted({**dict(_OPTIONS.get()), **options}.items())))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def current_options() -> tuple[tuple[str, object], ...]:
    """The compiler options `compiler_options` set for this context, as (name, value) pairs."""
    return _OPTIONS.get()


@functools.lru_cache(maxsize=None)
def compiled(compiler_options: tuple[tuple[str, object], ...] | None = None):
    """`run` under jax.jit: one compile per (paradigm config, context, shape bucket).

    The input state carries no KV cache (prefill allocates it), so it is not
    donated and a prepared state can be decoded again.
    compiler_options: XLA options as (name, value) pairs, e.g.
    (("xla_backend_optimization_level", 0),) to trade run time for compile time;
    None: those of the enclosing `compiler_options()` block.
    """
    if compiler_options is None:
        return compiled(current_options())
    return _jit(run, compiler_options=compiler_options)


@functools.lru_cache(maxsize=None)
def compiled_steps(compiler_options: tuple[tuple[str, object], ...] | None = None) -> dict:
    """The host-driven pieces under jax.jit: prefill, plan, forward, reveal, step, step_n, finalize
    (compiler_options as in `compiled`).

    State-in, state-out pieces donate the state (the KV cache is updated in
    place): keep using the returned state, not the one passed in.
    """
    if compiler_options is None:
        return compiled_steps(current_options())
    opts = compiler_options
    return dict(prefill=_jit(prefill, compiler_options=opts),
                plan=_jit(plan, donate=("state",), compiler_options=opts),
                forward=_jit(forward, donate=("state",), compiler_options=opts),
                reveal=_jit(reveal, donate=("state",), compiler_options=opts),
                step=_jit(step, donate=("state",), compiler_options=opts),
                step_n=_jit(step_n, donate=("state",), compiler_options=opts),
                finalize=_jit(finalize, static=(), donate=("state",), compiler_options=opts))
