"""The model handle and `logits()`.

`Model` bundles what generation needs: the static config, the parameter
pytree, the tokenizer (or None for token-id-only use) and the attention
implementation. `jdllm.load` (in `jdllm.checkpoint`) reads one from a Hugging
Face directory or a converted jdllm checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors, inputs
from jdllm.config import ModelConfig
from jdllm.sharding import Placement, auto_axes
from jdllm.model import Params, default_layout, default_positions, forward, init_params, to_layout


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded model: config (static), params (pytree), tokenizer, attention impl.

    `jdllm.load` and `Model.random` hold the params per layer (`params["layers"]` a tuple of
    per-layer dicts, q/k/v and gate/up fused where no mesh splits them: `jdllm.model.param_specs`'
    layouts), so every forward reads each weight in place. Params in the stacked checkpoint
    layout also work: the forward then runs its layers through `lax.scan` (on the CPU `run`
    splits them once per call instead); `jdllm.model.stack_layers` converts back.
    """

    config: ModelConfig
    params: Params
    tokenizer: Any = None  # a transformers PreTrainedTokenizerFast, or None
    attn_impl: str = "auto"  # "auto" | "xla" | "pallas" | "cudnn"
    path: str | None = None
    placement: Any = None  # jdllm.sharding.Placement (mesh + rules) when params live on a mesh

    @property
    def mesh(self):
        return None if self.placement is None else self.placement.mesh

    def shard(self, mesh, rules=None) -> "Model":
        """This model with its params placed on `mesh` under `rules` (see `jdllm.sharding`)."""

        placement = Placement.of(mesh, rules)
        return dataclasses.replace(self, params=placement.place_params(self.params, self.config),
                                   placement=placement)

    @property
    def forward_impl(self):
        """attn_impl as the forward takes it: under a mesh, the kernels run per shard."""
        return self.attn_impl if self.placement is None else self.placement.attention_impl(self.attn_impl)

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02,
               **kw) -> "Model":
        """Random weights (normal(0, std)), for tests and smoke runs, in the layout `jdllm.load` returns."""
        params = to_layout(init_params(config, jax.random.key(seed), dtype, std=std), config, default_layout(),
                           consume=True)
        return cls(config=config, params=params, **kw)

    @property
    def dtype(self):
        return self.params["embed"].dtype


def check_token_ids(ids: np.ndarray, config: ModelConfig) -> None:
    inputs.check_id_range(ids, config.vocab_size)


def logits(model: Model, token_ids) -> jax.Array:
    """Full-sequence logits [B, T, V] float32 under the model's own attention kind.

    `token_ids`: a list of token-id lists (ragged rows are left-padded and the
    padding is masked out; the padded positions' logits are zeros for
    block-causal models and meaningless otherwise) or an int array [B, T].
    """
    rows = inputs.id_rows(token_ids)
    if not rows or any(len(r) == 0 for r in rows):
        raise errors.InputError("logits() needs at least one non-empty row of token ids")
    T = max(len(r) for r in rows)
    if T > model.config.max_position_embeddings:
        raise errors.SequenceTooLongError(
            f"sequence length {T} exceeds max_position_embeddings="
            f"{model.config.max_position_embeddings}; truncate the input")
    for r in rows:
        check_token_ids(r, model.config)
    rows = [r.astype(np.int32) for r in rows]
    cfg = model.config
    if cfg.attention == "block_causal" and len({len(r) for r in rows}) > 1:
        # The block grid lies on slots, so a left pad that is not a whole number of
        # blocks would move a row's block boundaries: run each length on its own.
        out = jnp.zeros((len(rows), T, cfg.vocab_size), jnp.float32)
        for n in sorted({len(r) for r in rows}):
            idx = [b for b, r in enumerate(rows) if len(r) == n]
            part = _logits_jit(model.params, jnp.asarray(np.stack([rows[b] for b in idx])),
                               jnp.zeros((len(idx),), jnp.int32), cfg=cfg, attn_impl=model.forward_impl,
                               placement=model.placement)
            out = out.at[np.asarray(idx), T - n:].set(part)
        return out
    tokens = np.zeros((len(rows), T), np.int32)
    start = np.zeros((len(rows),), np.int32)
    for b, r in enumerate(rows):
        tokens[b, T - len(r):] = r
        start[b] = T - len(r)
    return _logits_jit(model.params, jnp.asarray(tokens), jnp.asarray(start),
                       cfg=cfg, attn_impl=model.forward_impl, placement=model.placement)


@jax.jit(static_argnames=("cfg", "attn_impl", "placement"))
@auto_axes
def _logits_jit(params, tokens, start, *, cfg, attn_impl, placement=None):
    pos = default_positions(start, 0, tokens.shape[1])
    out, _ = forward(params, cfg, tokens, pos, start=start, attn_impl=attn_impl)
    return out
