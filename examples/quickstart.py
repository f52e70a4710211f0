"""Quickstart: load the small models shipped in models/ and generate with them.

    python examples/quickstart.py [--models-dir models]

Each model was trained by examples/train_tiny.py on a synthetic task suite
(sorting digits, two-digit addition, reversing a word). The script decodes a
few held-out prompts with each paradigm that fits the model and prints the
answer, whether it is right, the forward passes used (NFE) and, for the
diffusion paradigms, which tokens were revealed together in one step.

The models are small and not perfect: on 300 held-out prompts tiny-ar answers
99.7%, tiny-sdar 96% and tiny-llada about 74% exactly (`training.json`), so a
few `BAD` rows, mostly tiny-llada's, are expected.
"""

from __future__ import annotations

import argparse
import os
import time

import jdllm
from jdllm import tasks
from jdllm.cli import quiet_transformers

HERE = os.path.dirname(os.path.abspath(__file__))


def show_steps(token_ids, step_map, tokenizer) -> str:
    """Group the answer's tokens by the step that revealed them: [1: 1 2][2: 3]..."""
    groups: dict[int, list[int]] = {}
    for t, s in zip(token_ids, step_map):
        groups.setdefault(s, []).append(t)
    return " ".join(f"[{s}:{tokenizer.decode(ids)!r}]" for s, ids in sorted(groups.items()))


def run(model_dir: str, decoding, label: str, examples) -> None:
    model = jdllm.load(model_dir, dtype="float32")
    prompts = [e.prompt for e in examples]
    sampling = jdllm.Sampling(temperature=0.0, max_new_tokens=12)
    t0 = time.perf_counter()
    outs = jdllm.generate(model, prompts, decoding=decoding, sampling=sampling,
                          apply_chat_template=False)
    dt = time.perf_counter() - t0
    right = sum(tasks.normalize(o.text) == e.answer for e, o in zip(examples, outs))
    print(f"\n== {label}: {os.path.basename(model_dir)} ({dt:.1f}s incl. compile; {right}/{len(outs)} right, "
          f"the model scores {_exact_match(model_dir)} on held-out prompts)")
    for e, o in zip(examples, outs):
        ok = "ok " if tasks.normalize(o.text) == e.answer else "BAD"
        line = f"  {ok} {e.prompt:<16} -> {o.text!r:<14} nfe={o.nfe:<3}"
        if label != "ar":
            line += " steps " + show_steps(o.token_ids, o.step_map, model.tokenizer)
        print(line)


def _exact_match(model_dir: str) -> str:
    import json  # noqa: PLC0415

    with open(os.path.join(model_dir, "training.json")) as f:
        acc = json.load(f)["eval_exact_match"]
    return "n/a (not evaluated)" if acc is None else f"{acc:.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", default=os.path.join(HERE, "..", "models"))
    ap.add_argument("-n", type=int, default=6, help="held-out prompts per model")
    args = ap.parse_args()
    quiet_transformers()
    examples = tasks.test_set(args.n, seed=0)
    d = args.models_dir
    run(os.path.join(d, "tiny-ar"), jdllm.AR(), "ar", examples)
    run(os.path.join(d, "tiny-sdar"),
        jdllm.BlockDiffusion(block_length=4, denoising_steps=4, strategy="low_confidence_dynamic",
                             confidence_threshold=0.9),
        "block_diffusion (low_confidence_dynamic)", examples)
    run(os.path.join(d, "tiny-sdar"), jdllm.MultiBlock(block_size=4),
        "multi_block", examples)
    run(os.path.join(d, "tiny-llada"),
        jdllm.MaskedDiffusion(steps=12, block_length=12, confidence_threshold=0.9, cache_mode="dual"),
        "masked_diffusion (Fast-dLLM threshold, dual cache)", examples)


if __name__ == "__main__":
    main()
