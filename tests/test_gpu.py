"""The GPU tier (`pytest -m gpu`): kernels and every paradigm on the GPU, against the CPU.

Run it on a GPU machine (about 10 minutes at most on an H100, compiles included):

    pip install -e ".[cuda,test]" && python -m pytest -q -m gpu tests/

`-m gpu` lets JAX see the GPU (the root conftest pins every other run to the CPU);
without a GPU the tier is skipped. JDLLM_TEST_ACCEL=cpu makes the CPU stand in for
the GPU, so that on a machine without one

    JDLLM_TEST_ACCEL=cpu python -m pytest -q -m gpu tests/test_gpu.py

runs the whole tier, CPU against CPU: that proves the test code, not the GPU.
(tests/accel.py holds the devices and the skip markers.)

What it checks, on the accelerator ("accel": the first GPU):
- the attention kernels (`pallas_kernels.attention`, the backend the machine picks:
  Mosaic GPU for bf16/f16 prefill on Hopper, Triton otherwise) in float32, bfloat16
  and float16, forward and gradients, against the XLA reference computed on the CPU
  in float32; float32 to 1e-5, also under a global "bfloat16" matmul precision
  (the kernels' float32 dots are exact, not TF32); prefill chunks and windows whose
  last rows sit at the cache's end (kv_len = S, not a tile multiple), the window with
  a split count that does not divide its key tiles;
- every paradigm end to end on the shipped tiny models in float32 with
  attn_impl="auto" (the Pallas kernels on a GPU): ar and ar_spec (draft model
  and prompt lookup) on tiny-ar, block_diffusion and multi_block on tiny-sdar,
  masked_diffusion (no cache, prefix, dual) and multi_block on tiny-llada:
  token ids, step maps, NFE, finish reasons and traces identical to the same
  `jdllm.generate` run on the CPU device of this process (attn_impl="xla", what
  "auto" is on a CPU), log-probs to 1e-4. The CPU run really runs on the CPU
  (the arrays `generate` reads back are checked for their device);
- the serving engine: concurrent requests on its own thread, each equal to
  offline `generate` of its prompt alone on the accelerator;
- DFA constraints (`backend="dfa"`) on the accelerator equal to the CPU;
- int8 weights (the Pallas quantized matmul) and an int8 KV cache (read by the kernels as
  int8, scaled on chip) on ar and block_diffusion, equal to the CPU's XLA paths;
- bfloat16 end to end: runs and returns valid tokens.

The end-to-end tests run at JAX's default matmul precision: a float32 model is exact on
the GPU (the model's einsums and the XLA attention ask for full float32 precision where
XLA:GPU would otherwise use TF32: `jdllm.model.mm`), which is what they check. They
run under a global "tensorfloat32" setting (`exact_xla`), which must not change a token.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm import api, constraints, tasks
from jdllm.serve import engine as E
from pallas_kernels import attention as attention_dispatch
from pallas_kernels import flash
from pallas_kernels.reference import attention_reference
from tests.accel import accel_device, cpu_device, gpu_tier

pytestmark = gpu_tier

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
EXACT = "highest"
PROMPTS = [e.prompt for e in tasks.test_set(4, seed=0)]
MAX_NEW = 12


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all()
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


@pytest.fixture
def exact_xla():
    """A global TF32 matmul precision for this test, on every thread (the engine runs on its own):
    what XLA:GPU does by default anyway, and what jdllm's float32 matmuls must ignore."""
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "tensorfloat32")
    yield
    jax.config.update("jax_default_matmul_precision", old)


@pytest.fixture
def platforms(monkeypatch):
    """The platforms of the arrays `jdllm.generate` (and the constraint backends) read back to the
    host: where the decode really ran."""
    seen: set[str] = set()
    real = api.to_host

    def spy(tree):
        for x in jax.tree.leaves(tree):
            if isinstance(x, jax.Array):
                seen.update(d.platform for d in x.devices())
        return real(tree)

    monkeypatch.setattr(api, "to_host", spy)
    return seen


def on(device, seen: set, fn, *args, **kw):
    """fn(...) with `device` as the default device; asserts its decode ran there."""
    seen.clear()
    with jax.default_device(device):
        out = fn(*args, **kw)
    assert seen == {device.platform}, f"the decode ran on {sorted(seen)}, not on {device.platform}"
    return out


# --------------------------------------------------------------------------- kernels
KERNEL_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}
GRAD_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2, jnp.float16: 1e-2}
# (variant, kind, block_size, B, T, S, q_offset, H, KV, D, start); kv_len is q_offset + T. head_dim
# 64 takes the Mosaic kernel for a bf16/f16 prefill on Hopper; the window runs Triton (split over
# the cache). The "-at-cache-end" cases end at the cache's last slot (q_offset + T = kv_len = S, S
# not a multiple of the key tile: the last tile is part padding); T > 128 takes the prefill kernel
KERNEL_CASES = {
    "prefill": ("prefill", "block_causal", 32, 2, 160, 160, 0, 4, 2, 64, [0, 37]),
    "window": ("window", "causal", 1, 2, 8, 600, 500, 8, 2, 64, [0, 21]),
    "prefill-at-cache-end": ("prefill", "block_causal", 32, 2, 150, 290, 140, 4, 2, 64, [0, 37]),
    "window-at-cache-end": ("window", "block_causal", 32, 1, 32, 1000, 968, 8, 2, 64, [5]),
}
# key splits of a window case (`flash.Tiles.num_splits`; default: enough for the device's cores): 6
# splits over the 16 live 64-key tiles of S = 1000 give 3 tiles each, the last split 1 (clipped at S)
KERNEL_SPLITS = {"window-at-cache-end": 6}


def _qkv(seed, B, T, S, H, KV, D, dtype, device):
    rng = np.random.default_rng(seed)
    return tuple(jax.device_put(jnp.asarray(rng.standard_normal(shape, np.float32), dtype), device)
                 for shape in ((B, T, H, D), (B, S, KV, D), (B, S, KV, D)))


def _cpu_reference(q, k, v, w, kw):
    """The XLA reference and its gradients in float32 on the CPU, from the same (rounded) inputs."""
    q, k, v, w = (jax.device_put(np.asarray(x, np.float32), cpu_device()) for x in (q, k, v, w))

    def loss(q, k, v):
        return jnp.sum(w * attention_reference(q, k, v, **kw))

    with jax.default_device(cpu_device()), jax.default_matmul_precision(EXACT):
        out = jax.jit(lambda q, k, v: attention_reference(q, k, v, **kw))(q, k, v)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert out.devices() == {cpu_device()}
    return out, grads


@pytest.mark.parametrize("dtype,global_precision", [(jnp.float32, None), (jnp.float32, "bfloat16"),
                                                    (jnp.bfloat16, None), (jnp.float16, None)],
                         ids=["float32", "float32-under-bf16-default", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernels_match_the_reference_in_every_dtype(case, dtype, global_precision):
    """`pallas_kernels.attention(impl="pallas")` on the accelerator (the backend it picks there),
    forward and gradients, against the float32 XLA reference on the CPU."""
    variant, kind, bs, B, T, S, qoff, H, KV, D, start = KERNEL_CASES[case]
    q, k, v = _qkv(30, B, T, S, H, KV, D, dtype, accel_device())
    w = jax.device_put(jnp.asarray(np.random.default_rng(31).standard_normal((B, T, H, D), np.float32)), accel_device())
    kw = dict(start=jnp.asarray(start, jnp.int32), q_offset=qoff, kv_len=qoff + T, kind=kind, block_size=bs)

    def attn(q, k, v):
        if case in KERNEL_SPLITS:  # flash.attention: the dispatcher's kernel and backend, with the splits given
            return flash.attention(q, k, v, **kw, variant=variant, tiles=flash.Tiles(num_splits=KERNEL_SPLITS[case]))
        return attention_dispatch(q, k, v, **kw, impl="pallas")

    def loss(q, k, v):
        return jnp.sum(w * attn(q, k, v).astype(jnp.float32))

    with jax.default_device(accel_device()), jax.default_matmul_precision(global_precision):
        out = jax.jit(attn)(q, k, v)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert out.dtype == dtype and out.devices() == {accel_device()}
    ref, ref_grads = _cpu_reference(q, k, v, w, {**kw, "start": np.asarray(start, np.int32)})
    assert _rel_err(out, ref) <= KERNEL_TOL[dtype]
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        assert _rel_err(g, r) <= GRAD_TOL[dtype]


# --------------------------------------------------------------------------- models
@functools.lru_cache(maxsize=None)
def load_on(name: str, platform: str, dtype: str = "float32", **load_kw):
    """models/<name> with its params put on the accelerator (attn_impl "auto") or on the CPU
    (attn_impl "xla": what "auto" picks on a CPU; here "auto" would see the GPU backend);
    `load_kw` goes to `jdllm.load` (quantize=, kv_cache=)."""
    device = accel_device() if platform == "accel" else cpu_device()
    impl = "auto" if platform == "accel" else "xla"
    with jax.default_device(device):
        model = jdllm.load(os.path.join(MODELS, name), dtype=dtype, attn_impl=impl, **load_kw)
    model = dataclasses.replace(model, params=jax.device_put(model.params, device))
    assert all(x.devices() == {device} for x in jax.tree.leaves(model.params))
    return model


def _assert_same(got, want, what: str):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"{what}, prompt {i}"
        assert g.token_ids == w.token_ids, where
        assert g.step_map == w.step_map, where
        assert (g.nfe, g.finish_reason, g.constraint_ok) == (w.nfe, w.finish_reason, w.constraint_ok), where
        assert g.trace == w.trace, where
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4, err_msg=where)


def _draft(platform: str):
    return jdllm.Speculative(draft=load_on("tiny-ar-draft", platform), num_draft_tokens=3)


# (model, decoding for a platform): each paradigm on a model it fits
PARADIGMS = {
    "ar": ("tiny-ar", lambda p: jdllm.AR()),
    "ar_spec-draft_model": ("tiny-ar", _draft),
    "ar_spec-prompt_lookup": ("tiny-ar", lambda p: jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=3,
                                                                     max_ngram=3)),
    "block_diffusion": ("tiny-sdar", lambda p: jdllm.BlockDiffusion(
        block_length=4, denoising_steps=4, strategy="low_confidence_dynamic", confidence_threshold=0.9)),
    "multi_block-exact": ("tiny-sdar", lambda p: jdllm.MultiBlock(block_size=4)),
    "masked_diffusion": ("tiny-llada", lambda p: jdllm.MaskedDiffusion(steps=12, block_length=4)),
    "masked_diffusion-prefix": ("tiny-llada", lambda p: jdllm.MaskedDiffusion(
        steps=12, block_length=4, confidence_threshold=0.9, cache_mode="prefix")),
    "masked_diffusion-dual": ("tiny-llada", lambda p: jdllm.MaskedDiffusion(
        steps=12, block_length=4, confidence_threshold=0.9, cache_mode="dual")),
    "multi_block-bidirectional": ("tiny-llada", lambda p: jdllm.MultiBlock(block_size=4, cache_mode="approx")),
}


@pytest.mark.usefixtures("exact_xla")
@pytest.mark.parametrize("paradigm", list(PARADIGMS))
def test_paradigm_on_the_accelerator_equals_the_cpu(paradigm, platforms):
    """Greedy float32 generation of four task prompts: the accelerator's trajectory (Pallas
    attention on a GPU) is the CPU's, token for token and step for step."""
    name, decoding = PARADIGMS[paradigm]
    sampling = jdllm.Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    got = on(accel_device(), platforms, jdllm.generate, load_on(name, "accel"), PROMPTS, decoding("accel"), sampling)
    want = on(cpu_device(), platforms, jdllm.generate, load_on(name, "cpu"), PROMPTS, decoding("cpu"), sampling)
    assert all(o.token_ids for o in want)
    _assert_same(got, want, paradigm)


QUANT_CASES = {"ar": "ar", "block_diffusion": "block_diffusion"}


@pytest.mark.usefixtures("exact_xla")
@pytest.mark.parametrize("paradigm", list(QUANT_CASES))
def test_int8_weights_on_the_accelerator_equal_the_cpu(paradigm, platforms):
    """float32 activations, int8 weights (`quantize="int8"`): on a GPU the decode's few-row matmuls
    run the Pallas quantized matmul (`pallas_kernels.qmatmul`), on the CPU XLA's dot; the same
    tokens and steps."""
    from jdllm.model import default_positions, forward

    name, decoding = PARADIGMS[QUANT_CASES[paradigm]]
    accel = load_on(name, "accel", quantize="int8")
    if jax.default_backend() == "gpu":  # a real GPU (not JDLLM_TEST_ACCEL=cpu): the kernel is in the program
        ids = jnp.asarray([[3, 4, 5, 6]])
        jaxpr = jax.make_jaxpr(lambda p: forward(p, accel.config, ids, default_positions(jnp.zeros((1,), jnp.int32),
                                                                                         0, 4),
                                                 start=jnp.zeros((1,), jnp.int32), attn_impl="auto")[0])
        assert "jdllm_qmatmul" in str(jaxpr(accel.params))
    sampling = jdllm.Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    got = on(accel_device(), platforms, jdllm.generate, accel, PROMPTS, decoding("accel"), sampling)
    want = on(cpu_device(), platforms, jdllm.generate, load_on(name, "cpu", quantize="int8"), PROMPTS, decoding("cpu"),
              sampling)
    assert all(o.token_ids for o in want)
    _assert_same(got, want, f"int8 {paradigm}")


@pytest.mark.usefixtures("exact_xla")
@pytest.mark.parametrize("paradigm", list(QUANT_CASES))
def test_int8_kv_cache_on_the_accelerator_equals_the_cpu(paradigm, platforms):
    """float32 activations, an int8 KV cache (`kv_cache="int8"`): on a GPU the Pallas kernels read the
    int8 cache and its scales in place and scale on chip, on the CPU XLA dequantizes each layer; the
    same tokens and steps."""
    name, decoding = PARADIGMS[QUANT_CASES[paradigm]]
    sampling = jdllm.Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    got = on(accel_device(), platforms, jdllm.generate, load_on(name, "accel", kv_cache="int8"), PROMPTS,
             decoding("accel"), sampling)
    want = on(cpu_device(), platforms, jdllm.generate, load_on(name, "cpu", kv_cache="int8"), PROMPTS,
              decoding("cpu"), sampling)
    assert all(o.token_ids for o in want)
    _assert_same(got, want, f"int8 KV {paradigm}")


# --------------------------------------------------------------------------- serving
ENGINE_CASES = {
    "ar": ("tiny-ar", jdllm.AR()),
    "block_diffusion": ("tiny-sdar", jdllm.BlockDiffusion(block_length=4, denoising_steps=2,
                                                          confidence_threshold=0.8)),
}


@pytest.mark.usefixtures("exact_xla")
@pytest.mark.parametrize("which", list(ENGINE_CASES))
def test_serving_engine_equals_offline_generate(which):
    """Five greedy requests, two of them arriving while the first ones decode, on an engine thread
    with three rows on the accelerator: each equals offline `generate` of its prompt alone there."""
    name, decoding = ENGINE_CASES[which]
    model = load_on(name, "accel")
    prompts = [tasks.encode(p) for p in PROMPTS] + [tasks.encode("rev:abcd=")]
    sampling = jdllm.Sampling(temperature=0.0, max_new_tokens=MAX_NEW)
    with jax.default_device(accel_device()):
        want = [jdllm.generate(model, [p], decoding, sampling)[0] for p in prompts]
    done = {i: threading.Event() for i in range(len(prompts))}
    first_tokens = threading.Event()

    def listener(i):
        def hear(ev):
            if ev.kind == "tokens":
                first_tokens.set()
            if ev.kind in ("done", "error"):
                done[i].set()
        return hear

    eng = E.Engine(model, decoding, max_batch=3, max_prompt_tokens=16, max_new_tokens=16, steps_per_round=2)
    eng.start()
    try:
        reqs = [eng.submit(p, sampling, on_event=listener(i)) for i, p in enumerate(prompts[:3])]
        assert first_tokens.wait(600), "the engine produced nothing"
        reqs += [eng.submit(p, sampling, on_event=listener(i + 3)) for i, p in enumerate(prompts[3:])]
        for i, ev in done.items():
            assert ev.wait(600), f"request {i} did not finish"
    finally:
        eng.stop()
    got = [r.output for r in reqs]
    assert all(r.status == "done" for r in reqs), [r.status for r in reqs]
    _assert_same(got, want, f"engine {which}")


# --------------------------------------------------------------------------- constraints
DFA_CASES = {
    "ar": ("tiny-ar", jdllm.AR(), r"\d( \d)*"),
    "block_diffusion": ("tiny-sdar", jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_dynamic"),
                        r"[a-c]+ \d\d?"),
    "masked_diffusion": ("tiny-llada", jdllm.MaskedDiffusion(steps=8, block_length=4), r"(1|22)+"),
}


@pytest.mark.usefixtures("exact_xla")
@pytest.mark.parametrize("which", list(DFA_CASES))
def test_dfa_constraints_on_the_accelerator_equal_the_cpu(which, platforms):
    """Greedy decoding under an on-device DFA regex constraint: the same tokens, steps and
    constraint verdicts on both devices, and every output matches its regex."""
    # the GPU image has no jdllm[constraints]: benchmarks/gpu_session.sh installs the wheel carried in .whl/
    pytest.importorskip("interegular", reason="the dfa backend needs interegular; on the GPU machine carry .whl/ "
                        "(benchmarks/gpu_session.sh says how)")
    name, decoding, pattern = DFA_CASES[which]
    c = constraints.regex(pattern, backend="dfa")
    sampling = jdllm.Sampling(temperature=0.0, max_new_tokens=8)
    got = on(accel_device(), platforms, jdllm.generate, load_on(name, "accel"), PROMPTS, decoding, sampling,
             constraint=c)
    want = on(cpu_device(), platforms, jdllm.generate, load_on(name, "cpu"), PROMPTS, decoding, sampling,
              constraint=c)
    _assert_same(got, want, f"dfa {which}")
    for o in got:
        assert o.constraint_ok is True, o
        assert re.fullmatch(pattern, o.text), (pattern, o.text)


# --------------------------------------------------------------------------- bfloat16
BF16_CASES = {
    "ar": ("tiny-ar", jdllm.AR()),
    "block_diffusion": ("tiny-sdar", jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_dynamic")),
    "masked_diffusion-dual": ("tiny-llada", jdllm.MaskedDiffusion(steps=12, block_length=4,
                                                                  confidence_threshold=0.9, cache_mode="dual")),
}


@pytest.mark.parametrize("which", list(BF16_CASES))
def test_bfloat16_end_to_end_returns_valid_tokens(which, platforms):
    """bfloat16 weights, attn_impl "auto", the default matmul precision (the fast path): it runs on
    the accelerator and every output is well formed (ids in the vocabulary, a step per token)."""
    name, decoding = BF16_CASES[which]
    model = load_on(name, "accel", "bfloat16")
    assert model.dtype == jnp.bfloat16
    outs = on(accel_device(), platforms, jdllm.generate, model, PROMPTS, decoding,
              jdllm.Sampling(temperature=0.0, max_new_tokens=MAX_NEW))
    for o in outs:
        assert 0 < len(o.token_ids) <= MAX_NEW and len(o.step_map) == len(o.token_ids) == len(o.logprobs)
        assert all(0 <= t < model.config.vocab_size for t in o.token_ids)
        assert all(s >= 1 for s in o.step_map) and o.nfe >= max(o.step_map)
        assert o.finish_reason in ("stop", "length") and np.isfinite(o.logprobs).all()
