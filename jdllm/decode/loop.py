"""The decode loop: prefill, then `lax.while_loop(not all done, paradigm.step)`, in one jit.

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

    prefill(self, params, ctx: common.DecodeCtx, state) -> DecodeState
        The first forward(s) (prompt into the KV cache; it may also take the
        first decoding step). Pure.

    step(self, params, ctx, state, bitmask=None) -> DecodeState
        One loop iteration: normally exactly one model forward plus a reveal.
        Pure, static shapes, no host sync. `bitmask` is an optional packed
        int32 token mask [B, W, ceil(V/32)] over the positions it samples
        (constraints drive it from outside the loop; the loop passes None).

    attention_config(self, cfg) -> ModelConfig   (optional)
        The config the forward runs with, e.g. block_diffusion sets the
        attention block grid to its block_length. Default: cfg.

    max_iterations(self, state) -> int   (optional)
        A static bound on loop iterations (a guard; default 2 * S + 8).

State contract (see jdllm/state.py): a step must
  - reveal tokens only through `common.reveal` (so step_map and log-probs
    follow one rule: 1-based, the per-row counter advances only on steps that
    reveal >= 1 token, tokens revealed together share a number, log-prob of
    the distribution actually sampled from, float32);
  - count every forward: `common.forward_window` bumps `state.forwards`
    (batch) and the paradigm calls `common.count_forward(state, rows)` for the
    rows that had work in it (prefill and KV-commit passes included), so a row
    in a batch reports the NFE it would report alone;
  - call `common.finish_rows(state, ctx.stop_ids)` after revealing; the loop
    ends when every row is done;
  - never touch a done row's tokens (`common.candidates` excludes done rows);
  - keep paradigm-only arrays in `state.extra` (a dict) and set them in
    `prefill` (the while_loop carry must keep one structure).

  - advance a row's PRNG stream only when it samples for real
    (`common.sample_window(..., rows=...)`), so sampled rows too do not
    depend on the rest of the batch.

Shared pieces for all of this live in `jdllm/decode/common.py` (window forward,
shifted-logit alignment, sampling with the mask token excluded, the
`select_*` reveal rules, `reveal`, the stop rule). `ar.py` is the smallest
complete example, `block_diffusion.py` one with a phase decided by `lax.cond`.

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

from jdllm.decode.common import DecodeCtx
from jdllm.state import DecodeState

# registry: paradigm name -> "module:ConfigClass"
PARADIGMS = {
    "ar": "jdllm.decode.ar:AR",
    "block_diffusion": "jdllm.decode.block_diffusion:BlockDiffusion",
    "multi_block": "jdllm.decode.multi_block:MultiBlock",
    "masked_diffusion": "jdllm.decode.masked_diffusion:MaskedDiffusion",
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


def run(params, state: DecodeState, *, paradigm, ctx: DecodeCtx) -> DecodeState:
    """Prefill, then step until every row is done. Pure: usable inside a user's jit / vmap.

    NFE counts every model forward a row took part in, prefill and KV-commit
    passes included (`state.nfe` per row, `state.forwards` for the batch).
    """
    TRACES[paradigm.name] += 1
    state = paradigm.prefill(params, ctx, state)
    bound = max_iterations(paradigm, state)

    def cond(s: DecodeState):
        return ~jax.numpy.all(s.done) & (s.iteration < bound)

    def body(s: DecodeState):
        s = paradigm.step(params, ctx, s)
        return s.replace(iteration=s.iteration + 1)

    return jax.lax.while_loop(cond, body, state)


@functools.lru_cache(maxsize=None)
def compiled(compiler_options: tuple[tuple[str, object], ...] = ()):
    """`run` under jax.jit: one compile per (paradigm config, context, shape bucket), state donated.

    compiler_options: XLA options as (name, value) pairs, e.g.
    (("xla_backend_optimization_level", 0),) to trade run time for compile time.
    """
    return jax.jit(run, static_argnames=("paradigm", "ctx"), donate_argnames=("state",),
                   compiler_options=dict(compiler_options) or None)


decode = compiled()  # what jdllm.generate calls
