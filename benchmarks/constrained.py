"""Constrained decoding (llguidance backend) on the shipped models: quality and cost.

The shipped models know only the `sort:` / `add:` / `rev:` tasks, so each answer format
is written as a constraint: sort -> regex `[0-9]( [0-9]){2,4}`, add -> JSON schema
`{"type": "integer", "minimum": 0, "maximum": 198}`, rev -> regex `[a-z]{3,6}`. Per paradigm
(tiny-ar with AR, tiny-sdar with block diffusion) and temperature, three modes run on the
same held-out examples, interleaved, median of `--repeats` timed runs (compile excluded):

    free     jdllm.generate without a constraint: the one-jit lax.while_loop
    host     the llguidance backend's host loop with every row free (its per-step overhead)
    guided   the host loop with the constraints

Columns: valid % (the output ended with eos and its text passes the format's independent
checker: re.fullmatch / json.loads + range), exact %, TPF (generated tokens per forward
a row took part in), tokens/s, step ms (wall time per host step), mask ms (llguidance
mask filling per step), host ms (consuming tokens, fast-forward, backtrack per step).

    python benchmarks/constrained.py [--n 96] [--batch 32] [--repeats 3] [--json out.json]
        [--cases ar spec-lookup spec-draft bd-dynamic bd-static masked] [--temperatures 0 1]

Cases: tiny-ar with AR and with ar_spec (prompt lookup / the tiny-ar-draft model, k = 3:
draft-token masks in verification), tiny-sdar with block diffusion (dynamic 0.9, static
top-2), tiny-llada with masked diffusion (block 4, 6 steps for 12 slots: 2 tokens per step);
json-*: the structured task (`jdllm.tasks` "json", schema `tasks.JSON_SCHEMA`, 24 new tokens)
on models/tiny-json-ar (AR) and tiny-json-sdar (block diffusion; json-mb: multi_block with
block 4 and d3LLM's default thresholds; json-spec-lookup: ar_spec with prompt lookup, k = 3),
where valid % measures what the constraint adds (validity checked by hand: json.loads +
keys / types / ranges).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FORMATS = {
    "sort": ("regex", r"[0-9]( [0-9]){2,4}"),
    "add": ("json_schema", {"type": "integer", "minimum": 0, "maximum": 198}),
    "rev": ("regex", r"[a-z]{3,6}"),
}


CASES = ("ar", "spec-lookup", "spec-draft", "bd-dynamic", "bd-static", "masked",
         "json-ar", "json-bd-dynamic", "json-bd-static", "json-mb", "json-spec-lookup")
DEFAULT_CASES = CASES[:6]  # the json-* cases need models/tiny-json-ar and tiny-json-sdar


def label(decoding) -> str:
    if decoding.name == "ar_spec":
        return f"ar_spec {decoding.proposer} k={decoding.num_draft_tokens}"
    if decoding.name == "multi_block":
        return (f"multi_block H<={decoding.entropy_threshold} add={decoding.block_add_threshold} "
                f"act={decoding.decoded_token_threshold}")
    if decoding.name == "masked_diffusion":
        return f"masked_diffusion bl={decoding.block_length} steps={decoding.steps}"
    return f"{decoding.name} {getattr(decoding, 'strategy', '')}".strip()


def json_answer_ok(text: str) -> bool:
    """The json task's schema, checked by hand (not by llguidance): {"w": 2-3 letters, "n": 0..99}."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(v, dict) and set(v) == {"w", "n"} and isinstance(v["w"], str)
            and re.fullmatch("[a-z]{2,3}", v["w"]) is not None and isinstance(v["n"], int)
            and not isinstance(v["n"], bool) and 0 <= v["n"] <= 99)


def valid(task: str, text: str) -> bool:
    if task == "json":
        return json_answer_ok(text)
    kind, spec = FORMATS[task]
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 198


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES))
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    args = ap.parse_args()

    import jax

    import jdllm
    from jdllm import constraints as C
    from jdllm import tasks
    from jdllm.constraints import guidance as G

    cons = {t: (C.regex(s) if k == "regex" else C.json_schema(s)) for t, (k, s) in FORMATS.items()}
    cons["json"] = C.json_schema(tasks.JSON_SCHEMA)
    suites = {False: tasks.test_set(args.n, seed=0), True: tasks.test_set(args.n, seed=0, tasks=("json",))}
    cases = {"ar": ("tiny-ar", jdllm.AR()),
             "spec-lookup": ("tiny-ar", jdllm.Speculative(num_draft_tokens=3)),
             "spec-draft": ("tiny-ar", jdllm.Speculative(draft=os.path.join(ROOT, "models", "tiny-ar-draft"),
                                                         num_draft_tokens=3)),
             "bd-dynamic": ("tiny-sdar", jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_dynamic",
                                                              confidence_threshold=0.9)),
             "bd-static": ("tiny-sdar", jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_static",
                                                             denoising_steps=2)),
             "masked": ("tiny-llada", jdllm.MaskedDiffusion(block_length=4, steps=6)),
             "json-ar": ("tiny-json-ar", jdllm.AR()),
             "json-bd-dynamic": ("tiny-json-sdar", jdllm.BlockDiffusion(
                 block_length=4, strategy="low_confidence_dynamic", confidence_threshold=0.9)),
             "json-bd-static": ("tiny-json-sdar", jdllm.BlockDiffusion(
                 block_length=4, strategy="low_confidence_static", denoising_steps=2)),
             "json-mb": ("tiny-json-sdar", jdllm.MultiBlock(block_size=4)),
             "json-spec-lookup": ("tiny-json-ar", jdllm.Speculative(num_draft_tokens=3))}
    cases = [cases[c] for c in args.cases]
    models = {name: jdllm.load(os.path.join(ROOT, "models", name), dtype="float32") for name in {n for n, _ in cases}}
    records = []
    for name, decoding in cases:
        examples = suites["json" in name]
        max_new = 24 if "json" in name else 12
        model = models[name]
        for temp in args.temperatures:
            def run(mode):
                outs, st = [], G.Stats()
                t0 = time.perf_counter()
                for i in range(0, args.n, args.batch):
                    ex = examples[i:i + args.batch]
                    samp = [jdllm.Sampling(temperature=temp, max_new_tokens=max_new, seed=1000 + i + j)
                            for j in range(len(ex))]
                    prompts = [e.prompt for e in ex]
                    if mode == "free":
                        outs += jdllm.generate(model, prompts, decoding, samp)
                    else:
                        rows = [cons[e.task] if mode == "guided" else None for e in ex]
                        outs += G.generate_constrained(model, prompts, decoding, samp, rows, stats=st)
                jax.effects_barrier()
                return outs, st, time.perf_counter() - t0

            modes = ("free", "host", "guided")
            for m in modes:  # compile
                run(m)
            times = {m: [] for m in modes}
            last = {}
            for _ in range(args.repeats):
                for m in modes:
                    outs, st, dt = run(m)
                    times[m].append(dt)
                    last[m] = (outs, st)
            for m in modes:
                outs, st = last[m]
                dt = statistics.median(times[m])
                toks = sum(len(o.token_ids) for o in outs)
                ok = [o.finish_reason == "stop" and valid(e.task, tasks.normalize(o.text or ""))
                      for o, e in zip(outs, examples)]
                rec = dict(model=name, paradigm=decoding.name, label=label(decoding),
                           strategy=getattr(decoding, "strategy", ""), temperature=temp, mode=m,
                           valid=100 * sum(ok) / len(ok),
                           exact=100 * tasks.exact_match([o.text or "" for o in outs], examples),
                           tpf=toks / sum(o.nfe for o in outs), tokens_per_s=toks / dt, wall_s=dt,
                           steps=st.steps, step_ms=1e3 * st.total_s / max(st.steps, 1) if m != "free" else None,
                           mask_ms=1e3 * st.mask_s / max(st.steps, 1) if m != "free" else None,
                           host_ms=1e3 * st.advance_s / max(st.steps, 1) if m != "free" else None,
                           ff_tokens=st.ff_tokens, remasked=st.backtracked,
                           tokens=[o.token_ids for o in outs])
                records.append(rec)
                f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
                print(f"| {name} | {label(decoding)} | {temp} | {m} | {rec['valid']:.1f} | "
                      f"{rec['exact']:.1f} | {rec['tpf']:.2f} | {rec['tokens_per_s']:.0f} | {f(rec['step_ms'])} | "
                      f"{f(rec['mask_ms'])} | {f(rec['host_ms'])} | {st.ff_tokens} | {st.backtracked} |", flush=True)
            same = last["free"][0], last["host"][0]
            assert [o.token_ids for o in same[0]] == [o.token_ids for o in same[1]], "host loop != one-jit loop"
    meta = dict(machine=platform.machine(), processor=platform.processor(), cpus=os.cpu_count(),
                jax=jax.__version__, devices=[str(d) for d in jax.devices()], n=args.n, batch=args.batch,
                repeats=args.repeats, loadavg_end=os.getloadavg())
    print(f"load average at the end: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, records=records), fh)


if __name__ == "__main__":
    main()
