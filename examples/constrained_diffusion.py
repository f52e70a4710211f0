"""Regular constraints on a diffusion model, enforced on the device (`backend="dfa"`).

    python examples/constrained_diffusion.py                         # models/tiny-sdar, block diffusion
    python examples/constrained_diffusion.py --regex "[a-c]+ \\d\\d?" --temperature 1.0
    python examples/constrained_diffusion.py --paradigm masked       # models/tiny-llada

The shipped models answer `sort:` / `add:` / `rev:` prompts (models/README.md).
Here every answer is forced into one format whatever the task, e.g. digits
separated by spaces for a `rev:` prompt, while the model still reveals several
tokens per step, out of order. The script prints each answer, whether it
matches, the forward passes it took and which tokens were revealed together,
then the same prompts unconstrained for comparison.
"""

from __future__ import annotations

import argparse
import os
import re

import jdllm
from jdllm.cli import quiet_transformers

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regex", default=r"\d( \d)*")
    ap.add_argument("--paradigm", choices=("block", "masked"), default="block")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    a = ap.parse_args()
    quiet_transformers()
    if a.paradigm == "block":
        model = jdllm.load(os.path.join(MODELS, "tiny-sdar"), dtype="float32")
        decoding = jdllm.BlockDiffusion(block_length=4)
    else:
        model = jdllm.load(os.path.join(MODELS, "tiny-llada"), dtype="float32")
        decoding = jdllm.MaskedDiffusion(block_length=4, steps=a.max_new_tokens // 2)
    prompts = ["sort:3 1 2=", "add:12+34=", "rev:abc=", "sort:9 0 5 5="]
    sampling = jdllm.Sampling(max_new_tokens=a.max_new_tokens, temperature=a.temperature)
    constraint = jdllm.constraints.regex(a.regex, backend="dfa")
    for label, c in ((f"constrained to {a.regex!r}", constraint), ("unconstrained", None)):
        print(f"\n{label}:")
        outs = jdllm.generate(model, prompts, decoding, sampling, constraint=c)
        for p, o in zip(prompts, outs):
            ok = re.fullmatch(a.regex, o.text or "") is not None
            print(f"  {p:16s} -> {o.text!r:14s} matches={ok!s:5s} finish={o.finish_reason:6s} "
                  f"nfe={o.nfe:2d} step_map={o.step_map}")


if __name__ == "__main__":
    main()
