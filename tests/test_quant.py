"""Weight-only int8 / fp8 (`jdllm.quant`, `jdllm.load(..., quantize=)`).

References independent of the fused path: a NumPy absmax quantizer and a NumPy
dequantize-then-einsum for every projection shape the forward uses, and each paradigm run
on the quantized weights against itself on the explicitly dequantized ones (the same numbers
through the plain path: tokens must agree under greedy decoding).
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm import errors, quant
from jdllm.model import QUANT_MATMUL_ENV, default_positions, forward, mm, quant_matmul_kernel

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODELS = os.path.join(ROOT, "models")
PROMPTS = ["sort:3 1 2=", "add:12+34=", "rev:abc="]


def np_quantize(w: np.ndarray, scheme: str, axes: tuple[int, ...]):
    """The reference: absmax over the contracted axes, q = round(w / scale) (int8) or the
    nearest e4m3 value (fp8, through ml_dtypes' cast)."""
    qmax = {"int8": 127.0, "fp8": 448.0}[scheme]
    amax = np.abs(w).max(axis=axes, keepdims=True)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    y = np.clip(w / scale, -qmax, qmax)
    q = np.round(y).astype(np.int8) if scheme == "int8" else y.astype(jnp.float8_e4m3fn)
    return q, scale


# (einsum spec, x shape, weight name, weight shape): every projection the forward runs
SHAPES = [("btd,dhk->bthk", (2, 3, 16), "qkv", (16, 6, 8)), ("bthk,hkd->btd", (2, 3, 4, 8), "o", (4, 8, 16)),
          ("btd,df->btf", (2, 3, 16), "gate_up", (16, 24)), ("btf,fd->btd", (2, 3, 12), "down", (12, 16)),
          ("...d,vd->...v", (2, 3, 16), "embed", (40, 16)), ("...d,dv->...v", (2, 3, 16), "lm_head", (16, 40))]


def np_quantize_groups(w: np.ndarray, axis: int, group: int):
    """int4 reference: absmax over each `group` consecutive elements of `axis`, round, clip to +-7."""
    g = np.moveaxis(w, axis, -1)
    g = g.reshape(g.shape[:-1] + (g.shape[-1] // group, group))
    amax = np.abs(g).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / 7, 1.0).astype(np.float32)
    deq = (np.clip(np.round(g / scale), -7, 7) * scale).reshape(g.shape[:-2] + (-1,))
    return np.moveaxis(deq, -1, axis)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_matmul_matches_numpy_dequantize_then_einsum(scheme):
    rng = np.random.default_rng(0)
    for spec, xs, name, ws in SHAPES:
        w = rng.normal(size=ws).astype(np.float32) * rng.uniform(0.1, 3, size=ws[-1]).astype(np.float32)
        x = rng.normal(size=xs).astype(np.float32)
        if scheme == "int4":  # groups of 4 along the last contracted axis
            axes, group = jdllm.Quantization("int4", group_size=4).axes_for(name, w.shape)
            qa = quant.quantize_array(jnp.asarray(w), scheme, axes, group=group)
            assert qa.q.dtype == jnp.int4
            want = np.einsum(spec, x, np_quantize_groups(w, axes[0], 4))
            np.testing.assert_allclose(np.asarray(mm(spec, jnp.asarray(x), qa)), want, rtol=1e-5, atol=1e-5)
            continue
        qa = quant.quantize_array(jnp.asarray(w), scheme, quant.CONTRACTED[name])
        q, scale = np_quantize(w, scheme, quant.CONTRACTED[name])
        np.testing.assert_array_equal(np.asarray(qa.q).astype(np.float32), q.astype(np.float32), err_msg=name)
        np.testing.assert_allclose(np.asarray(qa.scale), scale, rtol=1e-6, err_msg=name)  # XLA may divide by 127 as a multiply
        want = np.einsum(spec, x, q.astype(np.float32) * scale)
        got = np.asarray(mm(spec, jnp.asarray(x), qa))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} {spec}")
        # the few-row Pallas kernel (interpret mode here) computes the same product, for every shape
        def with_kernel(x):
            return mm(spec, x, qa, kernel=True)

        assert "jdllm_qmatmul" in str(jax.make_jaxpr(with_kernel)(jnp.asarray(x))), spec
        np.testing.assert_allclose(np.asarray(with_kernel(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"kernel {name} {spec}")
        # int8 keeps each weight within half a step of its channel's scale
        if scheme == "int8":
            assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-6)
    ids = jnp.asarray([[0, 5, 39]])
    group = 4 if scheme == "int4" else None
    qa = quant.quantize_array(jnp.asarray(w.T), scheme, (1,) if group else quant.CONTRACTED["embed"],
                              group=group)  # [V, D], a row per token
    np.testing.assert_allclose(np.asarray(quant.take_rows(qa, ids)),
                               np.asarray(quant.dequantize(qa))[np.asarray(ids)], rtol=1e-6)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_host_quantization_in_slabs_gives_the_same_arrays(scheme, monkeypatch):
    """`quant.quantize_numpy` (load and convert's host path) cuts a weight into slabs of output
    channels: the same q and scale as the whole weight at once, for every weight's axes."""
    monkeypatch.setattr(quant, "HOST_SLAB_BYTES", 1024)
    rng = np.random.default_rng(2)
    qc = jdllm.Quantization(scheme, **({"group_size": 4} if scheme == "int4" else {}))
    for _, _, name, shape in SHAPES:
        x = rng.normal(size=shape).astype(jnp.bfloat16)
        axes, group = qc.axes_for(name, shape)
        got, want = quant.quantize_numpy(x, scheme, axes, group), quant.quantize_array(x, scheme, axes, np, group)
        assert got.q.dtype == want.q.dtype and got.scale.shape == want.scale.shape, name
        np.testing.assert_array_equal(got.q.astype(np.float32), want.q.astype(np.float32), err_msg=name)
        np.testing.assert_array_equal(got.scale, want.scale, err_msg=name)


def test_load_quantized_logits_close_and_exact_against_dequantized():
    """tiny-ar loaded with quantize=: its logits equal the plain forward on the dequantized
    weights, within int8 / fp8's error of the float32 model; the embedding and head can stay."""
    path = os.path.join(MODELS, "tiny-ar")
    ids = [[int(t) for t in np.arange(3, 15)]]
    ref = np.asarray(jdllm.logits(jdllm.load(path, dtype="float32"), ids))
    for scheme, bound in (("int8", 0.02), ("fp8", 0.08)):
        m = jdllm.load(path, dtype="float32", quantize=scheme)
        assert quant.describe(m.params) == scheme and m.dtype == jnp.float32
        assert m.params["layers"][0]["qkv"].q.dtype == quant.STORAGE[scheme]
        got = np.asarray(jdllm.logits(m, ids))
        plain = jdllm.Model(m.config, quant.dequantize_params(m.params), attn_impl=m.attn_impl)
        np.testing.assert_allclose(got, np.asarray(jdllm.logits(plain, ids)), rtol=1e-4, atol=1e-4)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert 0 < rel < bound, (scheme, rel)
    # the few-row matmuls through the Pallas kernel (forced here; on a GPU by default): the same
    # logits, and every projection and the head take it (the prompt's 12 rows are few)
    # (the switch is read when a program is traced, and JAX caches traces per function: each trace
    # below is of a function object of its own)
    m = jdllm.load(path, dtype="float32", quantize="int8")

    def fwd(p):
        return forward(p, m.config, jnp.asarray(ids), default_positions(jnp.zeros((1,), jnp.int32), 0, len(ids[0])),
                       start=jnp.zeros((1,), jnp.int32), attn_impl=m.attn_impl)[0]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(QUANT_MATMUL_ENV, "pallas")
        assert quant_matmul_kernel(m.attn_impl)
        kernels = str(jax.make_jaxpr(lambda p: fwd(p))(m.params)).count("name=jdllm_qmatmul")
        got = np.asarray(jax.jit(lambda p: fwd(p))(m.params))
    assert "jdllm_qmatmul" not in str(jax.make_jaxpr(lambda p: fwd(p))(m.params))  # off the GPU: XLA's dot by default
    assert kernels == 4 + 1, kernels  # qkv, o, gate_up, down in the one traced layer body; the head
    with pytest.MonkeyPatch.context() as mp:  # a switch that names no mode: a jdllm error naming it
        mp.setenv(QUANT_MATMUL_ENV, "triton")
        with pytest.raises(errors.QuantizationError, match="JDLLM_QUANT_MATMUL='triton'"):
            jdllm.logits(m, [[3, 4, 5]])
    np.testing.assert_allclose(got, np.asarray(jax.jit(lambda p: fwd(p))(m.params)), rtol=1e-5, atol=1e-5)
    with pytest.MonkeyPatch.context() as mp:  # the weights read as int32 words (`qmatmul(words=)`): the same logits
        from pallas_kernels import qmatmul  # noqa: PLC0415
        mp.setenv(QUANT_MATMUL_ENV, "pallas")
        mp.setenv(qmatmul.WORDS_ENV, "1")
        assert "bitcast_convert_type" in str(jax.make_jaxpr(lambda p: fwd(p))(m.params))
        words = np.asarray(jax.jit(lambda p: fwd(p))(m.params))
    np.testing.assert_allclose(words, got, rtol=1e-6, atol=1e-6)
    keep = jdllm.load(path, dtype="float32", quantize=jdllm.Quantization("int8", embed=False, lm_head=False))
    assert not quant.is_quantized(keep.params["embed"]) and not quant.is_quantized(keep.params["lm_head"])
    assert quant.is_quantized(keep.params["layers"][0]["down"])


def _dequantized(model):
    return jdllm.Model(model.config.replace(kv_cache_dtype=None), quant.dequantize_params(model.params),
                       tokenizer=model.tokenizer, attn_impl=model.attn_impl)


# The forward is the only place weights are read, so two paradigms cover what differs: speculative
# (an AR target verifying and an AR draft proposing, both quantized; the draft rides along through
# `bind_params`) and masked_diffusion (a bidirectional model, a cache refreshed in place). Two
# compiles each on a shared 2-core CI; block_diffusion and multi_block run in
# benchmarks/quant.py (accuracy and agreement with bfloat16). masked_diffusion also runs an int8 KV
# cache (its dual cache rewrites kept slots: the path that re-quantizes), so its reference, the
# dequantized weights with a float cache, differs by the cache's rounding: tokens must still agree
# (they do on every paradigm and all 256 held-out items, benchmarks/RESULTS.md).
CASES = {
    "masked_diffusion": ("tiny-llada", lambda: jdllm.MaskedDiffusion(gen_length=8, block_length=4, steps=8,
                                                                      cache_mode="dual")),
    "speculative": ("tiny-ar", None),
}


@pytest.mark.parametrize("paradigm", list(CASES))
def test_every_paradigm_int8_matches_itself_on_dequantized_weights(paradigm, fast_compile):  # noqa: F811
    name, make = CASES[paradigm]
    kv = "int8" if paradigm == "masked_diffusion" else None
    model = jdllm.load(os.path.join(MODELS, name), dtype="float32", quantize="int8", kv_cache=kv)
    if make is None:  # target and draft both quantized; the reference runs both dequantized
        draft = jdllm.load(os.path.join(MODELS, "tiny-ar-draft"), dtype="float32", quantize="int8")
        dec, ref_dec = (jdllm.Speculative(proposer="draft_model", draft=draft, num_draft_tokens=3),
                        jdllm.Speculative(proposer="draft_model", draft=_dequantized(draft), num_draft_tokens=3))
    else:
        dec = ref_dec = make()
    sampling = jdllm.Sampling(max_new_tokens=8)
    got = jdllm.generate(model, PROMPTS, dec, sampling)
    want = jdllm.generate(_dequantized(model), PROMPTS, ref_dec, sampling)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.step_map for o in got] == [o.step_map for o in want]
    assert any(o.token_ids for o in got)


@pytest.mark.parametrize("name,paradigm", [
    ("tiny-ar", jdllm.AR()),
    ("tiny-sdar", jdllm.BlockDiffusion(block_length=4, denoising_steps=2, confidence_threshold=0.7))])
def test_serving_engine_with_int8_weights_equals_generate(name, paradigm, fast_compile):  # noqa: F811
    """The continuous-batching engine serving a `quantize="int8"` model: requests joining a running
    pool of two rows (so rows are reused) decode, token for token and step for step, as
    `jdllm.generate` decodes each alone with the same quantized model."""
    from jdllm.serve.engine import Engine
    from tests.decode_fixtures import FAST_COMPILE

    model = jdllm.load(os.path.join(MODELS, name), dtype="float32", quantize="int8")
    assert quant.describe(model.params) == "int8"
    tok = model.tokenizer
    prompts = [tok.encode(p) for p in ("sort:3 1 2=", "add:12+34=", "rev:abc=", "sort:9 4=")]
    settings = [jdllm.Sampling(max_new_tokens=n) for n in (8, 6, 7, 8)]  # one generation bucket: one compile
    want = [jdllm.generate(model, [p], paradigm, s)[0] for p, s in zip(prompts, settings)]
    eng = Engine(model, paradigm, max_batch=2, max_prompt_tokens=16, max_new_tokens=8, steps_per_round=2,
                 compiler_options=FAST_COMPILE)
    reqs = []
    for p, s in zip(prompts, settings):
        reqs.append(eng.submit(p, s))
        eng.step_round()  # each arrives while the earlier ones decode
    eng.run_until_idle()
    for r, w in zip(reqs, want):
        assert (r.output.token_ids, r.output.step_map, r.output.finish_reason) == (w.token_ids, w.step_map,
                                                                                   w.finish_reason)
    assert any(w.token_ids for w in want)


def test_errors_before_anything_compiles():
    path = os.path.join(MODELS, "tiny-ar")
    with pytest.raises(errors.QuantizationError, match="'int3'"):
        jdllm.load(path, quantize="int3")
    with pytest.raises(errors.QuantizationError, match="'int2'"):
        jdllm.Quantization("int2")
    for scheme in ("int8", "fp8"):  # a group size was ignored there; the CLI's --group-size is refused the same way
        with pytest.raises(errors.QuantizationError, match=f"group_size=32 applies to int4 only .*'{scheme}'"):
            jdllm.Quantization(scheme, group_size=32)
    with pytest.raises(errors.QuantizationError, match="group_size=128 does not divide .* size 32 of weight 'o'"):
        jdllm.load(path, quantize="int4")  # tiny-ar's head_dim is 32
    for name in ("embed", "lm_head"):  # "no" counted as True: the embedding was quantized
        with pytest.raises(errors.QuantizationError, match=f"{name}='no' must be True or False"):
            jdllm.Quantization("int8", **{name: "no"})
    assert jdllm.Quantization("int4", group_size=np.int64(32)) == jdllm.Quantization("int4", group_size=32)
    with pytest.raises(errors.QuantizationError, match="kv_cache='fp8'"):
        jdllm.load(path, kv_cache="fp8")
    m = jdllm.load(path, dtype="float32", quantize="fp8")
    with pytest.raises(errors.QuantizationError, match="already quantized.*fp8"):
        quant.quantize_params(m.params, "int8")
    from jdllm import nnx as jnnx
    with pytest.raises(errors.QuantizationError, match="quantized"):
        jnnx.Model(m)


def test_convert_quantize_writes_q_and_scale_that_load_as_they_are(tmp_path):
    """`convert --quantize` stores each weight's q and scale (quantized slice by slice as it
    streams): loading gives the very arrays `load(hf, quantize=)` builds; a quantized checkpoint
    refuses another scheme, and a Hugging Face directory already quantized is refused."""
    from convert.cli import main as convert_main

    src = os.path.join(MODELS, "tiny-ar")
    out = str(tmp_path / "ar-fp8")
    assert convert_main([src, out, "--dtype", "float32", "--quantize", "fp8", "--quiet"]) == 0
    got = jdllm.load(out, dtype="float32")
    want = jdllm.load(src, dtype="float32", quantize="fp8")
    assert quant.describe(got.params) == "fp8"
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
    assert jdllm.load(out, dtype="float32", quantize="fp8").params["embed"].scheme == "fp8"
    with pytest.raises(errors.QuantizationError, match="already quantized as .*'fp8'.*'int8'"):
        jdllm.load(out, quantize="int8")
    pre = tmp_path / "hf-gptq"
    pre.mkdir()
    for f in os.listdir(src):
        os.symlink(os.path.join(src, f), pre / f) if f != "config.json" else None
    import json
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    (pre / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(errors.QuantizationError, match="'gptq'"):
        jdllm.load(str(pre), quantize="int8")
    assert convert_main([str(pre), str(tmp_path / "x"), "--quantize", "int8", "--quiet"]) == 2


def test_convert_int4_groups_load_and_generate_like_int4_on_load(tmp_path, capsys, fast_compile):  # noqa: F811
    """`jdllm convert --quantize int4 --group-size 16` stores int4 q with a scale per 16 inputs:
    loading it gives the arrays `load(hf, quantize=Quantization("int4", group_size=16))` builds and
    the same greedy tokens. A group size that does not divide a weight's contracted axis (or one
    given without int4) is an error naming it, before anything is read or written."""
    from jdllm.cli import main as jdllm_main

    src = os.path.join(MODELS, "tiny-ar")
    out = str(tmp_path / "ar-int4")
    assert jdllm_main(["convert", src, out, "--dtype", "float32", "--quantize", "int4", "--group-size", "16",
                       "--quiet"]) == 0
    got = jdllm.load(out, dtype="float32")
    qc = jdllm.Quantization("int4", group_size=16)
    want = jdllm.load(src, dtype="float32", quantize=qc)
    assert quant.config_of(got.params) == qc and got.params["layers"][0]["down"].q.dtype == jnp.int4
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
    sampling = jdllm.Sampling(max_new_tokens=6)
    # committed to the device as the restored arrays are, so both runs share one compile
    want = dataclasses.replace(want, params=jax.device_put(want.params, jax.devices()[0]))
    toks = [[o.token_ids for o in jdllm.generate(m, PROMPTS[:2], jdllm.AR(), sampling)] for m in (got, want)]
    assert toks[0] == toks[1] and any(toks[0])
    capsys.readouterr()
    for argv, msg in ((["--quantize", "int4", "--group-size", "48"], "group_size=48 does not divide .* size 128"),
                      (["--quantize", "fp8", "--group-size", "16"], "--group-size 16 applies to --quantize int4")):
        assert jdllm_main(["convert", src, str(tmp_path / "bad"), *argv, "--quiet"]) == 2
        assert re.search(msg, capsys.readouterr().err)
        assert sorted(os.listdir(tmp_path)) == ["ar-int4"]  # not even a temporary directory


def test_load_plain_checkpoint_quantizes_each_slice_as_it_is_read(tmp_path, monkeypatch):
    """`jdllm.load(plain jdllm checkpoint, quantize=)` quantizes each layer slice as it is read (on
    the host before it reaches the device; on a mesh on the device, the full-precision shards freed
    at once), never after the whole full-precision model is restored: the arrays equal
    quantize-on-load of the Hugging Face directory (one device) and the former quantize-after-restore
    (on a mesh)."""
    from convert.io import convert_checkpoint
    from jdllm import sharding
    from jdllm.model import flat_param_specs

    src = os.path.join(MODELS, "tiny-ar")
    plain = convert_checkpoint(src, str(tmp_path / "plain"), dtype="float32", progress=False)
    qc = jdllm.Quantization("int8", lm_head=False)
    want = jdllm.load(src, dtype="float32", quantize=qc)
    mesh = sharding.make_mesh("data=1", devices=jax.devices()[:1])
    late = quant.quantize_params(jdllm.load(plain, dtype="float32", mesh=mesh).params, qc)
    seen = []

    def spy(real):
        def f(*a, **k):
            seen.append(next(v.ndim for v in a if hasattr(v, "ndim")))  # the weight's
            return real(*a, **k)
        return f

    def no_late(params, quantize, consume=False):
        assert quantize is None, "quantized after the whole restore"
        return params

    monkeypatch.setattr(quant, "quantize_host", spy(_host))
    monkeypatch.setattr(quant, "quantize_params", no_late)
    slices = sum(s.shape[0] if s.axes[:1] == ("layers",) else 1 for s in flat_param_specs(want.config).values())
    got = jdllm.load(plain, dtype="float32", quantize=qc)
    assert len(seen) == slices and max(seen) <= 3  # one call per layer slice, none with a layers axis
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
    seen.clear()
    monkeypatch.setattr(quant, "quantize_weight", spy(_weight))
    on_mesh = jdllm.load(plain, dtype="float32", quantize=qc, mesh=mesh)
    assert len(seen) == slices and max(seen) <= 3
    assert quant.config_of(on_mesh.params) == qc
    for a, b in zip(jax.tree.leaves(on_mesh.params), jax.tree.leaves(late), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))


_host, _weight = quant.quantize_host, quant.quantize_weight


def test_fp8_runs_emulated_with_a_warning_only_on_a_gpu_without_fp8_units(monkeypatch):
    """fp8 is a storage format (converted inside each dot), so every device runs it: a GPU of compute
    capability < 8.9 gets one warning naming it; an fp8 GPU, the CPU and the other schemes none."""
    import types
    import warnings

    x = jnp.ones((1, 128), jnp.bfloat16)
    weights = {s: quant.quantize_array(jnp.ones((128, 256), jnp.float32), s, (0,)) for s in ("fp8", "int8")}
    for backend, cc, scheme, warns in (("gpu", "8.0", "fp8", True), ("gpu", "9.0", "fp8", False),
                                       ("gpu", "8.0", "int8", False), ("cpu", None, "fp8", False)):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        monkeypatch.setattr(jax, "devices", lambda c=cc, b=backend: [types.SimpleNamespace(compute_capability=c,
                                                                                           platform=b)])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quant.check_fp8_device(scheme)
        msgs = [str(w.message) for w in seen]
        assert (len(msgs) == 1 and "compute capability 8.0" in msgs[0]) if warns else msgs == [], \
            (backend, cc, scheme, msgs)
        # the few-row kernel converts fp8 in Triton, which needs the fp8 units: XLA's dot without them
        jaxpr = str(jax.make_jaxpr(lambda x, w: mm("bd,df->bf", x, w, kernel=True))(x, weights[scheme]))
        assert ("jdllm_qmatmul" in jaxpr) == (not warns), (backend, cc, scheme)


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory):
    from convert.io import convert_checkpoint

    return convert_checkpoint(os.path.join(MODELS, "tiny-ar"), str(tmp_path_factory.mktemp("ckpt") / "int8"),
                              dtype="float32", progress=False, quantize="int8")


@pytest.mark.parametrize("change,message", [
    (None, "no quantization: a plain checkpoint.*stores embed/q"),
    (dict(scheme="fp8"), "'fp8'.*embed/q is stored as int8, scheme 'fp8' stores float8_e4m3fn"),
    (dict(scheme="int4", group_size=16), "embed/q is stored as int8, scheme 'int4' stores int4"),
    (dict(embed=False), "'embed': False.*embed/q is stored but not expected"),
    (dict(scheme="int3"), "quantization .*'int3'.* does not read"),
], ids=["dropped", "fp8", "int4", "embed", "unknown"])
def test_quantized_checkpoint_whose_marker_disagrees_is_refused_before_compiling(change, message, int8_checkpoint,
                                                                                 tmp_path):
    """A quantized checkpoint whose jdllm_config.json says another quantization than its arrays hold
    (or none: change None drops it) is a jdllm error naming the parameter and the values, at load,
    before anything runs."""
    import json
    import shutil

    out = shutil.copytree(int8_checkpoint, str(tmp_path / "q"))
    marker = os.path.join(out, "jdllm_config.json")
    with open(marker) as f:
        meta = json.load(f)
    if change is None:
        del meta["quantization"]
    else:
        meta["quantization"].update(change)
    with open(marker, "w") as f:
        json.dump(meta, f)
    with pytest.raises((errors.QuantizationError, errors.CorruptCheckpointError), match=message):
        jdllm.load(out, dtype="float32")


def test_command_lines_offer_the_schemes_quant_implements():
    """`--quantize` of generate / serve / convert spells out jdllm.quant.SCHEMES (so --help stays
    free of JAX): the lists must agree."""
    import argparse

    from convert import cli as convert_cli
    from jdllm import bench_cli, generate_cli
    from jdllm.serve import cli as serve_cli

    for module in (generate_cli, serve_cli, convert_cli, bench_cli):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        action = next(a for a in p._actions if a.dest == "quantize")
        assert tuple(action.choices) == quant.SCHEMES and action.default is None, module.__name__
        assert any(a.dest == "group_size" for a in p._actions), module.__name__


def test_rl_update_params_quantizes_the_trainers_weights_like_the_rollout_model(fast_compile):  # noqa: F811
    from jdllm.rl.tunix_bridge import JdllmRollout

    path = os.path.join(MODELS, "tiny-ar")
    qc = jdllm.Quantization("int8", lm_head=False)
    rollout = JdllmRollout(model=jdllm.load(path, dtype="float32", quantize=qc))
    plain = jdllm.load(path, dtype="float32")
    scaled = jax.tree.map(lambda x: 2 * x, plain.params)
    rollout.update_params(scaled)
    got = rollout.params()
    assert quant.config_of(got) == qc and not quant.is_quantized(got["lm_head"])
    want = quant.quantize_params(scaled, qc)["layers"][1]["gate_up"]
    np.testing.assert_array_equal(np.asarray(got["layers"][1]["gate_up"].q), np.asarray(want.q))
    # the trainer's float weights back: a greedy rollout runs them quantized as the loaded model
    # does: each token is the argmax of the quantize-on-load model's logits (one forward; tunix's
    # completions drop the stop token)
    import types

    rollout.update_params(plain.params)
    config = types.SimpleNamespace(max_tokens_to_generate=6, temperature=0.0, top_p=1.0, top_k=None, seed=0,
                                   max_prompt_length=16, eos_tokens=None, return_logprobs=False)
    out = rollout.generate(PROMPTS, config)
    model = jdllm.load(path, dtype="float32", quantize=qc)
    rows = [model.tokenizer.encode(p) + t.tolist() for p, t in zip(PROMPTS, out.tokens)]
    greedy = np.asarray(jdllm.logits(model, rows)).argmax(-1)
    T = greedy.shape[1]
    for b, t in enumerate(out.tokens):
        n = len(t)
        assert n, b
        assert greedy[b, T - n - 1:T - 1].tolist() == t.tolist(), b
        assert n == 6 or greedy[b, T - 1] == rollout.eos_id(), b  # it stopped at the stop token


def test_int8_kv_cache_layout_and_rounding():
    """An int8 cache: int8 K / V with a float32 scale per (token, KV head); quantize_kv keeps each
    value within half a step of its row's scale (the paradigm test above decodes with it)."""
    from jdllm.model import KVCache, dequantize_kv, quantize_kv

    cfg = jdllm.ModelConfig(model_type="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                            num_heads=2, num_kv_heads=2, head_dim=8, kv_cache_dtype="int8")
    c = KVCache.empty(cfg, 3, 5)
    assert c.k.dtype == jnp.int8 and c.k_scale.shape == (2, 3, 5, 2, 1) and c.v_scale.dtype == jnp.float32
    assert KVCache.empty(cfg.replace(kv_cache_dtype=None), 3, 5).k_scale is None
    x = np.random.default_rng(1).normal(size=(2, 4, 2, 8)).astype(np.float32)
    q, sc = quantize_kv(jnp.asarray(x))
    want = np.abs(x).max(-1, keepdims=True) / 127
    np.testing.assert_allclose(np.asarray(sc), want, rtol=1e-6)
    assert np.all(np.abs(np.asarray(dequantize_kv(q, sc, jnp.float32)) - x) <= want / 2 + 1e-7)


def test_quantize_example_runs_and_reports_each_scheme(capsys):
    """examples/quantize.py on the shipped tiny-ar: int8 / fp8 weights' logits error against bfloat16,
    an int8 KV cache's answers beside the bfloat16 cache's, and a quantized checkpoint's answers; the
    figures it prints are in range (int8 logits within 5% of bfloat16, most answers right)."""
    from tests.scripts import load_script  # noqa: PLC0415

    load_script("examples/quantize.py").main(["--models-dir", MODELS])
    out = capsys.readouterr().out
    err = float(re.search(r"^int8 +weights [\d.]+ MiB +logits rel\. error vs bfloat16 ([\d.]+)", out, re.M).group(1))
    assert 0 < err < 0.05, out
    right, n, same = map(int, re.search(r"int8 KV cache: (\d+)/(\d+) answers right, (\d+)/\d+ identical", out).groups())
    assert n == 8 and right >= 6 and same >= 6, out
    assert re.search(r"tiny-ar-int8 \(int8 checkpoint\): [678]/8 answers right", out), out
