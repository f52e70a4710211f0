"""The serving engine on the CPU with glibc's default heap and with the one `import jdllm` sets up
(`jdllm.host_memory`: large buffers kept between calls), side by side.

A random-weight model with a Qwen-sized vocabulary (151,936; hidden 512, 4 layers) serves
`--requests` requests (prompt 64, `--new` tokens, no stop ids) through `jdllm.serve.Engine`
(`--max-batch` rows), all submitted at once. Each setting runs in its own process
(`JDLLM_MALLOC=off` for glibc's default), the settings interleaved `--pairs` times; each process
serves the workload twice and times the second pass (every compile done by then). Reported: wall
and CPU seconds, tokens per second, and the minor page faults the timed pass took (each a fresh
4 KiB page the kernel zeroed), tokens compared between the settings.

    python benchmarks/host_memory.py                    # block_diffusion and AR, 1 pair
    python benchmarks/host_memory.py --paradigms block_diffusion --pairs 3

Writes benchmarks/results/host_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {"glibc default (JDLLM_MALLOC=off)": "off", "jdllm (1 GiB kept)": "on"}


def worker(args) -> dict:
    import hashlib  # noqa: PLC0415
    import resource  # noqa: PLC0415
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    sys.path.insert(0, ROOT)
    import numpy as np  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm import host_memory  # noqa: PLC0415
    from jdllm.config import ModelConfig  # noqa: PLC0415
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    V, ar = args.vocab, args.paradigm == "ar"
    cfg = ModelConfig(model_type="bench", vocab_size=V, hidden_size=512, intermediate_size=1536, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=128, qk_norm=True, block_size=32,
                      attention="causal" if ar else "block_causal", mask_token_id=None if ar else V - 1,
                      eos_token_ids=())
    model = jdllm.Model.random(cfg, seed=0)
    par = jdllm.AR() if ar else jdllm.BlockDiffusion(block_length=32, denoising_steps=8)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V - 2, 64).tolist() for _ in range(args.requests)]
    eng = Engine(model, par, max_batch=args.max_batch, max_prompt_tokens=64, max_new_tokens=args.new,
                 max_queue=args.requests).start()
    try:
        for _ in range(2):  # the first pass compiles; the second is timed
            done, outs = threading.Semaphore(0), {}

            def on_event(i):
                def f(ev):
                    if ev.kind == "done":
                        outs[i] = ev.output.token_ids
                        done.release()
                return f

            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            w0, c0 = time.perf_counter(), time.process_time()
            for i, p in enumerate(prompts):
                eng.submit(p, jdllm.Sampling(max_new_tokens=args.new, stop_token_ids=()), on_event=on_event(i))
            for _ in prompts:
                done.acquire()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    finally:
        eng.stop()
    toks = hashlib.md5(json.dumps([outs[i] for i in range(len(prompts))]).encode()).hexdigest()[:12]
    return dict(wall_s=wall, cpu_s=cpu, faults=faults, tokens=toks, tok_s=args.requests * args.new / wall,
                heap_settings=sorted(host_memory.tune()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paradigms", nargs="+", default=["block_diffusion", "ar"], choices=["block_diffusion", "ar"])
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "host_memory.json"))
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--paradigm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        print(json.dumps(worker(args)))
        return
    rows = []
    for par in args.paradigms:
        runs = {name: [] for name in SETTINGS}
        for i in range(args.pairs):
            order = list(SETTINGS) if i % 2 == 0 else list(SETTINGS)[::-1]
            for name in order:
                env = {k: v for k, v in os.environ.items() if k != "JDLLM_MALLOC"}
                if SETTINGS[name] == "off":
                    env["JDLLM_MALLOC"] = "off"
                cmd = [sys.executable, os.path.abspath(__file__), "--_worker", "--paradigm", par,
                       "--requests", str(args.requests), "--new", str(args.new), "--max-batch", str(args.max_batch),
                       "--vocab", str(args.vocab)]
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                runs[name].append(r)
                print(f"{par:16s} {name:34s} wall {r['wall_s']:6.2f} s  cpu {r['cpu_s']:6.2f} s  "
                      f"{r['tok_s']:6.1f} tok/s  page faults {r['faults']:>9,d}  tokens {r['tokens']}", flush=True)
        for name, rs in runs.items():
            rows.append(dict(paradigm=par, heap=name, wall_s=statistics.median(r["wall_s"] for r in rs),
                             cpu_s=statistics.median(r["cpu_s"] for r in rs),
                             tok_s=statistics.median(r["tok_s"] for r in rs),
                             faults=statistics.median(r["faults"] for r in rs), runs=rs,
                             same_tokens=len({r["tokens"] for v in runs.values() for r in v}) == 1))
    print("\n| paradigm | heap | wall s | CPU s | tok/s | page faults | same tokens |\n|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['paradigm']} | {r['heap']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['tok_s']:.1f} | "
              f"{r['faults']:,.0f} | {'yes' if r['same_tokens'] else 'no'} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=platform.platform(), processor=platform.processor(), cores=os.cpu_count(),
                       load_average=os.getloadavg(), requests=args.requests, new=args.new,
                       max_batch=args.max_batch, vocab=args.vocab, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
