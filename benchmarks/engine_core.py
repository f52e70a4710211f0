"""Peak memory and wall time of a whole decode on a realistic vocabulary, before/after a change.

The engine computes the LM head only at the slots a step chooses tokens for.
This benchmark measures what that buys on a Qwen-sized vocabulary (151936)
with hidden 1024, a 1024-token prompt and a short generation, per paradigm:

- peak memory: XLA's own accounting of the compiled decode
  (`compiled.memory_analysis()`: temporary buffers + arguments + outputs), a
  deterministic figure on any backend;
- time: wall time of the whole decode (compile excluded), median of
  `--repeats` runs.

Side by side with another checkout (`--baseline DIR`, e.g. the commit before
the change): each configuration runs in a subprocess per tree, the two trees
interleaved, same weights (same seed, same init code), tokens compared.

    python benchmarks/engine_core.py                       # this tree only
    python benchmarks/engine_core.py --baseline /tmp/base  # before / after table
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = ("ar", "block_diffusion", "masked_diffusion", "multi_block")


def worker(args) -> dict:
    """Run one case in this process with the jdllm found on sys.path; print a JSON record."""
    sys.path.insert(0, args.root)
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.api import outputs, prepare  # noqa: PLC0415
    from jdllm.config import ModelConfig  # noqa: PLC0415
    from jdllm.decode import loop  # noqa: PLC0415
    from jdllm.model import init_params  # noqa: PLC0415

    V, D = args.vocab, args.hidden
    kind = {"ar": "causal", "block_diffusion": "block_causal", "multi_block": "block_causal",
            "masked_diffusion": "bidirectional"}[args.case]
    cfg = ModelConfig(model_type="bench", vocab_size=V, hidden_size=D, intermediate_size=3 * D,
                      num_layers=args.layers, num_heads=D // 128, num_kv_heads=max(1, D // 256), head_dim=128,
                      qk_norm=True, attention=kind, block_size=args.block,
                      mask_token_id=None if kind == "causal" else V - 1,
                      max_position_embeddings=4 * (args.prompt + args.new), eos_token_ids=())
    model = jdllm.Model(cfg, init_params(cfg, jax.random.key(0)), attn_impl="xla")
    rng = np.random.default_rng(0)
    batch = args.batch if args.case == "ar" else 1
    prompts = [rng.integers(0, V - 2, args.prompt).tolist() for _ in range(batch)]
    decoding = {"ar": jdllm.AR(),
                "block_diffusion": jdllm.BlockDiffusion(block_length=args.block, denoising_steps=4,
                                                        strategy="low_confidence_static"),
                "masked_diffusion": jdllm.MaskedDiffusion(gen_length=args.new, block_length=args.block,
                                                          steps=4 * (args.new // args.block)),
                "multi_block": jdllm.MultiBlock(block_size=args.block, entropy_threshold=100.0)}[args.case]
    sampling = jdllm.Sampling(max_new_tokens=args.new, stop_token_ids=())
    prep = prepare(model, prompts, decoding, sampling)
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)
    fresh = lambda: prepare(model, prompts, decoding, sampling).state  # noqa: E731 (old trees donate it)
    compiled = loop.compiled().lower(model.params, fresh(), **kw).compile()
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
                   - getattr(mem, "alias_size_in_bytes", 0))
    times, final = [], None
    for _ in range(args.repeats):
        st = fresh()
        t = time.perf_counter()
        final = loop.compiled()(model.params, st, **kw)
        jax.block_until_ready(final.tokens)
        times.append(time.perf_counter() - t)
    outs = outputs(prep, final)
    return dict(case=args.case, batch=batch, peak_bytes=peak,
                temp_bytes=None if mem is None else int(mem.temp_size_in_bytes),
                seconds=statistics.median(times), tokens=[o.token_ids for o in outs],
                nfe=[o.nfe for o in outs])


def run_tree(root: str, case: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--root", root, "--case", case,
           "--repeats", str(args.repeats), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--prompt", str(args.prompt), "--new", str(args.new),
           "--block", str(args.block), "--batch", str(args.batch)]
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"worker failed ({root}, {case}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another checkout to compare with (run interleaved)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="AR batch (the diffusion rows use batch 1)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "engine_core.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--case", default="ar", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    trees = [("after", ROOT)] + ([("before", os.path.abspath(args.baseline))] if args.baseline else [])
    rows = []
    for case in args.cases:
        rec = {}
        for label, root in (trees if len(rows) % 2 == 0 else trees[::-1]):  # alternate the order
            print(f"[{case}] {label} ({root}) ...", file=sys.stderr, flush=True)
            rec[label] = run_tree(root, case, args)
        if "before" in rec:
            rec["same_tokens"] = rec["before"]["tokens"] == rec["after"]["tokens"]
            rec["same_nfe"] = rec["before"]["nfe"] == rec["after"]["nfe"]
        rows.append(dict(case=case, **rec))

    mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.0f}"  # noqa: E731
    print(f"\nvocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, prompt {args.prompt}, "
          f"new {args.new}, block {args.block}; float32, XLA attention; {platform.machine()}, "
          f"{os.cpu_count()} cores; median of {args.repeats}")
    head = "| paradigm | batch | peak MiB after |" + (" peak MiB before | s before | " if args.baseline else " ") \
        + "s after |" + (" same tokens / NFE |" if args.baseline else "")
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for r in rows:
        a = r["after"]
        line = f"| {r['case']} | {a['batch']} | {mib(a['peak_bytes'])} |"
        if "before" in r:
            b = r["before"]
            line += f" {mib(b['peak_bytes'])} | {b['seconds']:.2f} |"
        line += f" {a['seconds']:.2f} |"
        if "before" in r:
            line += f" {r['same_tokens']} / {r['same_nfe']} |"
        print(line)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
