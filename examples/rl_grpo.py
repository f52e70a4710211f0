"""GRPO on a shipped diffusion model: jdllm as the rollout and scoring engine of an optax loop.

    python examples/rl_grpo.py --model models/tiny-llada --prompts 16 --group 8 --train-groups 4 --inner 1 \
        --lr 1e-4 --add-weight 4 --eval-every 25 --time-budget 1300 --seed 0 --out /tmp/rl-tiny-llada

(the second session's run in benchmarks/RESULTS.md; Adam above ~2e-4 makes the tiny
model oscillate or degrade, see there). The third session's runs add a KL anchor
to the initial policy, sort/rev groups in every update and a checkpoint chosen on
held-out validation items (the test items have no say):

    python examples/rl_grpo.py --model models/tiny-llada --prompts 16 --group 8 --train-groups 4 \
        --anchor-groups 1 --kl 0.1 --inner 1 --lr 1e-4 --lr-end 3e-5 --steps 600 --add-weight 4 \
        --eval-every 25 --val-items 300 --time-budget 1380 --seed 1 --out /tmp/rl-tiny-llada

Each step: G = --group samples of --prompts prompts (`jdllm.rl.rollout`, one
jitted call, temperature 1, every row its own PRNG stream), reward = exact
match of `jdllm.tasks` (verifiable), group-normalised advantages, then
--inner optax updates of the GRPO loss over the TraceRL replay of the
rollout's `step_map` (`jdllm.rl.trajectory_logprobs`). --train-groups N
updates on the N groups with the widest reward spread only (`rl.select_groups`:
a group whose samples all score the same has zero advantage, so it would cost
compute for no gradient). New params never
recompile the rollout. Greedy accuracy on held-out items (per task) is
measured before, every --eval-every steps (0: never) and after; the trained
model is saved as a Hugging Face directory `jdllm.load` reads, with `rl.json`
(curves, settings, timings) and, where matplotlib is installed
(`pip install 'jdllm[train]'`), `rl.png`: the base install trains and saves
the same, and says that it skipped the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jdllm  # noqa: E402
from jdllm import rl, tasks  # noqa: E402

GEN = 12  # answers are <= 9 characters + EOS (the quality benchmark's setting)


def decoding_for(model):
    cfg = model.config
    if cfg.attention == "bidirectional":
        return jdllm.MaskedDiffusion(gen_length=GEN, block_length=4, steps=GEN)  # one token per step
    if cfg.attention == "block_causal":
        return jdllm.BlockDiffusion(block_length=cfg.block_size, denoising_steps=cfg.block_size,
                                    strategy="low_confidence_static")
    return jdllm.AR()


def evaluate(model, params, decoding, examples, batch: int = 128) -> dict:
    """Greedy exact match per task (and overall) with jdllm.generate."""
    m = dataclasses.replace(model, params=params)
    preds = []
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        outs = jdllm.generate(m, [tasks.encode(ex.prompt) for ex in chunk], decoding,
                              jdllm.Sampling(temperature=0.0, max_new_tokens=GEN))
        preds += [tasks.decode(o.token_ids) for o in outs]
    res = {t: tasks.exact_match([p for p, ex in zip(preds, examples) if ex.task == t],
                                [ex for ex in examples if ex.task == t]) for t in sorted({e.task for e in examples})}
    res["all"] = tasks.exact_match(preds, examples)
    return res


def draw_batch(pool, n: int, weights: dict, rng: random.Random):
    """n training examples: one of each task (a sort prompt keeps the prompt bucket, hence the compiled
    shapes, fixed), the rest drawn by task weight (the weak task more often)."""
    names = list(weights)
    picks = names[:n] + rng.choices(names, [weights[t] for t in names], k=max(0, n - len(names)))
    return [rng.choice(pool[t]) for t in picks]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny-llada")
    ap.add_argument("--out", default="/tmp/rl-tiny-llada")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--inner", type=int, default=1, help="optimizer updates per rollout batch")
    ap.add_argument("--train-groups", type=int, default=4,
                    help="update on this many groups of each rollout batch, those with the widest reward spread "
                         "(equal rewards = zero advantage = no gradient); 0 = all")
    ap.add_argument("--anchor-groups", type=int, default=0,
                    help="of the --train-groups, reserve this many for groups of the other tasks than the "
                         "weak one ('add'), so the KL term (--kl) holds them near the initial policy")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lr-end", type=float, default=None,
                    help="decay the rate linearly to this value over --steps (default: constant)")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--kl", type=float, default=0.0, help="KL coefficient to the initial policy")
    ap.add_argument("--shrink", type=int, default=1)
    ap.add_argument("--full-replay", action="store_true",
                    help="replay every row over spec.max_steps canvas copies (default: only the copies the rows "
                         "use, `rl.replay_copies`, rounded up to 2 x the rows so few shapes compile)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--add-weight", type=float, default=4.0, help="sampling weight of 'add' (sort, rev: 1)")
    ap.add_argument("--eval-items", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25,
                    help="evaluate every N steps (0: never; the before / after evaluations always run)")
    ap.add_argument("--val-items", type=int, default=0,
                    help="held-out validation items (the held-out items after the --eval-items test ones): when > 0, "
                         "every eval also scores them and the saved model is the checkpoint with the best "
                         "validation accuracy (mean over tasks), the test figures reported are that checkpoint's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds of training")
    args = ap.parse_args(argv)
    for name in ("steps", "prompts", "group", "inner"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("eval_every", "train_groups", "anchor_groups", "eval_items", "val_items"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not has_matplotlib():
        print("note: matplotlib is not installed, so rl.png will not be drawn (pip install 'jdllm[train]'); "
              "training, evaluation and the saved model are unaffected", flush=True)

    model = jdllm.load(args.model, dtype="float32", attn_impl="xla")
    decoding = decoding_for(model)
    sampling = jdllm.Sampling(temperature=args.temperature, max_new_tokens=GEN)
    # test = the first --eval-items of the held-out set; validation = the next --val-items of it (the tiny
    # models never trained on its first 1000 items; the RL pool is the training set, disjoint from both)
    held = tasks.test_set(args.eval_items + args.val_items, seed=0)
    test, val = held[:args.eval_items], held[args.eval_items:]
    pool = {t: [e for e in tasks.train_set(6000, seed=0) if e.task == t] for t in tasks.TASKS}
    weights = {"sort": 1.0, "add": args.add_weight, "rev": 1.0}
    rng = random.Random(args.seed)
    key = jax.random.key(args.seed)

    params0 = model.params
    lr = args.lr if args.lr_end is None else optax.linear_schedule(args.lr, args.lr_end, args.steps)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))
    opt_state = opt.init(params0)

    @jax.jit(static_argnames=("spec", "copies"))
    def update(params, opt_state, ro, adv, ref, *, spec, copies):
        def loss_fn(p):
            lp = rl.trajectory_logprobs(p, ro, spec=spec, shrink=args.shrink, copies=copies)
            return rl.grpo_loss(lp, ro.logprobs, adv, ro.answer_mask, clip_eps=args.clip,
                                ref_logprobs=ref, kl_coef=args.kl, return_stats=True)

        (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        u, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss, stats

    replay = jax.jit(rl.trajectory_logprobs, static_argnames=("spec", "shrink", "copies"))

    t0 = time.perf_counter()
    before = evaluate(model, params0, decoding, test)
    print(f"before: {before}  ({time.perf_counter() - t0:.1f}s)", flush=True)
    log = {"args": vars(args), "before": before, "steps": [], "evals": [{"step": 0, **before}]}
    params = params0
    best = None  # (validation score, step, params) of the checkpoint to keep

    def checkpoint(step, ev=None):
        nonlocal best
        ev = ev if ev is not None else evaluate(model, params, decoding, test)
        rec = {"step": step, **ev}
        if val:
            v = evaluate(model, params, decoding, val)
            score = float(np.mean([v[t] for t in tasks.TASKS]))
            rec["val"] = v
            if best is None or score > best[0]:
                best = (score, step, params)
        log["evals"].append(rec)
        print(f"eval step {step}: {ev}" + (f" val {rec['val']}" if val else ""), flush=True)

    if val:
        log["evals"].pop(0)
        checkpoint(0, before)
    roll_time = roll_tokens = train_time = 0.0  # steps after the first two (those compile)
    all_roll_time = all_roll_tokens = all_train_time = 0.0  # every step, for runs too short for the above
    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = draw_batch(pool, args.prompts, weights, rng)
        state, spec = rl.prepare_rollout(model, [tasks.encode(e.prompt) for e in batch], decoding, sampling,
                                         group=args.group)
        key, k = jax.random.split(key)
        t1 = time.perf_counter()
        ro = rl.compiled_rollout(params, state, k, spec=spec)
        texts = rl.texts(ro, spec, decode=tasks.decode)  # host sync: the rollout is done
        dt_roll = time.perf_counter() - t1
        n_tok = int(jnp.sum(ro.answer_mask))
        rewards = np.zeros(ro.batch, np.float32)
        for r, txt in enumerate(texts):
            rewards[r] = float(tasks.normalize(txt) == batch[r // args.group].answer)
        adv = rl.group_advantages(rewards, spec.group, active=ro.active)
        tro, tspec, tadv = ro, spec, adv
        informative = int((rewards[:spec.rows].reshape(spec.prompts, spec.group).std(axis=1) > 0).sum())
        if args.train_groups:  # update on a fixed number of groups, informative ones (reward spread) first
            order = pick_groups(rewards[:spec.rows].reshape(spec.prompts, spec.group),
                                [e.task for e in batch], args.train_groups, args.anchor_groups)
            tro, tspec = rl.select_groups(ro, spec, order)
            tadv = rl.group_advantages(rewards[:spec.rows].reshape(spec.prompts, spec.group)[order].reshape(-1),
                                       spec.group)
        copies = None
        if not args.full_replay and rl.default_method(tspec) == "per_step":
            copies = rl.replay_copies(tro, args.shrink, multiple=2 * tspec.rows)
        ref = replay(params0, tro, spec=tspec, shrink=args.shrink, copies=copies) if args.kl else None
        t2 = time.perf_counter()
        for _ in range(args.inner):
            params, opt_state, loss, stats = update(params, opt_state, tro, tadv, ref, spec=tspec, copies=copies)
        loss = float(loss)
        dt_train = time.perf_counter() - t2
        if step > 2:  # the first steps compile
            roll_time, roll_tokens, train_time = roll_time + dt_roll, roll_tokens + n_tok, train_time + dt_train
        all_roll_time, all_roll_tokens = all_roll_time + dt_roll, all_roll_tokens + n_tok
        all_train_time += dt_train
        by_task = {t: float(np.mean([rewards[r] for r in range(spec.rows) if batch[r // args.group].task == t] or [0]))
                   for t in tasks.TASKS}
        rec = {"step": step, "reward": float(rewards[:spec.rows].mean()), "reward_by_task": by_task, "loss": loss,
               "clip_frac": float(stats["clip_frac"]), "rollout_s": dt_roll, "train_s": dt_train, "tokens": n_tok,
               "informative_groups": informative, "replay_copies": copies}
        log["steps"].append(rec)
        print(f"step {step:4d} reward {rec['reward']:.3f} (add {by_task['add']:.2f}) loss {loss:+.4f} "
              f"clip {rec['clip_frac']:.3f} informative {informative}/{spec.prompts} rollout {dt_roll:.2f}s train {dt_train:.2f}s", flush=True)
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            checkpoint(step)
        if args.time_budget and time.perf_counter() - t_train > args.time_budget:
            if log["evals"][-1]["step"] != step:
                checkpoint(step)
            break
    log["last"] = log["evals"][-1]
    if val:  # keep the checkpoint the validation set chose (the test set had no say)
        _, best_step, params = best
        log["selected_step"] = best_step
        print(f"selected step {best_step} by validation accuracy", flush=True)
    after = next(e for e in log["evals"] if e["step"] == log.get("selected_step", log["last"]["step"]))
    n_timed = len(log["steps"]) - 2
    with_compile = n_timed < 1  # every step compiled something: the rates below include it
    if with_compile:
        n_timed, roll_time, roll_tokens, train_time = len(log["steps"]), all_roll_time, all_roll_tokens, all_train_time
    log.update(after=after, train_seconds=time.perf_counter() - t_train,
               rollout_tokens_per_s=roll_tokens / roll_time if roll_time > 0 else None,
               train_steps_per_s=n_timed * args.inner / train_time if train_time > 0 else None,
               rates_include_compile=with_compile,
               backend=jax.default_backend(), command="python " + " ".join(sys.argv))
    rate = lambda v, fmt: "n/a" if v is None else format(v, fmt)  # noqa: E731
    print(f"after: {after}\nrollout {rate(log['rollout_tokens_per_s'], '.0f')} tokens/s, "
          f"{rate(log['train_steps_per_s'], '.2f')} optimizer steps/s"
          + (f" (over {len(log['steps'])} step(s), compilation included; with more than 2 steps the rates "
             "leave out the first 2, which compile)" if with_compile else ""), flush=True)

    from convert.hf import save_hf_dir  # noqa: PLC0415

    os.makedirs(args.out, exist_ok=True)
    save_hf_dir(args.out, jax.tree.map(np.asarray, params), model.config)
    tasks.save_tokenizer(args.out)
    with open(os.path.join(args.out, "rl.json"), "w") as f:
        json.dump(log, f, indent=1)
    if plot(log, os.path.join(args.out, "rl.png")):
        print(f"plotted {os.path.join(args.out, 'rl.png')}", flush=True)
    else:
        print("rl.png skipped: matplotlib is not installed (pip install 'jdllm[train]')", flush=True)
    reloaded = jdllm.load(args.out, dtype="float32", attn_impl="xla")
    print(f"reloaded from {args.out}: {evaluate(reloaded, reloaded.params, decoding, test)}")
    return 0


def pick_groups(rewards, task_of, n: int, anchors: int = 0, weak: str = "add"):
    """n group indices of a [P, G] reward table: `anchors` of them from the other tasks than `weak`
    (widest reward spread, then lowest mean reward), the rest by widest spread over all groups."""
    spread, mean = rewards.std(axis=1), rewards.mean(axis=1)
    order = list(np.lexsort((mean, -spread)))  # widest spread first, then the least solved
    others = [g for g in order if task_of[g] != weak][:anchors]
    rest = [g for g in order if g not in others][:n - len(others)]
    return others + rest


def has_matplotlib() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a module entry of None (blocked) or one without a spec
        return False


def plot(log, path: str) -> bool:
    """Draw the reward and accuracy curves into `path`; False (nothing drawn) without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415 (optional: the train extra)
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90)
    r = np.array([s["reward"] for s in log["steps"]])
    ra = np.array([s["reward_by_task"]["add"] for s in log["steps"]])
    w = max(1, len(r) // 15)
    k = np.ones(w) / w
    x = np.arange(1, len(r) + 1)
    a.plot(x, r, alpha=0.25, color="C0")
    a.plot(x[w - 1:], np.convolve(r, k, "valid"), color="C0", label="reward (all)")
    a.plot(x[w - 1:], np.convolve(ra, k, "valid"), color="C1", label="reward (add)")
    a.set_xlabel("GRPO step")
    a.set_title("rollout reward (exact match, T=1)", fontsize=9)
    a.legend(fontsize=7)
    ev = log["evals"]
    for t, c in (("all", "k"), ("add", "C1"), ("sort", "C2"), ("rev", "C3")):
        b.plot([e["step"] for e in ev], [100 * e[t] for e in ev], marker="o", ms=3, color=c, label=t)
    b.set_xlabel("GRPO step")
    b.set_ylabel("greedy exact match %")
    b.set_title("held-out accuracy", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
