"""multi_block's approximate KV caches on the shipped bidirectional model (models/tiny-llada).

cache_mode="approx" (d3LLM's delayed prefix cache) at several cache_delay_iter, and cache_mode="window"
(jdllm's windowed variant), against cache_mode="none" on the held-out task set: tokens/s (compile
excluded), forwards per item, the fraction of generated tokens that differ from cache_mode="none"
(slot by slot; a missing or extra token counts as different) and exact-match accuracy.

Two regimes: the task's own answers (12 tokens, stop at EOS) and a long fill (48 tokens, no stop
ids: every block is decoded, so the cache covers many blocks).

    python benchmarks/approx_cache.py [--n 256] [--json benchmarks/out/approx_cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CACHES = [("none", {}), ("approx", dict(cache_delay_iter=0)), ("approx", dict(cache_delay_iter=1)),
          ("approx", dict(cache_delay_iter=2)), ("window", dict(cache_delay_iter=1))]


def differing(a: list[list[int]], b: list[list[int]]) -> float:
    diff = total = 0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        diff += sum(1 for i in range(n) if i >= len(x) or i >= len(y) or x[i] != y[i])
        total += n
    return diff / max(total, 1)


def main(argv=None) -> int:
    import jax

    import jdllm
    from jdllm import tasks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "out", "approx_cache.json"))
    args = p.parse_args(argv)
    model = jdllm.load(os.path.join(ROOT, "models", "tiny-llada"), dtype="float32")
    examples = tasks.test_set(args.n, 0)
    prompts = [ex.prompt for ex in examples]
    rows = []
    for gen, stop in ((12, None), (48, ())):
        base = None
        for cache, kw in CACHES:
            dec = jdllm.MultiBlock(block_size=4, entropy_threshold=0.5, cache_mode=cache, **kw)
            sampling = jdllm.Sampling(max_new_tokens=gen, **({} if stop is None else dict(stop_token_ids=stop)))
            run = lambda: [o for i in range(0, len(prompts), args.batch)  # noqa: E731
                           for o in jdllm.generate(model, prompts[i:i + args.batch], dec, sampling,
                                                   apply_chat_template=False)]
            run()  # compile + warm
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = run()
                best = min(best, time.perf_counter() - t0)
            toks = [o.token_ids for o in outs]
            base = toks if base is None else base
            tokens = sum(len(t) for t in toks)
            row = dict(gen_length=gen, stop_at_eos=stop is None, cache=cache, **kw,
                       tokens_per_s=tokens / best, nfe_per_item=sum(o.nfe for o in outs) / len(outs),
                       differing_from_none=differing(toks, base),
                       accuracy=100.0 * tasks.exact_match([tasks.decode(t) for t in toks], examples))
            rows.append(row)
            print(json.dumps(row), flush=True)
    speed = {(r["gen_length"]): r["tokens_per_s"] for r in rows if r["cache"] == "none"}
    print("| gen tokens | cache | cache_delay_iter | tokens/s | speed vs none | forwards / item | "
          "tokens differing from none | accuracy % |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['gen_length']}{' (EOS)' if r['stop_at_eos'] else ''} | {r['cache']} | "
              f"{r.get('cache_delay_iter', '-')} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / speed[r['gen_length']]:.2f}x | {r['nfe_per_item']:.2f} | "
              f"{r['differing_from_none']:.3f} | {r['accuracy']:.1f} |")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(machine=platform.machine(), backend=jax.default_backend(), n=args.n, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
