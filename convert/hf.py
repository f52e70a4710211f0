"""Writing Hugging Face directories: config.json in each family's keys, safetensors files.

The tensor-name table both directions derive from is `jdllm.hf_layout`;
reading directories is `jdllm.checkpoint`'s job.
`save_hf_dir` is the inverse of `jdllm.load` on a Hugging Face directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Mapping

import numpy as np

from jdllm import errors
from jdllm.checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from jdllm.config import ModelConfig
from jdllm.hf_layout import params_to_hf_tensors

# Files copied verbatim alongside the weights (tokenizer, chat template, generation defaults).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


# --------------------------------------------------------------------------- config.json
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
    "sdar": "SDARForCausalLM", "Fast_dLLM_Qwen": "Fast_dLLM_QwenForCausalLM",
    "Dream": "DreamModel", "llada": "LLaDAModelLM",
}


def _eos_value(ids: tuple[int, ...]):
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _dtype_name(dtype) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
        np.dtype(dtype).name, np.dtype(dtype).name)


def hf_config_dict(cfg: ModelConfig, **extra) -> dict[str, Any]:
    """config.json in the family's own keys, with `ModelConfig.from_hf(result) == cfg`.

    Raises ConfigError when the family's config.json cannot express `cfg`
    (e.g. qwen2 without qkv bias, LLaDA with head_dim != d_model / n_heads).
    `extra` keys are added verbatim (e.g. torch_dtype).
    """
    scaling = dict(cfg.rope_scaling) or None
    if scaling:
        scaling = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
    if cfg.model_type == "llada":
        d = {
            "architectures": [_ARCHITECTURES["llada"]],
            "model_type": "llada",
            "d_model": cfg.hidden_size,
            "n_heads": cfg.num_heads,
            "n_kv_heads": cfg.num_kv_heads,
            "n_layers": cfg.num_layers,
            "mlp_hidden_size": cfg.intermediate_size,
            "mlp_ratio": max(1, cfg.intermediate_size // cfg.hidden_size),
            "embedding_size": cfg.vocab_size,
            "vocab_size": cfg.vocab_size,
            "max_sequence_length": cfg.max_position_embeddings,
            "rope": True,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": scaling,
            "rms_norm_eps": cfg.rms_norm_eps,
            "layer_norm_type": "rms",
            "block_type": "llama",
            "activation_type": "silu",
            "block_group_size": 1,
            "include_bias": False,
            "include_qkv_bias": cfg.qkv_bias,
            "attention_layer_norm": False,
            "alibi": False,
            "weight_tying": cfg.tie_word_embeddings,
            "scale_logits": False,
            "input_emb_norm": False,
            "mask_token_id": cfg.mask_token_id,
            "eos_token_id": _eos_value(cfg.eos_token_ids),
            "pad_token_id": cfg.pad_token_id,
            "bos_token_id": cfg.bos_token_id,
        }
    elif cfg.model_type in _ARCHITECTURES:
        d = {
            "architectures": [_ARCHITECTURES[cfg.model_type]],
            "model_type": cfg.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": scaling,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.qkv_bias,
            "eos_token_id": _eos_value(cfg.eos_token_ids),
            "pad_token_id": cfg.pad_token_id,
            "bos_token_id": cfg.bos_token_id,
        }
        if cfg.model_type == "llama":
            d["mlp_bias"] = False
        if cfg.model_type in ("qwen2", "Dream", "Fast_dLLM_Qwen"):
            d["use_sliding_window"] = False
        if cfg.model_type == "sdar":
            d["block_size"] = cfg.block_size
        if cfg.model_type == "Fast_dLLM_Qwen":
            d["bd_size"] = cfg.block_size
        if cfg.mask_token_id is not None:
            d["mask_token_id"] = cfg.mask_token_id
    else:
        raise errors.UnknownArchitectureError(
            f"model_type={cfg.model_type!r} has no Hugging Face config layout; "
            f"jdllm writes {sorted(_ARCHITECTURES)}")
    d.update(extra)
    back = ModelConfig.from_hf(d)
    if back != cfg:
        diff = {f.name: (getattr(cfg, f.name), getattr(back, f.name))
                for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(back, f.name)}
        raise errors.ConfigError(
            f"a {cfg.model_type!r} config.json cannot express this ModelConfig (field: (wanted, "
            f"expressible) {diff}); pick a model_type whose family has these traits")
    return d


# --------------------------------------------------------------------------- safetensors files
def _write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file  # noqa: PLC0415 (startup: kept out of `jdllm convert --help`)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path, metadata={"format": "pt"})


def copy_tokenizer_files(src_dir: str | None, dst_dir: str) -> list[str]:
    """Copy the tokenizer / generation files present in `src_dir`; returns their names."""
    if not src_dir:
        return []
    copied = []
    for fn in TOKENIZER_FILES:
        src = os.path.join(src_dir, fn)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dst_dir, fn))
            copied.append(fn)
    return copied


def save_hf_dir(out_dir: str, params, cfg: ModelConfig, tokenizer_dir: str | None = None,
                shards: int = 1) -> str:
    """Write a Hugging Face directory (config.json + safetensors, sharded when shards > 1).

    Tensors keep the params' dtype. Tokenizer files are copied from
    `tokenizer_dir` when given. Returns out_dir.
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = params_to_hf_tensors(params, cfg)
    dtype = next(iter(tensors.values())).dtype
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(hf_config_dict(cfg, torch_dtype=_dtype_name(dtype)), f, indent=2)
    names = list(tensors)
    if shards <= 1:
        _write_safetensors(os.path.join(out_dir, SINGLE_FILE), tensors)
    else:
        groups = [g for g in np.array_split(np.arange(len(names)), shards) if len(g)]
        weight_map, total = {}, 0
        for j, g in enumerate(groups):
            fn = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
            part = {names[i]: tensors[names[i]] for i in g}
            _write_safetensors(os.path.join(out_dir, fn), part)
            for n, x in part.items():
                weight_map[n] = fn
                total += x.nbytes
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    copy_tokenizer_files(tokenizer_dir, out_dir)
    return out_dir
