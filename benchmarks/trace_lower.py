"""Trace and lowering seconds of the whole `generate` program, per-layer layer bodies vs one traced body.

Python work that every new trace pays before the persistent compilation cache is consulted (issue 27):
the 8B shape (benchmarks/gpu.py's `--shape 8b`) with abstract bf16 weights (nothing is built), at each
depth, with `jdllm.model._TRACE_LAYER_ONCE` off (the layer function runs once per layer in the trace) and
on (one jitted layer body, called per layer). `--platform cuda` lowers for CUDA on any machine, so the
Pallas kernels' lowering (Mosaic GPU with JDLLM_PALLAS_BACKEND=mosaic) is counted without a GPU.

    JDLLM_PALLAS_BACKEND=mosaic python benchmarks/trace_lower.py --platform cuda --attn pallas
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def measure(G, case_id: str, layers: int, once: bool, attn: str, platform: str | None) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm import model as M  # noqa: PLC0415
    from jdllm.api import params_for, prepare  # noqa: PLC0415
    from jdllm.decode import loop  # noqa: PLC0415

    M._TRACE_LAYER_ONCE = once
    case = {c.id: c for c in G.all_cases()}[case_id]
    cfg = G.model_config(G.base_config("8b").replace(num_layers=layers), case.attention, 32)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16),
                          M.param_specs(cfg, M.default_layout()), is_leaf=M.is_param_spec)
    model = jdllm.Model(config=cfg, params=params, attn_impl=attn)
    dec = G.decoding_for(case, 256, 32)
    prep = prepare(model, G.prompts_for(case, 128, cfg.vocab_size, 0), dec,
                   jdllm.Sampling(max_new_tokens=256, stop_token_ids=()))
    jax.clear_caches()
    t0 = time.perf_counter()
    traced = loop.compiled(()).trace(params_for(model, dec), prep.state, paradigm=prep.paradigm, ctx=prep.ctx)
    t1 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
    t2 = time.perf_counter()
    return dict(case=case_id, layers=layers, trace_once=once, attn=attn, platform=platform or jax.default_backend(),
                pallas_backend=os.environ.get("JDLLM_PALLAS_BACKEND", "default"), trace_s=round(t1 - t0, 3),
                lower_s=round(t2 - t1, 3), stablehlo_chars=len(lowered.as_text()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["ar_b1", "bd_static_b1", "mb_approx_b1"])
    ap.add_argument("--layers", nargs="+", type=int, default=[4, 32])
    ap.add_argument("--attn", default="pallas", help="attention impl (pallas: the kernels' lowering counts)")
    ap.add_argument("--platform", default="cuda", help="lowering platform ('' = the default backend)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "trace_lower.json"))
    args = ap.parse_args(argv)
    from tests.scripts import load_script  # noqa: PLC0415

    G = load_script("benchmarks/gpu.py")
    rows = []
    print("| case | layers | trace s: per layer / once | lower s: per layer / once | StableHLO MB: per layer / once |")
    print("|---|---:|---:|---:|---:|")
    for case in args.cases:
        for L in args.layers:
            a, b = (measure(G, case, L, once, args.attn, args.platform or None) for once in (False, True))
            rows += [a, b]
            print(f"| {case} | {L} | {a['trace_s']:.2f} / {b['trace_s']:.2f} | {a['lower_s']:.2f} / {b['lower_s']:.2f} | "
                  f"{a['stablehlo_chars'] / 1e6:.2f} / {b['stablehlo_chars'] / 1e6:.2f} |", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(load_average=os.getloadavg(), rows=rows), f, indent=1)
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
