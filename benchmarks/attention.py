"""Attention benchmark: Pallas flash kernels vs cuDNN vs XLA, and the window kernel's bandwidth.

Prefill (T = S, start = 0): for each mask (block-causal B=4, B=32, causal) and
S, time each implementation and report achieved TFLOP/s counting only the
FLOPs inside the mask (4 * H * D per visible query-key pair), next to the
device's measured bf16 matmul rate. Window (the denoising / decoding step): a
T-token window at the end of an S-slot cache; achieved HBM bandwidth (K and V
bytes the mask lets it read) against a measured device-to-device copy.

    python benchmarks/attention.py            # GPU sizes: S = 1k..32k, head_dim 128, bf16
    python benchmarks/attention.py --quick    # tiny sizes; on the CPU the kernels run in
                                              # Pallas interpret mode (a smoke run, not a speed)

Prints one progress line per case as it runs, then a table; writes JSON to
benchmarks/results/attention.json (each row with its fraction of the device limit:
prefill TFLOP/s over the measured bf16 matmul rate, window GB/s over the measured
copy bandwidth; both measured in the same run, timed as 10 passes inside one
compiled loop on random data). `--markdown` prints the table of that JSON,
`--markdown --write-results-md` puts it into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pallas_kernels  # noqa: E402
from pallas_kernels import flash  # noqa: E402
from pallas_kernels.reference import horizon  # noqa: E402
from benchmarks.device_limits import copy_gbps, loop_seconds, matmul_tflops, median_seconds as bench  # noqa: E402

MASKS = (("block_causal", 4), ("block_causal", 32), ("causal", 1))
FULL_SEQ = (1024, 4096, 8192, 16384, 32768)
QUICK_SEQ = (64, 128)


def visible_pairs(T: int, S: int, kind: str, block_size: int, q_offset: int = 0) -> int:
    """Number of (query, key) pairs the rule lets through (start = 0, kv_len = q_offset + T)."""
    kv_len = q_offset + T
    p = np.arange(q_offset, q_offset + T, dtype=np.int64)
    end = np.minimum(np.asarray(horizon(jnp.asarray(p, jnp.int32), kind, block_size, kv_len)), kv_len)
    return int(np.minimum(end, S).sum())


def _inputs(B, T, S, H, KV, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype)
                 for s in ((B, T, H, D), (B, S, KV, D), (B, S, KV, D)))


def _pallas_options(impl: str, tiles) -> dict:
    """flash.attention options of the "pallas*" impls (the pinned backends interpret on the CPU)."""
    on_gpu = jax.default_backend() == "gpu"
    return {
        "pallas": dict(variant="auto", tiles=tiles),
        "pallas-mosaic": dict(variant="prefill", tiles=tiles,
                              backend="mosaic" if on_gpu else "mosaic_interpret"),
        # the one-warpgroup Mosaic prefill (the default before the H200 timed the warp-specialised one)
        "pallas-mosaic-1wg": dict(variant="prefill", tiles=dataclasses.replace(tiles, mosaic_warp_specialized=False),
                                  backend="mosaic" if on_gpu else "mosaic_interpret"),
        # the warp-specialised Mosaic prefill (issue 28 item 2), with and without the ping-pong
        "pallas-mosaic-ws": dict(variant="prefill", tiles=dataclasses.replace(tiles, mosaic_warp_specialized=True,
                                                                              mosaic_pingpong=True),
                                 backend="mosaic" if on_gpu else "mosaic_interpret"),
        "pallas-mosaic-ws-nopp": dict(variant="prefill", backend="mosaic" if on_gpu else "mosaic_interpret",
                                      tiles=dataclasses.replace(tiles, mosaic_warp_specialized=True,
                                                                mosaic_pingpong=False)),
        "pallas-triton": dict(variant="prefill", tiles=tiles,
                              backend="triton" if on_gpu else "interpret"),
        "pallas-packed": dict(variant="window", tiles=dataclasses.replace(tiles, num_splits=1)),
    }[impl]


def _attn_fn(impl: str, *, kind, block_size, q_offset, kv_len, tiles):
    """impl "pallas" (auto variant, default backend), "pallas-mosaic" / "pallas-triton" (the
    prefill kernel on that backend), "pallas-mosaic-1wg" (the Mosaic prefill's one-warpgroup kernel),
    "pallas-mosaic-ws" / "pallas-mosaic-ws-nopp" (its warp-specialised variant, with / without the
    ping-pong; the latter is the default), "pallas-packed" (GQA-packed window kernel, one key split,
    used for prefill: each K/V tile is read once per KV head), or a dispatcher impl."""
    def fn(q, k, v):
        start = jnp.zeros((q.shape[0],), jnp.int32)
        if impl.startswith("pallas"):
            return flash.attention(q, k, v, start=start, q_offset=q_offset, kv_len=kv_len, kind=kind,
                                   block_size=block_size, **_pallas_options(impl, tiles))
        return pallas_kernels.attention(q, k, v, start=start, q_offset=q_offset, kv_len=kv_len,
                                        kind=kind, block_size=block_size, impl=impl)
    return jax.jit(fn)


# the "pallas*" forward+backward rows: Tiles overrides on the mosaic backends (the GPU interpreter off a GPU)
GRAD_TILES = {
    # the default before the H200 session of 2026-11-26: one-warpgroup forward, Triton backward
    "pallas-triton-bwd": dict(mosaic_warp_specialized=False, mosaic_backward=False),
    "pallas-mosaic-bwd": dict(mosaic_warp_specialized=False, mosaic_backward=True),
    "pallas-mosaic-ws-bwd": dict(mosaic_warp_specialized=True, mosaic_pingpong=True, mosaic_backward=True,
                                 mosaic_backward_warp_specialized=True),
}


def _grad_fn(impl: str, *, kind, block_size, tiles):
    """jit(grad) of sum(attention * w): forward plus backward, as a training step runs them. impl
    "pallas" (the defaults: on Hopper the warp-specialised Mosaic forward and the Mosaic backward),
    "pallas-triton-bwd" (one-warpgroup Mosaic forward, Triton backward kernels), "pallas-mosaic-bwd"
    (one-warpgroup forward, the Mosaic backward of mosaic_backward.py), "pallas-mosaic-ws-bwd" (both
    warp-specialised, with the ping-pong), or a dispatcher impl. Off a GPU the mosaic ones interpret."""
    def loss(q, k, v, w):
        start = jnp.zeros((q.shape[0],), jnp.int32)
        if impl in GRAD_TILES:
            backend = "mosaic" if jax.default_backend() == "gpu" else "mosaic_interpret"
            out = flash.attention(q, k, v, start=start, kind=kind, block_size=block_size, backend=backend,
                                  variant="prefill", tiles=dataclasses.replace(tiles, **GRAD_TILES[impl]))
        elif impl == "pallas":
            out = flash.attention(q, k, v, start=start, kind=kind, block_size=block_size, tiles=tiles)
        else:
            out = pallas_kernels.attention(q, k, v, start=start, kind=kind, block_size=block_size,
                                           impl=impl)
        return jnp.sum(out.astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


# --window-sweep: the window kernel's Tiles variants timed beside its defaults (key tile, software
# pipeline depth, warps, packed rows per program, key splits)
# (fewer splits write fewer float32 partials: the default's ~33 at T=32, S=16k write 0.26x the K/V
# bytes they read, and the merge reads them back)
WINDOW_SWEEP = ([(f"bk{bk} st{st} w{nw}", dict(block_k=bk, num_stages=st, num_warps=nw))
                 for bk in (32, 64, 128) for st in (2, 3, 4) for nw in (4, 8)]
                + [(f"bk64 splits{n}", dict(block_k=64, num_splits=n)) for n in (8, 16, 32, 64, 128)]
                + [(f"bk64 br{br}", dict(block_k=64, block_r=br)) for br in (16, 32, 64)])


# --kv-cache int8: the window kernel over an int8 cache (its scales beside it), its Tiles variants
# timed beside the defaults (one_row=False: a one-row window through the tensor-core dot, as before
# `flash._attend_one_row`)
INT8_SWEEP = ([(f"bk{bk} w{nw}", dict(block_k=bk, num_warps=nw)) for bk in (32, 64, 128) for nw in (4, 8)]
              + [(f"bk64 splits{n}", dict(block_k=64, num_splits=n)) for n in (16, 32, 64)]
              + [("dot", dict(one_row=False)), ("prefetch", dict(one_row_prefetch=True)),
                 ("prefetch w8", dict(one_row_prefetch=True, num_warps=8)),
                 ("prefetch bk32", dict(one_row_prefetch=True, block_k=32)),
                 # grouped heads (--kv-heads < --heads): a one-row program per query head
                 ("heads", dict(one_row_heads=True)), ("heads prefetch", dict(one_row_heads=True,
                                                                                one_row_prefetch=True)),
                 # windows of several rows (T > 1, or grouped heads): V read as int32 words, unpacked on chip
                 ("words", dict(int8_v_words=True)), ("words w4", dict(int8_v_words=True, num_warps=4)),
                 ("words bk32", dict(int8_v_words=True, block_k=32)),
                 ("bytes", dict(int8_v_words=False))])


def _int8_fn(*, kind, block_size, q_offset, kv_len, tiles):
    """The window kernel over an int8 cache: fn(q, k, v, k_scale, v_scale)."""
    def fn(q, k, v, ks, vs):
        start = jnp.zeros((q.shape[0],), jnp.int32)
        return flash.attention(q, k, v, start=start, q_offset=q_offset, kv_len=kv_len, kind=kind,
                               block_size=block_size, variant="window", tiles=tiles, k_scale=ks, v_scale=vs)
    return jax.jit(fn)


def _xla_fits(B, H, T, S, budget_bytes) -> bool:
    return 3 * B * H * T * S * 4 <= budget_bytes  # f32 scores, probabilities and a temporary


def progress(t0: float, part: str, row: dict) -> None:
    """One line per case as it finishes (a full run takes minutes)."""
    what = " ".join(f"{k}={row[k]}" for k in ("mask", "T", "S", "impl") if k in row)
    if "skipped" in row:
        fig = f"skipped: {row['skipped'][:100]}"
    elif "gbps" in row:
        fig = f"{row['ms']:.3f} ms, {row['gbps']:.1f} GB/s = {100 * row['frac_of_copy']:.1f}% of copy"
    else:
        fig = f"{row['ms']:.3f} ms, {row['tflops']:.2f} TFLOP/s = {100 * row['frac_of_matmul']:.1f}% of matmul"
    print(f"[{time.perf_counter() - t0:7.1f}s] {part:<8} {what:<55} {fig}", flush=True)


def run(args, save=None) -> dict:
    """The benchmark's rows; `save(partial_result)`, when given, is called after each window row, so
    a run stopped by a time limit (a device lease's) leaves what it timed."""
    t0 = time.perf_counter()
    dev = jax.devices()[0]
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.dtype(args.dtype)
    seqs = args.seq or (QUICK_SEQ if args.quick else FULL_SEQ)
    impls = args.impls.split(",")
    if not on_gpu:
        impls = [i for i in impls if i != "cudnn"]
    mem = getattr(dev, "memory_stats", lambda: None)() or {}
    budget = int(0.5 * mem.get("bytes_limit", 16 << 30))
    tiles = flash.Tiles(**({} if on_gpu else dict(block_q=32, block_k=32, block_r=32)))
    result = {
        "device": getattr(dev, "device_kind", str(dev)), "platform": jax.default_backend(),
        "jax": jax.__version__, "pallas_backend": flash.default_backend(),
        "mode": "quick" if args.quick else "full", "dtype": str(dtype),
        "shape": dict(B=args.batch, H=args.heads, KV=args.kv_heads, D=args.head_dim),
        "iters": args.iters,
    }
    n_mm = 512 if args.quick else 8192
    result["matmul_tflops"] = matmul_tflops(n_mm, dtype, args.iters)
    result["copy_gbps"] = copy_gbps((16 << 20) if args.quick else (1 << 30), args.iters)
    print(f"[{time.perf_counter() - t0:7.1f}s] device {result['device']}: matmul {result['matmul_tflops']:.1f} "
          f"TFLOP/s, copy {result['copy_gbps']:.0f} GB/s (read + write)", flush=True)

    rows = []
    B, H, KV, D = args.batch, args.heads, args.kv_heads, args.head_dim
    for kind, bs in (() if args.window_only else MASKS):
        for S in seqs:
            q, k, v = _inputs(B, S, S, H, KV, D, dtype)
            flops = 4 * B * H * D * visible_pairs(S, S, kind, bs)
            for impl in [i for i in impls if not i.endswith("-bwd")]:  # those only time the backward
                row = dict(mask=f"{kind}" + (f"(B={bs})" if kind == "block_causal" else ""), S=S,
                           impl=impl)
                if impl == "xla" and not _xla_fits(B, H, S, S, budget):
                    row["skipped"] = "XLA reference scores do not fit in memory"
                else:
                    try:
                        fn = _attn_fn(impl, kind=kind, block_size=bs, q_offset=0, kv_len=S, tiles=tiles)
                        sec = bench(fn, q, k, v, iters=args.iters)
                        row.update(ms=sec * 1e3, tflops=flops / sec / 1e12,
                                   frac_of_matmul=flops / sec / 1e12 / result["matmul_tflops"])
                    except Exception as e:  # noqa: BLE001 (a baseline that cannot run is recorded, not fatal)
                        row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                progress(t0, "prefill", row)
                rows.append(row)
    result["prefill"] = rows

    brows = []
    for kind, bs in (MASKS if args.backward and not args.window_only else ()):
        for S in seqs:
            q, k, v = _inputs(B, S, S, H, KV, D, dtype)
            w = jnp.ones(q.shape, jnp.float32)
            flops = 2.5 * 4 * B * H * D * visible_pairs(S, S, kind, bs)  # forward + backward (5 matmuls)
            for impl in [i for i in impls if i in ("pallas", *GRAD_TILES, "xla")]:
                row = dict(mask=f"{kind}" + (f"(B={bs})" if kind == "block_causal" else ""), S=S,
                           impl=impl + "+grad")
                if impl == "xla" and not _xla_fits(B, H, S, S, budget // 2):
                    row["skipped"] = "XLA reference scores do not fit in memory"
                else:
                    try:
                        sec = bench(_grad_fn(impl, kind=kind, block_size=bs, tiles=tiles), q, k, v, w,
                                    iters=args.iters)
                        row.update(ms=sec * 1e3, tflops=flops / sec / 1e12,
                                   frac_of_matmul=flops / sec / 1e12 / result["matmul_tflops"])
                    except Exception as e:  # noqa: BLE001
                        row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                progress(t0, "fwd+bwd", row)
                brows.append(row)
    result["forward_backward"] = brows

    wrows = result["window"] = []
    result["window_timing"] = "loop"  # see loop_seconds; absent in JSON written before: one dispatch per call
    for T in args.window:
        for S in seqs:
            if S <= T:
                continue
            q, k, v = _inputs(B, T, S, H, KV, D, dtype, seed=1)
            nbytes = 2 * B * KV * S * D * dtype.itemsize  # K and V of every visible slot
            variants = [(i, tiles) for i in ("pallas", "xla") if i in impls]
            if args.kv_cache == "int8":  # the same K / V quantized: one byte per element + a scale per key
                from jdllm.model import quantize_kv  # noqa: PLC0415
                (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
                variants += [(f"pallas int8 {name}".rstrip(), dataclasses.replace(tiles, **kw))
                             for name, kw in [("", {})] + (INT8_SWEEP if args.window_sweep else [])
                             if not name or not args.sweep_only or name in args.sweep_only]
            if args.window_sweep:  # the window kernel's tiles (issue 28: its long-context rate)
                variants += [(f"pallas {name}", dataclasses.replace(tiles, **kw)) for name, kw in WINDOW_SWEEP
                             if not args.sweep_only or name in args.sweep_only]
                if "pallas" in impls:  # the defaults once more, last: how far two timings of one kernel differ
                    variants.append(("pallas (defaults again)", tiles))
            for impl, vtiles in variants:
                row = dict(mask=f"block_causal(B={T})", T=T, S=S, impl=impl)
                int8 = impl.startswith("pallas int8")
                try:
                    mk = _int8_fn if int8 else functools.partial(_attn_fn, impl.split()[0])
                    fn = mk(kind="block_causal", block_size=T, q_offset=S - T, kv_len=S, tiles=vtiles)
                    # a window takes tens of microseconds: chained in one compiled loop, not one
                    # dispatch per call (the H200 run of 2026-11-26 timed dispatches: 0.12-0.32 ms)
                    sec = loop_seconds(fn, q, *((k8, v8, ks, vs) if int8 else (k, v)), iters=args.iters)
                    # (int8: one byte per element and a float32 scale per key and KV head, K and V)
                    gbps = (nbytes // dtype.itemsize + 2 * B * KV * S * 4 if int8 else nbytes) / sec / 1e9
                    row.update(ms=sec * 1e3, gbps=gbps, frac_of_copy=gbps / result["copy_gbps"])
                except Exception as e:  # noqa: BLE001
                    row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                progress(t0, "window", row)
                wrows.append(row)
                if save is not None:
                    save(dict(result, partial=True))
    return result


def print_table(res: dict) -> None:
    print(f"device: {res['device']} ({res['platform']}, Pallas backend {res['pallas_backend']}), "
          f"jax {res['jax']}, mode {res['mode']}, {res['dtype']}, shape {res['shape']}")
    print(f"measured matmul: {res['matmul_tflops']:.3f} TFLOP/s; copy: {res['copy_gbps']:.1f} GB/s")
    print(f"\n{'mask':<20}{'S':>7}  {'impl':<22}{'ms':>10}{'TFLOP/s':>10}{'vs cudnn':>10}")
    by = {(r["mask"], r["S"], r["impl"]): r for r in res["prefill"]}
    for r in res["prefill"] + res["forward_backward"]:
        if "skipped" in r:
            print(f"{r['mask']:<20}{r['S']:>7}  {r['impl']:<22}  skipped: {r['skipped']}")
            continue
        base = by.get((r["mask"], r["S"], "cudnn"), {})
        rel = f"{base['ms'] / r['ms']:.2f}x" if "ms" in base else "-"
        print(f"{r['mask']:<20}{r['S']:>7}  {r['impl']:<22}{r['ms']:>10.3f}{r['tflops']:>10.3f}{rel:>10}")
    print(f"\n{'window':<20}{'T':>4}{'S':>7}  {'impl':<26}{'ms':>10}{'GB/s':>10}{'of copy':>10}")
    # (--window-sweep rows: "pallas <tiles>"; the fastest per T and S is what the defaults should be)
    for r in res["window"]:
        if "skipped" in r:
            print(f"{r['mask']:<20}{r['T']:>4}{r['S']:>7}  {r['impl']:<26}  skipped: {r['skipped']}")
            continue
        print(f"{r['mask']:<20}{r['T']:>4}{r['S']:>7}  {r['impl']:<26}{r['ms']:>10.3f}{r['gbps']:>10.2f}"
              f"{100 * r['frac_of_copy']:>9.1f}%")


RESULTS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
BEGIN = "<!-- benchmarks/attention.py:begin (generated by `python benchmarks/attention.py --markdown --write-results-md`) -->"
END = "<!-- benchmarks/attention.py:end -->"


def markdown(res: dict) -> str:
    """The JSON's rows as tables, each figure with its fraction of the device limit measured in the run."""
    out = [f"Device {res['device']} ({res['platform']}, Pallas backend {res['pallas_backend']}), jax {res['jax']}, "
           f"{res['mode']} mode, {res['dtype']}, shape {res['shape']}; measured bf16 matmul "
           f"{res['matmul_tflops']:.1f} TFLOP/s, copy {res['copy_gbps']:.0f} GB/s (read + write)"
           + (f"; {res['when']}" if res.get("when") else "")
           + (f" (the prefill rows: {res['prefill_when']})" if res.get("prefill_when") else "") + ".\n"]
    if res.get("partial"):
        out.append("**A partial run**: it was stopped after the last window row below (the rows it had not "
                   "reached are missing).\n")
    if res["platform"] != "gpu":
        out.append("**Not a GPU run**: on the CPU the Pallas kernels are interpreted; these rows prove the script "
                   "runs and say nothing about speed.\n")

    def table(header, rule, rows, keys, figures):
        """A markdown table: each row's key cells, then its figures (or why it was skipped)."""
        if not rows:
            return []
        lines = [header, rule]
        for r in rows:
            figs = [f"skipped: {r['skipped'][:80]}", "", ""] if "skipped" in r else figures(r)
            lines.append("| " + " | ".join([str(r[k]) for k in keys] + figs) + " |")
        return lines + [""]

    out += table("| mask | S | impl | ms | TFLOP/s | of matmul |", "|---|---:|---|---:|---:|---:|",
                 res["prefill"] + res.get("forward_backward", []), ("mask", "S", "impl"),
                 lambda r: [f"{r['ms']:.3f}", f"{r['tflops']:.2f}", f"{100 * r['frac_of_matmul']:.1f}%"])
    if res["window"]:
        out.append("Window rows: " + ("each call timed inside one compiled loop of chained calls."
                                      if res.get("window_timing") == "loop" else
                                      "**one dispatch per call**, so for kernels of tens of microseconds they time "
                                      "the dispatch, not the kernel (later runs chain the calls in a compiled loop)")
                   + "\n")
    out += table("| window | T | S | impl | ms | GB/s | of copy |", "|---|---:|---:|---|---:|---:|---:|",
                 res["window"], ("mask", "T", "S", "impl"),
                 lambda r: [f"{r['ms']:.3f}", f"{r['gbps']:.1f}", f"{100 * r['frac_of_copy']:.1f}%"])
    return "\n".join(out)


def write_results_md(text: str, path: str = RESULTS_MD) -> None:
    """Put `text` between the markers in RESULTS.md (after the section's heading if they are missing)."""
    with open(path) as f:
        md = f.read()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in md and END in md:
        md = md[:md.index(BEGIN)] + block + md[md.index(END) + len(END):]
    else:
        head = "## Attention kernels (`benchmarks/attention.py`)\n"
        md = md.replace(head, f"{head}\n{block}\n", 1) if head in md else md + f"\n{block}\n"
    with open(path, "w") as f:
        f.write(md)


def parse(argv=None):
    """The command line, checked (sweep labels known, --sweep-only with --window-sweep)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (S = 64, 128): proves the script runs; on the CPU the "
                         "Pallas kernels are interpreted, so the timings say nothing about speed")
    ap.add_argument("--seq", type=int, nargs="*", help="sequence / cache lengths (default: per mode)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, nargs="+", default=[32, 128],
                    help="window lengths T (each its block size too; default 32 128)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--impls", default="pallas,pallas-mosaic-1wg,pallas-mosaic-ws,pallas-triton,pallas-packed,cudnn,xla,"
                                       "pallas-triton-bwd,pallas-mosaic-bwd",
                    help="implementations to time (prefill: all but the *-bwd ones; window: pallas and xla; with "
                         "--backward: pallas, pallas-triton-bwd, pallas-mosaic-bwd, pallas-mosaic-ws-bwd and xla); "
                         "the pallas-mosaic* ones are recorded as skipped off Hopper")
    ap.add_argument("--window-sweep", action="store_true",
                    help="also time the window kernel with each Tiles variant of WINDOW_SWEEP (key tile, stages, "
                         "warps, splits, packed rows) at every window length and S")
    ap.add_argument("--sweep-only", default=None, type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
                    help="with --window-sweep: only these WINDOW_SWEEP (and, with --kv-cache int8, INT8_SWEEP) "
                         "labels, comma-separated (e.g. 'bk32 st3 w4,bk64 st2 w4,bk64 splits16' or 'dot,prefetch')")
    ap.add_argument("--kv-cache", choices=("int8",), default=None,
                    help="also time the window kernel over the same K / V as an int8 cache (jdllm's kv_cache='int8': "
                         "read as int8, scaled on chip); with --window-sweep, INT8_SWEEP's Tiles variants too")
    ap.add_argument("--window-only", action="store_true", help="time the windows alone (no prefill, no backward)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--backward", action="store_true",
                    help="also time forward+backward (jax.grad) for Pallas and XLA")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "attention.json"))
    ap.add_argument("--markdown", action="store_true", help="print the tables of --out and exit")
    ap.add_argument("--write-results-md", action="store_true", help="with --markdown: also into RESULTS.md")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.sweep_only or ()) - {name for name, _ in WINDOW_SWEEP + INT8_SWEEP})
    if unknown:
        ap.error(f"--sweep-only: {unknown} are not WINDOW_SWEEP / INT8_SWEEP labels "
                 f"({', '.join(n for n, _ in WINDOW_SWEEP + INT8_SWEEP)})")
    if args.sweep_only and not args.window_sweep:
        ap.error("--sweep-only selects among --window-sweep's variants: add --window-sweep")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.markdown:
        with open(args.out) as f:
            text = markdown(json.load(f))
        print(text)
        if args.write_results_md:
            write_results_md(text)
            print(f"# wrote the tables into {RESULTS_MD}")
        return 0
    args.batch = args.batch or 1
    args.heads = args.heads or (2 if args.quick else 32)
    args.kv_heads = args.kv_heads or (1 if args.quick else 8)
    args.iters = args.iters or (2 if args.quick else 10)
    if args.quick:
        args.window = sorted({min(t, 16) for t in args.window})
    old = None
    if args.window_only and os.path.exists(args.out):  # keep the prefill rows a full run of this device wrote
        with open(args.out) as f:
            old = json.load(f)

    def save(res: dict) -> None:
        res["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        if old is not None and old.get("device") == res["device"] and old.get("prefill"):
            res.update(prefill=old["prefill"], forward_backward=old.get("forward_backward", []),
                       prefill_when=old.get("prefill_when", old.get("when")))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    res = run(args, save=save)
    save(res)
    print()
    print_table(res)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
