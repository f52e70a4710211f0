"""The "dfa" constraint backend: regular constraints enforced inside the jitted decode loop.

    c = jdllm.constraints.regex(r"\\d( \\d)*", backend="dfa")
    out = jdllm.generate(model, ["sort:3 1 2="], decoding=jdllm.BlockDiffusion(), constraint=c)

A regex, a (non-recursive) JSON schema or a choice list is compiled on the host
into a token-level DFA over the model's vocabulary (`dfa_compile`), stacked
per row into device tables (`dfa_device.DFATables`) and carried in the decode
state; every paradigm's sampling masks the tokens that leave no completion
and its reveal keeps a step's tokens jointly completable
(`common.constrain_logits`, `common.write_tokens`). No host callback: the
constrained rollout is as pure as the free one (jit / vmap / while_loop).

    tables(model, constraints, state)   -> DFATables for a prepared state
    compile(model, constraint, stop_ids) -> TokenDFA (host numpy tables)
    generate(model, prompts, decoding, sampling, constraints, *, apply_chat_template)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jdllm import api, compile_progress
from jdllm.constraints.dfa_compile import TokenDFA, compile_pattern, regex_of, token_strings
from jdllm.constraints.dfa_device import DFATables, stack
from jdllm.decode import loop
from jdllm.errors import ConstraintError


def _strings(model) -> list:
    tok = model.tokenizer
    if tok is None:
        raise ConstraintError("the 'dfa' backend needs the model's tokenizer (token texts) to compile a constraint")
    cache = getattr(model, "_dfa_strings", None)
    if cache is None:
        cache = token_strings(tok, model.config.vocab_size)
        try:
            object.__setattr__(model, "_dfa_strings", cache)
        except (AttributeError, TypeError):
            pass
    return cache


def compile(model, constraint, stop_ids=None, max_states: int | None = None) -> TokenDFA:  # noqa: A001
    """A constraint -> token DFA over the model's vocabulary (stop_ids default: the model's EOS ids;
    max_states: ConstraintError past that many states, raised early for a DFA that blows up)."""
    if constraint.backend != "dfa":
        raise ConstraintError(f"constraint backend {constraint.backend!r} is not 'dfa'")
    stops = model.config.eos_token_ids if stop_ids is None else stop_ids
    return compile_pattern(regex_of(constraint.kind, constraint.source), _strings(model),
                           stop_ids=tuple(stops), mask_id=model.config.mask_token_id, max_states=max_states)


def check_budget(d: TokenDFA, budget: int, where: str = "", raise_what: str = "max_new_tokens") -> None:
    """ConstraintError when the DFA's shortest match needs more than `budget` tokens, or (no stop id
    allowed: the row runs to its budget) its longest match fewer (where: a prefix naming the row;
    raise_what: the option the caller's user sets)."""
    if d.min_tokens > budget:
        raise ConstraintError(f"{where}the constraint's shortest match takes {d.min_tokens} tokens but "
                              f"max_new_tokens={budget}; raise {raise_what}")
    if d.max_tokens is not None and d.max_tokens < budget:  # no stop id: a row ends only when it is full
        raise ConstraintError(f"{where}no stop token may end the row, so it must fill max_new_tokens={budget}, but the "
                              f"constraint's longest match takes {d.max_tokens} tokens; allow a stop token "
                              f"(stop_token_ids) or lower {raise_what}")


def output_ok(d: TokenDFA, out) -> bool:
    """`Output.constraint_ok`: the row ended normally ("stop" / "length") and the DFA accepts its tokens."""
    return bool(out.finish_reason in ("stop", "length") and d.accepts(out.token_ids))


def tables(model, constraints, state, budgets=None) -> DFATables:
    """Device tables for a prepared state's rows (constraints: one per real prompt; batch padding free).

    Each row's DFA uses that row's stop ids; a constraint whose shortest match
    needs more tokens than the row's budget raises ConstraintError here."""
    stop_rows = np.asarray(state.stop_ids)
    rows = []
    for b in range(state.batch):
        c = constraints[b] if b < len(constraints) else None
        if c is None:
            rows.append(None)
            continue
        d = compile(model, c, [int(t) for t in stop_rows[b] if t >= 0])
        if budgets is not None:
            check_budget(d, budgets[b], f"prompt {b}: ")
        rows.append(d)
    return stack(rows, model.config.vocab_size, slots=state.slots)


def generate_constrained(model, prompts, decoding, sampling, constraints, *, apply_chat_template=False):
    """Constrained generate(): same outputs as `jdllm.generate`, plus `constraint_ok` on constrained rows."""


    constraints = list(constraints)
    settings = api.row_settings(sampling, len(constraints))
    budgets = [s.max_new_tokens for s in settings]
    for b, (c, s) in enumerate(zip(constraints, settings)):  # errors before anything compiles
        if c is not None:
            stops = model.config.eos_token_ids if s.stop_token_ids is None else s.stop_token_ids
            check_budget(compile(model, c, stops), budgets[b], f"prompt {b}: ")
    prep = api.prepare(model, prompts, decoding, sampling, apply_chat_template=apply_chat_template)
    tab = tables(model, constraints, prep.state, budgets)
    state = prep.state.replace(constraint=tab)
    with compile_progress.watch(loop.compiled(), prep.paradigm.name, state, (prep.paradigm, prep.ctx)):
        final = loop.compiled()(api.params_for(model, prep.paradigm), state, paradigm=prep.paradigm, ctx=prep.ctx)
    outs = api.outputs(prep, final)
    res = []
    stop_rows = np.asarray(prep.state.stop_ids)
    for b, (o, c) in enumerate(zip(outs, constraints)):
        if c is None:
            res.append(o)
            continue
        d = compile(model, c, [int(t) for t in stop_rows[b] if t >= 0])
        res.append(dataclasses.replace(o, constraint_ok=output_ok(d, o)))
    return res


__all__ = ["compile", "tables", "generate_constrained", "check_budget", "output_ok", "TokenDFA", "DFATables"]
