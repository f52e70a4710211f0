"""Decode speed: tokens/s, NFE and tokens per forward (TPF) per paradigm and batch size.

One small random Qwen3-architecture model, built with `transformers` and
loaded into jdllm from the same saved directory, so the AR baseline
(`transformers` `generate()`, greedy, same weights, same machine) produces the
tokens jdllm must reproduce. The block-diffusion rows run the same weights as
an SDAR-style block-causal model (mask token = the last id): the speed of the
decode engine, not the quality of a random model, is measured.

Every configuration runs once to compile, then `--repeats` timed runs (best
taken). Stop tokens are disabled so every row generates `--new` tokens.
TPF = generated tokens / forwards (per row, prefill and KV commits counted).

    python benchmarks/decode.py                      # batch 1, 8, 32
    python benchmarks/decode.py --batches 1 --new 32 # quick
    python benchmarks/decode.py --mb-only            # multi_block rows only (cache on/off, gen 64/256/1024)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jdllm  # noqa: E402
from jdllm.decode.block_diffusion import STRATEGIES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_model(tmp: str, args):
    """(transformers model, jdllm causal Model, jdllm block-causal Model) on the same weights."""
    import torch  # noqa: PLC0415

    from tests.hf_fixtures import make_transformers_model  # noqa: PLC0415

    hf = make_transformers_model("qwen3", seed=0, vocab_size=args.vocab, hidden_size=args.hidden,
                                 intermediate_size=args.hidden * 3, layers=args.layers, heads=args.heads,
                                 kv_heads=max(1, args.heads // 2), head_dim=args.hidden // args.heads,
                                 max_position_embeddings=1024)
    with torch.no_grad():  # peaked distributions: greedy comparisons are not decided by ties
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    hf.save_pretrained(tmp)
    ar = jdllm.load(tmp, dtype="float32")
    cfg = ar.config.replace(attention="block_causal", block_size=args.block, mask_token_id=args.vocab - 1)
    bd = jdllm.Model(cfg, ar.params, attn_impl=ar.attn_impl)
    return hf, ar, bd


def timed(fn, repeats: int, with_first: bool = False):
    """Best wall time of `repeats` calls after a compiling / warm-up call, and the last output.

    with_first: also return the first call's time (compile included)."""
    t = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return (best, out, first) if with_first else (best, out)


def run_jdllm(model, prompts, decoding, new: int, repeats: int):
    sampling = jdllm.Sampling(max_new_tokens=new, stop_token_ids=())
    dt, outs = timed(lambda: jdllm.generate(model, prompts, decoding, sampling), repeats)
    toks = sum(len(o.token_ids) for o in outs)
    nfe = float(np.mean([o.nfe for o in outs]))
    return dict(seconds=dt, tokens=toks, tokens_per_s=toks / dt, nfe=nfe,
                tpf=float(np.mean([len(o.token_ids) / o.nfe for o in outs]))), outs


def run_transformers(hf, prompts, new: int, repeats: int):
    import torch  # noqa: PLC0415

    x = torch.tensor(prompts)
    mask = torch.ones_like(x)

    def gen():
        with torch.no_grad():
            return hf.generate(x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               eos_token_id=None, pad_token_id=0)

    dt, out = timed(gen, repeats)
    toks = len(prompts) * new
    return dict(seconds=dt, tokens=toks, tokens_per_s=toks / dt, nfe=float(new), tpf=1.0), \
        out[:, len(prompts[0]):].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=32, help="prompt length (tokens)")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--threshold", type=float, default=0.6,
                    help="low_confidence_dynamic threshold (random weights are rarely 0.9-confident)")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8],
                    help="batch sizes for the transformers baseline")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch threads for the baseline (1 is fastest for this model on a shared 2-core CPU: "
                         "with 2, OpenMP waits cost ~100x per forward)")
    ap.add_argument("--machine", default=f"{platform.machine()} CPU, {os.cpu_count()} cores")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "decode.json"))
    ap.add_argument("--masked-gen-lengths", type=int, nargs="*", default=[64, 256, 1024],
                    help="masked_diffusion generation lengths (none: skip it)")
    ap.add_argument("--masked-block", type=int, default=32, help="masked_diffusion block_length")
    ap.add_argument("--masked-tokens-per-step", type=int, default=4, help="masked_diffusion schedule rate")
    ap.add_argument("--masked-threshold-max-len", type=int, default=256,
                    help="longest generation run with the threshold decoding (one forward per token on random "
                         "weights: bounds the CPU time)")
    ap.add_argument("--masked-only", action="store_true",
                    help="run only the masked_diffusion rows (written to benchmarks/out/decode_masked.json)")
    ap.add_argument("--mb-gen-lengths", type=int, nargs="*", default=[64, 256, 1024],
                    help="multi_block generation lengths (none: skip it)")
    ap.add_argument("--mb-block", type=int, default=32, help="multi_block block_size")
    ap.add_argument("--mb-max-blocks", type=int, default=None,
                    help="multi_block max_blocks (blocks in flight); default: none, the MultiBlock default "
                         "(d3LLM's, uncapped). The multi_block rows in RESULTS.md before issue 11 used 4")
    ap.add_argument("--mb-entropy", type=float, default=0.9, help="multi_block entropy_threshold")
    ap.add_argument("--mb-only", action="store_true",
                    help="run only the multi_block rows (written to benchmarks/out/decode_multi_block.json)")
    args = ap.parse_args(argv)

    import torch  # noqa: PLC0415
    torch.set_num_threads(args.torch_threads)
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, ar, bd = build_model(tmp, args)
        if args.mb_only:
            return write_multi_block(multi_block_rows(ar, args, np.random.default_rng(2)), args)
        masked = masked_diffusion_rows(ar, args, np.random.default_rng(1)) if args.masked_gen_lengths else []
        if args.masked_only:  # rows of other generation lengths already in the file are kept
            out = os.path.join(ROOT, "benchmarks", "out", "decode_masked.json")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            if os.path.exists(out):
                with open(out) as f:
                    kept = [r for r in json.load(f).get("rows", []) if r["gen_length"] not in args.masked_gen_lengths]
                masked = sorted(kept + masked, key=lambda r: r["gen_length"])
            with open(out, "w") as f:
                json.dump(dict(machine=args.machine, backend=jax.default_backend(), jax=jax.__version__,
                               model=dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                                          heads=args.heads, dtype="float32"), prompt_len=args.prompt,
                               rows=masked), f, indent=2)
            print("\n" + masked_table(masked) + f"\n\nwrote {out}")
            return 0
        for batch in args.batches:
            prompts = rng.integers(0, args.vocab - 2, size=(batch, args.prompt)).tolist()
            r, outs = run_jdllm(ar, prompts, jdllm.AR(), args.new, args.repeats)
            ar_tokens = [o.token_ids for o in outs]
            rows.append(dict(engine="jdllm", paradigm="ar", strategy="-", batch=batch, **r))
            print(_line(rows[-1]), flush=True)
            if batch in args.hf_batches:
                r, hf_tokens = run_transformers(hf, prompts, args.new, args.repeats)
                same = hf_tokens == ar_tokens
                rows.append(dict(engine="transformers", paradigm="ar", strategy="generate()", batch=batch,
                                 identical_to_jdllm_ar=same, **r))
                print(_line(rows[-1]), f"identical greedy tokens: {same}", flush=True)
            fused_tokens = None
            for strategy, fuse in [(s, True) for s in STRATEGIES] + [("low_confidence_static", False)]:
                dec = jdllm.BlockDiffusion(block_length=args.block, denoising_steps=args.block // 2 or 1,
                                           strategy=strategy, confidence_threshold=args.threshold,
                                           fuse_commit=fuse)
                r, outs = run_jdllm(bd, prompts, dec, args.new, args.repeats)
                extra = {}
                if strategy == "low_confidence_static" and fuse:
                    fused_tokens = [o.token_ids for o in outs]
                elif not fuse:  # SDAR's schedule: one commit forward per block
                    extra = dict(identical_to_fused=[o.token_ids for o in outs] == fused_tokens)
                name = strategy if fuse else f"{strategy} (unfused commit)"
                rows.append(dict(engine="jdllm", paradigm="block_diffusion", strategy=name, batch=batch,
                                 fuse_commit=fuse, **extra, **r))
                print(_line(rows[-1]), *(f"{k}: {v}" for k, v in extra.items()), flush=True)
    speedup = {}
    for batch in args.batches:
        j = [r for r in rows if r["engine"] == "jdllm" and r["paradigm"] == "ar" and r["batch"] == batch]
        h = [r for r in rows if r["engine"] == "transformers" and r["batch"] == batch]
        if j and h:
            speedup[batch] = j[0]["tokens_per_s"] / h[0]["tokens_per_s"]
    result = dict(machine=args.machine, backend=jax.default_backend(), jax=jax.__version__,
                  model=dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                             block=args.block, dtype="float32"),
                  prompt_len=args.prompt, new_tokens=args.new, repeats=args.repeats,
                  threshold=args.threshold, torch_threads=args.torch_threads, rows=rows,
                  ar_speedup_vs_transformers=speedup)
    result["masked_diffusion"] = masked
    result["multi_block"] = mb = multi_block_rows(ar, args, np.random.default_rng(2)) if args.mb_gen_lengths else []
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print()
    print(table(result))
    if masked:
        print("\n" + masked_table(masked))
    if mb:
        print("\n" + multi_block_table(mb))
    print(f"\nwrote {args.out}")
    return 0


# --------------------------------------------------------------------------- masked_diffusion (LLaDA / Fast-dLLM)
def cache_run_fields(outs, toks, base_toks, best: float, first: float) -> dict:
    """Speed figures of one timed run and the fraction of its tokens that differ from the cache-off run."""
    nfe = float(np.mean([o.nfe for o in outs]))
    return dict(seconds=best, first_call_s=first, tokens=int(toks.size), tokens_per_s=toks.size / best, nfe=nfe,
                tpf=toks.size / len(outs) / nfe, diff_vs_none=float(np.mean(toks != base_toks)))


def print_cache_row(label: str, r: dict) -> None:
    print(f"{label} {r['tokens_per_s']:9.1f} tok/s  NFE {r['nfe']:6.1f}  TPF {r['tpf']:5.2f}  "
          f"diff vs none {r['diff_vs_none']:.3f}  first call {r['first_call_s']:5.1f}s", flush=True)


def masked_diffusion_rows(ar, args, rng) -> list[dict]:
    """masked_diffusion per generation length and cache mode, batch 1, on the same weights run as a
    bidirectional LLaDA-like model (mask token = the last id).

    Two decodings: LLaDA's schedule at a fixed --masked-tokens-per-step (the NFE is set by the
    schedule, so every length finishes in bounded CPU time) and Fast-dLLM's threshold (--threshold;
    one forward per token while the random model is unsure), the latter only up to
    --masked-threshold-max-len. `diff_vs_none` is the fraction of generated tokens that differ from
    the cache_mode="none" run of the same decoding (the prefix / dual caches are approximations).
    `first_call_s` includes the compile (the prefix cache compiles one window per block).
    """
    ctx_len = max(ar.config.max_position_embeddings, args.prompt + max(args.masked_gen_lengths))  # RoPE: any length
    cfg = ar.config.replace(attention="bidirectional", mask_token_id=args.vocab - 1, max_position_embeddings=ctx_len)
    model = jdllm.Model(cfg, ar.params, attn_impl=ar.attn_impl)
    prompts = rng.integers(0, args.vocab - 2, size=(1, args.prompt)).tolist()
    rows = []
    for G in args.masked_gen_lengths:
        Bl = min(args.masked_block, G)
        decodings = {f"schedule {args.masked_tokens_per_step}/step": dict(steps=G // args.masked_tokens_per_step)}
        if G <= args.masked_threshold_max_len:
            decodings[f"threshold {args.threshold}"] = dict(confidence_threshold=args.threshold)
        repeats = args.repeats if G < 1024 else 1
        for label, kw in decodings.items():
            base = None
            for cache in ("none", "prefix", "dual"):
                dec = jdllm.MaskedDiffusion(block_length=Bl, cache_mode=cache, **kw)
                sampling = jdllm.Sampling(max_new_tokens=G, stop_token_ids=())
                best, outs, first = timed(lambda: jdllm.generate(model, prompts, dec, sampling), repeats,
                                          with_first=True)
                toks = np.concatenate([o.token_ids for o in outs])
                base = toks if base is None else base
                rows.append(dict(engine="jdllm", paradigm="masked_diffusion", strategy=label, cache=cache,
                                 gen_length=G, block_length=Bl, batch=len(prompts),
                                 **cache_run_fields(outs, toks, base, best, first)))
                print_cache_row(f"masked_diffusion G={G:5d} {label:16s} cache={cache:6s}", rows[-1])
    return rows


def masked_table(rows) -> str:
    lines = ["| gen length | decoding | cache | tokens/s | NFE | TPF | tokens differing from cache=none | "
             "first call (s, incl. compile) |", "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['gen_length']} | {r['strategy']} | {r['cache']} | {r['tokens_per_s']:.1f} | "
                     f"{r['nfe']:.0f} | {r['tpf']:.2f} | {r['diff_vs_none']:.3f} | {r['first_call_s']:.1f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- multi_block (d3LLM)
def multi_block_rows(ar, args, rng) -> list[dict]:
    """multi_block per generation length, batch 1, on the same weights run as an SDAR-like block-causal
    model (block grid --mb-block) and as a LLaDA-like bidirectional one (mask token = the last id).

    Block-causal: cache_mode="none" (every step one forward over the whole canvas) vs the exact KV cache
    (`identical_to_none`: same tokens and step map). Bidirectional: cache_mode="none" vs the approximate
    caches, d3LLM's delayed prefix cache ("approx") and jdllm's windowed one ("window"), both at
    cache_delay_iter=1, refresh_interval=10000 (`diff_vs_none` is the fraction of generated tokens
    that differ). 1024-token runs are timed once. `first_call_s` includes the compile.
    """
    models = {}
    for attention in ("block_causal", "bidirectional"):
        cfg = ar.config.replace(attention=attention, block_size=args.mb_block if attention == "block_causal" else 1,
                                mask_token_id=args.vocab - 1,  # RoPE positions have no hard limit
                                max_position_embeddings=max(ar.config.max_position_embeddings,
                                                            args.prompt + max(args.mb_gen_lengths)))
        models[attention] = jdllm.Model(cfg, ar.params, attn_impl=ar.attn_impl)
    prompts = rng.integers(0, args.vocab - 2, size=(1, args.prompt)).tolist()
    rows = []
    for G in args.mb_gen_lengths:
        repeats = args.repeats if G < 1024 else 1
        for attention, caches in (("block_causal", ("none", "exact")),
                                  ("bidirectional", ("none", "approx", "window"))):
            base = None
            for cache in caches:
                dec = jdllm.MultiBlock(block_size=args.mb_block, entropy_threshold=args.mb_entropy,
                                       max_blocks=args.mb_max_blocks, cache_mode=cache)
                sampling = jdllm.Sampling(max_new_tokens=G, stop_token_ids=())
                best, outs, first = timed(lambda: jdllm.generate(models[attention], prompts, dec, sampling),
                                          repeats, with_first=True)
                toks = np.concatenate([o.token_ids for o in outs])
                smap = np.concatenate([o.step_map for o in outs])
                if base is None:
                    base = (toks, smap)
                rows.append(dict(engine="jdllm", paradigm="multi_block", attention=attention, cache=cache,
                                 gen_length=G, block_size=args.mb_block, max_blocks=args.mb_max_blocks,
                                 entropy_threshold=args.mb_entropy, batch=len(prompts),
                                 **cache_run_fields(outs, toks, base[0], best, first),
                                 identical_to_none=bool(np.array_equal(toks, base[0])
                                                        and np.array_equal(smap, base[1]))))
                print_cache_row(f"multi_block G={G:5d} {attention:13s} cache={cache:6s}", rows[-1])
    return rows


def multi_block_table(rows) -> str:
    lines = ["| gen length | model | cache | tokens/s | NFE | TPF | speedup vs cache=none | "
             "tokens differing from cache=none | first call (s, incl. compile) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        none = [x for x in rows if x["gen_length"] == r["gen_length"] and x["attention"] == r["attention"]
                and x["cache"] == "none"]
        speed = r["tokens_per_s"] / none[0]["tokens_per_s"] if none else float("nan")
        lines.append(f"| {r['gen_length']} | {r['attention']} | {r['cache']} | {r['tokens_per_s']:.1f} | "
                     f"{r['nfe']:.0f} | {r['tpf']:.2f} | {speed:.2f}x | {r['diff_vs_none']:.3f} | "
                     f"{r['first_call_s']:.1f} |")
    return "\n".join(lines)


def write_multi_block(rows, args) -> int:
    out = os.path.join(ROOT, "benchmarks", "out", "decode_multi_block.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(machine=args.machine, backend=jax.default_backend(), jax=jax.__version__,
                       model=dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                  dtype="float32"), prompt_len=args.prompt, rows=rows), f, indent=2)
    print("\n" + multi_block_table(rows) + f"\n\nwrote {out}")
    return 0


def _line(r) -> str:
    return (f"{r['engine']:12s} {r['paradigm']:15s} {r['strategy']:38s} batch {r['batch']:3d}  "
            f"{r['tokens_per_s']:9.1f} tok/s  NFE {r['nfe']:6.1f}  TPF {r['tpf']:5.2f}")


def table(result) -> str:
    lines = ["| engine | paradigm | strategy | batch | tokens/s | NFE / row | TPF |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['engine']} | {r['paradigm']} | {r['strategy']} | {r['batch']} | "
                     f"{r['tokens_per_s']:.1f} | {r['nfe']:.1f} | {r['tpf']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
