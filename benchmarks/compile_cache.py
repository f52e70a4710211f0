"""A second process's first `jdllm.generate` with JAX's persistent compilation cache cold vs warm.

For each model and each cache setting (off, and the cache on with several
`jax_persistent_cache_min_compile_time_secs` thresholds), per round: a fresh cache directory,
one process that fills it (cold), one that reads it (warm). Each process times `jdllm.load`,
its first `generate` (compile + run) and a second one (run only), and reports the tokens and
log-probs, which must be identical across every setting (the cache must not change results).

    python benchmarks/compile_cache.py [--models models/tiny-sdar models/tiny-ar] [--rounds 2]
        [--json benchmarks/compile_cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {"off": None, "min 0 s": 0.0, "min 0.5 s": 0.5, "min 1 s (JAX's default)": 1.0}


def child(model_dir: str) -> None:
    t0 = time.perf_counter()
    import jdllm  # noqa: PLC0415

    model = jdllm.load(model_dir, dtype="float32")
    t1 = time.perf_counter()
    sampling = jdllm.Sampling(max_new_tokens=16, stop_token_ids=(), seed=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = jdllm.generate(model, prompts, sampling=sampling)
    t2 = time.perf_counter()
    jdllm.generate(model, prompts, sampling=sampling)
    t3 = time.perf_counter()
    print(json.dumps(dict(load_s=t1 - t0, first_s=t2 - t1, second_s=t3 - t2,
                          tokens=[o.token_ids for o in outs], logprobs=[o.logprobs for o in outs])))


def run_one(model_dir: str, setting, cache_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if setting is None:
        env["JDLLM_CACHE_DIR"] = "off"
    else:
        env["JDLLM_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(setting)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", model_dir], env=env, capture_output=True, text=True,
                         check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t0
    if setting is not None:
        names = [n for n in os.listdir(cache_dir) if n.endswith("-cache")]
        res["entries"] = len(names)
        res["cache_bytes"] = sum(os.path.getsize(os.path.join(cache_dir, n)) for n in names)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=["models/tiny-sdar", "models/tiny-ar"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.child:
        return child(args.child)
    rows = []
    for model_dir in args.models:
        runs: dict = {name: {"cold": [], "warm": []} for name in SETTINGS}
        for _ in range(args.rounds):
            for name, setting in SETTINGS.items():
                d = tempfile.mkdtemp(prefix="jdllm-cc-bench-")
                try:
                    runs[name]["cold"].append(run_one(model_dir, setting, d))
                    runs[name]["warm"].append(run_one(model_dir, setting, d))
                finally:
                    shutil.rmtree(d, ignore_errors=True)
        ref = runs["off"]["cold"][0]
        same = all(r["tokens"] == ref["tokens"] and r["logprobs"] == ref["logprobs"]
                   for v in runs.values() for rs in v.values() for r in rs)
        for name, v in runs.items():
            med = {k: {f: statistics.median(r[f] for r in rs) for f in ("load_s", "first_s", "second_s", "process_s")}
                   for k, rs in v.items()}
            row = dict(model=model_dir, setting=name, cold=med["cold"], warm=med["warm"],
                       entries=v["warm"][0].get("entries"), cache_bytes=v["warm"][0].get("cache_bytes"),
                       samples={k: [r["first_s"] for r in rs] for k, rs in v.items()}, identical_outputs=same)
            rows.append(row)
            print(f"| {model_dir} | {name} | {med['cold']['first_s']:.2f} | {med['warm']['first_s']:.2f} | "
                  f"{med['cold']['process_s']:.2f} | {med['warm']['process_s']:.2f} | {row['entries'] or '-'} | "
                  f"{(row['cache_bytes'] or 0) / 1e6:.2f} | {'yes' if same else 'NO'} |", flush=True)
    if args.json:
        import jax  # noqa: PLC0415

        with open(args.json, "w") as f:
            json.dump(dict(jax=jax.__version__, cpus=os.cpu_count(), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
