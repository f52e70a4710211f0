"""Scoring text with a causal model: multiple choice by log-likelihood, as evaluation harnesses do.

`jdllm.score` runs one teacher-forced forward per batch of rows and returns, per token, its
log-prob given the tokens before it and the most likely alternatives there. Each candidate answer
is scored after its question; the candidate whose tokens have the highest summed log-prob wins,
and `is_greedy` says whether greedy decoding would have produced it. Each sum is checked against
the log-softmax of `jdllm.logits` (the full [B, T, V] logits, a separate forward).

The server gives the same through OpenAI's `echo` with `logprobs` (lm-evaluation-harness'
`local-completions` loglikelihood requests); see the README's "Scoring" section.

    python examples/score.py
"""

from __future__ import annotations

import os

import jax
import numpy as np

import jdllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = {"sort:3 1 2=": ["1 2 3", "3 2 1", "2 1 3"], "rev:abc=": ["cba", "abc", "bca"]}


def main() -> None:
    model = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    enc = lambda s: model.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    for question, answers in QUESTIONS.items():
        ctx = enc(question)
        rows = [ctx + enc(a) for a in answers]
        scores = jdllm.score(model, rows, top_logprobs=1)  # one forward for the three rows
        sums = [float(np.sum(s.logprobs[len(ctx):])) for s in scores]
        for a, row, s, total in zip(answers, rows, scores, sums):
            logp = jax.nn.log_softmax(jdllm.logits(model, [row])[0], axis=-1)
            ref = float(sum(logp[t - 1, row[t]] for t in range(len(ctx), len(row))))
            print(f"  {question!r} + {a!r}: log-likelihood {total:9.4f}, greedy {s.is_greedy(begin=len(ctx))}; "
                  f"same as logits(): {abs(ref - total) < 1e-3}")
        print(f"{question!r} -> {answers[int(np.argmax(sums))]!r}")


if __name__ == "__main__":
    main()
