"""Long contexts: what a decode program holds grows linearly with the canvas (issue 28, item 3).

At a 32k prompt the canvas S is ~33k slots: a [S, vocab] float32 logits array is 16 GiB at the
8B shape's 126k vocabulary and an [S, S] one 4 GiB per head, so neither may appear anywhere in
a paradigm's decode program (prefill and steps). The LM head runs only at the slots whose tokens
a step chooses (`forward(logits_at=...)`); attention's S x S scores live only inside the Pallas
kernels (flash attention: tile by tile). Checked on the traced program (`jax.make_jaxpr` of
`loop.run`, nothing compiled): every array an equation outside a `pallas_call` produces, in the
loop bodies and branches too, holds fewer than S * V / 4 and S * S / 4 elements. The GPU run of
the same decodes at 32k is `benchmarks/gpu.py --long` (peak memory against weights + KV cache).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

import jdllm
from jdllm.api import params_for, prepare
from jdllm.config import ModelConfig
from jdllm.decode import loop

V = 1024  # far above the tiny model's widest activation (2 * 64 MLP columns), so S x V stands out
PROMPT, GEN = 2000, 48

PARADIGMS = {
    "ar": ("causal", lambda: jdllm.AR()),
    "ar_spec": ("causal", lambda: jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=4, max_ngram=3)),
    "block_diffusion": ("block_causal", lambda: jdllm.BlockDiffusion(block_length=32, denoising_steps=8)),
    "multi_block-exact": ("block_causal", lambda: jdllm.MultiBlock(block_size=32, cache_mode="exact")),
    # bidirectional multi_block ran its LM head over the whole canvas at every step before the
    # generation bucket bounded the slots in flight
    "multi_block-approx": ("bidirectional", lambda: jdllm.MultiBlock(block_size=32, cache_mode="approx",
                                                                      cache_delay_iter=2)),
    "multi_block-none": ("bidirectional", lambda: jdllm.MultiBlock(block_size=32)),
    "masked_diffusion-dual": ("bidirectional", lambda: jdllm.MaskedDiffusion(
        gen_length=GEN, block_length=16, confidence_threshold=0.9, cache_mode="dual")),
}


def _model(attention: str) -> jdllm.Model:
    cfg = ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=4096, eos_token_ids=())
    if attention != "causal":
        cfg = cfg.replace(model_type="llada" if attention == "bidirectional" else "sdar", attention=attention,
                          block_size=32 if attention == "block_causal" else 1, mask_token_id=V - 1)
    return jdllm.Model.random(cfg, attn_impl="pallas")  # interpret mode here: only traced


def _large_arrays(closed, limit: int) -> list[tuple[str, tuple]]:
    """(primitive, shape) of every array of >= limit elements produced outside a pallas_call."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.extend((eqn.primitive.name, tuple(v.aval.shape)) for v in eqn.outvars
                         if math.prod(getattr(v.aval, "shape", ())) >= limit)
            if eqn.primitive.name != "pallas_call":
                for sub in jaxprs_in_params(eqn.params):
                    walk(sub)

    walk(closed.jaxpr)
    return sorted(set(found))


@pytest.mark.parametrize("name", list(PARADIGMS))
def test_decode_program_holds_nothing_canvas_by_vocab_or_canvas_squared(name):
    attention, decoding = PARADIGMS[name]
    model, dec = _model(attention), decoding()
    prompt = np.random.default_rng(0).integers(0, V - 2, PROMPT).tolist()
    prep = prepare(model, [prompt], dec, jdllm.Sampling(max_new_tokens=GEN, stop_token_ids=()))
    S = prep.state.slots
    assert S >= PROMPT + GEN
    closed = jax.make_jaxpr(lambda p, s: loop.run(p, s, paradigm=prep.paradigm, ctx=prep.ctx))(
        params_for(model, dec), prep.state)
    big = _large_arrays(closed, min(S * V, S * S) // 4)
    assert not big, f"{name} at S={S}, V={V}: arrays of canvas x vocab or canvas^2 size: {big[:8]}"
