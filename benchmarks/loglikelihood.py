"""Scoring for evaluation, jdllm against PyTorch on the same weights, side by side.

What an lm-evaluation-harness multiple-choice run spends its time on: log p(continuation |
context) of many (context, continuation) pairs.

- causal (Qwen3): `jdllm.loglikelihood` (`jdllm.score`'s forward: longest first, 8 rows a forward, left-padded
  to quarter-octave lengths, the LM head and log-softmax only at the continuations' slots, only
  log-probs and the top-1 leave the device) against what the harness' `hf` model does: `transformers` forwards of 8 right-padded
  rows, longest first, `log_softmax` over every position, the continuation's log-probs gathered. Values and the
  greedy flags are compared.
- masked diffusion (LLaMA weights as a LLaDA-style bidirectional model): LLaDA's Monte Carlo ELBO
  (`jdllm.loglikelihood`, `mc_samples` in batches of `mc_batch`) against LLaDA's
  `get_log_likelihood` loop written out in PyTorch (one bidirectional forward of `mc_batch`
  noisy rows, cross-entropy at the masked slots / mask ratio), fed the very noisy rows jdllm drew
  (drawn before timing), so the two estimates must agree to float rounding.

Pairs interleaved after a warm-up of each, medians of this process's CPU time (both engines one
thread) and the wall-clock ratio; a table and JSON.

    python benchmarks/loglikelihood.py --quick
    python benchmarks/loglikelihood.py --pairs 5 --requests 64
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jdllm  # noqa: E402
from jdllm.likelihood import noisy_rows  # noqa: E402
from jdllm.scoring import length_bucket  # noqa: E402
from vs_pytorch import _mask4d, add_shape_args, build, diffusion_model, interleaved  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = 8  # rows per forward, both engines


def torch_causal(hf, pairs):
    """The harness' hf model: right-padded batches of ROWS, log_softmax everywhere, continuation gathered."""
    import torch  # noqa: PLC0415

    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))  # as the harness' Collator
    out: list = [None] * len(pairs)
    with torch.no_grad():
        for i in range(0, len(order), ROWS):
            idx = order[i:i + ROWS]
            part = [pairs[j] for j in idx]
            T = max(len(c) + len(k) for c, k in part)
            ids = torch.zeros((len(part), T), dtype=torch.long)
            for b, (c, k) in enumerate(part):
                ids[b, :len(c) + len(k)] = torch.as_tensor(c + k)
            logp = torch.log_softmax(hf(input_ids=ids).logits.float(), dim=-1)
            for b, (j, (c, k)) in enumerate(zip(idx, part)):
                P, n = len(c), len(k)
                lp = logp[b, P - 1:P + n - 1]
                tgt = torch.as_tensor(k)
                out[j] = (float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all()))
    return out


def llada_noise(model, pairs, mc_samples, mc_batch, seed):
    """The noisy rows jdllm's estimator draws for each pair (its keys), unpadded: [(noisy, masked, counts)]."""
    out = []
    for i, (c, k) in enumerate(pairs):
        row = np.asarray(c + k, np.int32)
        n, L = len(row), len(k)
        S = length_bucket(n, model.config.max_position_embeddings)
        padded = np.zeros(S, np.int32)
        padded[S - n:] = row
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), mc_samples // mc_batch)
        draws = [tuple(np.asarray(x) for x in noisy_rows(kk, padded, L, mc_batch, model.config.mask_token_id))
                 for kk in keys]
        out.append([(nz[:, S - n:], m[:, S - n:], cnt) for nz, m, cnt in draws])
    return out


def torch_llada(hf, pairs, noise):
    """LLaDA's get_log_likelihood on the given noisy rows: -mean over batches of sum(CE / ratio) / b."""
    import torch  # noqa: PLC0415

    out = []
    with torch.no_grad():
        for (c, k), draws in zip(pairs, noise):
            seq = torch.as_tensor(c + k)
            L, losses = len(k), []
            for nz, m, cnt in draws:
                b, T = nz.shape
                mask = _mask4d(torch.ones((T, T), dtype=torch.bool)).expand(b, 1, T, T)
                logits = hf(input_ids=torch.as_tensor(nz, dtype=torch.long), attention_mask=mask).logits.float()
                sel = torch.as_tensor(m)
                ce = torch.nn.functional.cross_entropy(logits[sel], seq.expand(b, T)[sel], reduction="none")
                ratio = torch.as_tensor(cnt, dtype=torch.float32)[:, None].expand(b, T)[sel] / L
                losses.append(float((ce / ratio).sum()) / b)
            out.append((-float(np.mean(losses)), False))
    return out


def row(name, requests, r, values_jd, values_pt):
    (tj, tsj, _, wj), (tp, tsp, _, wp) = r["jd"], r["pt"]
    diff = float(np.max(np.abs(np.asarray([v for v, _ in values_jd]) - np.asarray([v for v, _ in values_pt]))))
    greedy_same = [g for _, g in values_jd] == [g for _, g in values_pt]
    print(f"{name:52s} {requests:4d} requests: jdllm {tj:7.3f}s  pytorch {tp:7.3f}s  speed-up {tp / tj:5.2f} "
          f"(wall {wp / wj:5.2f})  max |diff| {diff:.2e}  greedy flags equal {greedy_same}", flush=True)
    return dict(comparison=name, requests=requests, jdllm_s=tj, pytorch_s=tp, speedup=tp / tj, jdllm_wall_s=wj,
                pytorch_wall_s=wp, wall_speedup=wp / wj, max_abs_diff=diff, greedy_flags_equal=greedy_same,
                jdllm_runs=tsj, pytorch_runs=tsp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--quick", action="store_true", help="16 requests, mc 32")
    ap.add_argument("--requests", type=int, default=32, help="(context, continuation) pairs")
    ap.add_argument("--context", type=int, nargs=2, default=[48, 160], help="context lengths drawn in [lo, hi)")
    ap.add_argument("--continuation", type=int, nargs=2, default=[2, 24], help="continuation lengths in [lo, hi)")
    ap.add_argument("--weight-scale", type=float, default=1.0, help="weights ~ N(0, (scale / sqrt(D))^2)")
    ap.add_argument("--mc-samples", type=int, default=64)
    ap.add_argument("--mc-batch", type=int, default=16)
    ap.add_argument("--only", choices=("causal", "masked"), default=None, help="one of the two comparisons")
    ap.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU core")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "loglikelihood.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.mc_samples, args.pairs = 16, 32, 2
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import torch  # noqa: PLC0415
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    V = args.vocab
    pairs = [(rng.integers(0, V - 2, int(rng.integers(*args.context))).tolist(),
              rng.integers(0, V - 2, int(rng.integers(*args.continuation))).tolist()) for _ in range(args.requests)]
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "causal"):
            qwen_hf, qwen = build(tmp, "qwen3", args, seed=0)
            r = interleaved({"jd": lambda: jdllm.loglikelihood(qwen, pairs),
                             "pt": lambda: torch_causal(qwen_hf, pairs)}, args.pairs)
            rows.append(row("causal: jdllm.loglikelihood vs transformers (Qwen3)", len(pairs), r, r["jd"][2],
                            r["pt"][2]))
        if args.only in (None, "masked"):
            llama_hf, llama = build(tmp, "llama", args, seed=1)
            llada = diffusion_model(llama, "bidirectional", args.block, V - 1)
            few = pairs[:max(1, len(pairs) // 4)]
            noise = llada_noise(llada, few, args.mc_samples, args.mc_batch, 0)
            kw = dict(mc_samples=args.mc_samples, mc_batch=args.mc_batch, seed=0)
            r = interleaved({"jd": lambda: jdllm.loglikelihood(llada, few, **kw),
                             "pt": lambda: torch_llada(llama_hf, few, noise)}, args.pairs)
            rows.append(row(f"masked diffusion: LLaDA ELBO, mc {args.mc_samples} / batch {args.mc_batch}", len(few),
                            r, r["jd"][2], r["pt"][2]))
    meta = dict(machine=platform.machine(), processor=platform.processor(), cpus=os.cpu_count(), jax=jax.__version__,
                torch=torch.__version__, shape=dict(vocab=V, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                                    mlp=args.mlp), context=args.context,
                continuation=args.continuation, pairs=args.pairs, seconds=round(time.time() - t0, 1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out} ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
