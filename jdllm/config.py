"""ModelConfig: the one description of a model every other module reads.

Family traits (attention kind, block size, logit shift, mask token, q/k norm,
qkv bias, tied embeddings, RoPE) are plain fields filled in by `from_hf` from a
Hugging Face config.json; nothing downstream looks at the family name. The one
exception is `weight_layout`, which only the checkpoint readers use to find
tensors under their published names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from jdllm import errors

ATTENTION_KINDS = ("causal", "block_causal", "bidirectional")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static, hashable model description (usable as a jit static argument)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted (key, value) pairs
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    attention: str = "causal"  # "causal" | "block_causal" | "bidirectional"
    block_size: int = 1  # block grid of block_causal attention
    logit_shift: bool = False  # logits at p predict token p+1 (Dream, Fast-dLLM v2)
    mask_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    weight_layout: str = "hf"  # "hf" (model.layers.N.*) | "llada" (model.transformer.blocks.N.*)
    kv_cache_dtype: str | None = None  # "int8": KV cache in int8, a scale per (token, KV head) (load(kv_cache=))

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise errors.ConfigError(f"{name}={v!r} must be an integer >= 1; fix config.json")
        if self.attention not in ATTENTION_KINDS:
            raise errors.ConfigError(
                f"attention={self.attention!r} is not one of {ATTENTION_KINDS}")
        if self.num_heads % self.num_kv_heads:
            raise errors.ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.block_size < 1:
            raise errors.ConfigError(f"block_size={self.block_size} must be >= 1")

    # -- helpers --------------------------------------------------------------
    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def is_diffusion(self) -> bool:
        return self.mask_token_id is not None and self.attention != "causal"

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = _freeze(d.get("rope_scaling") or {})
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json (path, directory or dict)."""
        if isinstance(path_or_dict, Mapping):
            hf = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise errors.ConfigError(f"{path} does not exist: point at a Hugging Face model "
                                         "directory that holds config.json")
            try:
                with open(path) as f:
                    hf = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise errors.ConfigError(f"{path} is not valid JSON ({e})") from e
            if not isinstance(hf, Mapping):
                raise errors.ConfigError(
                    f"{path} holds a JSON {type(hf).__name__}, not an object of config keys; "
                    "use the config.json that came with the model")
        model_type = hf.get("model_type")
        family = _FAMILIES.get(model_type)
        if family is None:
            archs = hf.get("architectures")
            raise errors.UnknownArchitectureError(
                f"model_type={model_type!r} (architectures={archs}) is not supported; "
                f"jdllm reads {sorted(_FAMILIES)}")
        return family(hf)


def _freeze(d: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def _eos(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def _rope(hf: Mapping[str, Any], default_theta: float) -> tuple[float, tuple]:
    """RoPE theta and scaling from either v4 (rope_theta/rope_scaling) or v5 (rope_parameters) keys."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", default_theta))
    scaling.update(params)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    rtype = scaling.get("rope_type", "default")
    if rtype == "default":
        scaling = {}
    elif rtype not in ("linear", "llama3", "yarn"):
        raise errors.ConfigError(
            f"rope_scaling type {rtype!r} is not supported; jdllm implements default, linear, llama3, yarn")
    return float(theta), _freeze(scaling)


def _first(hf: Mapping[str, Any], keys: tuple[str, ...], default):
    """The first of `keys` that config.json sets (to anything but null), else `default`.

    Unlike `hf.get(a) or default`, a 0 stays 0, so the checks below see it.
    """
    for k in keys:
        if hf.get(k) is not None:
            return hf[k]
    return default


def _int(hf: Mapping[str, Any], keys: tuple[str, ...], default):
    v = _first(hf, keys, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise errors.ConfigError(
            f"config.json of model_type={hf.get('model_type')!r} sets {keys[0]}={v!r}; expected an integer")
    return int(v)


def _need(hf: Mapping[str, Any], *keys: str):
    for k in keys:
        if k in hf and hf[k] is not None:
            return hf[k]
    raise errors.ConfigError(f"config.json of model_type={hf.get('model_type')!r} lacks {keys[0]!r}")


def _reject(hf: Mapping[str, Any], unsupported: Mapping[str, Any]) -> None:
    """Refuse config options jdllm does not implement instead of computing wrong logits."""
    for key, neutral in unsupported.items():
        if key in hf and hf[key] is not None and hf[key] != neutral:
            raise errors.ConfigError(
                f"config.json of model_type={hf.get('model_type')!r} sets {key}={hf[key]!r}; "
                f"jdllm only implements {key}={neutral!r}")


def _qwen_llama(hf: Mapping[str, Any], **traits) -> ModelConfig:
    _reject(hf, {"mlp_bias": False, "hidden_act": "silu"})
    heads = int(_need(hf, "num_attention_heads"))
    hidden = int(_need(hf, "hidden_size"))
    theta, scaling = _rope(hf, 10000.0)
    kw = dict(
        model_type=hf["model_type"],
        vocab_size=int(_need(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_need(hf, "intermediate_size")),
        num_layers=int(_need(hf, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=_int(hf, ("num_key_value_heads",), heads),
        head_dim=_int(hf, ("head_dim",), hidden // heads if heads else 0),
        max_position_embeddings=_int(hf, ("max_position_embeddings",), 4096),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        eos_token_ids=_eos(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        bos_token_id=hf.get("bos_token_id"),
    )
    kw.update(traits)
    return ModelConfig(**kw)


def _qwen2(hf):
    return _qwen_llama(hf, qkv_bias=True)


def _qwen3(hf):
    return _qwen_llama(hf, qk_norm=True)


def _llama(hf):
    return _qwen_llama(hf)


def _sdar(hf):
    # SDAR / TraDo: Qwen3 layout, block-causal, same-position logits.
    return _qwen_llama(hf, qk_norm=True, attention="block_causal",
                       block_size=_int(hf, ("block_size", "bd_size"), 4),
                       mask_token_id=_int(hf, ("mask_token_id",), 151669))


def _fast_dllm(hf):
    # Fast-dLLM v2: Qwen2.5 layout, block-causal over bd_size, logits shifted by one.
    return _qwen_llama(hf, qkv_bias=True, attention="block_causal",
                       block_size=_int(hf, ("bd_size", "block_size"), 32),
                       logit_shift=True,
                       mask_token_id=_int(hf, ("mask_token_id",), 151665))


def _dream(hf):
    # Dream: Qwen2.5 layout, bidirectional, logits shifted by one.
    return _qwen_llama(hf, qkv_bias=True, attention="bidirectional", logit_shift=True,
                       mask_token_id=_int(hf, ("mask_token_id",), 151666))


def _llada(hf):
    # LLaDA: LLaMA-like block, OLMo-style config keys and weight names, bidirectional.
    _reject(hf, {"include_bias": False, "scale_logits": False, "input_emb_norm": False,
                 "attention_layer_norm": False, "block_group_size": 1, "activation_type": "silu",
                 "block_type": "llama", "layer_norm_type": "rms", "alibi": False, "rope": True})
    heads = int(_need(hf, "n_heads"))
    hidden = int(_need(hf, "d_model"))
    theta, scaling = _rope(hf, 10000.0)
    if hf.get("mlp_hidden_size") is not None:
        inter = _int(hf, ("mlp_hidden_size",), None)
    else:
        inter = int(hf.get("mlp_ratio", 4) * hidden)
    return ModelConfig(
        model_type="llada",
        vocab_size=_int(hf, ("embedding_size", "vocab_size"), None) if "embedding_size" in hf
        else int(_need(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=int(_need(hf, "n_layers")),
        num_heads=heads,
        num_kv_heads=_int(hf, ("n_kv_heads",), heads),
        head_dim=hidden // heads if heads else 0,
        max_position_embeddings=_int(hf, ("max_sequence_length",), 4096),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("weight_tying", False)),
        qkv_bias=bool(hf.get("include_qkv_bias", False)),
        attention="bidirectional",
        mask_token_id=_int(hf, ("mask_token_id",), 126336),
        eos_token_ids=_eos(hf.get("eos_token_id", 126081)),
        pad_token_id=hf.get("pad_token_id", 126081),
        bos_token_id=hf.get("bos_token_id"),
        weight_layout="llada",
    )


_FAMILIES = {
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "llama": _llama,
    "sdar": _sdar,
    "Fast_dLLM_Qwen": _fast_dllm,
    "Dream": _dream,
    "llada": _llada,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))
