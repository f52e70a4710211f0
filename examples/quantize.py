"""Weight-only int8 / fp8: load a shipped model quantized, compare its logits and answers with
bfloat16, and write a quantized checkpoint that loads as it is.

    python examples/quantize.py [--models-dir models]

`jdllm.load(path, quantize="int8")` quantizes each matmul weight (and, by default, the
embedding and LM head) as it is read: one int8 / float8_e4m3fn value per weight and one
float32 scale per output channel; activations stay in `dtype`. `jdllm convert SRC DST
--quantize int8` stores the quantized weights, so loading DST never builds the bf16 ones.
`kv_cache="int8"` stores the KV cache in int8 too (a float32 scale per token and KV head: about
half a bf16 cache's bytes; on a GPU the attention kernels read it as int8 and scale on chip).
Runs on the CPU in a few seconds.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import numpy as np

import jdllm
from jdllm import quant, tasks
from jdllm.cli import quiet_transformers

HERE = os.path.dirname(os.path.abspath(__file__))


def megabytes(params) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", default=os.path.join(HERE, "..", "models"))
    args = ap.parse_args(argv)
    quiet_transformers()
    path = os.path.join(args.models_dir, "tiny-ar")
    prompts = [ex.prompt for ex in tasks.test_set(8, seed=1)]
    ids = [tasks.encode(ex.prompt + ex.answer) for ex in tasks.test_set(8, seed=1)]
    ref = None
    for scheme in (None, "int8", "fp8"):
        model = jdllm.load(path, dtype="bfloat16", quantize=scheme)
        logits = np.asarray(jdllm.logits(model, ids), np.float32)
        ref = logits if ref is None else ref
        err = np.linalg.norm(logits - ref) / np.linalg.norm(ref)
        same = (logits.argmax(-1) == ref.argmax(-1)).mean()
        print(f"{scheme or 'bfloat16':9s} weights {megabytes(model.params):.2f} MiB  logits rel. error vs bfloat16 "
              f"{err:.4f}  argmax agrees at {100 * same:.0f}% of positions")
    # an int8 KV cache beside the bfloat16 one, same weights and prompts
    texts = {}
    for kv in (None, "int8"):
        model = jdllm.load(path, dtype="bfloat16", kv_cache=kv)
        texts[kv] = [o.text for o in jdllm.generate(model, prompts, jdllm.AR(), jdllm.Sampling(max_new_tokens=12))]
    right = sum(tasks.is_correct(t, ex) for t, ex in zip(texts["int8"], tasks.test_set(8, seed=1)))
    same = sum(a == b for a, b in zip(texts["int8"], texts[None]))
    print(f"int8 KV cache: {right}/{len(prompts)} answers right, {same}/{len(prompts)} identical to the bfloat16 "
          f"cache's")
    # a quantized checkpoint: quantized slice by slice while converting, loaded as it is
    with tempfile.TemporaryDirectory() as tmp:
        from convert.io import convert_checkpoint  # noqa: PLC0415

        out = convert_checkpoint(path, os.path.join(tmp, "tiny-ar-int8"), quantize="int8", progress=False)
        model = jdllm.load(out)
        outs = jdllm.generate(model, prompts, jdllm.AR(), jdllm.Sampling(max_new_tokens=12))
        right = sum(tasks.is_correct(o.text, ex) for o, ex in zip(outs, tasks.test_set(8, seed=1)))
        print(f"{os.path.basename(out)} ({quant.describe(model.params)} checkpoint): {right}/{len(outs)} answers "
              f"right, e.g. {prompts[0]}{outs[0].text}")


if __name__ == "__main__":
    main()
