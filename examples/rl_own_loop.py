"""Your own training loop: jdllm rollouts and replay inside your `jax.jit`, your optax optimizer, your mesh.

    python examples/rl_own_loop.py --devices 8 --mesh 4x2 --steps 3      # 8 fake CPU devices, seconds

The mesh is made the way training code makes one, `jax.make_mesh((4, 2), ("data", "model"))`
(Explicit axes, JAX's default). The train state is placed the way this user wants it (FSDP-like:
each matrix's rows over `data`, its columns over `model`; not jdllm's rules), and one jitted
train step holds everything: a GRPO rollout (`jdllm.rl.rollout`, 4 samples per prompt), a toy
verifiable reward (the share of even token ids in each answer), group advantages, and --inner
Adam updates of the GRPO loss over the replay of the rollout (`jdllm.rl.trajectory_logprobs`).
The step returns its losses (they fall within each step: several updates on one rollout), and the
params come back with exactly the shardings they went in with: nothing is gathered to one device.
New params and keys are data: the step compiles once.

--devices 1 --mesh none runs the same loop on one device (the reference the test compares with).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models",
                                                   "tiny-ar"))
    p.add_argument("--devices", type=int, default=0, help="fake CPU devices (sets XLA_FLAGS; 0: leave as is)")
    p.add_argument("--mesh", default="4x2", help="DATAxMODEL for jax.make_mesh, or 'none' (one device)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--inner", type=int, default=3, help="Adam updates per rollout")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--json", action="store_true", help="print one JSON line with the results")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    if args.devices:  # before JAX starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jdllm  # noqa: PLC0415
    from jdllm import rl  # noqa: PLC0415

    mesh = None
    if args.mesh != "none":
        data, model_axis = (int(n) for n in args.mesh.split("x"))
        mesh = jax.make_mesh((data, model_axis), ("data", "model"))  # Explicit axes: JAX's default
    model = jdllm.load(args.model, dtype="float32", mesh=mesh)

    def user_sharding(x):  # this user's own layout of the train state (not jdllm's rules)
        if mesh is None or x.ndim < 2:  # vectors replicated (P(None): the spec JAX gives them back with)
            return x.sharding if mesh is None else NamedSharding(mesh, P(*[None] * x.ndim))
        rows = "data" if x.shape[0] % mesh.shape["data"] == 0 else None
        cols = "model" if x.shape[-1] % mesh.shape["model"] == 0 else None
        return NamedSharding(mesh, P(rows, *([None] * (x.ndim - 2)), cols))

    placed = jax.tree.map(user_sharding, model.params)
    params = jax.tree.map(jax.device_put, model.params, placed)
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)  # follows the params' shardings, but for Adam's step count:
    if mesh is not None:  # a scalar on one device, which the first step would hand back on the mesh (a retrace)
        opt_state = jax.tree.map(lambda x: x if x.ndim else jax.device_put(x, NamedSharding(mesh, P())), opt_state)
    prompts = [[1, 5, 9, 13], [2, 6, 10]]
    state, spec = rl.prepare_rollout(model, prompts, jdllm.AR(),
                                     jdllm.Sampling(temperature=1.0, max_new_tokens=8, stop_token_ids=()), group=4)

    def loss_of(p, ro, adv):
        return rl.grpo_loss(rl.trajectory_logprobs(p, ro, spec=spec), ro.logprobs, adv, ro.answer_mask)

    @jax.jit
    def train_step(params, opt_state, state, key):
        ro = rl.rollout(params, state, key, spec=spec)
        even = jnp.where(ro.answer_mask, (ro.tokens % 2 == 0).astype(jnp.float32), 0.0)
        reward = even.sum(1) / jnp.maximum(ro.answer_mask.sum(1), 1)
        adv = rl.group_advantages(reward, spec.group)

        def epoch(carry, _):  # PPO-style: several updates on one rollout
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_of)(params, ro, adv)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(epoch, (params, opt_state), length=args.inner)
        return params, opt_state, losses, reward.mean(), ro.tokens

    traced = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: traced.append(kw.get("fun_name")) if event == "/jax/core/compile/jaxpr_trace_duration"
        else None)
    curve, first_tokens = [], None
    for step in range(args.steps):
        params, opt_state, losses, reward, tokens = train_step(params, opt_state, state, jax.random.key(step))
        curve.append([float(x) for x in losses])
        first_tokens = first_tokens if first_tokens is not None else jax.device_get(tokens).tolist()
        print(f"step {step}: loss {' -> '.join(f'{x:+.5f}' for x in curve[-1])}, reward {float(reward):.3f}")
    kept = all(a.sharding == s for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(placed)))
    split = [not a.sharding.is_fully_replicated for a in jax.tree.leaves(params) if a.ndim >= 2]
    print(f"params kept the shardings they were placed with: {kept} "
          f"({sum(split)} of {len(split)} matrices split over the mesh)")
    result = dict(devices=len(jax.devices()), mesh=None if mesh is None else dict(mesh.shape),
                  axis_types=None if mesh is None else [str(t) for t in mesh.axis_types], losses=curve,
                  first_tokens=first_tokens, kept_shardings=kept, split=sum(split), matrices=len(split),
                  train_step_traces=traced.count("train_step"))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
