"""Meshes that training code brings, against one device, in a subprocess with 8 fake CPU devices.

`python tests/mesh_cases.py` (XLA_FLAGS=--xla_force_host_platform_device_count=8) loads the shipped
tiny models on meshes made the way JAX training code makes them and prints one JSON line per
(mesh, path): `jax.make_mesh((4, 2), ("data", "model"))` with Explicit axes (JAX's default) and
with Auto axes, and a hand-made `Mesh` with an extra `fsdp` axis (rows over ("data", "fsdp")).
Paths: load + generate (block diffusion), logits, the host-driven steps, an RL rollout and its
replay, the serving engine. Then the errors a mesh the rules do not cover raises.
tests/test_sharding_meshes.py runs it (the test process itself keeps one device), as two processes
side by side: `mesh_cases.py explicit` and `mesh_cases.py auto fsdp data_only errors` (each computes
the one-device reference itself; no argument: every part, in one process).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jdllm  # noqa: E402
from jdllm import rl  # noqa: E402
from jdllm.api import outputs, prepare  # noqa: E402
from jdllm.decode import loop  # noqa: E402
from compiles import traces  # noqa: E402
from sharding_cases import FAST, submit_staggered  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["sort:3 1 2=", "add:12+34=", "rev:abc=", "add:5+7="]  # tasks the tiny models were trained on
TOKENS = [[3, 4, 5, 6, 3, 4, 7, 8], [7, 8, 9, 10, 11, 12, 13, 14]]  # for the logits
PATHS = ("generate", "logits", "host_steps", "rollout", "serve", "paradigms")
SAMPLING = jdllm.Sampling(temperature=0.0, max_new_tokens=8, stop_token_ids=())
DECODING = jdllm.BlockDiffusion(block_length=4, denoising_steps=4, strategy="low_confidence_dynamic",
                                confidence_threshold=0.5)


def meshes():
    """(name, mesh, rules, paths): every path on the Explicit mesh; on the others the paths whose
    sharding differs (the Auto one is also what tests/sharding_cases.py covers paradigm by paradigm)."""
    devices = np.asarray(jax.devices())
    explicit, auto = (AxisType.Explicit,) * 2, (AxisType.Auto,) * 2
    yield "explicit", jax.make_mesh((4, 2), ("data", "model"), axis_types=explicit), None, PATHS
    yield "auto", jax.make_mesh((4, 2), ("data", "model"), axis_types=auto), None, ("generate", "logits", "rollout")
    yield "fsdp", Mesh(devices.reshape(2, 2, 2), ("data", "fsdp", "model"), axis_types=(AxisType.Explicit,) * 3), \
        {"batch": ("data", "fsdp")}, ("generate", "rollout", "serve")


def emit(**row):
    print(json.dumps(row), flush=True)


def tokens_of(outs):
    return [(o.token_ids, o.step_map, o.nfe, o.finish_reason) for o in outs]


def on_mesh(x, mesh) -> bool:
    return x.sharding.mesh == mesh


def split(model) -> bool:
    """Every layer's q projection split over `model`: no device holds it whole."""
    n = model.placement.mesh.shape["model"]
    qs = [lp["q"] if "q" in lp else lp["qkv"] for lp in model.params["layers"]]
    return all(s.data.shape[-2] == q.shape[-2] // n for q in qs for s in q.addressable_shards)


class Reference:
    """One device: what every mesh must reproduce."""

    def __init__(self, sdar, ar, prompts):
        self.sdar, self.ar = jdllm.load(sdar, dtype="float32"), jdllm.load(ar, dtype="float32")
        self.generate = tokens_of(jdllm.generate(self.sdar, prompts[:2], DECODING, SAMPLING))
        self.logits = np.asarray(jdllm.logits(self.sdar, TOKENS))
        st, spec = rl.prepare_rollout(self.ar, prompts[:2], jdllm.AR(), ROLLOUT, group=4)
        self.ro = rl.compiled_rollout(self.ar.params, st, jax.random.key(7), spec=spec)
        self.lp = np.asarray(REPLAY(self.ar.params, self.ro, spec=spec))
        self.serve = [tokens_of(jdllm.generate(self.sdar, [p], DECODING, SAMPLING))[0] for p in prompts]


ROLLOUT = jdllm.Sampling(temperature=1.0, max_new_tokens=8, stop_token_ids=())
REPLAY = jax.jit(rl.trajectory_logprobs, static_argnames=("spec",))


def host_steps(name, m, mesh, ref, prompts):
    """The host-driven steps: prefill, step_n until done, finalize (each jitted, state donated)."""
    prep = prepare(m, prompts[:2], DECODING, SAMPLING)
    fns, kw = loop.compiled_steps(FAST), dict(paradigm=prep.paradigm, ctx=prep.ctx)
    state = fns["prefill"](m.params, prep.state, **kw)
    while not bool(np.all(np.asarray(state.done))):
        state = fns["step_n"](m.params, state, 2, **kw)
    state = fns["finalize"](state)
    emit(mesh=name, path="host_steps", equal=tokens_of(outputs(prep, state)) == ref.generate,
         state_on_mesh=on_mesh(state.tokens, mesh) and on_mesh(state.cache.k, mesh))


def rollout(name, ar, mesh, rules, ref, prompts):
    """RL: rollout + replay on the sharded params (sampled: the same PRNG streams as one device)."""
    ma = jdllm.load(ar, dtype="float32", mesh=mesh, rules=rules)
    st, spec = rl.prepare_rollout(ma, prompts[:2], jdllm.AR(), ROLLOUT, group=4)
    ro = rl.compiled_rollout(ma.params, st, jax.random.key(7), spec=spec)
    lp = REPLAY(ma.params, ro, spec=spec)
    emit(mesh=name, path="rollout", equal=bool(np.array_equal(ro.tokens, ref.ro.tokens)
                                                and np.array_equal(ro.step_map, ref.ro.step_map)),
         logprob_diff=float(np.abs(np.asarray(ro.logprobs) - np.asarray(ref.ro.logprobs)).max()),
         replay_diff=float(np.abs(np.asarray(lp) - ref.lp).max()),
         on_mesh=on_mesh(ro.tokens, mesh) and on_mesh(lp, mesh))


def serve(name, m, mesh, ref, prompts):
    """The serving engine: staggered requests == each prompt alone on one device."""
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    eng = Engine(m, DECODING, max_batch=4, max_prompt_tokens=16, max_new_tokens=8, steps_per_round=2,
                 compiler_options=FAST)
    reqs = submit_staggered(eng, prompts, SAMPLING)
    emit(mesh=name, path="serve", equal=tokens_of([r.output for r in reqs]) == ref.serve,
         cache_on_mesh=on_mesh(eng.runner.pool.cache.k, mesh), tokens=[r.output.token_ids for r in reqs])


def paradigms(name, mesh, prompts):
    """The other paradigms' generate on the mesh == one device (the Explicit mesh: every one of them
    then runs through `jdllm.sharding.auto_axes`)."""
    for model_name, dec in (("tiny-ar", jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=2)),
                            ("tiny-sdar", jdllm.MultiBlock(block_size=4, max_blocks=2)),
                            ("tiny-llada", jdllm.MaskedDiffusion(gen_length=8, block_length=4, steps=8))):
        path = os.path.join(ROOT, "models", model_name)
        ref = tokens_of(jdllm.generate(jdllm.load(path, dtype="float32"), prompts[:2], dec, SAMPLING))
        got = tokens_of(jdllm.generate(jdllm.load(path, dtype="float32", mesh=mesh), prompts[:2], dec, SAMPLING))
        emit(mesh=name, path=f"paradigm_{dec.name}", equal=got == ref, tokens=[g[0] for g in got])


PARTS = ("explicit", "auto", "fsdp", "data_only", "errors")


def main(parts=PARTS):
    assert len(jax.devices()) == 8, jax.devices()
    assert set(parts) <= set(PARTS), parts
    sdar, ar = os.path.join(ROOT, "models", "tiny-sdar"), os.path.join(ROOT, "models", "tiny-ar")
    tok = jdllm.load(sdar, dtype="float32").tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    ref = Reference(sdar, ar, prompts)
    for name, mesh, rules, paths in meshes():
        if name not in parts:
            continue
        m = jdllm.load(sdar, dtype="float32", mesh=mesh, rules=rules)
        got = tokens_of(jdllm.generate(m, prompts[:2], DECODING, SAMPLING))
        with traces() as seen:  # a second call with the same shapes reuses the compile
            again = tokens_of(jdllm.generate(m, prompts[:2], DECODING, SAMPLING))
        emit(mesh=name, path="generate", equal=got == ref.generate == again, split=split(m), retraced=seen["run"],
             params_on_mesh=all(on_mesh(x, mesh) for x in jax.tree.leaves(m.params)), tokens=[g[0] for g in got])
        if "logits" in paths:
            diff = np.abs(np.asarray(jdllm.logits(m, TOKENS)) - ref.logits).max()
            emit(mesh=name, path="logits", equal=True, logit_diff=float(diff))
        if "host_steps" in paths:
            host_steps(name, m, mesh, ref, prompts)
        if "rollout" in paths:
            rollout(name, ar, mesh, rules, ref, prompts)
        if "serve" in paths:
            serve(name, m, mesh, ref, prompts)
        if "paradigms" in paths:
            paradigms(name, mesh, prompts)

    if "data_only" in parts:  # a ("data",) mesh: the default rules' `model` targets replicate (logits only)
        m = jdllm.load(sdar, dtype="float32", mesh=jax.make_mesh((8,), ("data",)))
        emit(mesh="data_only", path="logits", equal=True,
             logit_diff=float(np.abs(np.asarray(jdllm.logits(m, TOKENS)) - ref.logits).max()))
    if "errors" not in parts:
        return

    # bad input: a mesh axis no rule names
    for label, mesh in (("unnamed_fsdp", Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "model"))),
                        ("other_names", jax.make_mesh((4, 2), ("x", "y")))):
        try:
            jdllm.load(ar, dtype="float32", mesh=mesh)
            emit(error=label, message="no error")
        except Exception as e:  # noqa: BLE001
            emit(error=label, message=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    with jdllm.compiler_options(**dict(FAST)):
        main(tuple(sys.argv[1:]) or PARTS)
