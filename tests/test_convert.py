"""Conversion: lossless round trips, sharded input, and every failure leaving no OUT_DIR."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import hf_fixtures as fx
import jdllm
from convert import hf
from convert import io as cio
from jdllm import checkpoint as ckpt
from jdllm import errors, hf_layout
from jdllm.cli import main as jdllm_main
from jdllm.config import ModelConfig
from jdllm.model import init_params, layer_layout, stack_layers
from tests.quick import slow
from tests.scripts import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _assert_bit_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (k, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(_bits(x), _bits(y)), k


def _no_leftovers(parent, name="out"):
    """Nothing at OUT_DIR and no temporary directory left beside it."""
    assert not os.path.lexists(os.path.join(parent, name))
    assert [f for f in os.listdir(parent) if name in f] == []


def _hf_tensors(hf_dir) -> dict[str, np.ndarray]:
    sd = ckpt.SafetensorsDir(hf_dir)
    return {k: sd[k] for k in sd}


# --------------------------------------------------------------------------- round trips
def test_round_trip_float32_bit_exact(tmp_path):
    hf_dir, _ = fx.build_transformers_model("qwen3", str(tmp_path / "hf"), seed=0, tokenizer=True)
    src = _hf_tensors(hf_dir)
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False)
    assert sorted(os.listdir(out)) == sorted(["params", ckpt.MARKER_FILE, ckpt.HF_CONFIG_COPY,
                                              "tokenizer.json", "tokenizer_config.json",
                                              "generation_config.json"])
    cfg = ModelConfig.from_hf(hf_dir)
    restored = ckpt.restore_params(out)  # stored dtype
    _assert_bit_equal(restored, hf_layout.params_from_hf_tensors(src, cfg))
    # ... and back to the Hugging Face arrays, bit for bit.
    back = hf_layout.params_to_hf_tensors(jax.tree.map(np.asarray, restored), cfg)
    assert sorted(back) == sorted(src)
    _assert_bit_equal(back, src)
    m = jdllm.load(out, dtype="float32")
    assert m.tokenizer is not None and m.tokenizer.mask_token_id == cfg.vocab_size - 1


def test_round_trip_bfloat16_bit_exact(tmp_path):
    _, model = fx.build_transformers_model("llama", str(tmp_path / "f32"), seed=3, tied=True)
    hf_dir = str(tmp_path / "bf16")
    model.to(torch.bfloat16).save_pretrained(hf_dir)
    src = _hf_tensors(hf_dir)
    assert {x.dtype for x in src.values()} == {np.dtype(ml_dtypes.bfloat16)}
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="bfloat16", progress=False)
    cfg = ModelConfig.from_hf(hf_dir)
    restored = ckpt.restore_params(out)
    _assert_bit_equal(restored, hf_layout.params_from_hf_tensors(src, cfg))
    _assert_bit_equal(hf_layout.params_to_hf_tensors(jax.tree.map(np.asarray, restored), cfg), src)
    assert ckpt.read_jdllm_meta(out)["dtype"] == "bfloat16"


@slow
def test_float32_to_bfloat16_rounds_like_torch(tmp_path):
    hf_dir, model = fx.build_transformers_model("qwen2", str(tmp_path / "hf"), seed=2)
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="bfloat16", progress=False)
    cfg = ModelConfig.from_hf(hf_dir)
    back = hf_layout.params_to_hf_tensors(jax.tree.map(np.asarray, ckpt.restore_params(out)), cfg)
    for name, p in model.state_dict().items():
        want = p.to(torch.bfloat16).view(torch.int16).numpy()
        assert np.array_equal(back[name].view(np.int16), want), name


@slow
@pytest.mark.parametrize("family", ["qwen2", "llada", "sdar"])
def test_save_hf_dir_round_trip(family, tmp_path):
    """convert.hf writes each family's own keys and names; reading them back is exact."""
    base = fx.tiny_hf_config(fx.FAMILY_BASE.get(family, family), kv_heads=2)
    cfg = ModelConfig.from_hf(fx.family_config_json(family, base) if family in fx.FAMILY_BASE
                              else base.to_dict() | {"model_type": family})
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0), dtype=jax.numpy.bfloat16))
    d = hf.save_hf_dir(str(tmp_path / "hf"), params, cfg, shards=3)
    assert ModelConfig.from_hf(d) == cfg
    names = set(_hf_tensors(d))
    if family == "llada":
        _, ref = fx.build_family_dir("llada", str(tmp_path / "ref"), kv_heads=2)
        assert names == {fx._llada_name(k) for k in fx._state_numpy(ref)}
        assert "d_model" in json.load(open(os.path.join(d, "config.json")))
    m = jdllm.load(d, dtype=None)
    assert layer_layout(m.params) == "per_layer_fused"  # what load returns; stacked again, bit for bit
    _assert_bit_equal(jax.tree.map(np.asarray, stack_layers(m.params, cfg)), params)


@slow
def test_sharded_input(tmp_path):
    hf_dir, model = fx.build_transformers_model("qwen2", str(tmp_path / "hf"), seed=8, max_shard_size="20KB")
    index = json.load(open(os.path.join(hf_dir, ckpt.INDEX_FILE)))
    assert len(set(index["weight_map"].values())) >= 3
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False)
    tokens = np.random.default_rng(0).integers(0, 128, (1, 12))
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(tokens)).logits.numpy()
    for path in (hf_dir, out):
        got = np.asarray(jdllm.logits(jdllm.load(path, dtype="float32"), tokens))
        assert np.max(np.abs(got - ref)) <= 1e-4


# --------------------------------------------------------------------------- failures
@pytest.fixture
def sharded(tmp_path):
    hf_dir, _ = fx.build_family_dir("llada", str(tmp_path / "hf"), seed=1, shards=3)
    index = json.load(open(os.path.join(hf_dir, ckpt.INDEX_FILE)))
    return hf_dir, index["weight_map"]


def _convert_fails(hf_dir, tmp_path, exc, *needles):
    with pytest.raises(exc) as info:
        cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False)
    msg = str(info.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    _no_leftovers(str(tmp_path))
    return msg


@slow
def test_corrupted_shard(sharded, tmp_path):
    hf_dir, wm = sharded
    shard = sorted(set(wm.values()))[1]
    path = os.path.join(hf_dir, shard)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])  # truncated download
    _convert_fails(hf_dir, tmp_path, errors.CorruptCheckpointError, shard)
    open(path, "wb").write(b"\xff" * 64)  # garbage header
    _convert_fails(hf_dir, tmp_path, errors.CorruptCheckpointError, shard, "re-download")
    with pytest.raises(errors.CorruptCheckpointError):
        jdllm.load(hf_dir)


@slow
def test_missing_shard(sharded, tmp_path):
    hf_dir, wm = sharded
    shard = sorted(set(wm.values()))[2]
    os.remove(os.path.join(hf_dir, shard))
    _convert_fails(hf_dir, tmp_path, errors.MissingShardError, shard)


def test_missing_tensor(tmp_path):
    hf_dir, _ = fx.build_family_dir("sdar", str(tmp_path / "hf"), seed=1)
    path = os.path.join(hf_dir, ckpt.SINGLE_FILE)
    t = load_file(path)
    gone = "model.layers.1.self_attn.k_norm.weight"
    del t[gone]
    save_file(t, path, metadata={"format": "pt"})
    _convert_fails(hf_dir, tmp_path, errors.MissingTensorError, gone)
    with pytest.raises(errors.MissingTensorError, match="k_norm"):
        jdllm.load(hf_dir)


def test_unexpected_tensor(tmp_path):
    hf_dir, _ = fx.build_transformers_model("qwen3", str(tmp_path / "hf"), seed=1)
    path = os.path.join(hf_dir, ckpt.SINGLE_FILE)
    t = load_file(path)
    extra = "model.layers.2.mlp.gate_proj.weight"  # a third layer config.json does not declare
    t[extra] = t["model.layers.0.mlp.gate_proj.weight"]
    save_file(t, path, metadata={"format": "pt"})
    _convert_fails(hf_dir, tmp_path, errors.UnexpectedTensorError, extra)


def test_shape_mismatch(tmp_path):
    hf_dir, _ = fx.build_transformers_model("llama", str(tmp_path / "hf"), seed=1)
    cfg_path = os.path.join(hf_dir, "config.json")
    c = json.load(open(cfg_path))
    c["intermediate_size"] = 64  # weights were built with 48
    json.dump(c, open(cfg_path, "w"))
    msg = _convert_fails(hf_dir, tmp_path, errors.ShapeMismatchError,
                         "'model.layers.0.mlp.down_proj.weight'", "(32, 48)", "(32, 64)")
    assert "intermediate_size=64" in msg


def test_unknown_model_type(tmp_path):
    hf_dir, _ = fx.build_transformers_model("llama", str(tmp_path / "hf"), seed=1)
    cfg_path = os.path.join(hf_dir, "config.json")
    c = json.load(open(cfg_path))
    c["model_type"], c["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    json.dump(c, open(cfg_path, "w"))
    _convert_fails(hf_dir, tmp_path, errors.UnknownArchitectureError, "'gpt2'", "GPT2LMHeadModel", "llada")


def test_out_dir_exists(tmp_path):
    hf_dir, _ = fx.build_transformers_model("qwen2", str(tmp_path / "hf"), seed=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(errors.OutputExistsError, match="--overwrite"):
        cio.convert_checkpoint(hf_dir, str(out), progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    # --overwrite replaces a jdllm checkpoint (or an empty directory), never a directory of other files
    with pytest.raises(errors.OutputExistsError, match="not a jdllm checkpoint"):
        cio.convert_checkpoint(hf_dir, str(out), overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    cio.convert_checkpoint(hf_dir, str(out), dtype="float32", overwrite=True, progress=False)  # empty
    (out / "keep.txt").write_text("inside the old checkpoint")
    cio.convert_checkpoint(hf_dir, str(out), dtype="float32", overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and ckpt.is_jdllm_dir(str(out))
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert sorted(f for f in os.listdir(tmp_path)) == ["hf", "out"]


def test_a_source_that_is_not_a_hugging_face_directory_says_what_it_is(tmp_path):
    """A missing path, a file, a jdllm checkpoint (a user converting again with --quantize) and a
    directory without config.json each get their own message (all four said "no config.json")."""
    jd = cio.convert_checkpoint(os.path.join(ROOT, "models", "tiny-ar"), str(tmp_path / "tiny-ar"), progress=False)
    assert ckpt.is_jdllm_dir(jd)
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    for src, match in ((tmp_path / "nope", "nope does not exist"), (tmp_path / "f.txt", "f.txt is a file"),
                       (jd, "tiny-ar is already a jdllm checkpoint: load it as it is"),
                       (tmp_path / "empty", r"empty is not a Hugging Face model directory \(no config.json\)")):
        with pytest.raises(errors.CheckpointError, match=match):
            cio.convert_checkpoint(str(src), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["tensors", "orbax"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_conversion_leaves_nothing(where, exc, tmp_path, monkeypatch):
    hf_dir, _ = fx.build_transformers_model("qwen2", str(tmp_path / "hf"), seed=1)
    if where == "tensors":  # half-way through the tensors
        real, calls = ckpt.SafetensorsDir.rows, []

        def flaky(*a):
            calls.append(1)
            if len(calls) == 10:
                raise exc("interrupted")
            return real(*a)

        monkeypatch.setattr(ckpt.SafetensorsDir, "rows", flaky)
    else:  # after every array of the Orbax checkpoint is written
        real_finish = cio.OrbaxStreamWriter.finish

        def flaky_finish(self):
            real_finish(self)
            assert os.listdir(self.dir)
            raise exc("interrupted")

        monkeypatch.setattr(cio.OrbaxStreamWriter, "finish", flaky_finish)
    with pytest.raises(exc):
        cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False)
    _no_leftovers(str(tmp_path))


def _poison(hf_dir, name, value):
    path = os.path.join(hf_dir, ckpt.SINGLE_FILE)
    t = load_file(path)
    t[name] = t[name].copy()
    t[name].reshape(-1)[7] = value
    save_file(t, path, metadata={"format": "pt"})


def test_non_finite_weights_are_refused_while_streaming(tmp_path, monkeypatch):
    """A NaN weight: NonFiniteWeightsError naming the tensor, found on that tensor's slice as it streams
    by (the tensors after it are never converted), nothing left at OUT_DIR; check_finite=False converts."""
    hf_dir, _ = fx.build_transformers_model("qwen2", str(tmp_path / "hf"), seed=1)
    bad = "model.layers.0.mlp.up_proj.weight"
    _poison(hf_dir, bad, np.nan)
    cfg = ModelConfig.from_hf(hf_dir)
    converted, real = set(), ckpt.SafetensorsDir.rows

    def spy(self, name, *a):
        converted.add(name)
        return real(self, name, *a)

    monkeypatch.setattr(ckpt.SafetensorsDir, "rows", spy)
    _convert_fails(hf_dir, tmp_path, errors.NonFiniteWeightsError, repr(bad), "1 NaN/inf", "--no-check-finite")
    assert 0 < len(converted) < len(hf_layout.hf_tensor_names(cfg))  # stopped at the bad tensor, not after all
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False, check_finite=False)
    assert ckpt.is_jdllm_dir(out)


def test_weights_that_overflow_the_target_dtype_are_refused(tmp_path):
    """Finite in the source, inf once cast (7e4 > float16's 65504): the message says the dtype did it."""
    hf_dir, _ = fx.build_transformers_model("llama", str(tmp_path / "hf"), seed=1)
    bad = "model.layers.1.self_attn.o_proj.weight"
    _poison(hf_dir, bad, 7e4)
    with pytest.raises(errors.NonFiniteWeightsError, match=f"{bad}.*float16.*--dtype") as e:
        cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float16", progress=False)
    assert "corrupt" not in str(e.value)
    _no_leftovers(str(tmp_path))
    cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False)  # fits float32


# --------------------------------------------------------------------------- command line
def test_jdllm_cli_convert_checks_weights_are_finite(tmp_path, capsys):
    hf_dir, _ = fx.build_transformers_model("qwen3", str(tmp_path / "hf"), seed=1)
    bad = "model.embed_tokens.weight"
    _poison(hf_dir, bad, np.inf)
    out = str(tmp_path / "out")
    capsys.readouterr()  # the fixture's own output
    assert jdllm_main(["convert", hf_dir, out, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "NonFiniteWeightsError" in err and bad in err, err
    _no_leftovers(str(tmp_path))
    assert jdllm_main(["convert", hf_dir, out, "--quiet", "--no-check-finite"]) == 0
    assert ckpt.is_jdllm_dir(out)


def test_jdllm_cli_convert(tmp_path, capsys):
    hf_dir, _ = fx.build_transformers_model("qwen3", str(tmp_path / "hf"), seed=1)
    out = str(tmp_path / "out")
    assert jdllm_main(["convert", hf_dir, out, "--dtype", "float16", "--quiet"]) == 0
    m = jdllm.load(out, dtype=None)
    assert m.params["embed"].dtype == np.float16
    capsys.readouterr()
    assert jdllm_main(["convert", hf_dir, out, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "OutputExistsError" in err and out in err


@slow
def test_python_m_convert(tmp_path):
    hf_dir, _ = fx.build_transformers_model("llama", str(tmp_path / "hf"), seed=1)
    out = str(tmp_path / "out")
    env = subprocess_env()
    ok = subprocess.run([sys.executable, "-m", "convert", hf_dir, out, "--dtype", "float32"],
                        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "B/s" in ok.stderr and "100%" in ok.stderr  # the progress bar, in bytes
    assert ckpt.is_jdllm_dir(out)
    os.remove(os.path.join(hf_dir, ckpt.SINGLE_FILE))
    bad = subprocess.run([sys.executable, "-m", "convert", hf_dir, str(tmp_path / "out2")],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert bad.returncode != 0
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "CheckpointError" in lines[0] and hf_dir in lines[0]
    assert not os.path.exists(tmp_path / "out2")


def test_tolerated_extra_tensors(tmp_path):
    """A tied checkpoint that still ships lm_head, and old rotary inv_freq buffers, load unchanged."""
    hf_dir, model = fx.build_transformers_model("qwen2", str(tmp_path / "hf"), seed=1, tied=True)
    path = os.path.join(hf_dir, ckpt.SINGLE_FILE)
    t = load_file(path)
    assert "lm_head.weight" not in t
    t["lm_head.weight"] = t["model.embed_tokens.weight"]
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    save_file(t, path, metadata={"format": "pt"})
    tokens = np.random.default_rng(0).integers(0, 128, (1, 10))
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(tokens)).logits.numpy()
    got = np.asarray(jdllm.logits(jdllm.load(hf_dir, dtype="float32"), tokens))
    assert np.max(np.abs(got - ref)) <= 1e-4


@slow
def test_restore_into_shardings(tmp_path):
    """Orbax restores straight into the given shardings (one-device mesh on the CPU)."""
    hf_dir, _ = fx.build_transformers_model("qwen3", str(tmp_path / "hf"), seed=1)
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    cfg = ModelConfig.from_hf(hf_dir)
    from jdllm.model import param_shapes  # noqa: PLC0415

    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                             param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    for path in (out, hf_dir):
        m = ckpt.load_model(path, dtype="bfloat16", shardings=shardings)
        leaves = jax.tree.leaves(m.params)
        assert all(x.sharding == jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) for x in leaves)
        assert {x.dtype for x in leaves} == {jax.numpy.bfloat16.dtype}


def test_damaged_jdllm_checkpoint(tmp_path):
    hf_dir, _ = fx.build_transformers_model("llama", str(tmp_path / "hf"), seed=1)
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False)
    meta_path = os.path.join(out, ckpt.MARKER_FILE)
    meta = json.load(open(meta_path))
    meta["config"]["intermediate_size"] = 64  # config no longer describes the stored params
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(errors.CorruptCheckpointError, match="layers.*'down'.*re-run `jdllm convert`"):
        jdllm.load(out)
    meta["config"]["intermediate_size"] = 48
    json.dump(meta, open(meta_path, "w"))
    jdllm.load(out)  # repaired
    shutil.rmtree(os.path.join(out, "params"))
    with pytest.raises(errors.CorruptCheckpointError, match="params"):
        jdllm.load(out)


# --------------------------------------------------------------------------- streaming layout
def test_conversion_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The converter hands the writer one HF tensor's worth at a time (never a stacked parameter;
    tensors read and written in slabs equal the whole-tensor reference bit for bit),
    the result is an ordinary Orbax checkpoint (Orbax's own restore reads it, one zarr chunk per
    layer), and a checkpoint written the former way (Orbax saving the whole tree) still loads."""
    import orbax.checkpoint as ocp  # noqa: PLC0415
    import tensorstore as ts  # noqa: PLC0415

    hf_dir, _ = fx.build_transformers_model("qwen3", str(tmp_path / "hf"), seed=2, max_shard_size="20KB")
    monkeypatch.setattr(hf_layout, "READ_SLAB_BYTES", 1000)  # tensors read in several slabs of rows
    monkeypatch.setattr(cio, "CHUNK_BYTES", 2048)  # and written in several slabs of several chunks
    monkeypatch.setattr(cio, "SLAB_BYTES", 4096)
    monkeypatch.setattr(ckpt, "SLAB_BYTES", 4096)  # jdllm.load reads them in slabs too
    src = _hf_tensors(hf_dir)  # a plain dict: the reference reads each tensor whole
    largest = max(x.nbytes for x in src.values())
    sizes, real_write = [], cio.OrbaxStreamWriter.write

    def spy(self, path, layer, x):
        sizes.append(x.nbytes)
        return real_write(self, path, layer, x)

    monkeypatch.setattr(cio.OrbaxStreamWriter, "write", spy)
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False)
    cfg = ModelConfig.from_hf(hf_dir)
    assert len(sizes) == len(hf_layout.hf_tensor_names(cfg)) and max(sizes) == largest
    want = hf_layout.params_from_hf_tensors(src, cfg)
    with ocp.StandardCheckpointer() as c:  # Orbax alone, no jdllm code on the read side
        _assert_bit_equal(c.restore(os.path.join(out, ckpt.PARAMS_DIR)), want)
    q = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{out}/params/"},
                 "path": "layers.q"}).result()
    assert q.chunk_layout.read_chunk.shape == (1,) + cio.chunk_shape(q.shape[1:], ("embed", "q_heads", "head_dim"), 4)
    # the former layout: the whole tree saved by Orbax
    old = tmp_path / "old"
    shutil.copytree(out, old)
    shutil.rmtree(old / ckpt.PARAMS_DIR)
    with ocp.StandardCheckpointer() as c:
        c.save(str(old / ckpt.PARAMS_DIR), want)
        c.wait_until_finished()
    _assert_bit_equal(ckpt.restore_params(str(old)), want)
    # jdllm.load reads both layer slice by layer slice (tensorstore), as the HF directory loads
    monkeypatch.setattr(ckpt, "restore_params", None)  # not through Orbax's whole-parameter restore
    ref = jdllm.load(hf_dir, dtype="float32").params
    for d in (out, str(old)):
        _assert_bit_equal(jdllm.load(d, dtype="float32").params, ref)


def test_chunk_shape():
    # one layer per chunk, then the axes a mesh splits halved down to the target size
    assert cio.chunk_shape((28, 1024, 16, 128), ("layers", "embed", "q_heads", "head_dim"), 2) == (1, 1024, 16, 128)
    assert cio.chunk_shape((28, 2048, 6144), ("layers", "embed", "mlp"), 2) == (1, 2048, 1536)
    assert cio.chunk_shape((151936, 1024), ("vocab", "embed"), 2) == (2374, 1024)
    assert cio.chunk_shape((1024,), ("embed",), 2) == (1024,)
    # slabs of whole chunks along the first chunked axis: the lm_head [D, V] in column slabs
    assert cio.slabs((4, 10), (4, 2), 1, target=16) == [(slice(None), slice(r, min(r + 4, 10))) for r in (0, 4, 8)]
    assert cio.slabs((4, 10), (4, 10), 1, target=16) == [(slice(None), slice(None))]


# --------------------------------------------------------------------------- the per-tensor pipeline
class _AbsMax(cio.Transform):
    """A stand-in for quantization: halves q and stores each layer's per-head |q| max beside it."""

    def specs(self, specs):
        q = specs[("layers", "q")]
        extra = dataclasses.replace(q, shape=(q.shape[0], q.shape[2]), axes=("layers", "q_heads"))
        return {**specs, ("layers", "q_absmax"): extra}

    def __call__(self, path, layer, x):
        if path != ("layers", "q"):
            return ((path, x),)
        return ((path, x / 2), (("layers", "q_absmax"), np.abs(x).max(axis=(0, 2)).astype(np.float32)))

    def marker(self):
        return {"transform": "absmax"}


def test_transform_hook_sees_each_tensor_once(tmp_path):
    """A Transform gets each converted slice once (layer by layer) and may add parameters: the
    checkpoint holds exactly what it returned, with its marker keys; without one, the streamed
    checkpoint equals the whole-tree reference tensor for tensor (test_conversion_streams_...)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    hf_dir, _ = fx.build_transformers_model("qwen3", str(tmp_path / "hf"), seed=3)
    cfg = ModelConfig.from_hf(hf_dir)
    want = hf_layout.params_from_hf_tensors(_hf_tensors(hf_dir), cfg)
    out = cio.convert_checkpoint(hf_dir, str(tmp_path / "out"), dtype="float32", progress=False,
                                 transform=_AbsMax())
    with ocp.StandardCheckpointer() as c:
        got = c.restore(os.path.join(out, ckpt.PARAMS_DIR))
    q = want["layers"]["q"]
    want["layers"]["q"] = q / 2
    want["layers"]["q_absmax"] = np.abs(q).max(axis=(1, 3)).astype(np.float32)
    _assert_bit_equal(got, want)
    assert json.load(open(os.path.join(out, ckpt.MARKER_FILE)))["transform"] == "absmax"
    assert not os.path.exists(os.path.join(out, cio.OWNER_FILE))


_SLOW_CONVERT = r"""
import sys, time
from convert import io as cio
from convert.cli import main
from jdllm.process import exit_with
quantize = cio.QuantizeTransform.__call__
def slow(self, path, layer, x):
    print("converting", flush=True)
    time.sleep(0.2)
    return quantize(self, path, layer, x)
cio.QuantizeTransform.__call__ = slow
exit_with(main(sys.argv[1:], own_process=True))  # as `python -m convert` / `jdllm convert` run it
"""


def _digest(directory) -> dict[str, str]:
    import hashlib  # noqa: PLC0415
    return {f: hashlib.sha256(open(os.path.join(directory, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(directory))}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_killed_conversion_leaves_nothing(signum, tmp_path):
    """SIGTERM mid-conversion (`convert --quantize`): the process removes its temporary directory on
    the way out and exits 143 (128 + SIGTERM; Ctrl-C's is 130); SIGKILL cannot be caught, so the next
    conversion to the same OUT_DIR removes what it left. Either way nothing appears at OUT_DIR and
    the source is untouched."""
    hf_dir, _ = fx.build_transformers_model("qwen2", str(tmp_path / "hf"), seed=1)
    before = _digest(hf_dir)
    out = str(tmp_path / "out")
    env = subprocess_env()
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERT, hf_dir, out, "--dtype", "float32", "--quantize",
                             "int8", "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "converting"  # the temporary directory exists now
        proc.send_signal(signum)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    err = proc.stderr.read()
    assert proc.returncode == (143 if signum == signal.SIGTERM else -signal.SIGKILL), (proc.returncode, err)
    assert _digest(hf_dir) == before
    assert not os.path.lexists(out)
    left = [f for f in os.listdir(tmp_path) if "out" in f]
    if signum == signal.SIGTERM:
        assert left == [] and "convert: terminated" in err and "Traceback" not in err, err
        return
    assert len(left) == 1 and left[0].startswith(".out.tmp-")
    live = tmp_path / ".out.tmp-live"  # a running conversion's (this process's parent) stays
    live.mkdir()
    (live / cio.OWNER_FILE).write_text(f"{socket.gethostname()} {os.getppid()}\n")
    mine = tmp_path / ".out.tmp-unowned"  # no owner file: not ours to judge, stays
    mine.mkdir()
    cio.convert_checkpoint(hf_dir, out, dtype="float32", progress=False)
    assert ckpt.is_jdllm_dir(out)
    assert sorted(f for f in os.listdir(tmp_path) if "out" in f) == [".out.tmp-live", ".out.tmp-unowned", "out"]
