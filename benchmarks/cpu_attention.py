"""jdllm's XLA attention against PyTorch's CPU flash attention, one thread each, by window width.

Issue 33's last open clause (the d3LLM KV cache's speed-up falling from 2.03x at gen 128 to 1.89x at
gen 512) comes down to one operation: the bidirectional window of T queries over T + 32 keys that
the approximate cache attends, T growing to the generation's length. This times that operation
alone, both engines on the same float32 arrays in one process, interleaved, and compares outputs:
`pallas_kernels.reference.masked_attention_reference` (what jdllm's XLA path runs, compiled) against
`torch.nn.functional.scaled_dot_product_attention` with the boolean mask (PyTorch's CPU flash
attention, which keeps each tile's scores in cache). Heads 8, head_dim 64 (issue 33's shape).

    python benchmarks/cpu_attention.py --cpu 1                  # table + benchmarks/results/cpu_attention.json
    python benchmarks/cpu_attention.py --widths 32 512 --repeats 5 --out /tmp/a.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")  # one thread, like torch below
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.reference import masked_attention_reference  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_attention.json")


def time_pair(fa, fb, repeats: int):
    """Median seconds of fa and fb, called alternately after two warm-up calls each."""
    for f in (fa, fb, fa, fb):
        f()
    ta, tb = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        fb()
        tb.append(time.perf_counter() - t)
    return float(np.median(ta)), float(np.median(tb))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[32, 128, 256, 512], help="window queries T")
    ap.add_argument("--extra-keys", type=int, default=32, help="keys = T + this (the prompt before the window)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--cpu", type=int, default=None, help="pin the process to this core")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import torch  # noqa: PLC0415 (the baseline: imported only when run)

    torch.set_num_threads(1)
    H, D = args.heads, args.head_dim
    rows = []
    print(f"{'T':>5}{'S':>6}{'jdllm ms':>11}{'torch ms':>11}{'torch / jdllm':>15}{'max |diff|':>12}")
    for T in args.widths:
        S = T + args.extra_keys
        rng = np.random.default_rng(T)
        qn, kn, vn = (rng.standard_normal(s).astype(np.float32) for s in ((1, T, H, D), (1, S, H, D), (1, S, H, D)))
        mask = np.ones((1, T, S), bool)
        mask[:, :, S - 3:] = False  # a few keys past the live length, as a bucketed cache has
        q, k, v, m = map(jnp.asarray, (qn, kn, vn, mask))
        compiled = jax.jit(masked_attention_reference).lower(q, k, v, m).compile()
        tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (qn, kn, vn))
        tm = torch.from_numpy(mask)[:, None]

        def run_jdllm():
            return compiled(q, k, v, m).block_until_ready()

        def run_torch():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)

        tj, tt = time_pair(run_jdllm, run_torch, args.repeats)
        diff = float(np.abs(np.asarray(run_jdllm()) - run_torch().transpose(1, 2).numpy()).max())
        row = dict(T=T, S=S, jdllm_ms=tj * 1e3, torch_ms=tt * 1e3, torch_over_jdllm=tt / tj, max_abs_diff=diff)
        rows.append(row)
        print(f"{T:>5}{S:>6}{row['jdllm_ms']:>11.3f}{row['torch_ms']:>11.3f}{row['torch_over_jdllm']:>15.2f}"
              f"{diff:>12.1e}", flush=True)
        if not diff <= 1e-4:
            print(f"outputs differ at T={T}: {diff}")
            return 1
    result = dict(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, core "
                          f"{args.cpu if args.cpu is not None else 'any'}, one thread per engine",
                  jax=jax.__version__, torch=torch.__version__, heads=H, head_dim=D, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
