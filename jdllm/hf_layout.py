"""Hugging Face tensor names <-> jdllm's parameter tree, for every weight layout.

Each family's published weight names are mapped onto jdllm's parameter tree
(`jdllm.model.param_specs`) by one table, `hf_tensor_names`; reading
(`params_from_hf_tensors`, used by `jdllm.checkpoint`) and writing
(`params_to_hf_tensors`, used by `convert`) are both derived from it, so they
are exact inverses.

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
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from jdllm import errors
from jdllm.config import ModelConfig


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
    from jdllm.model import param_shapes  # noqa: PLC0415 (keeps reading config/names free of JAX)

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


FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_tensor_dtype(name: str, dtype, source: str = "checkpoint") -> None:
    """Weights are floating point; an integer or bool tensor is not cast silently into one."""
    if np.dtype(dtype).name not in FLOAT_DTYPES:
        raise errors.CorruptCheckpointError(
            f"tensor {name!r} in {source} has dtype {np.dtype(dtype).name}, but weights must be one of "
            f"{FLOAT_DTYPES}: the file is not a model's weights (quantized checkpoints are not supported); "
            "use the unquantized safetensors")


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
    out: dict[str, Any] = {"layers": {}}
    for path, x in iter_params_from_hf_tensors(tensors, cfg, dtype, progress, source):
        set_param(out, path, x)
    return out


def set_param(tree: dict, path: tuple[str, ...], x) -> dict:
    """`tree` with the parameter at `path` (("embed",), ("layers", "q"), ...) set to `x` (in place;
    missing levels are created)."""
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = x
    return tree


def iter_hf_slices(tensors: Mapping[str, Any], cfg: ModelConfig, dtype=None,
                   progress: Callable[[str], None] | None = None, source: str = "checkpoint"):
    """Yield (param path, layer index or None, the parameter's full jdllm shape, NumPy array) one HF
    tensor at a time, in jdllm's layout and `dtype`, ordered parameter by parameter and, within a
    stacked parameter, layer by layer. A caller that writes each slice where it belongs and drops
    it (the streaming `jdllm convert`) holds one tensor on the host, never a stacked parameter."""
    from jdllm.model import param_shapes  # noqa: PLC0415 (startup: reading configs and tensor names stays free of JAX)
    table = hf_tensor_names(cfg)
    check_tensor_names(tensors.keys(), cfg, source)
    shapes = param_shapes(cfg)
    first: dict[tuple[str, ...], int] = {}
    for i, slot in enumerate(table.values()):
        first.setdefault(tuple(slot.path), i)
    order = sorted(table.items(), key=lambda kv: (first[tuple(kv[1].path)],
                                                   -1 if kv[1].layer is None else kv[1].layer))
    for name, slot in order:
        full = shapes
        for key in slot.path:
            full = full[key]
        jd_shape = tuple(full[1:]) if slot.layer is not None else tuple(full)
        if hasattr(tensors, "rows"):
            y = _read_in_slabs(tensors, name, slot, cfg, jd_shape, dtype, source)
        else:
            x = np.asarray(tensors[name])
            check_tensor_shape(name, x.shape, slot, cfg, source)
            check_tensor_dtype(name, x.dtype, source)
            y = _to_jdllm(x, slot, jd_shape)
            del x
            y = np.ascontiguousarray(y, dtype=np.dtype(dtype) if dtype is not None else y.dtype)
        yield tuple(slot.path), slot.layer, tuple(full), y
        del y
        if progress is not None:
            progress(name)


READ_SLAB_BYTES = 64 << 20  # a tensor is read this many bytes of rows at a time


def _read_in_slabs(tensors, name: str, slot: TensorSlot, cfg: ModelConfig, jd_shape, dtype, source: str):
    """Tensor `name` read a slab of rows at a time straight into its jdllm array (transposed for
    a [out, in] weight: `_to_jdllm`'s x.T.reshape), so the host holds the result and one slab:
    never the tensor twice (the source and its transposed copy, or the file's mapped pages and
    their copy: 2 GB for an 8B model's 1 GB embedding or lm_head)."""
    shape = tuple(tensors.shape(name))
    check_tensor_shape(name, shape, slot, cfg, source)
    rows = shape[0]
    step = max(1, READ_SLAB_BYTES // max(1, tensors.nbytes(name) // max(1, rows)))
    transposed = slot.kind in ("linear", "heads_in", "heads_out")
    y = flat = None
    for r in range(0, rows, step):
        part = tensors.rows(name, r, min(rows, r + step))
        if y is None:
            check_tensor_dtype(name, part.dtype, source)
            y = np.empty(jd_shape, np.dtype(dtype) if dtype is not None else part.dtype)
            # views of y: [in, out] with out split into heads, or the on-disk shape
            flat = y.reshape(shape[::-1]) if transposed else y.reshape(shape)
        if transposed:
            flat[:, r:r + part.shape[0]] = part.T
        else:
            flat[r:r + part.shape[0]] = part
        del part
    return y


def iter_params_from_hf_tensors(tensors: Mapping[str, Any], cfg: ModelConfig, dtype=None,
                                progress: Callable[[str], None] | None = None, source: str = "checkpoint"):
    """Yield (param path, NumPy array) one jdllm parameter at a time, each as soon as every HF
    tensor it stacks has been read: a caller that places each one (on a device or mesh) and drops
    it holds at most one parameter on the host (`jdllm.load` does)."""
    stacked, current = None, None
    for path, layer, full, y in iter_hf_slices(tensors, cfg, dtype, progress, source):
        if layer is None:
            yield path, y
            continue
        if path != current:
            stacked, current = np.empty(full, y.dtype), path
        stacked[layer] = y.astype(stacked.dtype, copy=False)
        del y
        if layer == full[0] - 1:
            out, stacked, current = stacked, None, None
            yield path, out


def params_to_hf_tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """jdllm params (any layout: `jdllm.model.param_specs`) -> {HF name: NumPy array} in the
    family's published layout (exact inverse)."""
    from jdllm.model import weight  # noqa: PLC0415 (startup: reading configs and tensor names stays free of JAX)
    out = {}
    for name, slot in hf_tensor_names(cfg).items():
        x = np.asarray(weight(params, slot.path, slot.layer, cfg))
        out[name] = np.ascontiguousarray(_to_hf(x, slot))
    return out
