"""Sharded decoding overhead: tokens/s of each mesh against one device.

Runs on fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set
here before JAX starts). On a CPU the 8 "devices" share the same cores, so
these figures only show the overhead of partitioning (collectives, smaller
per-device matmuls), never a speed-up; on real accelerators the meshes split
the work. Interleaved timed runs (mesh order rotates each round), median taken.

    python benchmarks/sharding.py                    # AR and block diffusion, batch 8, 32 new tokens
    python benchmarks/sharding.py --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import jdllm  # noqa: E402
from jdllm import sharding  # noqa: E402
from jdllm.config import ModelConfig  # noqa: E402
from jdllm.model import init_params  # noqa: E402

MESHES = {"1 device": None, "8x1": "data=8", "1x8": "model=8", "2x4": "data=2,model=4"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    results = []
    for attention in ("causal", "block_causal"):
        cfg = ModelConfig(model_type="qwen3" if attention == "causal" else "sdar", vocab_size=1024,
                          hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_layers=args.layers,
                          num_heads=16, num_kv_heads=8, head_dim=args.hidden // 16, qk_norm=True,
                          attention=attention, block_size=4,
                          mask_token_id=None if attention == "causal" else 1023, max_position_embeddings=512,
                          eos_token_ids=())
        base = jdllm.Model(cfg, init_params(cfg, jax.random.key(0)), attn_impl="xla")
        dec = jdllm.AR() if attention == "causal" else jdllm.BlockDiffusion(block_length=4, denoising_steps=4)
        models = {name: base if spec is None else base.shard(sharding.make_mesh(spec))
                  for name, spec in MESHES.items()}
        prompts = [[(7 * b + i) % 1000 + 1 for i in range(16)] for b in range(args.batch)]
        samp = jdllm.Sampling(max_new_tokens=args.new)
        times: dict[str, list[float]] = {n: [] for n in models}
        tokens = {}
        for name, m in models.items():  # compile
            tokens[name] = [o.token_ids for o in jdllm.generate(m, prompts, dec, samp)]
        names = list(models)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                jdllm.generate(models[name], prompts, dec, samp)
                times[name].append(time.perf_counter() - t0)
        one = statistics.median(times["1 device"])
        for name in names:
            med = statistics.median(times[name])
            row = dict(paradigm=dec.name, mesh=name, batch=args.batch, new=args.new,
                       tokens_per_s=round(args.batch * args.new / med, 1), vs_one_device=round(one / med, 3),
                       same_tokens=tokens[name] == tokens["1 device"], runs=len(times[name]))
            results.append(row)
            print(f"{dec.name:16s} {name:9s} {row['tokens_per_s']:8.1f} tok/s  x{row['vs_one_device']:.2f} of one "
                  f"device  same tokens: {row['same_tokens']}", flush=True)
    meta = dict(load_average=os.getloadavg(), machine=platform.machine(), cpus=os.cpu_count(),
                jax=jax.__version__, hidden=args.hidden, layers=args.layers)
    print(json.dumps(meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
