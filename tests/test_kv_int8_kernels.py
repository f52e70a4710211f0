"""An int8 KV cache on the Pallas kernels (interpret mode here) decodes as the XLA path does.

The kernels read the int8 cache and its scales where they lie and scale on chip
(`pallas_kernels.flash.attention(k_scale=, v_scale=)`); the XLA path dequantizes the layer it reads.
Both run the same model with kv_cache_dtype "int8" in float32, so tokens, step maps and forward
counts must agree. The cases cover the cache paths that differ on the kernels: AR's one-query window
(with one query head per KV head: one row per program, no dot), block_diffusion's block window,
multi_block's approximate cache (kept slots dropped from the K/V and scale writes, widths in turn,
`common.in_turn`, restoring the scales' last slot) and Fast-dLLM's prefix cache (one switch whose
every branch writes); and rows of those two caches joining a running serving pool on the kernels
decode as each does alone.
"""

from __future__ import annotations

import functools

import jax
import pytest

import jdllm
from jdllm.config import ModelConfig
from jdllm.loading import Model
from jdllm.model import init_params
from tests.decode_fixtures import MASK, VOCAB, block_model, causal_model
from tests.quick import slow, slow_except

pytestmark = pytest.mark.usefixtures("fast_compile")

PROMPTS = [[5, 17, 3, 44, 9, 12], [70, 2, 31], [8, 21, 55, 90, 13, 4, 27, 66, 1]]


@functools.lru_cache(maxsize=None)
def bidir_model() -> Model:
    cfg = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, attention="bidirectional", mask_token_id=MASK,
                      max_position_embeddings=256, eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(3), std=0.7), attn_impl="xla")


@functools.lru_cache(maxsize=None)
def mha_model() -> Model:
    """A causal model with one query head per KV head: AR's window is one row per program, the
    int8 kernel's `flash._attend_one_row` (no dot)."""
    base = causal_model()
    cfg = base.config.replace(num_kv_heads=base.config.num_heads)
    return Model(cfg, init_params(cfg, jax.random.key(4), std=0.7), attn_impl="xla")


CASES = {
    "ar": (causal_model, lambda: jdllm.AR(), 10),
    "ar_one_row": (mha_model, lambda: jdllm.AR(), 10),
    "block_diffusion": (block_model, lambda: jdllm.BlockDiffusion(block_length=4, denoising_steps=4), 12),
    "multi_block_approx": (bidir_model, lambda: jdllm.MultiBlock(
        block_size=4, entropy_threshold=0.3, block_add_threshold=0.25, decoded_token_threshold=0.75, max_blocks=3,
        cache_mode="approx", cache_delay_iter=1, refresh_interval=3), 16),
    "masked_diffusion_prefix": (bidir_model, lambda: jdllm.MaskedDiffusion(
        block_length=8, confidence_threshold=0.5, cache_mode="prefix"), 16),
}


@pytest.mark.parametrize("case", slow_except(list(CASES), "multi_block_approx", "ar_one_row"))
def test_int8_cache_on_the_kernels_decodes_as_the_xla_path(case):
    make, decoding, max_new = CASES[case]
    base = make()
    cfg = base.config.replace(kv_cache_dtype="int8")
    sampling = jdllm.Sampling(max_new_tokens=max_new, stop_token_ids=())
    xla, kernels = (jdllm.generate(Model(cfg, base.params, attn_impl=impl), PROMPTS, decoding(), sampling)
                    for impl in ("xla", "pallas"))
    for x, k in zip(xla, kernels):
        assert (k.token_ids, k.step_map, k.nfe) == (x.token_ids, x.step_map, x.nfe)


@functools.lru_cache(maxsize=None)
def wide_head_block_model() -> Model:
    """block_model with head_dim 64: its windows of several rows can read V as words
    (`Tiles.int8_v_words` needs head_dim a multiple of 64)."""
    base = block_model()
    cfg = base.config.replace(head_dim=64)
    return Model(cfg, init_params(cfg, jax.random.key(5), std=0.7), attn_impl="xla")


def test_int8_cache_with_v_read_as_words_decodes_as_the_xla_path(monkeypatch):
    """`JDLLM_INT8_V_WORDS=1` (the end-to-end switch of `Tiles.int8_v_words`): block_diffusion's
    block windows read the int8 V as int32 words, and decode token for token as the XLA path."""
    from pallas_kernels import flash  # noqa: PLC0415

    monkeypatch.setenv(flash.WORDS_ENV, "1")
    read_as_words = []
    monkeypatch.setattr(flash, "int8_words", lambda v, f=flash.int8_words: (read_as_words.append(v.shape), f(v))[1])
    base = wide_head_block_model()
    cfg = base.config.replace(kv_cache_dtype="int8")
    sampling = jdllm.Sampling(max_new_tokens=8, stop_token_ids=())
    decoding = jdllm.BlockDiffusion(block_length=4, denoising_steps=4)
    xla, kernels = (jdllm.generate(Model(cfg, base.params, attn_impl=impl), PROMPTS, decoding, sampling)
                    for impl in ("xla", "pallas"))
    for x, k in zip(xla, kernels):
        assert (k.token_ids, k.step_map, k.nfe) == (x.token_ids, x.step_map, x.nfe)
    assert read_as_words  # the block windows took the words path


@slow
@pytest.mark.parametrize("case", ["multi_approx", "masked_prefix"])
def test_int8_cache_rows_joining_a_pool_on_the_kernels_decode_as_alone(case):
    """A serving pool (`jdllm.serve.runner.Runner`) on the kernels with an int8 cache: rows admitted at
    different steps, each on its own layout, decode as alone (the scales joined, dropped and restored
    with the values). Its own module: the jax caches are cleared between modules."""
    from tests.test_engine_core import JOIN_CASES, assert_joined_decode_as_alone  # noqa: PLC0415

    m, par, news = JOIN_CASES[case]()
    assert_joined_decode_as_alone(Model(m.config.replace(kv_cache_dtype="int8"), m.params, attn_impl="pallas"), par,
                                  news)
