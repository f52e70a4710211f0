"""logits() on ragged batches, and config options jdllm refuses rather than ignores."""

import numpy as np
import pytest

import jdllm
from jdllm import errors
from jdllm.config import ModelConfig
from tests.quick import slow


@slow
@pytest.mark.parametrize("attention", ["causal", "block_causal", "bidirectional"])
def test_ragged_rows_equal_rows_alone(attention):
    cfg = ModelConfig(model_type="t", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, attention=attention, block_size=4,
                      mask_token_id=3 if attention != "causal" else None)
    model = jdllm.Model.random(cfg, seed=1, std=0.5)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 64, n).tolist() for n in (7, 10, 5)]
    both = np.asarray(jdllm.logits(model, rows))
    T = max(map(len, rows))
    for b, r in enumerate(rows):
        alone = np.asarray(jdllm.logits(model, [r]))[0]
        np.testing.assert_allclose(both[b, T - len(r):], alone, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("key,value", [("scale_logits", True), ("input_emb_norm", True),
                                       ("block_group_size", 2), ("include_bias", True)])
def test_llada_unsupported_options_refused(key, value):
    hf = {"model_type": "llada", "d_model": 32, "n_heads": 4, "n_layers": 1, "mlp_hidden_size": 64,
          "vocab_size": 64, key: value}
    with pytest.raises(errors.ConfigError, match=key):
        ModelConfig.from_hf(hf)


def test_qwen_unsupported_activation_refused():
    hf = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_act": "gelu"}
    with pytest.raises(errors.ConfigError, match="hidden_act"):
        ModelConfig.from_hf(hf)


def test_library_never_imports_the_converter():
    """`convert` depends on jdllm (it writes what jdllm.checkpoint reads), never the reverse."""
    import ast
    import pathlib

    root = pathlib.Path(jdllm.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "convert"]
    assert not offenders
    assert any(root.rglob("checkpoint.py"))
