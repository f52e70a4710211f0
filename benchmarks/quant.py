"""Weight-only quantization (issue 29): quality on the shipped models, logits' error, CPU speed.

Quality: each shipped tiny model (models/) in bfloat16, then int8 and fp8 weights (bfloat16
activations), exact-match accuracy on the held-out set of `jdllm.tasks` for AR (tiny-ar),
block_diffusion and multi_block (tiny-sdar) and masked_diffusion and multi_block (tiny-llada),
greedy; float32 (the models' own dtype) as the reference row. `agree` = the share of items whose
output equals bfloat16's token for token.

Logits: relative error ||l_q - l_ref|| / ||l_ref|| of the full-sequence logits over the held-out
prompts + answers, against bfloat16 and against float32.

Speed (CPU): AR decode at batch 1 on a random Qwen3-shaped model large enough that weights
dominate (hidden 512, 8 layers, MLP 1536, vocabulary 8192: 34M parameters), bfloat16 vs int8 vs
fp8 weights, best of `--repeats` after a compile run.

    python benchmarks/quant.py                # writes benchmarks/quant.json, prints markdown
    python benchmarks/quant.py --n 64 --no-speed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jdllm  # noqa: E402
from jdllm import quant, tasks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMES = [("float32", None, None), ("bfloat16", None, None), ("bfloat16", "int8", None), ("bfloat16", "fp8", None),
           ("bfloat16", "int8", "int8"), ("bfloat16", "int4/32", None)]  # (activation dtype, weights, KV cache)
PARADIGMS = {
    "tiny-ar": [("ar", lambda: jdllm.AR())],
    "tiny-sdar": [("block_diffusion", lambda: jdllm.BlockDiffusion(block_length=4, denoising_steps=4,
                                                                   strategy="low_confidence_dynamic",
                                                                   confidence_threshold=0.9)),
                  ("multi_block", lambda: jdllm.MultiBlock(block_size=4, entropy_threshold=0.5))],
    "tiny-llada": [("masked_diffusion", lambda: jdllm.MaskedDiffusion(gen_length=12, block_length=4, steps=12)),
                   ("multi_block", lambda: jdllm.MultiBlock(block_size=4, entropy_threshold=0.5))],
}


def as_quantization(scheme):
    """"int4/32" -> int4 with groups of 32 (the tiny models' head_dim is 32); others as they are."""
    if scheme and "/" in scheme:
        name, group = scheme.split("/")
        return jdllm.Quantization(name, group_size=int(group))
    return scheme


def label(dtype, scheme, kv=None):
    return (scheme or dtype) + ("+kv8" if kv else "")


def quality(n: int, seed: int, log=print) -> tuple[list[dict], list[dict]]:
    examples = tasks.test_set(n, seed)
    prompts = [ex.prompt for ex in examples]
    gen = tasks.max_new_tokens(tasks.TASKS)
    acc_rows, err_rows = [], []
    for name, paradigms in PARADIGMS.items():
        path = os.path.join(ROOT, "models", name)
        models = {label(d, s, kv): jdllm.load(path, dtype=d, quantize=as_quantization(s), kv_cache=kv)
                  for d, s, kv in SCHEMES}
        full = [tasks.encode(ex.prompt + ex.answer) for ex in examples[:64]]
        L = max(len(r) for r in full)
        full = [r + [0] * (L - len(r)) for r in full]  # right-padded: every row sees its own prefix
        logits = {k: np.asarray(jdllm.logits(m, full), np.float32) for k, m in models.items()
                  if not k.endswith("+kv8")}  # full-sequence logits use no KV cache
        for k in logits:
            if k in ("float32",):
                continue
            err_rows.append({"model": name, "scheme": k,
                             "rel_err_vs_bf16": float(np.linalg.norm(logits[k] - logits["bfloat16"])
                                                      / np.linalg.norm(logits["bfloat16"])),
                             "rel_err_vs_f32": float(np.linalg.norm(logits[k] - logits["float32"])
                                                     / np.linalg.norm(logits["float32"]))})
            log(f"{name} {k}: logits rel err vs bf16 {err_rows[-1]['rel_err_vs_bf16']:.4f}, "
                f"vs f32 {err_rows[-1]['rel_err_vs_f32']:.4f}")
        for pname, make in paradigms:
            outs = {}
            for k, m in models.items():
                sampling = jdllm.Sampling(max_new_tokens=gen)
                res = []
                for i in range(0, len(prompts), 128):
                    res += jdllm.generate(m, prompts[i:i + 128], make(), sampling)
                outs[k] = res
            for k, res in outs.items():
                preds = [tasks.decode(o.token_ids) for o in res]
                agree = np.mean([a.token_ids == b.token_ids for a, b in zip(res, outs["bfloat16"])])
                acc_rows.append({"model": name, "paradigm": pname, "scheme": k,
                                 "accuracy": 100.0 * tasks.exact_match(preds, examples),
                                 "agree_with_bf16": 100.0 * float(agree)})
                log(f"{name} {pname} {k}: acc {acc_rows[-1]['accuracy']:.1f}%  agree {acc_rows[-1]['agree_with_bf16']:.1f}%")
    return acc_rows, err_rows


def speed(repeats: int, new: int, log=print) -> list[dict]:
    cfg = jdllm.ModelConfig(model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536,
                            num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, qk_norm=True,
                            max_position_embeddings=512, eos_token_ids=())
    base = jdllm.Model.random(cfg, seed=0, dtype=jnp.bfloat16, attn_impl="xla")
    rows = []
    for scheme, kv in ((None, None), ("int8", None), ("fp8", None), ("int8", "int8"), ("int4/64", None)):
        c = cfg.replace(kv_cache_dtype=kv)
        m = base if scheme is None else jdllm.Model(c, quant.quantize_params(base.params, as_quantization(scheme)),
                                                    attn_impl="xla")
        nbytes = sum(x.nbytes for x in jax.tree.leaves(m.params))
        prompt = [[int(t) for t in np.arange(1, 33)]]
        sampling = jdllm.Sampling(max_new_tokens=new)
        jdllm.generate(m, prompt, jdllm.AR(), sampling)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = jdllm.generate(m, prompt, jdllm.AR(), sampling)
            best = min(best, time.perf_counter() - t0)
        rows.append({"weights": label("bfloat16", scheme, kv), "param_mb": nbytes / 2**20, "tokens": len(out[0].token_ids),
                     "tokens_per_s": len(out[0].token_ids) / best, "ms_per_token": 1e3 * best / len(out[0].token_ids)})
        log(f"speed {rows[-1]['weights']}: {rows[-1]['param_mb']:.1f} MiB, {rows[-1]['tokens_per_s']:.1f} tok/s")
    return rows


def markdown(result: dict) -> str:
    lines = [f"{result['items']} held-out items of `jdllm.tasks` (seed {result['seed']}), greedy, {result['machine']}; "
             "int8 / fp8 = weight-only, one scale per output channel, bfloat16 activations; agree = outputs "
             "identical to bfloat16's.", "",
             "| model | paradigm | float32 | bfloat16 | int8 (agree) | fp8 (agree) | int8 + int8 KV (agree) | int4/32 (agree) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    keyed = {(r["model"], r["paradigm"], r["scheme"]): r for r in result["accuracy"]}
    for (m, p) in dict.fromkeys((r["model"], r["paradigm"]) for r in result["accuracy"]):
        a = {s: keyed[(m, p, s)] for s in ("float32", "bfloat16", "int8", "fp8", "int8+kv8", "int4/32")}
        lines.append(f"| {m} | {p} | {a['float32']['accuracy']:.1f} | {a['bfloat16']['accuracy']:.1f} | "
                     f"{a['int8']['accuracy']:.1f} ({a['int8']['agree_with_bf16']:.0f}%) | "
                     f"{a['fp8']['accuracy']:.1f} ({a['fp8']['agree_with_bf16']:.0f}%) | "
                     f"{a['int8+kv8']['accuracy']:.1f} ({a['int8+kv8']['agree_with_bf16']:.0f}%) | "
                     f"{a['int4/32']['accuracy']:.1f} ({a['int4/32']['agree_with_bf16']:.0f}%) |")
    lines += ["", "Logits' relative error (64 prompts + answers, full sequence):", "",
              "| model | weights | vs bfloat16 | vs float32 |", "|---|---|---:|---:|"]
    for r in result["logits"]:
        lines.append(f"| {r['model']} | {r['scheme']} | {r['rel_err_vs_bf16']:.4f} | {r['rel_err_vs_f32']:.4f} |")
    if result.get("speed"):
        lines += ["", "AR decode, batch 1, random 34M-parameter Qwen3 shape, bfloat16 activations:", "",
                  "| weights | MiB | tok/s | ms/token |", "|---|---:|---:|---:|"]
        for r in result["speed"]:
            lines.append(f"| {r['weights']} | {r['param_mb']:.1f} | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--machine", default=f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "quant.json"))
    args = ap.parse_args(argv)
    result = {"items": args.n, "seed": args.seed, "machine": args.machine, "accuracy": [], "logits": []}
    if not args.no_quality:
        result["accuracy"], result["logits"] = quality(args.n, args.seed)
    if not args.no_speed:
        result["speed"] = speed(args.repeats, args.new)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result) if result["accuracy"] else json.dumps(result.get("speed"), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
