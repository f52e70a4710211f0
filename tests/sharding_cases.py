"""Sharded decoding against one device, run in a subprocess with 8 fake CPU devices.

`python tests/sharding_cases.py` (XLA_FLAGS=--xla_force_host_platform_device_count=8) decodes
each paradigm on one device and on the meshes 8x1, 1x8 and 2x4 (data x model) and prints one
JSON line per case: whether greedy tokens, step maps and NFE are equal, the largest logit
difference, and whether params / KV cache really were split. tests/test_sharding.py runs it
(the test process itself keeps one device).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jdllm  # noqa: E402
from jdllm import sharding  # noqa: E402
from jdllm.config import ModelConfig  # noqa: E402
from jdllm.loading import Model  # noqa: E402
from jdllm.model import default_positions, forward, init_params  # noqa: E402
from compiles import traces  # noqa: E402

V, MASK = 96, 95
FAST = (("xla_backend_optimization_level", 0),)  # tiny models: compile time dominates


def tiny(attention: str, seed: int, kv: int = 8) -> Model:
    """Heads, KV heads, MLP and vocab all divide by 8 (so every mesh splits them)."""
    cfg = ModelConfig(model_type={"causal": "qwen3", "block_causal": "sdar", "bidirectional": "llada"}[attention],
                      vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=16,
                      num_kv_heads=kv, head_dim=8, qk_norm=attention != "bidirectional", attention=attention,
                      block_size=4, mask_token_id=None if attention == "causal" else MASK,
                      max_position_embeddings=128, eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(seed), std=0.7), attn_impl="xla")


def cases():
    ar, blk, bid = tiny("causal", 0), tiny("block_causal", 1), tiny("bidirectional", 2)
    yield "ar", ar, jdllm.AR()
    yield "ar_spec", ar, jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=2, max_ngram=2)
    yield "block_diffusion", blk, jdllm.BlockDiffusion(block_length=4, denoising_steps=4,
                                                       strategy="low_confidence_dynamic", confidence_threshold=0.5)
    yield "multi_block", blk, jdllm.MultiBlock(block_size=4, max_blocks=3, block_add_threshold=0.1)
    yield "masked_diffusion", bid, jdllm.MaskedDiffusion(steps=4, block_length=4)


PROMPTS = [[3, 4, 5, 6, 3, 4], [7, 8, 9]]
MESHES = {"8x1": "data=8", "1x8": "model=8", "2x4": "data=2,model=4"}
# "quick" (what tests/test_sharding.py runs, to stay within the CI's time): every paradigm on 2x4
# (both axes split), Pallas on 1x8; "all": every paradigm x mesh
QUICK: dict[str, tuple[str, ...]] = {}


def run(model, decoding, n=8):
    outs = jdllm.generate(model, PROMPTS, decoding, jdllm.Sampling(temperature=0.0, max_new_tokens=n))
    return [(o.token_ids, o.step_map, o.nfe, o.finish_reason) for o in outs]


def run_one(model, decoding, prompt, sampling):
    o = jdllm.generate(model, [prompt], decoding, sampling)[0]
    return o.token_ids, o.step_map, o.nfe, o.finish_reason


def split_ok(model) -> bool:
    """Every layer's q projection is split over `model` and no device holds it whole (when model > 1)."""
    n = model.placement.mesh.shape["model"]
    qs = [lp["q"] if "q" in lp else lp["qkv"] for lp in model.params["layers"]]
    return all(s.data.shape[1] == q.shape[1] // n for q in qs for s in q.addressable_shards)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), compiler_options=dict(FAST))
def _logits(params, tokens, *, cfg, impl):
    start = jnp.zeros((tokens.shape[0],), jnp.int32)
    return forward(params, cfg, tokens, default_positions(start, 0, tokens.shape[1]), start=start,
                   attn_impl=impl)[0]


def logit_check(model, sm) -> dict:
    """Full-sequence logits, sharded vs one device: max abs difference with ordinary weights
    (std 0.02, logits of order 0.1: `logit_diff`) and with the peaked test weights (std 0.7,
    logits of order 20: `peaked_diff`, relative to `peaked_scale`)."""
    tokens = np.array([[3, 4, 5, 6, 3, 4, 7, 8], [7, 8, 9, 10, 11, 12, 13, 14]], np.int32)
    rows = "data" if len(tokens) % sm.mesh.shape["data"] == 0 else None  # 2 rows do not split 8 ways
    placed = sharding.put(tokens, jax.sharding.NamedSharding(sm.mesh, jax.sharding.PartitionSpec(rows)))
    ordinary = init_params(model.config, jax.random.key(11), std=0.02)  # same shapes: same compile
    out = {}
    for key, params in (("logit_diff", ordinary), ("peaked_diff", model.params)):
        ref = np.asarray(_logits(params, tokens, cfg=model.config, impl=model.forward_impl))
        got = np.asarray(_logits(sm.placement.place_params(params, sm.config), placed, cfg=sm.config,
                                 impl=sm.forward_impl))
        out[key] = float(np.abs(got - ref).max())
        if key == "peaked_diff":
            out["peaked_scale"] = float(np.abs(ref).max())
    return out


def submit_staggered(eng, prompts, sampling):
    """Requests that join a running serving engine: two, a round, a third, a round, a fourth, run
    to the end. Returns the four requests."""
    reqs = [eng.submit(p, sampling) for p in prompts[:2]]
    eng.step_round()
    reqs.append(eng.submit(prompts[2], sampling))
    eng.step_round()
    reqs.append(eng.submit(prompts[3], sampling))
    eng.run_until_idle()
    return reqs


def emit(**row):
    print(json.dumps(row), flush=True)


def main(which: str = "all"):
    assert len(jax.devices()) == 8, jax.devices()
    meshes = {name: sharding.make_mesh(spec) for name, spec in MESHES.items()}
    checked_logits = set()
    for name, model, dec in cases():
        if which not in ("all", "quick") and name not in which.split(","):
            continue
        ref = run(model, dec)
        for mname, mesh in meshes.items():
            if which == "quick" and mname != "2x4" and mname not in QUICK.get(name, {}):
                continue
            t0 = time.perf_counter()
            sm = model.shard(mesh)
            got = run(sm, dec)
            row = dict(paradigm=name, mesh=mname, equal=got == ref, split=split_ok(sm), logit_diff=0.0,
                       tokens=[g[0] for g in got], ref=[r[0] for r in ref])
            # logits once per (model, mesh): each paradigm's model is one of three
            if (id(model), mname) not in checked_logits and (which != "quick" or mname != "8x1"):
                checked_logits.add((id(model), mname))
                row.update(logit_check(model, sm))
            row["s"] = round(time.perf_counter() - t0, 2)
            if mname == "2x4":  # a second call on the same mesh and shapes reuses the compile
                with traces() as seen:
                    row["equal"] = row["equal"] and run(model.shard(mesh), dec) == got
                row["retraced"] = seen["run"]
            emit(**row)
    if which in ("all", "quick", "pallas"):
        # Pallas kernels per shard (interpret mode on the CPU) with KV heads replicated over `model`
        # (rules kv_heads=None on 1x8: each shard keeps the one KV head its 2 query heads read);
        # the reference is the XLA one-device decode of the block_diffusion case above
        name, m, dec = [c for c in cases() if c[0] == "block_diffusion"][0]
        ref = run(m, dec)
        sm = jdllm.Model(m.config, m.params, attn_impl="pallas").shard(meshes["1x8"], rules={"kv_heads": None})
        got = run(sm, dec)
        emit(paradigm="pallas_block_diffusion", mesh="1x8", equal=got == ref, split=split_ok(sm),
             **({} if which == "quick" else logit_check(m, sm)), tokens=[g[0] for g in got],
             ref=[r[0] for r in ref])
        # default rules (heads and KV heads both split over `model`, rows over `data`): logits only
        sm = jdllm.Model(m.config, m.params, attn_impl="pallas").shard(meshes["2x4"])
        emit(paradigm="pallas_logits", mesh="2x4", equal=True, split=split_ok(sm), **logit_check(m, sm))
    if which in ("all", "quick", "quant"):
        # int8 weights (jdllm.quant) on 2x4: q split as the weight is, each scale beside its shards
        # (heads / MLP columns / vocabulary rows over `model`); same tokens as int8 on one device
        from jdllm import quant  # noqa: PLC0415

        name, m, dec = [c for c in cases() if c[0] == "block_diffusion"][0]
        qm = jdllm.Model(m.config, quant.quantize_params(m.params, "int8"), attn_impl="xla")
        ref = run(qm, dec)
        sm = qm.shard(meshes["2x4"])
        got = run(sm, dec)
        qkv = [lp["q"] for lp in sm.params["layers"]]
        scales_split = all(s.data.shape[1] == q.scale.shape[1] // 4 for q in qkv for s in q.scale.addressable_shards)
        emit(paradigm="quant_int8_block_diffusion", mesh="2x4", equal=got == ref,
             split=all(s.data.shape[1] == q.shape[1] // 4 for q in qkv for s in q.q.addressable_shards)
             and scales_split, tokens=[g[0] for g in got], ref=[r[0] for r in ref])
    if which in ("all", "quick", "rl"):
        # RL rollouts take sharded params: same sampled tokens and log-probs as on one device
        from jdllm import rl  # noqa: PLC0415

        rollout = jax.jit(rl.rollout, static_argnames=("spec",), compiler_options=dict(FAST))
        m = tiny("causal", 0)
        samp = jdllm.Sampling(temperature=1.0, max_new_tokens=8)
        outs = []
        for mm in (m, m.shard(meshes["2x4"])):
            st, spec = rl.prepare_rollout(mm, PROMPTS, jdllm.AR(), samp, group=2)
            ro = rollout(mm.params, st, jax.random.key(7), spec=spec)
            outs.append({k: np.asarray(getattr(ro, k))[:4] for k in ("tokens", "step_map", "logprobs")})
        a, b = outs
        emit(paradigm="rl_rollout", mesh="2x4", split=True, logit_diff=0.0,
             equal=bool((a["tokens"] == b["tokens"]).all() and (a["step_map"] == b["step_map"]).all()
                        and np.allclose(a["logprobs"], b["logprobs"], atol=1e-4)))
    if which in ("all", "quick", "serve"):
        # the continuous-batching engine on 2x4: staggered requests (joining while others decode;
        # masked_diffusion / multi_block: once the batch drains) give the tokens of one-device
        # generate for each prompt alone
        from jdllm.serve.engine import Engine  # noqa: PLC0415

        samp = jdllm.Sampling(temperature=0.0, max_new_tokens=8, stop_token_ids=())
        prompts = PROMPTS + [[5, 6, 7, 8, 9], [10, 11]]
        served = ("block_diffusion",) if which == "quick" else tuple(c[0] for c in cases())
        for name, m, dec in [c for c in cases() if c[0] in served]:
            ref = [run_one(m, dec, p, samp) for p in prompts]
            eng = Engine(m, dec, max_batch=4, max_prompt_tokens=8, max_new_tokens=8, steps_per_round=2,
                         compiler_options=FAST, mesh=meshes["2x4"])
            reqs = submit_staggered(eng, prompts, samp)
            got = [(r.output.token_ids, r.output.step_map, r.output.nfe, r.output.finish_reason) for r in reqs]
            cache = eng.runner.pool.cache.k
            emit(paradigm=f"serve_{name}", mesh="2x4", equal=got == ref, split=split_ok(eng.model)
                 and all(s.data.shape[1] == cache.shape[1] // 2 for s in cache.addressable_shards),
                 tokens=[g[0] for g in got], ref=[r[0] for r in ref])
    if which in ("all", "quick", "errors"):
        m = tiny("causal", 0, kv=4)  # 4 KV heads cannot split 8 ways
        try:
            m.shard(meshes["1x8"])
            emit(error="indivisible", message="no error")
        except Exception as e:  # noqa: BLE001
            emit(error="indivisible", message=str(e))
            emit(error="indivisible_type", message=type(e).__name__)
        from jdllm.serve.engine import Engine  # noqa: PLC0415

        try:  # 3 rows do not split over data=2
            Engine(tiny("causal", 0), jdllm.AR(), max_batch=3, max_prompt_tokens=8, max_new_tokens=8,
                   mesh=meshes["2x4"])
            emit(error="engine_rows", message="no error")
        except Exception as e:  # noqa: BLE001
            emit(error="engine_rows", message=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    with jdllm.compiler_options(**dict(FAST)):
        main(sys.argv[1] if len(sys.argv) > 1 else "all")
