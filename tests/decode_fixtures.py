"""Tiny random models for the decode tests.

Weights use init std 0.7 (not 0.02) so the next-token distributions are
peaked and confidences rarely tie: greedy comparisons between jdllm and the
reference decoders are then meaningful.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jdllm.config import ModelConfig
from jdllm.loading import Model
from jdllm.model import init_params

VOCAB = 96
# the tests compile many small decode loops on a shared 2-core CPU: LLVM opt level 0
# halves XLA compile time (same HLO, same float semantics), and the runs are tiny
FAST_COMPILE = (("xla_backend_optimization_level", 0),)  # the `fast_compile` fixture (tests/conftest.py)

MASK = VOCAB - 1


@functools.lru_cache(maxsize=None)
def causal_model(seed: int = 0) -> Model:
    """Qwen3-like causal model (q/k norm, GQA), no mask token."""
    cfg = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      max_position_embeddings=256, eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(seed), std=0.7), attn_impl="xla")


@functools.lru_cache(maxsize=None)
def block_model(seed: int = 1, logit_shift: bool = False, block_size: int = 4) -> Model:
    """SDAR-like block-causal model with a mask token (Fast-dLLM-like when logit_shift)."""
    cfg = ModelConfig(model_type="sdar", vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      attention="block_causal", block_size=block_size, logit_shift=logit_shift,
                      mask_token_id=MASK, max_position_embeddings=256, eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(seed), std=0.7), attn_impl="xla")


def assert_matches_reference(out, ref, nfe_key: str = "nfe") -> None:
    """A jdllm Output equals a plain-loop reference's record token for token.

    `ref` holds tokens, step_map, logprobs, finish and the forward count under
    `nfe_key` (block diffusion's references record fused and unfused counts).
    """
    assert out.token_ids == ref["tokens"]
    assert out.step_map == ref["step_map"]
    np.testing.assert_allclose(out.logprobs, ref["logprobs"], atol=2e-4, rtol=1e-4)
    assert out.nfe == ref[nfe_key]
    assert out.finish_reason == ref["finish"]
