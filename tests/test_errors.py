"""Bad input raises a jdllm.errors exception whose message names the value and the fix."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jdllm
from jdllm import errors
from jdllm.config import ModelConfig
from tests.quick import slow

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=16, qk_norm=True)


@pytest.fixture(scope="module")
def model():
    return jdllm.Model.random(CFG, seed=0)


@slow
def test_logits_accepts_valid_input(model):
    """The boundaries themselves are accepted (id vocab-1, length max_position_embeddings)."""
    out = jdllm.logits(model, [[0, 63] * 8])
    assert out.shape == (1, 16, 64) and np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("bad", [64, 1000, -1])
def test_token_out_of_vocab(model, bad):
    with pytest.raises(errors.TokenOutOfRangeError) as info:
        jdllm.logits(model, [[1, 2, 3], [4, bad]])
    msg = str(info.value)
    assert str(bad) in msg and "[0, 64)" in msg and "tokenizer" in msg


def test_token_out_of_vocab_in_array(model):
    with pytest.raises(errors.TokenOutOfRangeError, match="64"):
        jdllm.logits(model, np.array([[1, 64]]))


def test_sequence_too_long(model):
    with pytest.raises(errors.SequenceTooLongError) as info:
        jdllm.logits(model, [[1] * 17])
    msg = str(info.value)
    assert "17" in msg and "max_position_embeddings=16" in msg and "truncate" in msg


@pytest.mark.parametrize("rows", [[], [[]], [[1, 2], []], np.zeros((1, 0), np.int32)])
def test_empty_input(model, rows):
    with pytest.raises(errors.InputError, match="non-empty"):
        jdllm.logits(model, rows)


def test_errors_are_catchable_as_builtin_kinds():
    assert issubclass(errors.TokenOutOfRangeError, ValueError)
    assert issubclass(errors.OutputExistsError, FileExistsError)
    assert issubclass(errors.MissingShardError, errors.CheckpointError)


# --------------------------------------------------------------------------- loading
def test_load_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(errors.CheckpointError, match="nope.*not a directory"):
        jdllm.load(missing)


def test_load_directory_without_model(tmp_path):
    with pytest.raises(errors.CheckpointError, match="config.json.*jdllm_config.json"):
        jdllm.load(str(tmp_path))


def test_load_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(errors.UnknownArchitectureError) as info:
        jdllm.load(str(tmp_path))
    msg = str(info.value)
    assert "'mamba'" in msg and "MambaForCausalLM" in msg and "qwen3" in msg


def test_load_bad_dtype(tmp_path):
    from convert.hf import save_hf_dir  # noqa: PLC0415

    params = jdllm.Model.random(CFG).params
    save_hf_dir(str(tmp_path), params, CFG.replace(model_type="qwen3"))
    with pytest.raises(errors.ConfigError, match="'int8'.*bfloat16"):
        jdllm.load(str(tmp_path), dtype="int8")
    assert os.path.exists(tmp_path / "model.safetensors")


def test_corrupt_jdllm_marker(tmp_path):
    (tmp_path / "jdllm_config.json").write_text("{not json")
    with pytest.raises(errors.CorruptCheckpointError, match="jdllm_config.json.*jdllm convert"):
        jdllm.load(str(tmp_path))


# --------------------------------------------------------------------------- issue 19: rough edges
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")


@pytest.fixture(scope="module")
def tiny_sdar():
    return jdllm.load(os.path.join(SHIPPED, "tiny-sdar"), dtype="float32")


@pytest.mark.parametrize("text,char,pos", [("Add:1+2=", "A", 0), ("sort:3 1?", "?", 8), ("ab\ncd", "\n", 2),
                                           ("x\x00", "\x00", 1), ("日本", "日", 0), ("ok 🙂", "🙂", 3)])
def test_text_the_tokenizer_cannot_encode(tiny_sdar, text, char, pos):
    with pytest.raises(errors.InputError) as info:
        jdllm.generate(tiny_sdar, [text])
    msg = str(info.value)
    assert repr(char) in msg and f"position {pos}" in msg and "abcdefghijklmnopqrstuvwxyz" in msg


def test_text_that_is_not_utf8(tiny_sdar):
    with pytest.raises(errors.InputError, match="not valid UTF-8.*position 2"):
        jdllm.generate(tiny_sdar, ["ab\udcff"])  # how Python decodes a stray byte in argv


@pytest.mark.parametrize("kw,exc,match", [
    (dict(temperature="0.5"), errors.ArgumentTypeError, r"temperature='0.5'.*a number"),
    (dict(top_k=None), errors.ArgumentTypeError, "top_k=None"),
    (dict(stop_token_ids=5), errors.ArgumentTypeError, r"stop_token_ids=\[5\]"),
    (dict(stop_token_ids="12"), errors.ArgumentTypeError, "stop_token_ids='12'"),
    (dict(stop_token_ids=[-1]), errors.DecodingConfigError, "negative"),
    (dict(temperature=float("inf")), errors.DecodingConfigError, "temperature=inf must be finite"),
    (dict(temperature=1e30), errors.DecodingConfigError, r"temperature=1e\+30 must be finite and in \[0, 2.0\]"),
])
def test_sampling_types_and_ranges(kw, exc, match):
    with pytest.raises(exc, match=match):
        jdllm.Sampling(**kw)


def test_sampling_accepts_numpy_scalars_and_arrays():
    s = jdllm.Sampling(temperature=np.float32(0.5), top_k=np.int64(3), stop_token_ids=np.array([1, 4]))
    assert s.stop_token_ids == (1, 4)


def test_generate_argument_types_and_special_ids(tiny_sdar):
    with pytest.raises(errors.ArgumentTypeError, match=r"jdllm.Sampling\(\*\*\{'temperature': 0\}\)"):
        jdllm.generate(tiny_sdar, ["sort:1 2="], sampling={"temperature": 0})
    with pytest.raises(errors.TokenOutOfRangeError, match="stop token id 999.*0, 48"):
        jdllm.generate(tiny_sdar, ["sort:1 2="], sampling=jdllm.Sampling(stop_token_ids=[999]))
    with pytest.raises(errors.InputError, match="mask token id 2 at position 1"):
        jdllm.generate(tiny_sdar, [[31, 2, 30]])
    with pytest.raises(errors.ArgumentTypeError, match="prompt 0 holds float64"):
        jdllm.generate(tiny_sdar, [[1.5, 3.0]])


@pytest.mark.parametrize("bad,exc,match", [
    ("abc", errors.ArgumentTypeError, "text"), (np.zeros((1, 2, 3), np.int32), errors.ArgumentTypeError, "3 dim"),
    (5, errors.ArgumentTypeError, "0 dim"), ([[2**31]], errors.TokenOutOfRangeError, "2147483648"),
    ([[1.5]], errors.ArgumentTypeError, "float64"),
])
def test_logits_argument_types(model, bad, exc, match):
    with pytest.raises(exc, match=match):
        jdllm.logits(model, bad)


@slow
def test_default_max_new_tokens_fits_the_model(tiny_sdar):
    """The default 256 is clipped to the 64-token context. A note (pointing at the caller) says so when
    the context cut an output short, never on a call whose outputs stopped on their own."""
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        out = jdllm.generate(tiny_sdar, ["sort:3 1 2=", "rev:abc="])
    assert [o.text for o in out] == ["1 2 3", "cba"] and {o.finish_reason for o in out} == {"stop"}
    assert [str(w.message) for w in quiet if "max_new_tokens" in str(w.message)] == []
    with pytest.warns(UserWarning, match="output 1 ran to the end of the model's context after 56 tokens") as rec:
        out = jdllm.generate(tiny_sdar, ["sort:3 1 2=", "rev:abc="],
                             sampling=[jdllm.Sampling(), jdllm.Sampling(stop_token_ids=())])
    assert out[0].finish_reason == "stop" and (out[1].finish_reason, len(out[1].token_ids)) == ("length", 56)
    assert len([w for w in rec if "max_new_tokens" in str(w.message)]) == 1  # one note per call
    assert rec[0].filename == __file__  # stacklevel: the user's line, not jdllm/api.py
    with pytest.raises(errors.SequenceTooLongError):  # an explicit value is not second-guessed
        jdllm.generate(tiny_sdar, ["sort:3 1 2="], sampling=jdllm.Sampling(max_new_tokens=200))


@slow
def test_paradigm_warnings_point_at_the_caller(tiny_sdar):
    with pytest.warns(UserWarning, match="block_length=8 differs") as rec:
        jdllm.generate(tiny_sdar, ["sort:1 2="], jdllm.BlockDiffusion(block_length=8, denoising_steps=8),
                       jdllm.Sampling(max_new_tokens=8))
    assert rec[0].filename == __file__


def test_load_argument_checks(tmp_path):
    with pytest.raises(errors.ArgumentTypeError, match="path=None"):
        jdllm.load(None)
    with pytest.raises(errors.ConfigError, match="attn_impl='nonsense'"):
        jdllm.load(os.path.join(SHIPPED, "tiny-ar"), attn_impl="nonsense")
    with pytest.raises(errors.ConfigError, match="cudnn.*GPU"):
        jdllm.load(os.path.join(SHIPPED, "tiny-ar"), attn_impl="cudnn")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(errors.ConfigError, match="JSON list"):
        jdllm.load(str(tmp_path))


def _hf_copy(tmp_path, name="tiny-sdar", **config):
    import shutil  # noqa: PLC0415

    d = tmp_path / name
    shutil.copytree(os.path.join(SHIPPED, name), d)
    c = json.loads((d / "config.json").read_text())
    c.update(config)
    (d / "config.json").write_text(json.dumps(c))
    return str(d)


def test_config_zero_is_not_replaced_by_a_default(tmp_path):
    cfg = ModelConfig.from_hf({"model_type": "sdar", "vocab_size": 48, "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "mask_token_id": 0})
    assert cfg.mask_token_id == 0
    for key in ("block_size", "num_key_value_heads", "head_dim"):
        with pytest.raises(errors.ConfigError, match=f"{key.replace('num_key_value_heads', 'num_kv_heads')}=0"):
            jdllm.load(_hf_copy(tmp_path / key, **{key: 0}))
    llada = {"model_type": "llada", "d_model": 32, "n_heads": 4, "n_layers": 1, "mlp_hidden_size": 64,
             "vocab_size": 64, "embedding_size": 0}
    with pytest.raises(errors.ConfigError, match="vocab_size=0"):
        ModelConfig.from_hf(llada)


@pytest.mark.parametrize("key,value", [("mask_token_id", 999), ("eos_token_id", 48), ("pad_token_id", -1)])
def test_special_ids_outside_the_vocabulary(tmp_path, key, value):
    with pytest.raises(errors.ConfigError, match=f"{key}={value}.*0, 48"):
        jdllm.load(_hf_copy(tmp_path, **{key: value}))


def test_integer_weights_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415

    d = _hf_copy(tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(errors.CorruptCheckpointError, match="'model.norm.weight'.*int32"):
        jdllm.load(d)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_check_finite_names_the_tensor(tmp_path, value):
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415

    from convert.io import convert_checkpoint  # noqa: PLC0415

    d = _hf_copy(tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.2.self_attn.k_proj.weight"][0, 0] = value
    save_file(tensors, path, metadata={"format": "pt"})
    jdllm.load(d)  # off by default in Python
    with pytest.raises(errors.NonFiniteWeightsError, match=r"'model.layers.2.self_attn.k_proj.weight' \(layers/k\[2\]\)"):
        jdllm.load(d, check_finite=True)
    with pytest.raises(errors.NonFiniteWeightsError, match=r"'model.layers.2.self_attn.k_proj.weight' \(layers/k\[2\]\)"):
        convert_checkpoint(d, str(tmp_path / "ckpt"), dtype="float32", progress=False)  # checked by default
    out = convert_checkpoint(d, str(tmp_path / "ckpt"), dtype="float32", progress=False, check_finite=False)
    with pytest.raises(errors.NonFiniteWeightsError, match="model.layers.2.self_attn.k_proj.weight"):
        jdllm.load(out, check_finite=True)  # a jdllm checkpoint: checked on the device


# --------------------------------------------------------------------------- paradigm fields
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("cls,kw,exc,match", [
    ("MultiBlock", dict(block_size="4"), errors.ArgumentTypeError, r"MultiBlock\(block_size='4'\): expected an integer"),
    ("MultiBlock", dict(block_size=INF), errors.DecodingConfigError, "block_size=inf must be finite"),
    ("MultiBlock", dict(block_add_threshold=None), errors.ArgumentTypeError, "block_add_threshold=None"),
    ("MultiBlock", dict(entropy_threshold=INF), errors.DecodingConfigError, "entropy_threshold=inf must be finite"),
    ("MultiBlock", dict(max_forwards=True), errors.ArgumentTypeError, "max_forwards=True"),
    ("MaskedDiffusion", dict(gen_length=True), errors.ArgumentTypeError, "gen_length=True"),
    ("MaskedDiffusion", dict(steps="8"), errors.ArgumentTypeError, "steps='8'"),
    ("MaskedDiffusion", dict(gen_length=NAN), errors.DecodingConfigError, "gen_length=nan must be finite"),
    ("MaskedDiffusion", dict(cfg_scale=INF), errors.DecodingConfigError, "cfg_scale=inf must be finite"),
    ("MaskedDiffusion", dict(confidence_threshold="0.9"), errors.ArgumentTypeError, "confidence_threshold='0.9'"),
    ("BlockDiffusion", dict(block_length=NAN), errors.DecodingConfigError, "block_length=nan must be finite"),
    ("BlockDiffusion", dict(block_length=2.5), errors.DecodingConfigError, "block_length=2.5 must be an integer"),
    ("BlockDiffusion", dict(fuse_commit="no"), errors.DecodingConfigError, "fuse_commit='no' must be True or False"),
    ("BlockDiffusion", dict(eb_threshold=INF), errors.DecodingConfigError, "eb_threshold=inf must be finite"),
    ("Sampling", dict(top_k=NAN), errors.DecodingConfigError, "top_k=nan must be finite"),
    ("Sampling", dict(max_new_tokens=INF), errors.DecodingConfigError, "max_new_tokens=inf must be finite"),
    ("Sampling", dict(seed=1.5), errors.DecodingConfigError, "seed=1.5 must be an integer"),
])
def test_config_field_types(cls, kw, exc, match):
    with pytest.raises(exc, match=match):
        getattr(jdllm, cls)(**kw)


def test_config_fields_are_normalized():
    """Numpy scalars and integral floats become Python ints, so equal configs are one static jit argument."""
    for cls, kw in (("MultiBlock", dict(block_size=4, max_forwards=9)), ("MaskedDiffusion", dict(gen_length=8, steps=8)),
                    ("BlockDiffusion", dict(block_length=4, denoising_steps=2)),
                    ("Sampling", dict(top_k=3, max_new_tokens=5))):
        plain = getattr(jdllm, cls)(**kw)
        for convert in (float, np.int64, np.float32):
            other = getattr(jdllm, cls)(**{k: convert(v) for k, v in kw.items()})
            assert other == plain and hash(other) == hash(plain)
            assert all(type(getattr(other, k)) is int for k in kw), (cls, convert)
    assert jdllm.MultiBlock(early_stop=np.bool_(False)).early_stop is False


def test_block_size_defaults_to_the_models(tiny_sdar):
    """MultiBlock() and BlockDiffusion() on a block-causal model decode at its trained block size: the
    same tokens as the explicit value, no warning, no second compile. (MultiBlock's old default of 32 gave
    tiny-sdar, trained on blocks of 4, empty answers.)"""
    import warnings  # noqa: PLC0415

    from jdllm.api import resolve_paradigm  # noqa: PLC0415
    from tests.compiles import traces  # noqa: PLC0415

    prompts, s = ["sort:3 1 2=", "add:12+34=", "rev:abc="], jdllm.Sampling(max_new_tokens=8)
    for implicit, explicit in ((jdllm.MultiBlock(), jdllm.MultiBlock(block_size=4)),
                               (jdllm.BlockDiffusion(), jdllm.BlockDiffusion(block_length=4))):
        assert resolve_paradigm(implicit, tiny_sdar.config) == explicit
        want = jdllm.generate(tiny_sdar, prompts, explicit, s)
        with warnings.catch_warnings(), traces() as seen:
            warnings.simplefilter("error")
            got = jdllm.generate(tiny_sdar, prompts, implicit, s)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert seen["run"] == 0
    assert [o.text for o in want] == ["1 2 3", "46", "cba"]
    bidirectional = ModelConfig(model_type="llada", attention="bidirectional", mask_token_id=3, vocab_size=16,
                                hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                                head_dim=8)
    assert resolve_paradigm(jdllm.MultiBlock(), bidirectional).block_size == 32  # d3LLM's for LLaDA / Dream
    with pytest.raises(errors.DecodingConfigError, match="'block_diffusion' needs a block-causal"):
        resolve_paradigm(jdllm.BlockDiffusion(), bidirectional)
