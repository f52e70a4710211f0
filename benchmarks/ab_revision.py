"""Before / after a change to the forward or a layout, in one process, interleaved.

"before" runs `jdllm/model.py` as it was at git revision --rev (loaded as a
separate module and put in place of the decoders' `forward` while they are
traced), with --old-block-layout block diffusion's canvas with the extra
trailing block it had before, and with --scan-before the layer scan on every
step (no `unstack_layers` in `loop.run`); "after" is the working tree. Both run the same
random float32 weights at the same shape; each decode is warmed up (compiled)
first, then the two alternate --pairs times. Figures are this process's CPU
time (one XLA thread), medians, with the wall time beside them; greedy tokens
of the two are compared.

    python benchmarks/ab_revision.py --rev 3ab4de3 --gens 128 256
    python benchmarks/ab_revision.py --rev 3ab4de3 --old-block-layout --only block_static
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jdllm  # noqa: E402
from jdllm.config import ModelConfig  # noqa: E402
from jdllm.decode import block_diffusion, common, loop, masked_diffusion, multi_block  # noqa: E402
from jdllm.model import init_params  # noqa: E402
from vs_pytorch import add_shape_args  # noqa: E402 (benchmarks/ is this script's directory)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USERS = (common, masked_diffusion, multi_block)  # modules that call `forward` by that name
PARADIGMS = ("ar", "block_static", "block_dynamic", "fastdllm_prefix", "multi_block")


def old_module(rev: str, path: str = "jdllm/model.py"):
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True, capture_output=True,
                         text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("jdllm_model_" + rev.replace("/", "_"), f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@dataclasses.dataclass(frozen=True)
class OldLayoutBlockDiffusion(block_diffusion.BlockDiffusion):
    """Block diffusion on the canvas it had before: one more (never used) block at the end."""

    def layout(self, lengths, max_new_tokens, cfg):
        lay = super().layout(lengths, max_new_tokens, cfg)
        return lay._replace(slots=lay.slots + self.block_length)


def model_of(args, attention: str, impl: str):
    cfg = ModelConfig(model_type="ab", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.mlp, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.heads, head_dim=args.hidden // args.heads, max_position_embeddings=4096,
                      attention=attention, block_size=args.block, mask_token_id=args.vocab - 1,
                      qk_norm=attention != "bidirectional")
    params = init_params(cfg, jax.random.key(0), std=2.0 / np.sqrt(args.hidden))
    return jdllm.Model(cfg, params, attn_impl=impl)


def decoding(name: str, args, gen: int):
    if name == "ar":
        return jdllm.AR()
    if name.startswith("block_"):
        return jdllm.BlockDiffusion(block_length=args.block, denoising_steps=args.steps_per_block,
                                    strategy="low_confidence_static" if name == "block_static"
                                    else "low_confidence_dynamic", dynamic_minimum="sdar")
    if name == "fastdllm_prefix":
        return jdllm.MaskedDiffusion(gen_length=gen, block_length=args.block, confidence_threshold=0.9,
                                     cache_mode="prefix")
    return jdllm.MultiBlock(block_size=args.block)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="git revision whose jdllm/model.py is 'before'")
    ap.add_argument("--old-block-layout", action="store_true",
                    help="'before' also uses block diffusion's old canvas (one trailing block more)")
    ap.add_argument("--scan-before", action="store_true",
                    help="'before' runs the layers as a lax.scan on every step (no unstack_layers in loop.run)")
    ap.add_argument("--only", nargs="*", default=["ar", "block_static", "block_dynamic"], choices=PARADIGMS)
    ap.add_argument("--gens", type=int, nargs="+", default=[128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    add_shape_args(ap)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "ab_revision.json"))
    args = ap.parse_args(argv)
    old = old_module(args.rev)
    new_forward = common.forward
    rng = np.random.default_rng(0)
    rows = []
    models = {}
    for kind in ("causal", "block_causal", "bidirectional"):
        # "auto" and "xla" are the same attention on the CPU; they only keep the two compiled decodes apart
        models[kind] = {"before": model_of(args, kind, "auto"), "after": model_of(args, kind, "xla")}
    attention = {"ar": "causal", "block_static": "block_causal", "block_dynamic": "block_causal",
                 "fastdllm_prefix": "bidirectional", "multi_block": "block_causal"}
    for gen in args.gens:
        for name in args.only:
            for batch in args.batches:
                prompts = rng.integers(0, args.vocab - 2, size=(batch, args.prompt)).tolist()
                dec = decoding(name, args, gen)
                decs = {"before": dec, "after": dec}
                if args.old_block_layout and name.startswith("block_"):
                    decs["before"] = OldLayoutBlockDiffusion(**dataclasses.asdict(dec))
                sampling = jdllm.Sampling(max_new_tokens=gen, stop_token_ids=())

                def call(which):
                    outs = jdllm.generate(models[attention[name]][which], prompts, decs[which], sampling)
                    return [list(o.token_ids) for o in outs], [o.nfe for o in outs]

                for mod in USERS:  # trace "before" with the old forward
                    mod.forward = old.forward
                new_unstack = loop.unstack_layers  # and the old per-layer split (its weight names)
                loop.unstack_layers = getattr(old, "unstack_layers", new_unstack)
                unroll_on = loop.UNROLL_LAYERS_ON
                if args.scan_before:
                    loop.UNROLL_LAYERS_ON = ()
                try:
                    call("before")
                finally:
                    for mod in USERS:
                        mod.forward = new_forward
                    loop.unstack_layers = new_unstack
                    loop.UNROLL_LAYERS_ON = unroll_on
                call("after")
                cpu = {"before": [], "after": []}
                wall = {"before": [], "after": []}
                out = {}
                for _ in range(args.pairs):
                    for which in ("before", "after"):
                        t, w = time.process_time(), time.perf_counter()
                        out[which] = call(which)
                        cpu[which].append(time.process_time() - t)
                        wall[which].append(time.perf_counter() - w)
                med = {k: statistics.median(v) for k, v in cpu.items()}
                row = dict(paradigm=name, gen=gen, batch=batch, before_s=med["before"], after_s=med["after"],
                           speedup=med["before"] / med["after"],
                           wall_speedup=statistics.median(wall["before"]) / statistics.median(wall["after"]),
                           identical_tokens=out["before"][0] == out["after"][0],
                           nfe_before=float(np.mean(out["before"][1])), nfe_after=float(np.mean(out["after"][1])),
                           before_runs=cpu["before"], after_runs=cpu["after"])
                rows.append(row)
                print(f"{name:16s} gen {gen:4d} batch {batch}: before {med['before']:.3f}s after "
                      f"{med['after']:.3f}s  speed-up {row['speedup']:.2f} (wall {row['wall_speedup']:.2f})  "
                      f"identical {row['identical_tokens']}  NFE {row['nfe_before']:.1f} -> {row['nfe_after']:.1f}",
                      flush=True)
    load = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(rev=args.rev, old_block_layout=args.old_block_layout, scan_before=args.scan_before,
                       load_average=load,
                       model=dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                  mlp=args.mlp, block=args.block), rows=rows), f, indent=2)
    print(f"load average {load}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
