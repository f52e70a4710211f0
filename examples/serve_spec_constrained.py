"""Serving speculative AR decoding and constrained requests (no HTTP).

1. `ar_spec` with the shipped draft model: requests join a running pool at any round, each row
   carrying its own draft KV cache; every answer equals `jdllm.generate` alone, with the same
   drafts proposed / accepted (`Output.trace`).
2. Constraints on the device: an engine built with `constraint_states` holds a token-DFA table per
   row, so constrained and free requests decode side by side in one compiled step
   (block diffusion on tiny-sdar); `constraint_ok` says the whole answer matches.

    python examples/serve_spec_constrained.py
"""

from __future__ import annotations

import os

import jdllm
from jdllm import constraints
from jdllm.serve import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    target = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"))
    spec = jdllm.Speculative(draft=os.path.join(ROOT, "models", "tiny-ar-draft"), num_draft_tokens=4)
    engine = Engine(target, spec, max_batch=2, max_prompt_tokens=16, max_new_tokens=12, steps_per_round=1)
    tok, s = target.tokenizer, jdllm.Sampling(max_new_tokens=12)
    prompts = ["sort:3 1 2=", "add:12+34=", "rev:abcd="]
    reqs = []
    for p in prompts:  # one arrival per round
        reqs.append(engine.submit(tok.encode(p, add_special_tokens=False), s))
        engine.step_round()
    engine.run_until_idle()
    for p, r in zip(prompts, reqs):
        alone = jdllm.generate(target, [p], spec, s)[0]
        print(f"ar_spec {p!r} -> {r.output.text!r} {r.output.trace}; same as alone: "
              f"{(r.output.token_ids, r.output.trace) == (alone.token_ids, alone.trace)}")

    model = jdllm.load(os.path.join(ROOT, "models", "tiny-sdar"))
    par = jdllm.BlockDiffusion(block_length=4)
    engine = Engine(model, par, max_batch=2, max_prompt_tokens=16, max_new_tokens=12, constraint_states=16,
                    constraint_classes=16)
    cases = [("sort:3 1 2=", None), ("sort:3 1 2=", constraints.regex("[a-c]+", backend="dfa")),
             ("add:12+34=", constraints.json_schema({"type": "integer", "minimum": 50}, backend="dfa"))]
    reqs = [engine.submit(model.tokenizer.encode(p, add_special_tokens=False), s, constraint=c) for p, c in cases]
    engine.run_until_idle()
    for (p, c), r in zip(cases, reqs):
        alone = jdllm.generate(model, [p], par, s, constraint=c)[0]
        print(f"{'free' if c is None else c.kind:11s} {p!r} -> {r.output.text!r} (constraint_ok "
              f"{r.output.constraint_ok}); same as alone: {r.output.token_ids == alone.token_ids}")


if __name__ == "__main__":
    main()
