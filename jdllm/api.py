"""The building blocks of `jdllm.generate` (`jdllm.generation`): prompts in, one `Output` per prompt out.

Three layers, each usable on its own:

- `prepare(model, prompts, decoding, sampling)` checks the inputs (raising
  `jdllm.errors.*` before anything compiles), tokenizes, rounds the batch,
  prompt and generation lengths up to buckets and builds the initial
  `DecodeState` plus the static `DecodeCtx`;
- `jdllm.decode.loop.run(params, state, paradigm=..., ctx=...)` is the pure function
  (state in, state out: prefill + `lax.while_loop`) for use inside a user's own jit /
  vmap; `loop.compiled()` is the same, compiled; the prepared state holds no KV cache
  and is not consumed, so it can be decoded again. A host that drives
  the steps itself uses `jdllm.decode.loop`'s `prefill` / `plan` / `forward` /
  `reveal` / `step_n` (`loop.compiled_steps()`);
- `outputs(prepared, state)` turns the final state into `Output`s.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

from jdllm import compile_cache, errors, inputs
from jdllm.decode import common, loop
from jdllm.decode.protocol import Paradigm
from jdllm.loading import Model, check_token_ids
from jdllm.sampling import Sampling
from jdllm.sharding import put
from jdllm.state import FINISH_REASONS, DecodeState


@dataclasses.dataclass(frozen=True)
class Output:
    """One prompt's result. step_map[i] is the 1-based step that revealed token_ids[i];
    logprobs[i] its log-prob at reveal time; nfe the model forwards the row took part in
    (prefill and KV-commit passes included); finish_reason "stop" or "length" normally;
    finish_reason "abort": stopped by the iteration guard or a forward budget; "invalid":
    no token could be drawn (a warning says so for both).
    trace: paradigm-specific analysis arrays for this row (e.g. multi_block's block states),
    from the paradigm's optional `output_trace(extra, row)`; empty otherwise."""

    token_ids: list[int]
    text: str | None
    step_map: list[int]
    logprobs: list[float]
    nfe: int
    finish_reason: str | None
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    trace: dict = dataclasses.field(default_factory=dict)
    constraint_ok: bool | None = None  # constrained rows: the matcher accepted the whole output


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` builds: the initial state, the static context and how to read it back."""

    state: DecodeState
    paradigm: Any
    ctx: common.DecodeCtx
    prompts: list[list[int]]  # the real rows' prompt ids (batch padding excluded)
    tokenizer: Any = None
    clipped: dict = dataclasses.field(default_factory=dict)  # row -> max_new_tokens: a default the context clipped


def default_paradigm(cfg):
    """AR for causal models, block diffusion for block-causal ones (at the model's block size),
    masked diffusion for bidirectional ones."""
    if cfg.attention == "causal":
        return loop.paradigm_class("ar")()
    if cfg.attention == "block_causal":
        return loop.paradigm_class("block_diffusion")(block_length=cfg.block_size)
    return loop.paradigm_class("masked_diffusion")()


def resolve_paradigm(decoding, cfg):
    """The paradigm a decode runs with: `decoding` (None: the model's default paradigm), checked
    to be a paradigm instance, its model-dependent fields filled in (`Paradigm.for_model`) and
    validated against the model (`Paradigm.validate`; nothing compiles)."""
    decoding = default_paradigm(cfg) if decoding is None else decoding
    if isinstance(decoding, type):
        raise errors.DecodingConfigError(
            f"decoding={decoding.__name__} is a class; pass an instance such as {decoding.__name__}()")
    if not isinstance(decoding, Paradigm):
        raise errors.DecodingConfigError(
            f"decoding={decoding!r} is not a paradigm config; use one of jdllm.AR, jdllm.Speculative, jdllm.BlockDiffusion, "
            "jdllm.MultiBlock, jdllm.MaskedDiffusion (or a jdllm.decode.protocol.Paradigm of your own)")
    decoding = decoding.for_model(cfg)
    inputs.validate_paradigm(decoding, cfg)
    return decoding


def tokenize(model: Model, prompts, apply_chat_template: bool) -> list[list[int]]:
    """Text or token-id prompts -> a list of token-id lists."""
    if not isinstance(prompts, (str, list, tuple, np.ndarray)) and hasattr(prompts, "__array__"):
        prompts = np.asarray(prompts)  # a jax.Array of token ids, [T] or [B, T]
    if not isinstance(prompts, (str, list, tuple, np.ndarray)) or (isinstance(prompts, np.ndarray)
                                                                   and prompts.ndim == 0):
        raise errors.ArgumentTypeError(
            f"prompts is a {type(prompts).__name__} ({prompts!r:.40}); pass a string, a list of strings or of "
            "token-id lists, or an int array [batch, length]")
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts)
                                    and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise errors.InputError("generate() needs at least one prompt (a string or a list of token ids)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            tok = model.tokenizer
            if tok is None:
                raise errors.InputError(
                    f"prompt {i} is text but the model has no tokenizer; pass token ids instead")
            if apply_chat_template:
                if not getattr(tok, "chat_template", None):
                    raise errors.InputError(
                        "apply_chat_template=True but the tokenizer has no chat template; "
                        "pass apply_chat_template=False")
                ids = inputs.encode_text(tok, p, i, lambda: tok.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True))
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
            else:
                ids = inputs.encode_text(tok, p, i, lambda: tok.encode(p, add_special_tokens=False))
            ids = [int(t) for t in ids]
        else:
            ids = [int(t) for t in inputs.id_row(p, f"prompt {i}")]
        if len(ids) == 0:
            raise errors.InputError(f"prompt {i} is empty; give at least one token")
        out.append(ids)
    return out


def row_settings(sampling, n: int) -> list[Sampling]:
    """`sampling` (one Sampling, a list with one per prompt, or None) -> one Sampling per prompt."""
    if sampling is None:
        return [Sampling()] * n
    if isinstance(sampling, Sampling):
        return [sampling] * n
    if isinstance(sampling, (list, tuple)):
        for s in sampling:
            inputs.check_sampling(s)
        if len(sampling) != n:
            raise errors.InputError(f"sampling has {len(sampling)} entries for {n} prompts; give one "
                                    "jdllm.Sampling for all prompts or exactly one per prompt")
        return list(sampling)
    inputs.check_sampling(sampling)
    return [sampling] * n


def prepare(model: Model, prompts, decoding=None, sampling: Sampling | list[Sampling] | None = None, *,
            apply_chat_template: bool = False, max_rows: int | None = None) -> Prepared:
    """Check inputs and build the initial DecodeState and static context (nothing compiles).

    The batch is padded with inactive rows up to its shape bucket (a power of two, times the
    mesh's batch split), or to `max_rows` when that is smaller (the serving engine's pool size):
    a batch then never holds more than max_rows rows.

    sampling: one `Sampling` for every prompt (row b then draws from the stream
    fold_in(seed, b)) or a list with one per prompt (each row draws from its own
    fold_in(seed, 0): its sample does not depend on its neighbours). Settings,
    stop ids and seeds are per-row data: changing them does not recompile.
    """
    compile_cache.enable()  # once per process: JAX's persistent compilation cache (jdllm.compile_cache)
    cfg = model.config
    decoding = resolve_paradigm(decoding, cfg)
    decoding.validate_model(model)  # checks that need the whole model (e.g. a draft's tokenizer)
    ids = tokenize(model, prompts, apply_chat_template)
    per_row = isinstance(sampling, (list, tuple))
    asked = row_settings(sampling, len(ids))
    settings = inputs.check_prompts(ids, cfg, asked)
    max_new = [s.max_new_tokens for s in settings]
    if len(set(max_new)) > 1 and not decoding.ragged_lengths:
        raise errors.DecodingConfigError(
            f"paradigm {decoding.name!r} decodes every row to one length; the prompts ask for "
            f"max_new_tokens {sorted(set(max_new))}: give them one value")
    for i, p in enumerate(ids):
        check_token_ids(np.asarray(p), cfg)
        total = len(p) + max_new[i]
        if total > cfg.max_position_embeddings:
            raise errors.SequenceTooLongError(
                f"prompt {i} has {len(p)} tokens and max_new_tokens={max_new[i]}: {total} > "
                f"the model's context max_position_embeddings={cfg.max_position_embeddings}; "
                "shorten the prompt or lower max_new_tokens")
    stops = [tuple(cfg.eos_token_ids if s.stop_token_ids is None else s.stop_token_ids) for s in settings]
    n = len(ids)
    placement = model.placement
    mult = 1 if placement is None else placement.batch_multiple()  # rows split evenly over `data`
    padded = -(-common.bucket(n) // mult) * mult
    if max_rows is not None:
        if n > max_rows or max_rows % mult:
            raise errors.InputError(
                f"max_rows={max_rows} cannot hold {n} prompts" if n > max_rows else
                f"max_rows={max_rows} rows do not split over the mesh's batch axis (a multiple of {mult})")
        padded = min(padded, max_rows)
    pad = padded - n  # batch padding rows copy prompt 0, inactive
    rows = ids + [ids[0]] * pad
    active = np.arange(len(rows)) < n
    lengths = np.array([len(r) for r in rows], np.int32)
    layout = decoding.layout(lengths, max(max_new), cfg)
    settings, stops, max_new = settings + settings[:1] * pad, stops + stops[:1] * pad, max_new + max_new[:1] * pad
    seeds = [s.seed for s in settings]
    state = common.new_state(cfg, [np.asarray(r, np.int32) for r in rows], layout, max_new, settings=settings,
                             stop_ids=stops, seed=seeds, stream=np.zeros(len(rows)) if per_row else None,
                             active=active)
    fwd_cfg = decoding.attention_config(cfg)
    if placement is not None:
        state = placement.place_state(state)
    ctx = common.DecodeCtx(model=fwd_cfg, attn_impl=model.forward_impl, prefill_len=int(layout.prefill_len),
                           placement=placement)
    return Prepared(state=state, paradigm=decoding, ctx=ctx, prompts=ids, tokenizer=model.tokenizer,
                    clipped=inputs.clipped_rows(asked, settings[:n]))


def row_output(host: dict, b: int, prompt_ids, tokenizer=None, trace: dict | None = None) -> Output:
    """Row b of a finished state already on the host (numpy arrays "tokens", "step_map",
    "logprobs", "gen_start", "end", "nfe", "finish") as an Output: its slots [gen_start, end)."""
    g0 = int(host["gen_start"][b])
    e = max(int(host["end"][b]), g0)
    toks = host["tokens"][b, g0:e].tolist()
    return Output(token_ids=toks, text=None if tokenizer is None else tokenizer.decode(toks, skip_special_tokens=True),
                  step_map=host["step_map"][b, g0:e].tolist(), logprobs=host["logprobs"][b, g0:e].tolist(),
                  nfe=int(host["nfe"][b]), finish_reason=FINISH_REASONS[int(host["finish"][b])],
                  prompt_ids=list(prompt_ids), trace=trace or {})


def to_host(tree):
    """NumPy copies of a pytree of arrays; arrays spread over several processes (multi-host
    meshes) are gathered from all of them first."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(one, tree)


def trace_arrays(paradigm, extra):
    """The part of a state's `extra` that `paradigm.output_trace` reads (its `trace_keys`), to fetch
    to the host; None for a paradigm that keeps no trace."""
    if not paradigm.trace_keys:
        return None
    return {k: extra[k] for k in paradigm.trace_keys}


def outputs(prep: Prepared, state: DecodeState) -> list[Output]:
    """Final state -> one Output per real prompt (the row's end and finish reason come from the device)."""
    host = to_host({k: getattr(state, k) for k in
                    ("tokens", "step_map", "logprobs", "gen_start", "end", "nfe", "finish")})
    running = [b for b in range(len(prep.prompts)) if FINISH_REASONS[int(host["finish"][b])] is None]
    if running:
        raise errors.InputError(
            f"outputs() got a state whose rows {running} are still running: step until every row is done "
            "(state.done), then pass it through finalize (compiled_steps()['finalize']), which also ends "
            "rows the iteration guard stopped")
    extra = to_host(trace_arrays(prep.paradigm, state.extra))
    outs = []
    for b, prompt in enumerate(prep.prompts):
        out = row_output(host, b, prompt, prep.tokenizer, None if extra is None else prep.paradigm.output_trace(extra, b))
        reason = out.finish_reason
        if reason in ("abort", "invalid"):
            why = {"abort": "hit the iteration guard or the paradigm's forward budget before finishing",
                   "invalid": "reached a slot where no token could be drawn (a constraint that allows "
                              "nothing, or non-finite logits)"}[reason]
            warnings.warn(f"prompt {b} {why}: finish_reason={reason!r}, {len(out.token_ids)} tokens returned",
                          RuntimeWarning, stacklevel=3)
        outs.append(out)
    if prep.clipped:
        inputs.note_context_end(outs, prep.clipped, prep.ctx.model.max_position_embeddings)
    return outs


def params_for(model: Model, decoding):
    """The parameters the decode loop takes for this paradigm: the model's, plus what the paradigm
    binds to them (ar_spec's draft model: `decoding.bind_params`)."""
    params = decoding.bind_params(model.params)
    if params is not model.params and model.placement is not None:  # what the paradigm binds (a draft model) joins the mesh, replicated

        rep = model.placement.replicated()
        mesh_devices = set(model.placement.mesh.devices.flat)
        params = jax.tree.map(lambda x: x if getattr(x, "sharding", None) is not None
                              and set(x.sharding.device_set) == mesh_devices else put(x, rep), params)
    return params


__all__ = ["Output", "prepare", "outputs", "row_output", "trace_arrays", "Prepared",
           "params_for"]
