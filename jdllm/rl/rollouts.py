"""Rollouts: the decode loop as a pure function of (params, key), G samples per prompt.

`prepare_rollout` (host side, once per prompt batch) repeats every prompt G
times and builds the initial `DecodeState` and a static `RolloutSpec` through
`jdllm.prepare`. `rollout(params, state, key, spec=...)` (pure, usable inside
the user's `jax.jit`) gives every row its own PRNG stream fold_in(key, row),
runs `jdllm.decode.loop.run` and returns a `Rollout` of arrays. New params or a
new key are data: a training step that calls it again does not recompile
(count traces with jax.monitoring's "/jax/core/compile/jaxpr_trace_duration" events).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors
from jdllm.api import prepare, tokenize
from jdllm.decode import common, loop
from jdllm.sampling import RowSampling
from jdllm.sharding import auto_axes
from jdllm.state import DecodeState, slot_index



@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Static (hashable) description of a rollout batch: a jit static argument.

    group: samples per prompt (rows g * group ... (g + 1) * group - 1 share prompt g).
    prompts: real prompts (rows past prompts * group are batch padding, inactive).
    max_steps: a bound on the decoding steps of one row (every step reveals >= 1
    token, so the generation length is one); replay sizes its step copies from it.
    """

    paradigm: Any
    ctx: common.DecodeCtx
    group: int
    prompts: int
    max_steps: int

    @property
    def rows(self) -> int:
        return self.group * self.prompts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """One rollout batch. Shapes: B rows (prompt-major: row = prompt * G + sample), S canvas slots.

    tokens / step_map / logprobs are the whole canvas (replay needs every revealed
    slot, also those past a stop token); `answer_mask` marks the tokens a row
    returns (its generation up to and including its stop token): the loss mask.
    """

    tokens: jax.Array  # [B, S] int32
    step_map: jax.Array  # [B, S] int32, 1-based reveal step, 0 = not generated
    logprobs: jax.Array  # [B, S] float32, log-prob at reveal time (sampling distribution)
    prompt_mask: jax.Array  # [B, S] bool: the row's prompt slots
    answer_mask: jax.Array  # [B, S] bool: returned generated tokens
    start: jax.Array  # [B] int32: first real slot
    gen_start: jax.Array  # [B] int32
    end: jax.Array  # [B] int32: one past the last returned slot
    finish: jax.Array  # [B] int32 finish codes (jdllm.state.FINISH_REASONS)
    nfe: jax.Array  # [B] int32
    active: jax.Array  # [B] bool: False for batch-padding rows
    sampling: RowSampling  # [B] settings the tokens were drawn with (replay uses them)
    paradigm: str = dataclasses.field(default="", metadata=dict(static=True))

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def slots(self) -> int:
        return self.tokens.shape[1]


def prepare_rollout(model, prompts, decoding=None, sampling=None, *, group: int = 1,
                    apply_chat_template: bool = False):
    """Host side: (initial DecodeState, RolloutSpec) for `group` samples of every prompt.

    sampling: one `jdllm.Sampling` (temperature 1 is the usual RL choice);
    its seed is irrelevant: `rollout` draws every row's stream from its key.
    Nothing compiles here.
    """

    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise errors.InputError(f"group={group!r} must be an integer >= 1 (samples per prompt)")
    if sampling is not None and not hasattr(sampling, "temperature"):
        raise errors.ArgumentTypeError(f"sampling={sampling!r}: pass one jdllm.Sampling for every row")
    ids = tokenize(model, prompts, apply_chat_template)
    rows = [p for p in ids for _ in range(int(group))]
    prep = prepare(model, rows, decoding, sampling)
    if prep.clipped:  # no Outputs here to tell which rows the context cut short: one note per call site
        errors.warn(f"max_new_tokens: the default does not fit the "
                    f"model's context (max_position_embeddings={model.config.max_position_embeddings}); rollouts "
                    "generate at most what each prompt's context leaves. Set max_new_tokens to choose.")
    st = prep.state
    max_steps = int(np.max(np.asarray(st.limit) - np.asarray(st.gen_start)))
    spec = RolloutSpec(paradigm=prep.paradigm, ctx=prep.ctx, group=int(group), prompts=len(ids),
                       max_steps=max(1, max_steps))
    return st, spec


def row_stream_keys(key, batch: int) -> jax.Array:
    """[B] typed keys fold_in(key, b): one independent stream per row (raw or typed `key`)."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if (typed and key.ndim) or (not typed and (key.dtype != jnp.uint32 or key.shape != (2,))):
        raise errors.ArgumentTypeError(
            f"key is {key.dtype} {key.shape}: pass one PRNG key, e.g. jax.random.key(0) "
            "(rollout folds the row index into it: one stream per row)")
    if not typed:
        key = jax.random.wrap_key_data(key)
    return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch, dtype=jnp.uint32))


@auto_axes
def rollout(params, state: DecodeState, key, *, spec: RolloutSpec) -> Rollout:
    """Decode `state` (from `prepare_rollout`) with `params`; row b samples from fold_in(key, b).

    Pure: jit it with `spec` static (or call it inside a jitted training step);
    params and key are data, so new values never recompile. On a mesh with Explicit axes
    (`jax.make_mesh`'s default) the decode runs with them treated as Auto and the Rollout comes back
    typed on that mesh, rows over `batch` (`jdllm.sharding.auto_axes`).
    """
    if state.batch < spec.rows:
        raise errors.InputError(f"state has {state.batch} rows but spec wants {spec.rows} "
                                f"({spec.prompts} prompts x group {spec.group})")
    # another model's params are named, not decoded: loop.run checks them (model.check_params)
    active = ~state.done
    state = state.replace(key=row_stream_keys(key, state.batch))
    final = loop.run(params, state, paradigm=spec.paradigm, ctx=spec.ctx)
    s = slot_index(final)
    prompt = (s >= final.start[:, None]) & (s < final.gen_start[:, None])
    answer = (s >= final.gen_start[:, None]) & (s < final.end[:, None]) & (final.step_map > 0) & active[:, None]
    return Rollout(tokens=final.tokens, step_map=final.step_map, logprobs=final.logprobs,
                   prompt_mask=prompt, answer_mask=answer, start=final.start, gen_start=final.gen_start,
                   end=final.end, finish=final.finish, nfe=final.nfe, active=active,
                   sampling=final.sampling, paradigm=spec.paradigm.name)


compiled_rollout = jax.jit(rollout, static_argnames=("spec",))


def select_groups(ro: Rollout, spec: RolloutSpec, groups) -> tuple[Rollout, RolloutSpec]:
    """Host side: the rollout restricted to whole groups (prompt indices `groups`, in that order) and its spec.

    A group whose rewards are all equal has zero GRPO advantage and adds nothing
    to the gradient but its compute: keep the informative groups (DAPO's dynamic
    sampling) and update on a fixed number of them, so the update compiles once.
    """
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__") or any(
            isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)) for g in groups):
        raise errors.InputError(f"groups={groups!r}: give a list of prompt indices (ints), e.g. [0, 2]")
    groups = [int(g) for g in groups]
    if not groups or any(g < 0 or g >= spec.prompts for g in groups):
        raise errors.InputError(f"groups={groups}: need prompt indices in [0, {spec.prompts})")
    rows = np.asarray([g * spec.group + j for g in groups for j in range(spec.group)], np.int32)
    sub = jax.tree.map(lambda x: x[rows], ro)
    return sub, dataclasses.replace(spec, prompts=len(groups))


def texts(ro: Rollout, spec: RolloutSpec, tokenizer=None, decode=None) -> list[str]:
    """Host side: each real row's returned text (tokenizer.decode or a `decode(ids)` callable)."""
    host = jax.device_get((ro.tokens, ro.gen_start, ro.end))
    out = []
    for b in range(spec.rows):
        g0, e = int(host[1][b]), max(int(host[2][b]), int(host[1][b]))
        ids = [int(t) for t in host[0][b, g0:e]]
        if decode is not None:
            out.append(decode(ids))
        elif tokenizer is not None:
            out.append(tokenizer.decode(ids, skip_special_tokens=True))
        else:
            raise errors.InputError("texts() needs a tokenizer or a decode callable")
    return out


__all__ = ["RolloutSpec", "Rollout", "prepare_rollout", "rollout", "compiled_rollout", "row_stream_keys",
           "select_groups", "texts"]
