"""Continuous batching (`jdllm.serve.Engine`) vs static batching (`jdllm.generate` on fixed batches)
on one Poisson-arrival workload with mixed prompt and answer lengths, greedy.

For each model: the same request list (arrival times, prompts, max_new_tokens, no stop ids, so
every answer has exactly its asked length) runs through
  - continuous: the engine's row pool on its own thread, requests submitted at their arrival
    times, tokens streamed as they become final;
  - static: fixed batches of `max_batch` consecutive requests; a batch starts once its last request
    has arrived and the previous batch is done, as one `jdllm.generate` call (rows may ask for
    different lengths; every answer of the batch arrives when the batch ends). Fixed batches keep
    the shapes of both passes equal, so the timed pass compiles nothing.
Each path runs the workload twice and the second pass is timed (every compile cached by then).
Reported: throughput (generated tokens / (last finish - first arrival)), time to first token
(static: the batch's end), per-token latency ((finish - arrival) / tokens), p50 / p99, and
whether both paths produced the same tokens for every request.

    python benchmarks/serve.py                   # tiny-ar + a larger random-weight qwen3
    python benchmarks/serve.py --models tiny-ar --requests 32 --rate 40
Writes benchmarks/out/serve.json.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_model(name: str):
    import jax  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.config import ModelConfig  # noqa: PLC0415
    from jdllm.loading import Model  # noqa: PLC0415
    from jdllm.model import init_params  # noqa: PLC0415

    if name == "tiny-ar":
        return jdllm.load(os.path.join(ROOT, "models", "tiny-ar")), (4, 16), (4, 40)
    # a larger random-weight causal model (no tokenizer: token-id prompts)
    cfg = ModelConfig(model_type="qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=6,
                      num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True, max_position_embeddings=512,
                      eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(0), std=0.05), attn_impl="xla"), (8, 64), (8, 96)


def workload(n: int, rate: float, prompt_range, new_range, vocab: int, seed: int = 0):
    """(arrival s, prompt ids, max_new_tokens) per request: Poisson arrivals; answers mostly short,
    a quarter long (the mix where a static batch waits for its longest row)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    lo, hi = new_range
    out = []
    for i in range(n):
        plen = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        new = int(rng.integers(hi * 3 // 4, hi + 1)) if rng.random() < 0.25 else int(rng.integers(lo, lo + (hi - lo) // 4 + 1))
        out.append((float(arrivals[i]), rng.integers(3, vocab - 1, plen).tolist(), new))
    return out


def run_continuous(model, reqs, max_batch: int, steps_per_round: int):
    import jdllm  # noqa: PLC0415
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    max_new = max(r[2] for r in reqs)
    max_prompt = max(len(r[1]) for r in reqs)
    eng = Engine(model, jdllm.AR(), max_batch=max_batch, max_prompt_tokens=max_prompt, max_new_tokens=max_new,
                 max_queue=len(reqs), steps_per_round=steps_per_round).start()
    try:
        result = None
        for _ in range(2):  # the first pass compiles
            first, done, outs = {}, {}, {}
            lock = threading.Event()

            def on_event(i):
                def f(ev):
                    now = time.perf_counter()
                    if ev.kind == "tokens" and i not in first:
                        first[i] = now
                    elif ev.kind == "done":
                        done[i], outs[i] = now, ev.output.token_ids
                        if len(done) == len(reqs):
                            lock.set()
                return f

            t0 = time.perf_counter()
            for i, (at, prompt, new) in enumerate(reqs):
                wait = t0 + at - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                eng.submit(prompt, jdllm.Sampling(max_new_tokens=new, stop_token_ids=()), on_event=on_event(i))
            lock.wait()
            result = dict(t0=t0, first=first, done=done, outs=outs)
    finally:
        eng.stop()
    return result


def run_static(model, reqs, max_batch: int):
    import jdllm  # noqa: PLC0415

    result = None
    for _ in range(2):
        first, done, outs = {}, {}, {}
        t0 = time.perf_counter()
        for k in range(0, len(reqs), max_batch):
            batch = list(range(k, min(k + max_batch, len(reqs))))
            wait = t0 + reqs[batch[-1]][0] - time.perf_counter()  # the batch is complete
            if wait > 0:
                time.sleep(wait)
            res = jdllm.generate(model, [reqs[i][1] for i in batch], jdllm.AR(),
                                 [jdllm.Sampling(max_new_tokens=reqs[i][2], stop_token_ids=()) for i in batch])
            end = time.perf_counter()
            for i, o in zip(batch, res):
                first[i] = done[i] = end
                outs[i] = o.token_ids
        result = dict(t0=t0, first=first, done=done, outs=outs)
    return result


def summary(reqs, r) -> dict:
    t0 = r["t0"]
    arr = np.array([t0 + a for a, _, _ in reqs])
    n = np.array([len(r["outs"][i]) for i in range(len(reqs))])
    first = np.array([r["first"][i] for i in range(len(reqs))])
    done = np.array([r["done"][i] for i in range(len(reqs))])
    ttft, per_tok = first - arr, (done - arr) / np.maximum(n, 1)
    span = done.max() - arr.min()
    q = lambda x, p: float(np.percentile(x, p) * 1e3)  # noqa: E731
    return dict(tokens=int(n.sum()), seconds=float(span), tok_per_s=float(n.sum() / span),
                ttft_p50_ms=q(ttft, 50), ttft_p99_ms=q(ttft, 99), per_token_p50_ms=q(per_tok, 50),
                per_token_p99_ms=q(per_tok, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-ar", "random-qwen3-h256-l6"])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second (default: per model)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--steps-per-round", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "serve.json"))
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = []
    for name in args.models:
        model, prange, nrange = load_model(name)
        rate = args.rate or (200.0 if name == "tiny-ar" else 50.0)
        reqs = workload(args.requests, rate, prange, nrange, model.config.vocab_size)
        cont = run_continuous(model, reqs, args.max_batch, args.steps_per_round)
        stat = run_static(model, reqs, args.max_batch)
        same = all(cont["outs"][i] == stat["outs"][i] for i in range(len(reqs)))
        for mode, r in (("continuous", cont), ("static", stat)):
            rows.append(dict(model=name, mode=mode, requests=len(reqs), rate=rate, max_batch=args.max_batch,
                             same_tokens=same, **summary(reqs, r)))
    hdr = ("model", "mode", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "per-tok p50 ms", "per-tok p99 ms", "same tokens")
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['tok_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['per_token_p50_ms']:.1f} | {r['per_token_p99_ms']:.1f} | {r['same_tokens']} |")
    for name in args.models:
        c, s = (next(r for r in rows if r["model"] == name and r["mode"] == m) for m in ("continuous", "static"))
        print(f"{name}: continuous / static throughput = {c['tok_per_s'] / s['tok_per_s']:.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
