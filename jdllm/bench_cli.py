"""`jdllm bench MODEL`: decode speed of one paradigm on a model directory.

Random prompts (token ids drawn below the model's special ids), stop tokens
off so every row generates --max-new-tokens; per batch size one compile call,
then --repeats timed calls (best kept). Prints tokens/s, NFE and tokens per
forward (TPF); --json writes the rows. The paradigm options are those of
`jdllm generate`. (benchmarks/decode.py is the fuller comparison with
transformers.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jdllm.generate_cli import add_paradigm_arguments  # noqa: PLC0415

    p.add_argument("model", help="Hugging Face model directory or jdllm checkpoint")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attn-impl", default="auto", choices=("auto", "xla", "pallas", "cudnn"))
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    add_paradigm_arguments(p)


def run(args) -> int:
    import numpy as np  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.generate_cli import decoding_from_args  # noqa: PLC0415

    if min(args.batch) < 1 or args.prompt_len < 1 or args.repeats < 1:
        raise jdllm.errors.InputError(
            f"--batch {args.batch}, --prompt-len {args.prompt_len} and --repeats {args.repeats} must be >= 1")
    model = jdllm.load(args.model, dtype=args.dtype, attn_impl=args.attn_impl)
    cfg = model.config
    decoding = decoding_from_args(args, cfg, command="bench")
    sampling = jdllm.Sampling(max_new_tokens=args.max_new_tokens, stop_token_ids=())
    specials = [t for t in (cfg.mask_token_id, cfg.pad_token_id, cfg.bos_token_id, *cfg.eos_token_ids)
                if t is not None]
    high = min(specials) if specials and min(specials) > 1 else cfg.vocab_size
    rng = np.random.default_rng(args.seed)
    rows = []
    print(f"{type(decoding).name}: {decoding}", file=sys.stderr)
    print("| batch | tokens/s | NFE / row | TPF | first call (s) |\n|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        prompts = rng.integers(0, high, size=(batch, args.prompt_len)).tolist()
        t0 = time.perf_counter()
        jdllm.generate(model, prompts, decoding, sampling)
        first = time.perf_counter() - t0
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = jdllm.generate(model, prompts, decoding, sampling)
            best = min(best, time.perf_counter() - t0)
        toks = sum(len(o.token_ids) for o in outs)
        nfe = float(np.mean([o.nfe for o in outs]))
        tpf = float(np.mean([len(o.token_ids) / o.nfe for o in outs]))
        rows.append(dict(batch=batch, tokens=toks, seconds=best, tokens_per_s=toks / best, nfe=nfe, tpf=tpf,
                         first_call_s=first))
        print(f"| {batch} | {toks / best:.1f} | {nfe:.1f} | {tpf:.2f} | {first:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, paradigm=type(decoding).name, decoding=repr(decoding),
                           prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens, rows=rows), f, indent=2)
    return 0
