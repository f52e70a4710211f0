"""examples/train_tiny.py's noisy-context term against the BD3-LM objective it extends."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import objectives, tasks
from jdllm.model import init_params
from tests.quick import slow
from tests.scripts import load_script

pytestmark = slow  # its one test compiles two training losses (~4 s); the quick tier has test_objectives.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_tiny():
    return load_script("examples/train_tiny.py")


def test_noisy_context_loss_is_bd3_when_earlier_blocks_are_clean():
    """With every target slot in the last block, earlier blocks hold no noise, so the noisy-context
    pass (one block-causal forward over the noisy row) sees what BD3-LM's clean copy shows: same loss.
    With targets in two blocks the second block's context is noisy and the losses differ."""
    tt = _train_tiny()
    cfg = tt.model_config("sdar", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, tasks.VOCAB_SIZE, (3, 16)), jnp.int32)
    start = jnp.asarray([0, 2, 5], jnp.int32)
    key = jax.random.key(1)
    ours = jax.jit(tt.noisy_context_loss, static_argnums=1)  # one compile each, not op by op
    bd3 = jax.jit(objectives.block_diffusion_loss, static_argnums=1)
    last = jnp.broadcast_to(jnp.arange(16) >= 12, (3, 16))
    a = ours(params, cfg, tokens, last, start, key)
    b = bd3(params, cfg, tokens, last, start, key)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    two = jnp.broadcast_to(jnp.arange(16) >= 8, (3, 16))
    a2 = ours(params, cfg, tokens, two, start, key)
    b2 = bd3(params, cfg, tokens, two, start, key)
    assert abs(float(a2) - float(b2)) > 1e-4
