"""Sharded decoding against one device, run in a subprocess with 8 fake CPU devices.

`python tests/sharding_cases.py` (XLA_FLAGS=--xla_force_host_platform_device_count=8) decodes
each paradigm on one device and on the meshes 8x1, 1x8 and 2x4 (data x model) and prints one
JSON line per case: whether greedy tokens, step maps and NFE are equal, the largest logit
difference, and whether params / KV cache really were split. tests/test_sharding.py runs it
(the test process itself keeps one device).
"""

from __future__ import annotations

import json
import os
import sys

import jax

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jdllm  # noqa: E402
from jdllm import sharding  # noqa: E402
from jdllm.config import ModelConfig  # noqa: E402
from jdllm.decode import loop  # noqa: E402
from jdllm.loading import Model  # noqa: E402
from jdllm.model import init_params  # noqa: E402

V, MASK = 96, 95
FAST = (("xla_backend_optimization_level", 0),)
loop.decode = loop.compiled(FAST)  # tiny models: compile time dominates


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


def run(model, decoding, n=8):
    outs = jdllm.generate(model, PROMPTS, decoding, jdllm.Sampling(temperature=0.0, max_new_tokens=n))
    return [(o.token_ids, o.step_map, o.nfe, o.finish_reason) for o in outs]


def split_ok(model) -> bool:
    """The q projection is split over `model` and no device holds it whole (when model > 1)."""
    q = model.params["layers"]["q"]
    n = model.placement.mesh.shape["model"]
    return all(s.data.shape[2] == q.shape[2] // n for s in q.addressable_shards)


def main(which: str = "all"):
    assert len(jax.devices()) == 8, jax.devices()
    results = []
    for name, model, dec in cases():
        if which != "all" and name not in which.split(","):
            continue
        ref = run(model, dec)
        ref_logits = np.asarray(jdllm.logits(model, PROMPTS))
        for mname, spec in MESHES.items():
            sm = model.shard(sharding.make_mesh(spec))
            got = run(sm, dec)
            lg = np.asarray(jdllm.logits(sm, PROMPTS))
            results.append(dict(paradigm=name, mesh=mname, equal=got == ref, split=split_ok(sm),
                                logit_diff=float(np.abs(lg - ref_logits).max()),
                                tokens=[g[0] for g in got], ref=[r[0] for r in ref]))
            print(json.dumps(results[-1]), flush=True)
    # Pallas kernels per shard (interpret mode on the CPU), with KV heads replicated over `model`
    # (4 KV heads, model=8: each shard keeps the KV head its query heads read)
    if which in ("all", "pallas"):
        m = tiny("block_causal", 3, kv=4)
        dec = jdllm.BlockDiffusion(block_length=4, denoising_steps=4)
        ref = run(m, dec, n=4)
        sm = jdllm.Model(m.config, m.params, attn_impl="pallas").shard(sharding.make_mesh("data=2,model=4"),
                                                                        rules={"kv_heads": None})
        got = run(sm, dec, n=4)
        lg = float(np.abs(np.asarray(jdllm.logits(sm, PROMPTS)) - np.asarray(jdllm.logits(m, PROMPTS))).max())
        print(json.dumps(dict(paradigm="pallas_block_diffusion", mesh="2x4", equal=got == ref, split=True,
                              logit_diff=lg, tokens=[g[0] for g in got], ref=[r[0] for r in ref])), flush=True)
        sm8 = jdllm.Model(m.config, m.params, attn_impl="pallas").shard(sharding.make_mesh("model=8"),
                                                                         rules={"kv_heads": None})
        lg8 = float(np.abs(np.asarray(jdllm.logits(sm8, PROMPTS)) - np.asarray(jdllm.logits(m, PROMPTS))).max())
        print(json.dumps(dict(paradigm="pallas_logits", mesh="1x8", equal=True, split=True, logit_diff=lg8,
                              tokens=[], ref=[])), flush=True)



if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
