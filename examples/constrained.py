"""Grammar-constrained generation with the llguidance backend: JSON schema, regex, Lark.

Every output of a constrained row is accepted by its constraint (or ends "length" with
`constraint_ok=False` when max_new_tokens runs out first). The shipped tiny models know
only `sort:` / `add:` / `rev:` prompts and a character vocabulary of lowercase letters,
digits and ` ()+,-.:=`, so the constraints below use those characters; the last one uses
models/tiny-json-ar, trained on the structured `json:` task (its alphabet has `{ } "`).

    python examples/constrained.py
"""

from __future__ import annotations

import os

import jdllm
from jdllm import constraints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ar = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    sampling = jdllm.Sampling(temperature=0.0, max_new_tokens=16)

    # JSON schema: the sum of two numbers in [0, 99] is an integer in [0, 198]
    schema = {"type": "integer", "minimum": 0, "maximum": 198}
    outs = jdllm.generate(ar, ["add:12+34=", "add:99+98="], sampling=sampling,
                          constraint=constraints.json_schema(schema))
    for o in outs:
        print(f"json_schema: {o.text!r:12} finish={o.finish_reason} constraint_ok={o.constraint_ok} nfe={o.nfe}")

    # one constraint per prompt (None = free); a forced literal is fast-forwarded (no forward of its own)
    outs = jdllm.generate(ar, ["sort:3 1 2=", "rev:abc=", "rev:abc="], sampling=sampling,
                          constraint=[constraints.regex(r"[0-9]( [0-9])*"),
                                      constraints.lark('start: "answer:" /[a-z]{3}/'), None])
    for o in outs:
        print(f"per row:     {o.text!r:12} finish={o.finish_reason} constraint_ok={o.constraint_ok} "
              f"tokens={len(o.token_ids)} nfe={o.nfe}")

    # block diffusion: tokens revealed out of order are checked left to right; rejected ones are re-masked
    sdar = jdllm.load(os.path.join(ROOT, "models", "tiny-sdar"), dtype="float32")
    outs = jdllm.generate(sdar, ["add:5+7=", "sort:4 2 3="], jdllm.BlockDiffusion(block_length=4), sampling,
                          constraint=[constraints.json_schema(schema), constraints.choice(["2 3 4", "4 3 2"])])
    for o in outs:
        print(f"sdar:        {o.text!r:12} finish={o.finish_reason} constraint_ok={o.constraint_ok} "
              f"step_map={o.step_map}")

    # speculative AR: the verification slots are masked from the drafts (one parallel llguidance call)
    outs = jdllm.generate(ar, ["rev:abcd=", "sort:5 3 4="], jdllm.Speculative(num_draft_tokens=3), sampling,
                          constraint=[constraints.regex("[a-d]{3,5}"), constraints.regex(r"[0-9]( [0-9])*")])
    for o in outs:
        print(f"ar_spec:     {o.text!r:12} finish={o.finish_reason} constraint_ok={o.constraint_ok} nfe={o.nfe} "
              f"drafts accepted={o.trace['drafts_accepted']}")

    # masked diffusion (LLaDA layout): the same out-of-order rule as block diffusion
    llada = jdllm.load(os.path.join(ROOT, "models", "tiny-llada"), dtype="float32")
    outs = jdllm.generate(llada, ["add:5+7=", "rev:abc="], jdllm.MaskedDiffusion(block_length=4, steps=8),
                          sampling, constraint=[constraints.json_schema(schema), constraints.regex("[a-c]{3}")])
    for o in outs:
        print(f"llada:       {o.text!r:12} finish={o.finish_reason} constraint_ok={o.constraint_ok} "
              f"step_map={o.step_map}")

    # the structured task: a model trained on json: prompts, under the task's JSON schema
    from jdllm import tasks

    jm = jdllm.load(os.path.join(ROOT, "models", "tiny-json-ar"), dtype="float32")
    outs = jdllm.generate(jm, ["json:abc 7=", "json:xy 42="],
                          sampling=jdllm.Sampling(temperature=1.0, max_new_tokens=24),
                          constraint=constraints.json_schema(tasks.JSON_SCHEMA))
    for o in outs:
        print(f"json task:   {o.text!r:22} finish={o.finish_reason} constraint_ok={o.constraint_ok} nfe={o.nfe}")

    # the same schema on the block-diffusion json model with multi_block (several blocks in flight)
    js = jdllm.load(os.path.join(ROOT, "models", "tiny-json-sdar"), dtype="float32")
    outs = jdllm.generate(js, ["json:abc 7=", "json:xy 42="], jdllm.MultiBlock(block_size=4),
                          jdllm.Sampling(temperature=1.0, max_new_tokens=24),
                          constraint=constraints.json_schema(tasks.JSON_SCHEMA))
    for o in outs:
        print(f"multi_block: {o.text!r:22} finish={o.finish_reason} constraint_ok={o.constraint_ok} nfe={o.nfe}")


if __name__ == "__main__":
    main()
