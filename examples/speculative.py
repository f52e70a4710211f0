"""Speculative decoding (`jdllm.Speculative`, paradigm `ar_spec`) with the shipped tiny models.

    python examples/speculative.py [--models-dir models]

The target is models/tiny-ar. Two proposers draft tokens that the target then
verifies in one forward per step:

- prompt lookup: the continuation of the longest recent n-gram match in the
  row's own prompt + output (no second model);
- a draft model: models/tiny-ar-draft (1 layer, hidden 64, same tokenizer).

Greedy output is identical to plain AR token for token; what changes is how
many target forwards it takes (NFE) and how many tokens each step accepted
(`step_map`: tokens verified together share a step number). `Output.trace`
reports the drafts proposed and accepted. With temperature > 0 the output
follows the target's own sampling distribution exactly.
"""

from __future__ import annotations

import argparse
import os

import jdllm

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", default=os.path.join(os.path.dirname(HERE), "models"))
    args = ap.parse_args(argv)
    target = jdllm.load(os.path.join(args.models_dir, "tiny-ar"), dtype="float32")
    draft = jdllm.load(os.path.join(args.models_dir, "tiny-ar-draft"), dtype="float32")
    prompts = ["rev:drafts=", "sort:9 3 7 1 5=", "add:47+38="]
    greedy = jdllm.Sampling(max_new_tokens=12)

    ar = jdllm.generate(target, prompts, jdllm.AR(), greedy)
    for label, decoding in (
            ("prompt lookup", jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=4)),
            ("draft model", jdllm.Speculative(proposer="draft_model", draft=draft, num_draft_tokens=4))):
        outs = jdllm.generate(target, prompts, decoding, greedy)
        print(f"== {label}")
        for p, o, a in zip(prompts, outs, ar):
            groups: dict[int, list[int]] = {}
            for t, s in zip(o.token_ids, o.step_map):
                groups.setdefault(s, []).append(t)
            steps = " ".join(f"[{target.tokenizer.decode(ids)!r}]" for _, ids in sorted(groups.items()))
            t = o.trace
            print(f"{p:18s} -> {o.text!r:12s} same as AR: {o.token_ids == a.token_ids}  "
                  f"NFE {o.nfe} (AR {a.nfe})  drafts accepted {t['drafts_accepted']}/{t['drafts_proposed']}")
            print(f"{'':18s}    steps: {steps}")
        assert [o.token_ids for o in outs] == [a.token_ids for a in ar]

    sampled = jdllm.generate(target, prompts, jdllm.Speculative(draft=draft),
                             jdllm.Sampling(temperature=0.8, max_new_tokens=12, seed=1))
    print("== sampled (temperature 0.8), draft model:", [o.text for o in sampled])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
