"""`jdllm bench MODEL`: decode speed of one paradigm on a model directory.

Random prompts (token ids drawn below the model's special ids), stop tokens
off so every row generates --max-new-tokens; per batch size one compile call,
then --repeats timed calls (best kept). Prints tokens/s, NFE and tokens per
forward (TPF); --json writes the rows. For `--paradigm ar_spec` it also times plain AR on
the same target and prompts and prints the draft acceptance rate, the speedup and whether the
tokens are the same as AR's (they must be under greedy decoding). The paradigm options are those of
`jdllm generate`. (benchmarks/decode.py is the fuller comparison with
transformers.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jdllm.checkpoint import ATTN_IMPLS, DTYPES  # noqa: PLC0415
    from jdllm.generate_cli import (add_check_finite_argument, add_quantize_arguments,  # noqa: PLC0415
                                    add_paradigm_arguments)

    p.add_argument("model", help="Hugging Face model directory or jdllm checkpoint")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help=f"prompt tokens (default: {PROMPT_LEN}, or half the model's context if less)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens generated per row (default: {MAX_NEW_TOKENS}, or what the context leaves)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    add_quantize_arguments(p)
    p.add_argument("--attn-impl", default="auto", choices=ATTN_IMPLS)
    add_check_finite_argument(p)
    p.add_argument("--json", default=None, help="write the rows to this JSON file (its directory must exist)")
    add_paradigm_arguments(p)


PROMPT_LEN = 32
MAX_NEW_TOKENS = 64


def lengths(args, context: int) -> tuple[int, int]:
    """(prompt length, new tokens): the defaults shrunk to fit the model's context (with a note),
    explicit values checked against it."""
    from jdllm import errors  # noqa: PLC0415

    prompt = args.prompt_len if args.prompt_len is not None else min(PROMPT_LEN, context // 2)
    new = args.max_new_tokens if args.max_new_tokens is not None else min(MAX_NEW_TOKENS, context - prompt)
    if args.prompt_len is None and args.max_new_tokens is None and (prompt, new) != (PROMPT_LEN, MAX_NEW_TOKENS):
        errors.warn(f"the model's context is {context} tokens: benchmarking prompts of {prompt} tokens and "
                    f"{new} new tokens (set --prompt-len / --max-new-tokens to choose)")
    if prompt < 1 or new < 1 or prompt + new > context:
        raise errors.InputError(
            f"--prompt-len {prompt} + --max-new-tokens {new} must both be >= 1 and fit the model's context "
            f"of {context} tokens; lower them")
    return prompt, new


def run_command(args) -> int:
    import numpy as np  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.generate_cli import decoding_from_args, quantize_from_args  # noqa: PLC0415

    from jdllm.inputs import check_output_path  # noqa: PLC0415

    if min(args.batch) < 1 or args.repeats < 1:
        raise jdllm.errors.InputError(f"--batch {args.batch} and --repeats {args.repeats} must be >= 1")
    if not 0 <= args.seed < 2**32:
        raise jdllm.errors.InputError(f"--seed {args.seed} must be in [0, 2**32) (it seeds the random prompts)")
    if args.json:
        check_output_path(args.json, "--json", create_parents=False)  # before the benchmark, not after
    model = jdllm.load(args.model, dtype=args.dtype, attn_impl=args.attn_impl, check_finite=args.check_finite,
                       quantize=quantize_from_args(args), kv_cache=args.kv_cache)
    cfg = model.config
    args.prompt_len, args.max_new_tokens = lengths(args, cfg.max_position_embeddings)
    decoding = decoding_from_args(args, cfg, command="bench")
    sampling = jdllm.Sampling(max_new_tokens=args.max_new_tokens, stop_token_ids=())
    specials = [t for t in (cfg.mask_token_id, cfg.pad_token_id, cfg.bos_token_id, *cfg.eos_token_ids)
                if t is not None]
    high = min(specials) if specials and min(specials) > 1 else cfg.vocab_size
    rng = np.random.default_rng(args.seed)
    rows = []
    base = decoding.baseline()  # e.g. ar_spec: also plain AR on the same target and prompts
    print(f"{decoding.name}: {decoding}", file=sys.stderr)
    head = "| batch | tokens/s | NFE / row | TPF | first call (s) |"
    if base is not None:
        head += f" acceptance | {base.name} tokens/s | speedup | same tokens as {base.name} |"
    print(head + "\n|" + "---:|" * head.count(" |"))

    def timed(dec, prompts):
        t0 = time.perf_counter()
        jdllm.generate(model, prompts, dec, sampling)
        first, best = time.perf_counter() - t0, float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = jdllm.generate(model, prompts, dec, sampling)
            best = min(best, time.perf_counter() - t0)
        return outs, best, first

    for batch in args.batch:
        prompts = rng.integers(0, high, size=(batch, args.prompt_len)).tolist()
        outs, best, first = timed(decoding, prompts)
        toks = sum(len(o.token_ids) for o in outs)
        nfe = float(np.mean([o.nfe for o in outs]))
        tpf = float(np.mean([len(o.token_ids) / o.nfe for o in outs]))
        row = dict(batch=batch, tokens=toks, seconds=best, tokens_per_s=toks / best, nfe=nfe, tpf=tpf,
                   first_call_s=first)
        line = f"| {batch} | {toks / best:.1f} | {nfe:.1f} | {tpf:.2f} | {first:.1f} |"
        if base is not None:
            ar_outs, ar_best, _ = timed(base, prompts)
            proposed = sum(o.trace.get("drafts_proposed", 0) for o in outs)
            rate = sum(o.trace.get("drafts_accepted", 0) for o in outs) / max(proposed, 1)
            same = [o.token_ids for o in outs] == [o.token_ids for o in ar_outs]
            ar_tps = sum(len(o.token_ids) for o in ar_outs) / ar_best
            row.update(acceptance_rate=rate, baseline=base.name, baseline_tokens_per_s=ar_tps,
                       speedup=toks / best / ar_tps, same_tokens_as_baseline=same)
            line += f" {rate:.2f} | {ar_tps:.1f} | {toks / best / ar_tps:.2f}x | {'yes' if same else 'no'} |"
        rows.append(row)
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, paradigm=decoding.name, decoding=repr(decoding),
                           prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens, rows=rows), f, indent=2)
    return 0
