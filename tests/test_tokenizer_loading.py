"""load_tokenizer's direct path: the class tokenizer_config.json names, without AutoTokenizer.

AutoTokenizer reads config.json through transformers' configuration module, which imports torch
wherever torch is installed; for the diffusion families' model types (which transformers does not
register) jdllm loads the named class itself. These tests hold it to what AutoTokenizer loads.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import transformers

from jdllm import checkpoint
from jdllm.config import SUPPORTED_MODEL_TYPES
from tests import hf_fixtures as fx
from tests.scripts import ROOT, subprocess_env

MODELS = os.path.join(ROOT, "models")


def _texts(tok):
    """Texts of characters the vocabulary holds (the shipped and fixture vocabularies have no <unk>
    in their models), with spaces where it can spell them and its special tokens among them."""
    vocab = tok.get_vocab()
    chars = sorted(t for t in vocab if len(t) == 1 and t.isprintable() and not t.isspace() and t != "\u2581")
    sep = " " if (" " in vocab or "\u2581" in vocab) else ""
    specials = "".join(tok.all_special_tokens[:2])
    return ["".join(chars[:8]), "".join(chars[::3]), sep.join(chars[:5]), specials + "".join(chars[-4:]), ""]


def _auto(path):
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def _same(direct, auto):
    assert type(direct) is type(auto)
    assert direct.get_vocab() == auto.get_vocab()
    assert direct.all_special_tokens == auto.all_special_tokens
    assert (direct.eos_token_id, direct.pad_token_id, direct.mask_token_id) == \
        (auto.eos_token_id, auto.pad_token_id, auto.mask_token_id)
    texts = _texts(auto)
    assert len(texts[1]) > 3, texts
    for text in texts:
        ids = direct(text)["input_ids"]
        assert ids == auto(text)["input_ids"], text
        assert direct.decode(ids) == auto.decode(ids)
        assert direct.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    if auto.chat_template:
        msgs = [{"role": "user", "content": "rev:abc="}]
        assert direct.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_direct_model_types_have_no_transformers_tokenizer():
    """If transformers registers one of them, AutoTokenizer may correct its hub class: drop it."""
    from transformers.models.auto import tokenization_auto  # noqa: PLC0415
    registered = set(tokenization_auto.TOKENIZER_MAPPING_NAMES)
    assert checkpoint._UNREGISTERED_MODEL_TYPES <= set(SUPPORTED_MODEL_TYPES)
    assert not checkpoint._UNREGISTERED_MODEL_TYPES & registered


@pytest.mark.parametrize("name", sorted(os.listdir(MODELS)))
def test_shipped_models_load_what_autotokenizer_loads(name):
    path = os.path.join(MODELS, name)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        pytest.skip("no tokenizer")
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    cls = checkpoint.declared_tokenizer_class(transformers, path)
    assert (cls is not None) == (model_type in checkpoint._UNREGISTERED_MODEL_TYPES)
    _same(checkpoint.load_tokenizer(path), _auto(path))


def _hf_dir(tmp_path, model_type, tokenizer_class, config_extra=None, **tokenizer_extra):
    """A fixture tokenizer with a chat template, `tokenizer_class` named (None: no name) and a
    config.json of `model_type` plus `config_extra` (model_type None: no config.json)."""
    d = str(tmp_path / f"{model_type}-{tokenizer_class}")
    fx.build_tokenizer(d, 128)
    if model_type is not None:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": model_type, "vocab_size": 128, **(config_extra or {})}, f)
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    tok_cfg.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tok_cfg["tokenizer_class"] = tokenizer_class
    tok_cfg["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok_cfg.update(tokenizer_extra)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f)
    return d


@pytest.mark.parametrize("model_type", sorted(checkpoint._UNREGISTERED_MODEL_TYPES))
@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast"])
def test_named_class_equals_autotokenizer(tmp_path, model_type, tokenizer_class):
    d = _hf_dir(tmp_path, model_type, tokenizer_class)
    cls = checkpoint.declared_tokenizer_class(transformers, d)
    fast_name = tokenizer_class.removesuffix("Fast") + "Fast"
    assert cls in (getattr(transformers, tokenizer_class), getattr(transformers, fast_name, None))
    _same(checkpoint.load_tokenizer(d), _auto(d))


def test_jdllm_checkpoint_dir_reads_hf_config_copy(tmp_path):
    """A converted checkpoint has hf_config.json, not config.json: the same class as its source."""
    src = _hf_dir(tmp_path, "sdar", "Qwen2Tokenizer")
    dst = str(tmp_path / "converted")
    shutil.copytree(src, dst)
    os.rename(os.path.join(dst, "config.json"), os.path.join(dst, checkpoint.HF_CONFIG_COPY))
    assert checkpoint.declared_tokenizer_class(transformers, dst) is \
        checkpoint.declared_tokenizer_class(transformers, src) is not None
    _same(checkpoint.load_tokenizer(dst), _auto(src))


# how each case differs from an sdar directory naming Qwen2Tokenizer (which the direct path loads)
ELSEWHERE = {
    "registered_model_type": dict(model_type="qwen3"),
    "auto_map": dict(auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", None]}),
    "config_auto_map": dict(config_extra={"auto_map": {"AutoTokenizer": "x.Y"}}),
    "llama": dict(tokenizer_class="LlamaTokenizerFast"),
    "unknown_class": dict(tokenizer_class="NoSuchTokenizer"),
    "no_class": dict(tokenizer_class=None),
    "no_config": dict(model_type=None),
}


@pytest.mark.parametrize("case", list(ELSEWHERE))
def test_autotokenizer_decides_elsewhere(tmp_path, case):
    d = _hf_dir(tmp_path, **{"model_type": "sdar", "tokenizer_class": "Qwen2Tokenizer", **ELSEWHERE[case]})
    assert checkpoint.declared_tokenizer_class(transformers, d) is None
    if case in ("registered_model_type", "unknown_class", "no_class"):
        # the AutoTokenizer path still loads it: AutoTokenizer's choice, or where AutoTokenizer
        # fails (transformers 4 knows no "sdar" config), load_tokenizer's generic fallback
        try:
            ref = _auto(d)
        except (ValueError, KeyError, OSError):
            ref = transformers.PreTrainedTokenizerFast.from_pretrained(d, local_files_only=True)
        _same(checkpoint.load_tokenizer(d), ref)


def test_direct_path_does_not_import_torch():
    """The point of the direct path: `jdllm generate` on a diffusion model starts 1.8 s sooner."""
    pytest.importorskip("torch")
    code = ("import sys; from jdllm.checkpoint import load_tokenizer; "
            f"t = load_tokenizer({os.path.join(MODELS, 'tiny-sdar')!r}); "
            "assert t is not None; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
