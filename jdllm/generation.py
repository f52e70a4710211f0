"""`jdllm.generate`: prompts in, one `Output` per prompt out, constrained or free.

The one entry point above the two ways a call runs: the free path (`jdllm.api.prepare`, then
the one-jit decode loop, then `api.outputs`) and a constraint backend (`jdllm.constraints`:
llguidance on the host or the on-device DFA), which are built from the same `api` pieces.
"""

from __future__ import annotations

from jdllm import compile_progress, constraints
from jdllm.api import Output, outputs, params_for, prepare, tokenize
from jdllm.decode import loop
from jdllm.loading import Model
from jdllm.sampling import Sampling


def generate(model: Model, prompts, decoding=None, sampling: Sampling | list[Sampling] | None = None, *,
             apply_chat_template: bool = False, constraint=None) -> list[Output]:
    """Generate for each prompt (text or token ids; rows of different lengths are fine).

    sampling: one `jdllm.Sampling` for all prompts or a list with one per
    prompt (rows may differ in temperature, top-k/p, stop ids, seed and, for
    AR / block diffusion, max_new_tokens).

    decoding: a paradigm config (jdllm.AR(), jdllm.BlockDiffusion(...), ...);
    default AR for causal models and BlockDiffusion(block_length=block_size)
    for block-causal ones. Runs prefill and every decoding step in one
    compiled call; a second call whose batch / prompt / generation lengths fall
    in the same buckets reuses the compile.

    constraint: a `jdllm.constraints` constraint for every prompt, or a list with one
    per prompt (None = free); constrained calls go to the constraint's backend.
    """
    if constraint is not None:  # one Constraint | None per prompt; all None = the free path below
        rows = constraints.per_row(constraint, len(tokenize(model, prompts, apply_chat_template)))
        if any(c is not None for c in rows):
            return constraints.backend_module(rows).generate_constrained(model, prompts, decoding, sampling, rows,
                                                             apply_chat_template=apply_chat_template)
    prep = prepare(model, prompts, decoding, sampling, apply_chat_template=apply_chat_template)
    run = loop.compiled()
    with compile_progress.watch(run, prep.paradigm.name, prep.state, (prep.paradigm, prep.ctx)):
        final = run(params_for(model, prep.paradigm), prep.state, paradigm=prep.paradigm, ctx=prep.ctx)
    return outputs(prep, final)


__all__ = ["generate"]
