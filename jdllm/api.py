"""`generate()`: prompts in, one `Output` per prompt out.

Three layers, each usable on its own:

- `prepare(model, prompts, decoding, sampling)` checks the inputs (raising
  `jdllm.errors.*` before anything compiles), tokenizes, rounds the batch,
  prompt and generation lengths up to buckets and builds the initial
  `DecodeState` plus the static `DecodeCtx`;
- `decode(params, state, paradigm=..., ctx=...)` is the pure function (state in,
  state out: prefill + `lax.while_loop`) for use inside a user's own jit / vmap;
  `jdllm.decode.loop.decode` is the same, compiled with the state donated;
- `outputs(prepared, state)` turns the final state into `Output`s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jdllm import errors, inputs
from jdllm.decode import common, loop
from jdllm.loading import Model, check_token_ids
from jdllm.sampling import Sampling
from jdllm.state import FINISH_REASONS, DecodeState

decode = loop.run  # the pure lower-level function


@dataclasses.dataclass(frozen=True)
class Output:
    """One prompt's result. step_map[i] is the 1-based step that revealed token_ids[i];
    logprobs[i] its log-prob at reveal time; nfe the model forwards the row took part in
    (prefill and KV-commit passes included); finish_reason "stop" or "length".
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


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` builds: the initial state, the static context and how to read it back."""

    state: DecodeState
    paradigm: Any
    ctx: common.DecodeCtx
    prompts: list[list[int]]  # the real rows' prompt ids (batch padding excluded)
    tokenizer: Any = None


def default_paradigm(cfg):
    """AR for causal models, block diffusion for block-causal ones."""
    if cfg.attention == "causal":
        return loop.paradigm_class("ar")()
    if cfg.attention == "block_causal":
        return loop.paradigm_class("block_diffusion")(block_length=cfg.block_size)
    return loop.paradigm_class("masked_diffusion")()


def tokenize(model: Model, prompts, apply_chat_template: bool) -> list[list[int]]:
    """Text or token-id prompts -> a list of token-id lists."""
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


def prepare(model: Model, prompts, decoding=None, sampling: Sampling | None = None, *,
            apply_chat_template: bool = False) -> Prepared:
    """Check inputs and build the initial DecodeState and static context (nothing compiles)."""
    cfg = model.config
    sampling = Sampling() if sampling is None else sampling
    inputs.check_sampling(sampling)
    decoding = default_paradigm(cfg) if decoding is None else decoding
    if isinstance(decoding, type):
        raise errors.DecodingConfigError(
            f"decoding={decoding.__name__} is a class; pass an instance such as {decoding.__name__}()")
    if not hasattr(decoding, "layout") or not hasattr(decoding, "step"):
        raise errors.DecodingConfigError(
            f"decoding={decoding!r} is not a paradigm config; use one of jdllm.AR, jdllm.BlockDiffusion, "
            "jdllm.MultiBlock, jdllm.MaskedDiffusion")
    inputs.validate_paradigm(decoding, cfg)
    ids = tokenize(model, prompts, apply_chat_template)
    sampling = inputs.check_prompts(ids, cfg, sampling)
    for i, p in enumerate(ids):
        check_token_ids(np.asarray(p), cfg)
        total = len(p) + sampling.max_new_tokens
        if total > cfg.max_position_embeddings:
            raise errors.SequenceTooLongError(
                f"prompt {i} has {len(p)} tokens and max_new_tokens={sampling.max_new_tokens}: {total} > "
                f"the model's context max_position_embeddings={cfg.max_position_embeddings}; "
                "shorten the prompt or lower max_new_tokens")
    n = len(ids)
    rows = ids + [ids[0]] * (common.bucket(n) - n)  # batch padding rows copy prompt 0, inactive
    active = np.arange(len(rows)) < n
    lengths = np.array([len(r) for r in rows], np.int32)
    layout = decoding.layout(lengths, sampling.max_new_tokens, cfg)
    state = common.new_state(cfg, [np.asarray(r, np.int32) for r in rows], layout, sampling.max_new_tokens,
                             seed=sampling.seed, active=active, dtype=model.dtype)
    stop = cfg.eos_token_ids if sampling.stop_token_ids is None else sampling.stop_token_ids
    fwd_cfg = decoding.attention_config(cfg) if hasattr(decoding, "attention_config") else cfg
    ctx = common.DecodeCtx(model=fwd_cfg, attn_impl=model.attn_impl, temperature=float(sampling.temperature),
                           top_k=int(sampling.top_k), top_p=float(sampling.top_p), stop_ids=tuple(stop),
                           prefill_len=int(layout.prefill_len))
    return Prepared(state=state, paradigm=decoding, ctx=ctx, prompts=ids, tokenizer=model.tokenizer)


def row_ends(state: dict, stop_ids: tuple[int, ...]) -> np.ndarray:
    """Host-side mirror of `common.stop_end`: one past the last slot to return, per row."""
    tokens, revealed = state["tokens"], state["revealed"]
    B, S = tokens.shape
    s = np.arange(S)[None]
    gen = (s >= state["gen_start"][:, None]) & (s < state["limit"][:, None])
    hole = gen & ~revealed
    first_hole = np.where(hole, s, S).min(-1)
    is_stop = gen & revealed & np.isin(tokens, np.asarray(stop_ids, np.int64))
    first_stop = np.where(is_stop, s, S).min(-1)
    return np.where(first_stop < first_hole, first_stop + 1, np.minimum(first_hole, state["limit"]))


def outputs(prep: Prepared, state: DecodeState) -> list[Output]:
    """Final state -> one Output per real prompt."""
    host = jax.device_get({k: getattr(state, k) for k in
                           ("tokens", "revealed", "step_map", "logprobs", "gen_start", "limit", "nfe",
                            "finish")})
    ends = row_ends(host, prep.ctx.stop_ids)
    trace_fn = getattr(prep.paradigm, "output_trace", None)
    extra = jax.device_get(state.extra) if trace_fn is not None else None
    outs = []
    for b, prompt in enumerate(prep.prompts):
        g0, e = int(host["gen_start"][b]), int(ends[b])
        toks = [int(t) for t in host["tokens"][b, g0:e]]
        text = None
        if prep.tokenizer is not None:
            text = prep.tokenizer.decode(toks, skip_special_tokens=True)
        outs.append(Output(token_ids=toks, text=text,
                           step_map=[int(x) for x in host["step_map"][b, g0:e]],
                           logprobs=[float(x) for x in host["logprobs"][b, g0:e]],
                           nfe=int(host["nfe"][b]), finish_reason=FINISH_REASONS[int(host["finish"][b])],
                           prompt_ids=list(prompt),
                           trace=trace_fn(extra, b) if trace_fn is not None else {}))
    return outs


def generate(model: Model, prompts, decoding=None, sampling: Sampling | None = None, *,
             apply_chat_template: bool = False) -> list[Output]:
    """Generate for each prompt (text or token ids; rows of different lengths are fine).

    decoding: a paradigm config (jdllm.AR(), jdllm.BlockDiffusion(...), ...);
    default AR for causal models and BlockDiffusion(block_length=block_size)
    for block-causal ones. Runs prefill and every decoding step in one
    compiled call; a second call whose batch / prompt / generation lengths fall
    in the same buckets reuses the compile.
    """
    prep = prepare(model, prompts, decoding, sampling, apply_chat_template=apply_chat_template)
    final = loop.decode(model.params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx)
    return outputs(prep, final)


__all__ = ["generate", "Output", "prepare", "decode", "outputs", "Prepared"]
