"""examples/train_tiny.py: a few steps per family produce loadable Hugging Face directories, deterministically."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from jdllm import tasks
from jdllm.config import ModelConfig
from tests.quick import slow
from tests.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_tiny():
    return load_script("examples/train_tiny.py")


# Each family's own published names (SDAR/Qwen3: model.layers.N.*, LLaDA: model.transformer.blocks.N.*).
EXPECTED = {
    "tiny-ar": ("qwen3", "model.layers.0.self_attn.q_norm.weight", "causal"),
    "tiny-sdar": ("sdar", "model.layers.0.self_attn.k_norm.weight", "block_causal"),
    "tiny-llada": ("llada", "model.transformer.blocks.0.ff_proj.weight", "bidirectional"),
}


def _not_json(word):
    raise ValueError(f"training.json holds {word}, which is not JSON")


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    assert _train_tiny().main(["--model", "all", "--steps", "3", "--smoke", "--quiet", "--out", str(out)]) == 0
    return out


@slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_directory_is_a_loadable_hf_model(smoke_dir, name):
    from jdllm.checkpoint import load_model

    d = smoke_dir / name
    model_type, tensor, attention = EXPECTED[name]
    with open(d / "config.json") as f:
        hf = json.load(f)
    assert hf["model_type"] == model_type
    cfg = ModelConfig.from_hf(hf)
    assert cfg.attention == attention and cfg.vocab_size == tasks.VOCAB_SIZE
    if attention != "causal":
        assert cfg.mask_token_id == tasks.MASK_ID
    if model_type == "sdar":
        assert hf["block_size"] == 4
    tensors = load_file(str(d / "model.safetensors"))
    assert tensor in tensors
    n_params = sum(x.size for x in tensors.values())
    assert 4e5 < n_params < 1.2e6
    for fn in ("tokenizer.json", "tokenizer_config.json", "loss.png", "training.json"):
        assert (d / fn).is_file(), fn
    model = load_model(str(d), dtype="float32")
    assert model.config == cfg
    assert model.tokenizer("rev:abc=")["input_ids"] == tasks.encode("rev:abc=")
    info = json.loads((d / "training.json").read_text(), parse_constant=_not_json)  # strict JSON: no NaN
    assert info["steps"] == 3 and np.isfinite(info["final_loss"])
    assert info["eval_exact_match"] is None  # --smoke does not evaluate
    assert info["init_from"] == (None if name == "tiny-ar" else "tiny-ar")  # the recipe's warm start


@slow
def test_training_is_deterministic(smoke_dir, tmp_path):
    assert _train_tiny().main(["--model", "ar", "--steps", "3", "--smoke", "--quiet", "--out", str(tmp_path)]) == 0
    a = load_file(str(smoke_dir / "tiny-ar" / "model.safetensors"))
    b = load_file(str(tmp_path / "tiny-ar" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_lr_schedule_warmup_and_constant():
    """--warmup / --constant-lr: hand values of a linear climb then a flat rate, and the default
    (cosine) schedule's warmup length and end value."""
    sched = _train_tiny().lr_schedule
    flat = sched(4e-4, 500, warmup=10, constant=True)
    np.testing.assert_allclose([float(flat(t)) for t in (0, 5, 10, 250, 499)], [0, 2e-4, 4e-4, 4e-4, 4e-4], rtol=1e-6)
    assert float(sched(1e-3, 500, warmup=0, constant=True)(0)) == pytest.approx(1e-3)
    cos = sched(1e-3, 600)  # default: warmup min(100, 60) = 60 steps, cosine to lr / 10 at step 600
    np.testing.assert_allclose([float(cos(t)) for t in (30, 60, 600)], [5e-4, 1e-3, 1e-4], rtol=1e-5)
