"""Speculative AR decoding (`ar_spec`) against plain AR on the shipped tiny-ar, per proposer.

Target models/tiny-ar; proposers: prompt lookup (PLD) and the shipped draft
models/tiny-ar-draft. Held-out prompts of the `rev:` and `sort:` tasks
(jdllm.tasks), greedy, stopping at EOS as a user would. Batch 1 runs the
prompts one call each; batch 16 runs them in one call. Every configuration
compiles once, then the compiled decode (prefill + while_loop, prepared
states: host-side tokenizing and output conversion excluded, the same for
every method) of the methods runs interleaved (AR, PLD, draft, AR, ...)
`--repeats` times and the median is kept, so a shared machine's load hits
them alike.

Columns: tokens/s; speedup over AR in the same run; acceptance = drafts
accepted / drafts proposed; tokens per target forward (TPF, prefill
included); tokens per verification step; whether the tokens equal AR's.

    python benchmarks/speculative.py                 # batch 1 and 16, k = 4
    python benchmarks/speculative.py --batches 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import jdllm  # noqa: E402
from jdllm import tasks  # noqa: E402
from jdllm.api import outputs, params_for, prepare  # noqa: E402
from jdllm.decode import loop  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts_of(task: str, n: int) -> list[str]:
    return [ex.prompt for ex in tasks.test_set(20 * n, 0) if ex.task == task][:n]


def run_once(model, decoding, preps):
    """(outputs, seconds) of the prepared calls: the compiled decode only (tokenizing, building the
    state and reading the outputs back are the same host work for every method and are left out)."""
    params = params_for(model, decoding)
    finals, t0 = [], time.perf_counter()
    for prep in preps:
        finals.append(jax.block_until_ready(loop.compiled()(params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx)))
    dt = time.perf_counter() - t0
    return [o for prep, f in zip(preps, finals) for o in outputs(prep, f)], dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="num_draft_tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tasks", nargs="+", default=["rev", "sort"])
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "speculative.json"))
    args = ap.parse_args(argv)

    target = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    draft = jdllm.load(os.path.join(ROOT, "models", "tiny-ar-draft"), dtype="float32")
    methods = {"ar": jdllm.AR(),
               "pld": jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=args.k),
               "draft": jdllm.Speculative(proposer="draft_model", draft=draft, num_draft_tokens=args.k)}
    sampling = jdllm.Sampling(max_new_tokens=12)
    rows = []
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}; "
          f"target tiny-ar, draft tiny-ar-draft, k={args.k}, {args.prompts} prompts, median of {args.repeats}")
    print("| task | batch | method | tokens/s | speedup vs AR | acceptance | TPF | tokens / step | same as AR |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for task in args.tasks:
        prompts = prompts_of(task, args.prompts)
        for batch in args.batches:
            ref, times, preps = {}, {m: [] for m in methods}, {}
            for name, dec in methods.items():  # prepare and compile
                preps[name] = [prepare(target, prompts[i:i + batch], dec, sampling)
                               for i in range(0, len(prompts), batch)]
                ref[name], _ = run_once(target, dec, preps[name])
            for _ in range(args.repeats):
                for name, dec in methods.items():
                    times[name].append(run_once(target, dec, preps[name])[1])
            toks = sum(len(o.token_ids) for o in ref["ar"])
            ar_tps = toks / statistics.median(times["ar"])
            for name in methods:
                outs = ref[name]
                n = sum(len(o.token_ids) for o in outs)
                tps = n / statistics.median(times[name])
                nfe = sum(o.nfe for o in outs)
                steps = sum(max(o.step_map, default=0) for o in outs)
                prop = sum(o.trace.get("drafts_proposed", 0) for o in outs)
                acc = sum(o.trace.get("drafts_accepted", 0) for o in outs)
                same = [o.token_ids for o in outs] == [o.token_ids for o in ref["ar"]]
                row = dict(task=task, batch=batch, method=name, tokens=n, tokens_per_s=tps,
                           speedup=tps / ar_tps, acceptance=acc / prop if prop else None, tpf=n / nfe,
                           tokens_per_step=n / steps, same_as_ar=same, seconds=times[name])
                rows.append(row)
                accs = f"{acc / prop:.2f}" if prop else "-"
                print(f"| {task} | {batch} | {name} | {tps:.0f} | {tps / ar_tps:.2f}x | {accs} | {n / nfe:.2f} | "
                      f"{n / steps:.2f} | {'yes' if same else 'NO'} |", flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(machine=platform.platform(), cores=os.cpu_count(), k=args.k, prompts=args.prompts,
                       repeats=args.repeats, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
