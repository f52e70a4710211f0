"""Layer weights are read in place: `jdllm.load` holds one copy, per layer, and the decode program
(lowered for CUDA here, on the CPU) never slices or stacks a weight, so no step copies one.

A scanned layer stack makes XLA:GPU copy each layer's weights out of the stacked arrays on every
step (2.5-3x the weight-read floor on an H100); splitting the stack inside the jit holds the
weights twice. See issue 27 and ../shared/gpu/README.md.
"""

from __future__ import annotations

import gc
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm.api import prepare
from jdllm.decode import loop
from jdllm.model import (default_layout, forward, layer_layout, param_bytes, param_specs, stack_layers,
                         to_layout)
from tests.quick import slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a slice (static or dynamic) and its operand's shape
SLICE = re.compile(r"stablehlo\.(?:dynamic_slice|slice)\b[^\n]*?:\s*\(tensor<([0-9x]+)x(?:f32|bf16)>")


def _weight_shapes(cfg, layout):
    return {"x".join(map(str, s.shape)) for s in jax.tree.leaves(param_specs(cfg, layout),
                                                                 is_leaf=lambda x: hasattr(x, "axes"))
            if len(s.shape) >= 2}


def _weight_slices(text: str, shapes) -> list[str]:
    return [m.group(0) for m in SLICE.finditer(text) if m.group(1) in shapes]


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name,decoding", [
    ("tiny-ar", jdllm.AR()),
    pytest.param("tiny-sdar", jdllm.BlockDiffusion(block_length=4, denoising_steps=2), marks=slow),
    pytest.param("tiny-llada", jdllm.MultiBlock(block_size=4, cache_mode="approx"), marks=slow),
])
def test_decode_program_never_slices_a_weight(name, decoding):
    model = jdllm.load(os.path.join(ROOT, "models", name), dtype="bfloat16", attn_impl="xla")
    assert layer_layout(model.params) == "per_layer_fused"
    prep = prepare(model, ["sort:3 1 2="], decoding, jdllm.Sampling(max_new_tokens=8))
    text = _cuda_text(lambda p, s: loop.run(p, s, paradigm=prep.paradigm, ctx=prep.ctx), model.params, prep.state)
    cfg = model.config
    assert "stablehlo.while" in text
    shapes = _weight_shapes(cfg, "per_layer_fused") | _weight_shapes(cfg, "per_layer") | _weight_shapes(cfg, "stacked")
    assert _weight_slices(text, shapes) == []
    stacked = {"x".join(map(str, x.shape)) for x in param_specs(cfg)["layers"].values() if len(x.shape) >= 3}
    assert not any(f"tensor<{s}xbf16>" in text for s in stacked), "a stacked copy of some weight is built"


def test_the_detector_sees_a_scanned_stack():
    """The check above can fail: a scanned stack (stacked params through `forward`) slices its
    weights inside the loop."""
    model = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="bfloat16", attn_impl="xla")
    cfg = model.config
    stacked = stack_layers(model.params, cfg)
    tokens = jnp.zeros((1, 4), jnp.int32)

    def fwd(p, t):
        start = jnp.zeros((1,), jnp.int32)
        return forward(p, cfg, t, jnp.broadcast_to(jnp.arange(4), (1, 4)), start=start, attn_impl="xla")[0]

    shapes = _weight_shapes(cfg, "per_layer_fused") | _weight_shapes(cfg, "per_layer") | _weight_shapes(cfg, "stacked")
    assert len(_weight_slices(_cuda_text(fwd, stacked, tokens), shapes)) >= 5
    assert _weight_slices(_cuda_text(fwd, model.params, tokens), shapes) == []


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


@slow
@pytest.mark.parametrize("name", ["tiny-sdar", "tiny-llada"])
def test_load_holds_one_copy_of_the_weights(name):
    """After `load` the device holds the weights once (the stacked arrays restored or read are freed
    as they are split), in the per-layer layout; the values are the stacked checkpoint's."""
    path = os.path.join(ROOT, "models", name)
    before = _live_bytes()
    model = jdllm.load(path, dtype="float32")
    held = _live_bytes() - before
    want = param_bytes(model.config, jnp.float32)
    assert held == want, (held, want)
    assert sum(x.nbytes for x in jax.tree.leaves(model.params)) == want
    ref = jdllm.logits(jdllm.Model(model.config, stack_layers(model.params, model.config), attn_impl="xla"),
                       [[3, 4, 5, 6]])
    np.testing.assert_allclose(np.asarray(jdllm.logits(model, [[3, 4, 5, 6]])), np.asarray(ref), atol=2e-5)


@slow
def test_layouts_round_trip_and_model_random():
    model = jdllm.Model.random(jdllm.load(os.path.join(ROOT, "models", "tiny-ar")).config, seed=1)
    cfg = model.config
    assert layer_layout(model.params) == default_layout() == "per_layer_fused"
    for layout in ("stacked", "per_layer", "per_layer_fused"):
        other = to_layout(model.params, cfg, layout)
        assert layer_layout(other) == layout
        back = to_layout(other, cfg, "per_layer_fused")
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="layout"):
        to_layout(model.params, cfg, "rows")


@slow
def test_decode_program_allocates_no_copy_of_the_weights():
    """XLA's own memory analysis of the compiled decode program: with per-layer params its scratch
    space is a small fraction of the weights; stacked params split inside the jit (the CPU's way
    of running them) need a whole second copy. A device-independent view of 'peak <= weights +
    KV cache + a little' (on a GPU the same analysis covers the scan's per-step copies)."""
    model = jdllm.load(os.path.join(ROOT, "models", "tiny-sdar"), dtype="float32")
    prep = prepare(model, ["sort:3 1 2="], None, jdllm.Sampling(max_new_tokens=8))
    run = loop.compiled((("xla_backend_optimization_level", 0),))
    weights = param_bytes(model.config, jnp.float32)

    def temp(params):
        return run.lower(params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx).compile() \
            .memory_analysis().temp_size_in_bytes

    assert temp(model.params) < 0.1 * weights
    assert temp(stack_layers(model.params, model.config)) > weights  # the check can fail


def test_per_layer_forward_traces_one_layer_body(monkeypatch):
    """Per-layer weights run one jitted layer body for every layer (XLA inlines the calls): the
    lowered program defines the layer once and calls it per layer, so tracing and lowering (Python
    work paid on every new trace, before the persistent cache is consulted) do not grow with the
    depth; the logits and the written cache equal those of the body traced once per layer."""
    from jdllm import model as model_mod
    from jdllm.config import ModelConfig
    from jdllm.model import KVCache

    V = 256
    cfg = ModelConfig(model_type="llama", vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, attention="block_causal", mask_token_id=V - 1,
                      block_size=4)
    model = jdllm.Model.random(cfg, seed=3, std=0.2)
    assert layer_layout(model.params) == "per_layer_fused"
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 8)), jnp.int32)
    cache = KVCache.empty(cfg, 2, 16)

    outs = {}
    for once in (True, False):
        monkeypatch.setattr(model_mod, "_TRACE_LAYER_ONCE", once)

        def run(p, c):  # a new function per setting: jit's trace cache keys on the function
            pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
            logits, c = forward(p, cfg, tokens, pos, start=jnp.zeros((2,), jnp.int32), cache=c)
            return logits, c.k, c.v

        text = jax.jit(run).lower(model.params, cache).as_text()
        defs = re.findall(r"func\.func private @(layer[\w.]*)", text)
        calls = re.findall(r"call @(layer[\w.]*)\(", text)
        assert (len(defs), len(calls)) == ((1, 3) if once else (0, 0)), (defs, calls)
        outs[once] = jax.jit(run)(model.params, cache)
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
