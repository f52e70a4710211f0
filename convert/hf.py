"""Hugging Face checkpoint format: tensor names, config.json keys, safetensors files.

Each family's published weight names are mapped onto jdllm's parameter tree
(`jdllm.model.param_specs`) by one table, `hf_tensor_names`; reading
(`params_from_hf_tensors`) and writing (`params_to_hf_tensors`) are both
derived from it, so they are exact inverses.

Layouts:
  "hf"    (Qwen2, Qwen3, LLaMA, SDAR, Dream, Fast-dLLM v2):
          model.embed_tokens, model.layers.N.self_attn.{q,k,v,o}_proj, ...,
          model.norm, lm_head
  "llada" (LLaDA, OLMo-style names from its modeling_llada.py):
          model.transformer.wte, model.transformer.blocks.N.{q_proj, k_proj,
          v_proj, attn_out, ff_proj (gate), up_proj, ff_out (down), attn_norm,
          ff_norm}, model.transformer.ln_f, model.transformer.ff_out (head)

A torch Linear stores its weight as [out, in]; jdllm keeps [in, ...out] with
heads split out, e.g. q_proj.weight [H*Dh, D] <-> q [D, H, Dh].
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from jdllm import errors
from jdllm.config import ModelConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files copied verbatim alongside the weights (tokenizer, chat template, generation defaults).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


# --------------------------------------------------------------------------- name table
@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where one Hugging Face tensor lives in jdllm's parameter tree.

    path: keys into the params dict, e.g. ("layers", "q").
    layer: index along the stacked `layers` axis, or None for top-level weights.
    hf_shape: the shape the tensor has on disk, as the config implies.
    kind: how HF and jdllm layouts relate (see `_to_jdllm` / `_to_hf`).
    """

    path: tuple[str, ...]
    layer: int | None
    hf_shape: tuple[int, ...]
    kind: str  # "copy" | "linear" | "heads_in" | "heads_out" | "head_bias"


def _layer_names(cfg: ModelConfig) -> dict[str, str]:
    """jdllm layer param -> HF name template (relative to the layer prefix)."""
    if cfg.weight_layout == "llada":
        names = {
            "attn_norm": "attn_norm.weight", "q": "q_proj.weight", "k": "k_proj.weight",
            "v": "v_proj.weight", "o": "attn_out.weight", "mlp_norm": "ff_norm.weight",
            "gate": "ff_proj.weight", "up": "up_proj.weight", "down": "ff_out.weight",
            "q_bias": "q_proj.bias", "k_bias": "k_proj.bias", "v_bias": "v_proj.bias",
        }
    elif cfg.weight_layout == "hf":
        names = {
            "attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
            "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
            "o": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
            "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
            "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
            "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
            "k_norm": "self_attn.k_norm.weight",
        }
    else:
        raise errors.ConfigError(f"weight_layout={cfg.weight_layout!r} is not 'hf' or 'llada'")
    return names


def _prefixes(cfg: ModelConfig) -> tuple[str, dict[str, str]]:
    """(layer prefix template, top-level jdllm param -> HF name)."""
    if cfg.weight_layout == "llada":
        return "model.transformer.blocks.{i}.", {
            "embed": "model.transformer.wte.weight",
            "final_norm": "model.transformer.ln_f.weight",
            "lm_head": "model.transformer.ff_out.weight",
        }
    return "model.layers.{i}.", {
        "embed": "model.embed_tokens.weight",
        "final_norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
    }


def hf_tensor_names(cfg: ModelConfig) -> dict[str, TensorSlot]:
    """Every HF tensor name the config requires -> its TensorSlot (ordered as on disk)."""
    from jdllm.model import param_shapes  # noqa: PLC0415 (keeps `import convert.hf` light)

    shapes = param_shapes(cfg)
    D = cfg.hidden_size
    layer_prefix, top = _prefixes(cfg)
    layer_names = _layer_names(cfg)
    kinds = {"q": "heads_in", "k": "heads_in", "v": "heads_in", "o": "heads_out",
             "gate": "linear", "up": "linear", "down": "linear",
             "q_bias": "head_bias", "k_bias": "head_bias", "v_bias": "head_bias"}
    out: dict[str, TensorSlot] = {}
    out[top["embed"]] = TensorSlot(("embed",), None, tuple(shapes["embed"]), "copy")
    for i in range(cfg.num_layers):
        for name, shape in shapes["layers"].items():
            kind = kinds.get(name, "copy")
            hf_shape = _hf_shape(kind, tuple(shape[1:]))
            out[layer_prefix.format(i=i) + layer_names[name]] = TensorSlot(("layers", name), i, hf_shape, kind)
    out[top["final_norm"]] = TensorSlot(("final_norm",), None, (D,), "copy")
    if not cfg.tie_word_embeddings:
        out[top["lm_head"]] = TensorSlot(("lm_head",), None, (cfg.vocab_size, D), "linear")
    return out


def _hf_shape(kind: str, jd: tuple[int, ...]) -> tuple[int, ...]:
    """On-disk HF shape of a tensor whose jdllm (per-layer) shape is `jd`."""
    if kind == "copy":
        return jd
    if kind == "linear":
        return jd[::-1]
    if kind == "heads_in":  # [D, N, Dh] -> [N*Dh, D]
        return (jd[1] * jd[2], jd[0])
    if kind == "heads_out":  # [H, Dh, D] -> [D, H*Dh]
        return (jd[2], jd[0] * jd[1])
    if kind == "head_bias":  # [N, Dh] -> [N*Dh]
        return (jd[0] * jd[1],)
    raise AssertionError(kind)


def is_ignored_tensor(name: str, cfg: ModelConfig) -> bool:
    """Tensors some checkpoints carry that jdllm recomputes or does not need."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    _, top = _prefixes(cfg)
    # A tied model may still ship a copy of the head; the embedding is used instead.
    return cfg.tie_word_embeddings and name == top["lm_head"]


def _to_jdllm(x: np.ndarray, slot: TensorSlot, jd_shape: tuple[int, ...]) -> np.ndarray:
    if slot.kind == "copy":
        return x
    if slot.kind == "linear":
        return x.T
    if slot.kind == "heads_in":  # [N*Dh, D] -> [D, N, Dh]
        return x.T.reshape(jd_shape)
    if slot.kind == "heads_out":  # [D, H*Dh] -> [H, Dh, D]
        return x.T.reshape(jd_shape)
    if slot.kind == "head_bias":
        return x.reshape(jd_shape)
    raise AssertionError(slot.kind)


def _to_hf(x: np.ndarray, slot: TensorSlot) -> np.ndarray:
    if slot.kind == "copy":
        return x
    if slot.kind == "linear":
        return x.T
    if slot.kind == "heads_in":  # [D, N, Dh] -> [N*Dh, D]
        return x.reshape(x.shape[0], -1).T
    if slot.kind == "heads_out":  # [H, Dh, D] -> [D, H*Dh]
        return x.reshape(-1, x.shape[-1]).T
    if slot.kind == "head_bias":
        return x.reshape(-1)
    raise AssertionError(slot.kind)


def check_tensor_names(names: Iterable[str], cfg: ModelConfig, source: str = "checkpoint") -> None:
    """Raise MissingTensorError / UnexpectedTensorError unless `names` match the config."""
    names = set(names)
    expected = hf_tensor_names(cfg)
    missing = [n for n in expected if n not in names]
    if missing:
        others = f" (and {len(missing) - 1} more, e.g. {missing[1]!r})" if len(missing) > 1 else ""
        raise errors.MissingTensorError(
            f"{source} lacks tensor {missing[0]!r}{others} that config.json (model_type="
            f"{cfg.model_type!r}, {cfg.num_layers} layers, tie_word_embeddings={cfg.tie_word_embeddings}) "
            "requires: re-download the weights or fix config.json")
    unexpected = sorted(n for n in names if n not in expected and not is_ignored_tensor(n, cfg))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise errors.UnexpectedTensorError(
            f"{source} holds tensor {unexpected[0]!r}{more} that model_type={cfg.model_type!r} "
            f"with {cfg.num_layers} layers has no place for: check config.json matches the weights "
            "(num_hidden_layers, attention_bias, tie_word_embeddings)")


def check_tensor_shape(name: str, shape: tuple[int, ...], slot: TensorSlot, cfg: ModelConfig,
                       source: str = "checkpoint") -> None:
    if tuple(shape) != slot.hf_shape:
        raise errors.ShapeMismatchError(
            f"tensor {name!r} in {source} has shape {tuple(shape)} but config.json implies "
            f"{slot.hf_shape} (hidden_size={cfg.hidden_size}, heads={cfg.num_heads}, "
            f"kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, "
            f"intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}): "
            "use the config.json that came with these weights")


# --------------------------------------------------------------------------- tensors <-> params
def params_from_hf_tensors(tensors: Mapping[str, Any], cfg: ModelConfig, dtype=None,
                           progress: Callable[[str], None] | None = None, source: str = "checkpoint"):
    """HF tensors {name: array [out, in]} -> jdllm params (nested dict of NumPy arrays).

    `tensors` may be lazy (a Mapping that reads on access): each tensor is read
    once, checked against the config and written into the stacked layer arrays.
    dtype: output dtype (NumPy/ml_dtypes); None keeps each tensor's own dtype.
    progress: called with each tensor name after it is placed.
    """
    from jdllm.model import param_shapes  # noqa: PLC0415

    table = hf_tensor_names(cfg)
    check_tensor_names(tensors.keys(), cfg, source)
    shapes = param_shapes(cfg)
    out: dict[str, Any] = {"layers": {}}
    for name, slot in table.items():
        x = np.asarray(tensors[name])
        check_tensor_shape(name, x.shape, slot, cfg, source)
        full = shapes
        for key in slot.path:
            full = full[key]
        jd_shape = tuple(full[1:]) if slot.layer is not None else tuple(full)
        y = _to_jdllm(x, slot, jd_shape)
        target_dtype = np.dtype(dtype) if dtype is not None else x.dtype
        if slot.layer is None:
            out[slot.path[0]] = np.ascontiguousarray(y, dtype=target_dtype)
        else:
            stacked = out["layers"].get(slot.path[1])
            if stacked is None:
                stacked = out["layers"][slot.path[1]] = np.empty(tuple(full), target_dtype)
            stacked[slot.layer] = y.astype(stacked.dtype, copy=False)
        if progress is not None:
            progress(name)
    return out


def params_to_hf_tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """jdllm params -> {HF name: NumPy array} in the family's published layout (exact inverse)."""
    out = {}
    for name, slot in hf_tensor_names(cfg).items():
        x = params
        for key in slot.path:
            x = x[key]
        x = np.asarray(x)
        if slot.layer is not None:
            x = x[slot.layer]
        out[name] = np.ascontiguousarray(_to_hf(x, slot))
    return out


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
def one_line(e: BaseException) -> str:
    """An exception's text on one line (library messages may span several)."""
    return " ".join(str(e).split())


def _safetensors_error(path: str, e: Exception) -> errors.CorruptCheckpointError:
    return errors.CorruptCheckpointError(
        f"{path} is not a readable safetensors file ({type(e).__name__}: {one_line(e)}); "
        "re-download or re-export this file")


class SafetensorsDir(Mapping):
    """Lazy {tensor name: NumPy array} over a HF directory's single or sharded safetensors.

    Opening checks the index and every shard header; a tensor is read from disk
    when it is accessed.
    """

    def __init__(self, hf_dir: str):
        from safetensors import safe_open  # noqa: PLC0415

        self.dir = os.fspath(hf_dir)
        index = os.path.join(self.dir, INDEX_FILE)
        single = os.path.join(self.dir, SINGLE_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise errors.CorruptCheckpointError(
                    f"{index} is not a valid safetensors index ({type(e).__name__}: {one_line(e)}); "
                    "it needs a 'weight_map' of tensor name -> shard file") from e
            files = sorted(set(weight_map.values()))
            for fn in files:
                if not os.path.exists(os.path.join(self.dir, fn)):
                    users = sorted(n for n, s in weight_map.items() if s == fn)
                    raise errors.MissingShardError(
                        f"shard {os.path.join(self.dir, fn)} listed in {INDEX_FILE} (holding "
                        f"{users[0]!r} and {len(users) - 1} more tensors) is missing: "
                        "download every shard of the checkpoint")
        elif os.path.exists(single):
            files, weight_map = [SINGLE_FILE], None
        else:
            raise errors.CheckpointError(
                f"{self.dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}: point at a Hugging Face "
                "model directory with safetensors weights (convert .bin weights with transformers first)")
        self._handles = {}
        self._where: dict[str, str] = {}
        for fn in files:
            path = os.path.join(self.dir, fn)
            try:
                h = safe_open(path, framework="numpy")
                names = list(h.keys())
            except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
                raise _safetensors_error(path, e) from e
            self._handles[fn] = h
            for n in names:
                self._where[n] = fn
        if weight_map is not None:
            for n, fn in weight_map.items():
                if self._where.get(n) != fn:
                    raise errors.CorruptCheckpointError(
                        f"{INDEX_FILE} places tensor {n!r} in {fn} but that shard does not hold it: "
                        "re-download the checkpoint (the index and shards disagree)")

    def __getitem__(self, name: str) -> np.ndarray:
        fn = self._where[name]
        try:
            return self._handles[fn].get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise _safetensors_error(os.path.join(self.dir, fn), e) from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file  # noqa: PLC0415

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
