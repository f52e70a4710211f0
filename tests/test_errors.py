"""Bad input raises a jdllm.errors exception whose message names the value and the fix."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jdllm
from jdllm import errors
from jdllm.config import ModelConfig

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=16, qk_norm=True)


@pytest.fixture(scope="module")
def model():
    return jdllm.Model.random(CFG, seed=0)


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
