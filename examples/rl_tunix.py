"""GRPO with google-tunix's own learner, jdllm as its rollout engine (AR policies).

    pip install -e ".[tunix]"
    python examples/rl_tunix.py --steps 4                      # tunix GRPOLearner + JdllmRollout
    python examples/rl_tunix.py --steps 4 --compare-vanilla    # ... then tunix's own sampler, same model

tunix's `RLCluster` / `GRPOLearner` train the actor, a `jdllm.nnx.Model` view of
models/tiny-ar (its nnx state is jdllm's parameter pytree); the reference is a second view
of the same checkpoint. `JdllmRollout` takes its model from the actor tunix hands it and,
after every optimizer step, the actor's `nnx.state` through `update_params` (tunix's
`sync_weights`): no `param_map`. The task: `jdllm.tasks` prompts (`add:12+34=` ...), reward
= the share of the expected answer's characters the completion gets right at their place.

--compare-vanilla runs the same learner with tunix's own sampler (`rollout_engine="vanilla"`)
on tunix's Qwen3 built from the same safetensors (`tunix.models.qwen3`), and prints the wall
time per step of both (the first step, which compiles, apart).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jdllm  # noqa: E402
import jdllm.nnx  # noqa: E402
from jdllm import tasks  # noqa: E402
from jdllm.rl.tunix_bridge import JdllmRollout  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def reward(prompts, completions, answer, **kw):
    """Share of the answer's characters the completion has at the same place (1.0 = exact)."""
    del prompts, kw
    out = []
    for c, a in zip(completions, answer):
        c, a = tasks.normalize(c), tasks.normalize(a)
        out.append(sum(x == y for x, y in zip(c, a)) / max(len(a), 1))
    return out


def dataset(batch: int, steps: int, seed: int):
    """`steps` batches of `batch` prompts: tunix's learner reads a dict of numpy columns per batch."""
    examples = tasks.train_set(batch * steps, seed=seed)
    for s in range(steps):
        part = examples[s * batch:(s + 1) * batch]
        yield {"prompts": np.array([ex.prompt for ex in part]), "answer": np.array([ex.answer for ex in part])}


def timed(fn, marks: list[float]):
    """fn, noting the wall time of each call in `marks`."""

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        if hasattr(out, "tokens"):  # a RolloutOutput: its arrays are on the host already
            jax.block_until_ready(out.logprobs)
        marks.append(time.perf_counter() - t0)
        return out

    return wrapper


def one_device_mesh():
    """tunix's mesh axis names on one device, with `jax.make_mesh`'s default Explicit axes (tunix
    enters the mesh around every role's work; jdllm runs Explicit axes as Auto, see "Scaling out")."""
    return jax.make_mesh((1, 1), ("fsdp", "tp"))


def tunix_cluster(actor, reference, tokenizer, engine, *, steps, lr, max_new, prompt_len):
    """tunix's RLCluster: actor, reference and rollout colocated on one device."""
    from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: PLC0415
    from tunix.rl.rollout import base_rollout  # noqa: PLC0415

    mesh = one_device_mesh()
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adam(lr), eval_every_n_steps=10 ** 9, max_steps=steps, pbar_description=None)
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=max_new, max_prompt_length=prompt_len, temperature=1.0, top_p=1.0, top_k=None,
        return_logprobs=True, kv_cache_size=prompt_len + max_new + 8, seed=None)
    roles = rl_cluster_lib.Role
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine=engine, offload_to_cpu=False, training_config=training, rollout_config=rollout)
    return rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=config)


def grpo(cluster, *, steps, batch, group, beta, seed):
    """Run tunix's GRPOLearner for `steps` steps. Returns wall times: {"step": [...] one per
    global step (from the start, then between the ends of tunix's actor updates, one per step),
    "rollout": [...] per rollout call, "reward": [...] mean reward per step, "total": train() as a whole}."""
    from tunix.rl.grpo import grpo_learner  # noqa: PLC0415

    updates, rollouts, rewards = [], [], []

    def scored(prompts, completions, **kw):
        r = reward(prompts, completions, **kw)
        rewards.append(float(np.mean(r)))
        return r

    scored.__name__ = "reward"  # tunix logs it as rewards/<name>
    update_actor = cluster.update_actor

    def update_and_mark(*a, **kw):
        update_actor(*a, **kw)
        updates.append(time.perf_counter())

    cluster.update_actor = update_and_mark
    cluster.rollout.generate = timed(cluster.rollout.generate, rollouts)
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(num_generations=group, num_iterations=1, beta=beta),
        reward_fns=[scored])
    t0 = time.perf_counter()
    learner.train(dataset(batch, steps, seed))
    return {"step": list(np.diff([t0] + updates)), "rollout": rollouts, "reward": rewards,
            "total": time.perf_counter() - t0}


def run_jdllm(model_dir, *, steps=3, lr=1e-3, batch=2, group=2, max_new=8, prompt_len=16, beta=0.04, seed=0):
    """tunix GRPO with JdllmRollout, the nnx view as actor and reference. Returns (cluster, `grpo`'s
    record); the trained actor is `cluster.actor_trainer.model`."""
    actor = jdllm.nnx.Model(jdllm.load(model_dir, dtype="float32", attn_impl="xla"))
    reference = jdllm.nnx.Model(jdllm.load(model_dir, dtype="float32", attn_impl="xla"))
    tokenizer = actor.as_model().tokenizer
    cluster = tunix_cluster(actor, reference, tokenizer, JdllmRollout, steps=steps, lr=lr, max_new=max_new,
                            prompt_len=prompt_len)
    times = grpo(cluster, steps=steps, batch=batch, group=group, beta=beta, seed=seed)
    return cluster, times


def run_vanilla(model_dir, *, steps=3, lr=1e-3, batch=2, group=2, max_new=8, prompt_len=16, beta=0.04, seed=0):
    """The same learner with tunix's own sampler on tunix's Qwen3 built from the same safetensors."""
    from tunix.models.qwen3 import model as qwen3_model  # noqa: PLC0415
    from tunix.models.qwen3 import params as qwen3_params  # noqa: PLC0415

    cfg = jdllm.load(model_dir, dtype="float32").config
    if cfg.model_type != "qwen3":
        raise SystemExit(f"--compare-vanilla builds tunix's Qwen3; {model_dir} is {cfg.model_type}")
    tcfg = qwen3_model.ModelConfig(
        num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps,
        use_tied_embedding=cfg.tie_word_embeddings)
    mesh = one_device_mesh()
    actor = qwen3_params.create_model_from_safe_tensors(model_dir, tcfg, mesh)
    reference = qwen3_params.create_model_from_safe_tensors(model_dir, tcfg, mesh)
    tokenizer = jdllm.load(model_dir, dtype="float32").tokenizer
    cluster = tunix_cluster(actor, reference, tokenizer, "vanilla", steps=steps, lr=lr, max_new=max_new,
                            prompt_len=prompt_len)
    times = grpo(cluster, steps=steps, batch=batch, group=group, beta=beta, seed=seed)
    return cluster, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-ar"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO's G)")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--beta", type=float, default=0.04, help="KL weight against the reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-vanilla", action="store_true", help="also time tunix's own sampler")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("tunix") is None:  # before loading anything: it takes ~20 s to fail later
        ap.exit(2, "examples/rl_tunix.py needs google-tunix, in its own environment (README, 'tunix'): "
                   "python3 -m venv .venv-tunix && . .venv-tunix/bin/activate && pip install -e \".[tunix]\"\n")
    for name in ("steps", "batch", "max_new"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.group < 2:
        ap.error(f"--group {args.group} must be >= 2 (GRPO compares samples of one prompt)")
    kw = dict(steps=args.steps, lr=args.lr, batch=args.batch, group=args.group, max_new=args.max_new,
              beta=args.beta, seed=args.seed)
    before = jdllm.load(args.model, dtype="float32").params
    cluster, times = run_jdllm(args.model, **kw)
    after = cluster.actor_trainer.model.params()
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
    print(f"tunix GRPOLearner with JdllmRollout: {len(times['step'])} steps, mean reward per step "
          f"{[round(r, 3) for r in times['reward']]}, max |weight change| {moved:.3g}")
    rows = [("JdllmRollout", times)]
    if args.compare_vanilla:
        rows.append(("tunix vanilla sampler", run_vanilla(args.model, **kw)[1]))
    print(f"{'rollout engine':>22} | first step (compiles) | later steps, mean | rollout call: first, later mean")
    for name, t in rows:
        st, ro = t["step"], t["rollout"]
        later = f"{np.mean(st[1:]):.3f} s" if len(st) > 1 else "-"
        ro_later = f"{np.mean(ro[1:]):.3f} s" if len(ro) > 1 else "-"
        print(f"{name:>22} | {st[0]:.2f} s | {later} | {ro[0]:.2f} s, {ro_later}")


if __name__ == "__main__":
    main()
