"""lm-evaluation-harness on the shipped models: multiple choice by log-likelihood and generation.

Writes two tiny tasks (sorting three digits: pick the sorted answer among three; write it) as
lm-eval YAML over local JSONL files, then runs the harness' own evaluator on the `jdllm` model
type: the multiple-choice task on tiny-ar (exact log-likelihoods), tiny-llada (LLaDA's Monte
Carlo ELBO) and tiny-sdar (its block-diffusion form), the generation task on tiny-sdar (block diffusion) and tiny-llada (masked
diffusion). The same from the command line:

    python -m jdllm.evaluation --model jdllm --model_args path=models/tiny-llada,mc_samples=32 \\
        --tasks sort_mc --include_path DIR

    pip install -e ".[eval]" && python examples/evaluate.py
"""

from __future__ import annotations

import json
import os
import random
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import jdllm  # noqa: E402
from jdllm.evaluation import JdllmLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tasks(d: str, n: int = 12) -> None:
    rng = random.Random(0)
    with open(os.path.join(d, "sort.jsonl"), "w") as f:
        for _ in range(n):
            xs = rng.sample(range(1, 10), 3)
            right, backwards, given = (" ".join(map(str, v)) for v in (sorted(xs), sorted(xs, reverse=True), xs))
            f.write(json.dumps({"q": f"sort:{given}=", "choices": [right, backwards, given], "label": 0}) + "\n")
    data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {os.path.join(d, 'sort.jsonl')}\ntest_split: test\n"
    with open(os.path.join(d, "sort_mc.yaml"), "w") as f:
        f.write("task: sort_mc\n" + data + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
                "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\ntarget_delimiter: ''\n"
                "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    with open(os.path.join(d, "sort_gen.yaml"), "w") as f:
        f.write("task: sort_gen\n" + data + "output_type: generate_until\ndoc_to_text: '{{q}}'\n"
                "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: ['<eos>']\n  max_gen_toks: 8\n"
                "  do_sample: false\nfilter_list:\n  - name: strip\n    filter:\n      - function: regex\n"
                "        regex_pattern: '^(\\d \\d \\d)'\n      - function: take_first\n"
                "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        write_tasks(d)
        tasks = TaskManager(include_path=d)
        runs = [("tiny-ar", "sort_mc", {}), ("tiny-llada", "sort_mc", {"mc_samples": 32, "mc_batch": 16}),
                ("tiny-sdar", "sort_mc", {"mc_samples": 32, "mc_batch": 16}),
                ("tiny-sdar", "sort_gen", {"paradigm": "block_diffusion", "denoising_steps": 2}),
                ("tiny-llada", "sort_gen", {"paradigm": "masked_diffusion", "steps": 8})]
        for name, task, kw in runs:
            model = jdllm.load(os.path.join(ROOT, "models", name), dtype="float32")
            res = lm_eval.simple_evaluate(model=JdllmLM(model=model, **kw), tasks=[task], task_manager=tasks,
                                          bootstrap_iters=0, verbosity="ERROR")
            metric = "acc" if task == "sort_mc" else "exact_match"
            value = res["results"][task][f"{metric},{'none' if task == 'sort_mc' else 'strip'}"]
            print(f"{name:10s} {task:8s} {metric} {value:.2f}  ({', '.join(f'{k}={v}' for k, v in kw.items())})")


if __name__ == "__main__":
    main()
