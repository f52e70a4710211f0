"""RL layer costs: rollout tokens/s (jdllm.rl.compiled_rollout vs jdllm.generate on the same batch) and
trajectory replay (packed one-forward vs one batched copy per step vs one forward per step in a loop).

    python benchmarks/rl.py [--repeats 5] [--json benchmarks/out/rl.json]

Rollouts run `models/tiny-llada` (MaskedDiffusion, 12 tokens, one per step) at temperature 1 on
--prompts x --group rows. Replays (value and gradient of the summed trajectory log-likelihood) run
T=1 rollouts of `models/tiny-sdar` (block diffusion, block 4, one token per step) and tiny-llada.
Timings are wall clock, interleaved, median of --repeats after a warm-up call (compiles excluded).
--only rollout|replay runs one half.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jdllm  # noqa: E402
from jdllm import rl, tasks  # noqa: E402
from jdllm.api import outputs, prepare  # noqa: E402
from jdllm.decode import loop  # noqa: E402
from jdllm.model import default_positions, forward  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def timed(fn, repeats):
    fn()  # warm-up / compile
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def rollout_bench(args) -> list[dict]:
    model = jdllm.load(os.path.join(ROOT, "models/tiny-llada"), dtype="float32", attn_impl="xla")
    dec = jdllm.MaskedDiffusion(gen_length=12, block_length=4, steps=12)
    samp = jdllm.Sampling(temperature=1.0, max_new_tokens=12)
    exs = tasks.test_set(args.prompts, seed=0)
    prompts = [tasks.encode(e.prompt) for e in exs]
    rows = [p for p in prompts for _ in range(args.group)]
    state, spec = rl.prepare_rollout(model, prompts, dec, samp, group=args.group)
    key = jax.random.key(0)
    counts = {}

    def run_rl():
        ro = rl.compiled_rollout(model.params, state, key, spec=spec)
        counts["rl"] = int(jnp.sum(ro.answer_mask))
        rl.texts(ro, spec, decode=tasks.decode)

    def run_generate():
        prep = prepare(model, rows, dec, samp)
        outs = outputs(prep, loop.compiled()(model.params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx))
        counts["generate"] = sum(len(o.token_ids) for o in outs)

    fns = {"jdllm.rl.compiled_rollout": run_rl, "jdllm.generate": run_generate}
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(args.repeats):  # interleaved
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    res = []
    for k in fns:
        med = statistics.median(times[k])
        n = counts["rl" if k.startswith("jdllm.rl") else "generate"]
        res.append({"what": k, "rows": len(rows), "tokens": n, "median_s": med, "tokens_per_s": n / med})
    return res


def replay_bench(args) -> list[dict]:
    """Gradient of the trajectory log-likelihood: jdllm's replay (one call) vs one forward + backward per
    decoding step (a jitted call per step, the naive replay). Methods interleaved, median of --repeats."""
    res = []
    for name, path, dec in (
            ("block_diffusion", "models/tiny-sdar", jdllm.BlockDiffusion(block_length=4, denoising_steps=4,
                                                                         strategy="low_confidence_static")),
            ("masked_diffusion", "models/tiny-llada", jdllm.MaskedDiffusion(gen_length=12, block_length=4,
                                                                            steps=12))):
        if args.paradigm and name != args.paradigm:
            continue
        model = jdllm.load(os.path.join(ROOT, path), dtype="float32", attn_impl="xla")  # trained: real step_maps
        prompts = [tasks.encode(e.prompt) for e in tasks.test_set(args.prompts, seed=0)]
        state, spec = rl.prepare_rollout(model, prompts, dec, jdllm.Sampling(temperature=1.0, max_new_tokens=12),
                                         group=args.group)
        ro = rl.compiled_rollout(model.params, state, jax.random.key(0), spec=spec)
        steps = int(jnp.max(ro.step_map))
        scored = int(jnp.sum(ro.step_map > 0))
        variants = ([("packed", 1, False), ("packed", 2, False), ("per_step", 1, False)] if name == "block_diffusion"
                    else [("per_step", 1, False), ("per_step", 1, True), ("per_step", 2, False), ("per_step", 2, True)])
        fns, meta = {}, {}
        for m, k, bounded in variants:
            c = rl.replay_copies(ro, k, multiple=1) if bounded else None  # only the copies the rows use
            f = jax.jit(jax.grad(lambda p, m=m, k=k, c=c: jnp.sum(rl.trajectory_logprobs(
                p, ro, spec=spec, method=m, shrink=k, copies=c))))
            label = f"{m}" + (f", shrink={k}" if k > 1 else "") + (", bounded (rl.replay_copies)" if bounded else "")
            fns[label] = lambda f=f: jax.block_until_ready(f(model.params))
            per_row = (c * ro.slots / ro.batch if bounded else rl.replay_cost(spec, ro.slots, m, k)["tokens"])
            meta[label] = {"forward_calls": 1, "positions_per_row": per_row, "canvas_copies": c if bounded else
                           (ro.batch * -(-spec.max_steps // k) if m == "per_step" else None)}
        # the naive replay: one forward (and its backward) per decoding step, each its own call
        cfgm = spec.ctx.model
        S = ro.slots
        pos = default_positions(ro.start, 0, S)

        def one_step(p, s):
            toks = jnp.where((ro.step_map >= s) | ((ro.step_map == 0) & (jnp.arange(S)[None] >= ro.gen_start[:, None])),
                             cfgm.mask_token_id, ro.tokens)
            logits, _ = forward(p, cfgm, toks, pos, start=ro.start, attn_impl="xla")
            lp = jax.nn.log_softmax(logits, -1)
            tok = jnp.take_along_axis(lp, ro.tokens[..., None], -1)[..., 0]
            return jnp.sum(jnp.where(ro.step_map == s, tok, 0.0))

        g1 = jax.jit(jax.grad(one_step))

        def loop_all():
            for s in range(1, steps + 1):
                jax.block_until_ready(g1(model.params, jnp.int32(s)))

        fns["one forward per step (loop)"] = loop_all
        meta["one forward per step (loop)"] = {"forward_calls": steps, "positions_per_row": steps * S,
                                               "canvas_copies": steps * ro.batch}
        for f in fns.values():
            f()  # compile
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, f in fns.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        for k in fns:
            med = statistics.median(times[k])
            res.append({"paradigm": name, "method": k, **meta[k], "grad_median_s": med, "steps": steps,
                        "rows": ro.batch, "scored_tokens": scored, "scored_tokens_per_s": scored / med})
            print(f"  {name} {k}: {med:.3f}s", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks/out/rl.json"))
    ap.add_argument("--only", choices=("rollout", "replay"), default=None)
    ap.add_argument("--paradigm", choices=("block_diffusion", "masked_diffusion"), default=None,
                    help="replay: one paradigm only")
    args = ap.parse_args(argv)
    roll = rollout_bench(args) if args.only != "replay" else []
    rows = args.prompts * args.group
    print(f"\nrollout, tiny-llada MaskedDiffusion(12 tokens, 12 steps), T=1, {rows} rows "
          f"({args.prompts} prompts x G={args.group}), median of {args.repeats}, {jax.default_backend()}")
    print("| path | tokens | median s | tokens/s |\n|---|---:|---:|---:|")
    for r in roll:
        print(f"| {r['what']} | {r['tokens']} | {r['median_s']:.3f} | {r['tokens_per_s']:.0f} |")
    rep = replay_bench(args) if args.only != "rollout" else []
    print(f"\nreplay + grad (tiny-sdar / tiny-llada, T=1 rollouts), {rows} rows, median of {args.repeats}")
    print("| paradigm | method | steps | forward calls | canvas copies | positions / row | grad s | scored tokens/s |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rep:
        print(f"| {r['paradigm']} | {r['method']} | {r['steps']} | {r['forward_calls']} | {r.get('canvas_copies') or '-'} "
              f"| {r['positions_per_row']:.0f} "
              f"| {r['grad_median_s']:.3f} | {r['scored_tokens_per_s']:.0f} |")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rollout": roll, "replay": rep, "backend": jax.default_backend()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
