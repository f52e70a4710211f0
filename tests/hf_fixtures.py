"""Tiny Hugging Face model directories for tests (random weights, built in well under a second).

* `build_transformers_model`: a real `transformers` Qwen2 / Qwen3 / LLaMA model
  saved with `save_pretrained` (GQA or MHA, tied or untied, RoPE scaling).
* `build_family_dir`: SDAR, LLaDA, Dream and Fast-dLLM v2 directories written
  in each family's *own* config keys and weight names, made from the weights
  of the equivalent transformers model (Qwen3 for SDAR, LLaMA for LLaDA,
  Qwen2 for Dream and Fast-dLLM v2). The renaming here is written out
  independently of `jdllm.hf_layout`, so loading these directories tests it.
* `build_tokenizer`: a small trained BPE tokenizer.json (+ tokenizer_config.json).
* `reference_logits`: the transformers model's float32 logits under an
  explicit attention mask (causal, block-causal or bidirectional, with left
  padding): the independent reference jdllm is checked against.

Every builder returns (directory, reference torch model in eval mode).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

BASE_FAMILIES = ("qwen2", "qwen3", "llama")
DIFFUSION_FAMILIES = ("sdar", "llada", "Dream", "Fast_dLLM_Qwen")
# Which transformers family each synthetic family is built from.
FAMILY_BASE = {"sdar": "qwen3", "llada": "llama", "Dream": "qwen2", "Fast_dLLM_Qwen": "qwen2"}
FAMILY_ATTENTION = {"qwen2": "causal", "qwen3": "causal", "llama": "causal", "sdar": "block_causal",
                    "Fast_dLLM_Qwen": "block_causal", "llada": "bidirectional", "Dream": "bidirectional"}

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}
LINEAR_SCALING = {"rope_type": "linear", "factor": 2.0}


# --------------------------------------------------------------------------- transformers models
def tiny_hf_config(family: str, *, vocab_size: int = 128, hidden_size: int = 32, layers: int = 2,
                   heads: int = 4, kv_heads: int | None = 2, head_dim: int | None = None,
                   intermediate_size: int = 48, tied: bool = False, rope_theta: float = 10000.0,
                   rope_scaling: dict | None = None, max_position_embeddings: int = 128,
                   eos_token_id: int | None = None, **extra):
    """A tiny transformers config of `family` ("qwen2" | "qwen3" | "llama")."""
    import transformers  # noqa: PLC0415

    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "llama": transformers.LlamaConfig}[family]
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        hidden_act="silu", eos_token_id=eos_token_id if eos_token_id is not None else vocab_size - 2,
        bos_token_id=None, pad_token_id=None,
    )
    params = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        params = {**rope_scaling, "rope_theta": rope_theta}
    kw["rope_parameters"] = params
    if head_dim is not None:
        kw["head_dim"] = head_dim
    if family == "qwen2":
        kw["use_sliding_window"] = False
    kw.update(extra)
    return cls(**kw)


def _randomize(model, seed: int) -> None:
    """Give every weight (norms and biases included) a distinct random value.

    transformers initialises norms to 1 and biases to 0, which would hide a
    misplaced norm or bias; std 0.1 keeps logits O(1) for a 32-wide model.
    """
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def make_transformers_model(family: str, *, seed: int = 0, **cfg_kw):
    """An in-memory float32 transformers CausalLM with random weights (eager attention)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    config = tiny_hf_config(family, **cfg_kw)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "llama": transformers.LlamaForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, seed)
    return model.eval()


def build_transformers_model(family: str, out_dir: str, *, seed: int = 0, max_shard_size: str | None = None,
                             tokenizer: bool = False, **cfg_kw):
    """Save a random tiny `family` model with `save_pretrained`; returns (out_dir, model)."""
    model = make_transformers_model(family, seed=seed, **cfg_kw)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kw)
    if tokenizer:
        build_tokenizer(out_dir, model.config.vocab_size)
    return out_dir, model


# --------------------------------------------------------------------------- synthetic families
def _state_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()
            if not k.endswith("rotary_emb.inv_freq")}


def _write_tensors(out_dir: str, tensors: dict[str, np.ndarray], shards: int) -> None:
    from safetensors.numpy import save_file  # noqa: PLC0415

    names = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    parts = [list(p) for p in np.array_split(np.arange(len(names)), shards)]
    weight_map = {}
    for j, idx in enumerate(parts):
        fn = f"model-{j + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({names[i]: tensors[names[i]] for i in idx}, os.path.join(out_dir, fn),
                  metadata={"format": "pt"})
        weight_map.update({names[i]: fn for i in idx})
    total = sum(x.nbytes for x in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def _llada_name(name: str) -> str | None:
    """LLaMA transformers name -> LLaDA's published modeling_llada.py name."""
    top = {"model.embed_tokens.weight": "model.transformer.wte.weight",
           "model.norm.weight": "model.transformer.ln_f.weight",
           "lm_head.weight": "model.transformer.ff_out.weight"}
    if name in top:
        return top[name]
    parts = name.split(".")  # model.layers.{i}.<module...>
    i, rest = parts[2], ".".join(parts[3:])
    block = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ff_norm.weight",
             "self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
             "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "attn_out.weight",
             "self_attn.q_proj.bias": "q_proj.bias", "self_attn.k_proj.bias": "k_proj.bias",
             "self_attn.v_proj.bias": "v_proj.bias",
             "mlp.gate_proj.weight": "ff_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
             "mlp.down_proj.weight": "ff_out.weight"}[rest]
    return f"model.transformer.blocks.{i}.{block}"


def _rope_keys(c) -> dict[str, Any]:
    rp = dict(getattr(c, "rope_parameters", None) or {})
    theta = rp.pop("rope_theta", 10000.0)
    scaling = rp if rp.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling}


def family_config_json(family: str, base_config, *, block_size: int | None = None,
                       mask_token_id: int | None = None, eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json in `family`'s own published keys describing `base_config`'s architecture.

    block_size: SDAR's published config.json has no block key (jdllm then uses
    its default, 4) so it is written only when given; Fast-dLLM v2's `bd_size`
    is always written (default 4 here, to keep test sequences short).
    """
    c = base_config
    V = c.vocab_size
    mask = V - 1 if mask_token_id is None else mask_token_id
    eos = c.eos_token_id if eos_token_id is None else eos_token_id
    if family == "llada":
        # OLMo-style keys of LLaDA's configuration_llada.py (LLaDA-8B-Instruct's config.json).
        return {
            "architectures": ["LLaDAModelLM"], "model_type": "llada",
            "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                         "AutoModel": "modeling_llada.LLaDAModelLM"},
            "d_model": c.hidden_size, "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
            "n_layers": c.num_hidden_layers, "mlp_hidden_size": c.intermediate_size, "mlp_ratio": 4,
            "vocab_size": V, "embedding_size": V, "max_sequence_length": c.max_position_embeddings,
            "rope": True, "alibi": False, "block_type": "llama", "activation_type": "silu",
            "layer_norm_type": "rms", "rms_norm_eps": c.rms_norm_eps, "include_bias": False,
            "include_qkv_bias": False, "weight_tying": bool(c.tie_word_embeddings),
            "attention_layer_norm": False, "block_group_size": 1, "scale_logits": False,
            "mask_token_id": mask, "eos_token_id": eos, "pad_token_id": eos, "bos_token_id": None,
            **{k: v for k, v in _rope_keys(c).items() if k == "rope_theta"},
        }
    common = {
        "vocab_size": V, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": bool(c.tie_word_embeddings), "eos_token_id": eos,
        "bos_token_id": None, "pad_token_id": None, "torch_dtype": "float32", **_rope_keys(c),
    }
    if family == "sdar":
        return {"architectures": ["SDARForCausalLM"], "model_type": "sdar",
                "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
                             "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
                "head_dim": c.head_dim, "attention_bias": False, "mask_token_id": mask, **common,
                **({"block_size": block_size} if block_size is not None else {})}
    if family == "Fast_dLLM_Qwen":
        return {"architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen",
                "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                             "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
                "bd_size": 4 if block_size is None else block_size, "use_sliding_window": False,
                "mask_token_id": mask, **common}
    if family == "Dream":
        return {"architectures": ["DreamModel"], "model_type": "Dream",
                "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                             "AutoModel": "modeling_dream.DreamModel"},
                "use_sliding_window": False, "mask_token_id": mask, **common}
    raise ValueError(f"unknown synthetic family {family!r}")


def build_family_dir(family: str, out_dir: str, *, seed: int = 0, shards: int = 1,
                     block_size: int | None = None, tokenizer: bool = False, **cfg_kw):
    """A `family` directory (SDAR / LLaDA / Dream / Fast-dLLM v2) in its own keys and names.

    Returns (out_dir, reference transformers model with the same weights).
    LLaDA has no q/k norm and no qkv bias; SDAR is Qwen3 (q/k norm); Dream and
    Fast-dLLM v2 are Qwen2 (qkv bias).
    """
    base = FAMILY_BASE[family]
    model = make_transformers_model(base, seed=seed, **cfg_kw)
    os.makedirs(out_dir, exist_ok=True)
    tensors = _state_numpy(model)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if family == "llada":
        tensors = {_llada_name(k): v for k, v in tensors.items()}
    _write_tensors(out_dir, tensors, shards)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(family_config_json(family, model.config, block_size=block_size), f, indent=2)
    if tokenizer:
        build_tokenizer(out_dir, model.config.vocab_size)
    return out_dir, model


def build_model_dir(family: str, out_dir: str, **kw):
    """Any family: transformers save_pretrained for qwen2/qwen3/llama, synthetic otherwise."""
    if family in BASE_FAMILIES:
        kw.pop("block_size", None)
        return build_transformers_model(family, out_dir, **kw)
    return build_family_dir(family, out_dir, **kw)


# --------------------------------------------------------------------------- tokenizer
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a diffusion language model reveals several tokens per step",
    "jax compiles the whole decoding loop into one program",
    "1 + 2 = 3, 2 * 3 = 6, 10 - 4 = 6.",
    "Hello world! What is the capital of France? Paris.",
]


def build_tokenizer(out_dir: str, vocab_size: int = 128) -> dict[str, int]:
    """Train a small BPE tokenizer.json of exactly `vocab_size` entries into out_dir.

    Special tokens take the last ids: <|mask|> = V-1, <|endoftext|> = V-2
    (the defaults the fixture configs use), <unk> = V-3. Returns their ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    specials = ["<unk>", "<|endoftext|>", "<|mask|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), special_tokens=[],
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    n = tok.get_vocab_size()
    # Pad the learned vocabulary with unused placeholders so specials sit at V-3..V-1.
    tok.add_tokens([f"<|unused{i}|>" for i in range(vocab_size - len(specials) - n)])
    tok.add_special_tokens(specials)
    ids = {s: tok.token_to_id(s) for s in specials}
    assert tok.get_vocab_size() == vocab_size and ids["<|mask|>"] == vocab_size - 1, ids
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", mask_token="<|mask|>")
    fast.save_pretrained(out_dir)
    return ids


# --------------------------------------------------------------------------- reference logits
def visible_mask_np(T: int, start: np.ndarray, kind: str, block_size: int = 1) -> np.ndarray:
    """Boolean [B, T, T]: query p sees key s iff start[b] <= s < horizon(p) (written out here)."""
    p = np.arange(T)[:, None]
    s = np.arange(T)[None, :]
    if kind == "causal":
        m = s <= p
    elif kind == "block_causal":
        m = (s // block_size) <= (p // block_size)
    elif kind == "bidirectional":
        m = np.ones((T, T), bool)
    else:
        raise ValueError(kind)
    return m[None] & (s[None] >= np.asarray(start)[:, None, None])


def reference_logits(model, tokens: np.ndarray, start: np.ndarray | None = None, kind: str = "causal",
                     block_size: int = 1) -> np.ndarray:
    """transformers float32 logits [B, T, V] under an explicit 4D additive mask.

    Rows are left-padded: row b's real tokens sit at slots [start[b], T) with
    RoPE positions 0, 1, ...; padded query rows are garbage (ignore them).
    """
    import torch  # noqa: PLC0415

    tokens = np.asarray(tokens)
    B, T = tokens.shape
    start = np.zeros(B, np.int64) if start is None else np.asarray(start)
    vis = visible_mask_np(T, start, kind, block_size)
    # A padded query row sees nothing; give it its own slot to avoid an all -inf softmax.
    vis = vis | np.eye(T, dtype=bool)[None]
    add = np.where(vis, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None]  # [B, 1, T, T]
    pos = np.maximum(np.arange(T)[None, :] - start[:, None], 0)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                    attention_mask=torch.as_tensor(add), position_ids=torch.as_tensor(pos, dtype=torch.long),
                    use_cache=False)
    return out.logits.float().numpy()
