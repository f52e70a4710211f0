"""A flax nnx view of a jdllm model, for training loops (nnx.Optimizer / optax, tunix).

    import jdllm, jdllm.nnx, optax
    from flax import nnx
    view = jdllm.nnx.Model(jdllm.load("models/tiny-ar", dtype="float32"))
    logits, _ = view(tokens)                        # jdllm's forward: [B, T, V] float32
    opt = nnx.Optimizer(view, optax.adam(1e-3), wrt=nnx.Param)
    ...                                             # nnx.value_and_grad, opt.update(view, grads)
    jdllm.generate(view.as_model(), prompts)        # generation reads the trained weights
    jdllm.rl.rollout(view.params(), state, key, spec=spec)

The view's state IS the model's parameter pytree: one `nnx.Param` per array, at the path
`jdllm.model.param_specs` names it (`embed`, `layers`/0/`qkv`, ..., `final_norm`, `lm_head`),
wrapping the very arrays the model holds (no copy; same shapes, dtypes and shardings). Whatever
layout the params are in (`jdllm.load`'s per-layer fused one, per-layer, stacked) is the layout
of the view. `view.params()` gives them back as the pytree every jdllm function takes, and
`params_of` does the same for `nnx.state(view)` (what tunix's learner hands its rollout worker),
so no mapping function sits between a trainer and jdllm.

`__call__` is `jdllm.model.forward` over those params, with the calling convention of tunix's
models (`model(tokens, positions=, cache=None, attention_mask=) -> (logits, cache)`), under the
model's own attention kind (causal, block-causal, bidirectional) or one chosen per call.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdllm import errors, inputs
from jdllm.checkpoint import check_attn_impl
from jdllm.config import ATTENTION_KINDS, ModelConfig
from jdllm.model import Params, default_positions, forward, is_param_spec, layer_layout, param_specs
from jdllm.sharding import auto_axes


def _is_param(x) -> bool:
    return isinstance(x, nnx.Variable)


class Model(nnx.Module):
    """`jdllm.nnx.Model(model)`: the nnx view of a `jdllm.load`ed (or `jdllm.Model.random`) model.

    Attributes holding state: one per top-level weight (`embed`, `layers`, `final_norm`, and
    `lm_head` for untied models), each `nnx.Param` carrying its logical axes as metadata
    (`logical_axes`). Static: `config` (the `ModelConfig`), the tokenizer and placement of the
    model it views (`as_model()` returns them with the current weights).
    """

    def __init__(self, model):
        from jdllm.loading import Model as JdllmModel  # noqa: PLC0415 (jdllm.loading imports jax-heavy modules)
        from jdllm.model import check_params  # noqa: PLC0415

        if not isinstance(model, JdllmModel):
            raise errors.ArgumentTypeError(
                f"jdllm.nnx.Model takes a jdllm.Model (jdllm.load(...) or jdllm.Model.random(...)), "
                f"not {type(model).__name__}")
        cfg = model.config
        from jdllm import quant  # noqa: PLC0415
        if quant.describe(model.params) is not None:
            raise errors.QuantizationError(
                f"jdllm.nnx.Model trains float weights, and this model's are quantized "
                f"({quant.describe(model.params)!r}); load it without quantize= for training (a "
                "quantized rollout model takes the trainer's weights through update_params), or "
                "view jdllm.Model(config, jdllm.quant.dequantize_params(params))")
        check_params(model.params, cfg)
        axes = jax.tree.map(lambda s: s.axes, param_specs(cfg, layer_layout(model.params)), is_leaf=is_param_spec)
        self.config = cfg
        self._handle = dataclasses.replace(model, params=None)  # tokenizer, attn_impl, placement, path
        self._names = tuple(model.params)
        for name, value in model.params.items():
            setattr(self, name, nnx.data(jax.tree.map(lambda x, a: nnx.Param(x, logical_axes=a),
                                                      value, axes[name])))

    # ------------------------------------------------------------------ back to jdllm
    def params(self) -> Params:
        """The current weights as jdllm's parameter pytree (the arrays themselves, no copy)."""
        return {name: jax.tree.map(lambda p: p.get_value(), getattr(self, name), is_leaf=_is_param)
                for name in self._names}

    def load_params(self, params) -> None:
        """Set the view's weights to `params` (a jdllm pytree in the view's layout, a
        `jdllm.nnx.Model` or an `nnx.state`), in place. Every weight must keep its shape and
        dtype: else `ConfigError` naming the first that differs, and nothing is written."""
        new = params_of(params)
        old = self.params()
        flat_old = dict(jax.tree_util.tree_flatten_with_path(old)[0])
        flat_new = dict(jax.tree_util.tree_flatten_with_path(new)[0])
        for path, x in flat_old.items():
            name = jax.tree_util.keystr(path)
            y = flat_new.get(path)
            if y is None:
                raise errors.ConfigError(f"load_params: weight {name} is missing (the view holds "
                                         f"{layer_layout(old)} params)")
            if tuple(getattr(y, "shape", ())) != tuple(x.shape) or getattr(y, "dtype", None) != x.dtype:
                raise errors.ConfigError(
                    f"load_params: weight {name} is {getattr(y, 'dtype', type(y).__name__)}"
                    f"{list(getattr(y, 'shape', ()))}, the view holds {x.dtype}{list(x.shape)}; nothing was written")
        extra = [jax.tree_util.keystr(p) for p in flat_new if p not in flat_old]
        if extra:
            raise errors.ConfigError(f"load_params: weight {extra[0]} is not one of the view's; nothing was written")
        for name in self._names:
            jax.tree.map(lambda v, x: v.set_value(x), getattr(self, name), new[name], is_leaf=_is_param)

    def as_model(self):
        """A `jdllm.Model` with the view's current weights (config, tokenizer, placement of the
        model the view was made from): what `jdllm.generate`, `jdllm.logits`, rollouts and
        the serving engine take."""
        return dataclasses.replace(self._handle, params=self.params())

    # ------------------------------------------------------------------ forward
    def forward_config(self, attention: str | None = None, block_size: int | None = None) -> ModelConfig:
        """The config the forward runs: the model's own, or with another attention kind / block size."""
        cfg = self.config
        if attention is None and block_size is None:
            return cfg
        kind = cfg.attention if attention is None else attention
        if kind not in ATTENTION_KINDS:
            raise errors.InputError(f"attention={attention!r} is not one of {ATTENTION_KINDS}")
        if block_size is None:
            block_size = cfg.block_size
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
            raise errors.InputError(f"block_size={block_size!r} must be an integer >= 1")
        if kind == "block_causal" and block_size == 1:
            raise errors.InputError(
                f"attention='block_causal' needs a block size: this model ({cfg.attention}) has none; "
                "pass block_size=")
        return dataclasses.replace(cfg, attention=kind, block_size=int(block_size) if kind == "block_causal" else 1)

    def __call__(self, tokens, positions=None, cache=None, attention_mask=None, *, start=None, offset=None,
                 attention: str | None = None, block_size: int | None = None, attn_impl=None,
                 return_hidden: bool = False, logits_at=None):
        """`jdllm.model.forward` over the view's weights -> (logits [B, T, V] float32, cache).

        tokens [B, T] int; start [B]: first real slot of each row (left padding; default 0);
        positions [B, T]: RoPE positions (default: slot - start). attention: "causal" |
        "block_causal" | "bidirectional" (default: the model's own; block_size for block-causal).
        attention_mask [B, T, S] bool (tunix's name): replaces the masking rule outright (XLA
        path). cache / offset / attn_impl / return_hidden / logits_at: as `forward` takes them.
        """
        cfg = self.forward_config(attention, block_size)
        host = not isinstance(tokens, jax.Array)  # a list / numpy array: its values can be checked here
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise errors.InputError(f"tokens must be an integer array [B, T], got {tokens.dtype}{list(tokens.shape)}")
        B, T = tokens.shape
        if cache is None and T > cfg.max_position_embeddings:
            raise errors.SequenceTooLongError(f"tokens has {T} slots > the model's context max_position_embeddings="
                                              f"{cfg.max_position_embeddings}")
        if host:  # a traced or device array is not fetched for this (training steps stay asynchronous)
            inputs.check_id_range(np.asarray(tokens), cfg.vocab_size)
        start = jnp.zeros((B,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
        for name, x, want in (("start", start, "[B]"), ("positions", positions, "[B, T]"),
                              ("attention_mask", attention_mask, "[B, T, S]")):
            shape = None if x is None else tuple(np.shape(x))
            if shape is not None and (len(shape) != want.count(",") + 1 or shape[:2] != (B, T)[:len(shape)]):
                raise errors.InputError(f"{name} has shape {list(shape)}; tokens are [B, T] = [{B}, {T}], so "
                                        f"{name} must be {want}")
        if positions is None:
            at = offset if offset is not None else (0 if cache is None else cache.length)
            positions = default_positions(start, at, T)
        impl = self._handle.forward_impl if attn_impl is None else attn_impl
        if isinstance(impl, str):
            check_attn_impl(impl)

        # tokens first: on a mesh with Explicit axes (tunix's role meshes from jax.make_mesh), auto_axes
        # runs the forward with them treated as Auto and splits the outputs' rows like the tokens'
        def run(tokens, positions, start, params, cache, offset, attn_mask, logits_at):
            return forward(params, cfg, tokens, positions, start=start, cache=cache, offset=offset, attn_impl=impl,
                           return_hidden=return_hidden, attn_mask=attn_mask, logits_at=logits_at)

        return auto_axes(run)(tokens, positions, start, self.params(), cache, offset, attention_mask, logits_at)


def params_of(weights: Any) -> Params:
    """jdllm's parameter pytree from a `jdllm.nnx.Model`, its `nnx.state(...)` (an `nnx.State`, as
    tunix's learner passes it), that state's pure dict (`nnx.to_pure_dict`), or a jdllm pytree
    (returned as is). The arrays are not copied; only the container types change (`layers` back
    to a tuple of per-layer dicts)."""
    if isinstance(weights, Model):
        return weights.params()
    if isinstance(weights, nnx.State):
        weights = nnx.to_pure_dict(weights)
    if not isinstance(weights, Mapping):
        raise errors.ArgumentTypeError(
            f"weights of type {type(weights).__name__}: pass a jdllm params pytree, a jdllm.nnx.Model "
            "or its nnx.state")

    def plain(x):
        if isinstance(x, nnx.Variable):
            return x.get_value()
        if isinstance(x, Mapping):
            keys = list(x)
            if keys and all(isinstance(k, int) for k in keys):  # nnx.state keys a tuple's items by index
                if sorted(keys) != list(range(len(keys))):
                    raise errors.ArgumentTypeError(f"layer indices {sorted(keys)} are not 0..{len(keys) - 1}")
                return tuple(plain(x[i]) for i in range(len(keys)))
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(weights)


__all__ = ["Model", "params_of"]
