"""jdllm as the rollout engine of a google-tunix RL learner (autoregressive policies only).

    import functools, jdllm, jdllm.nnx
    from jdllm.rl.tunix_bridge import JdllmRollout
    actor = jdllm.nnx.Model(jdllm.load("models/tiny-ar", dtype="float32"))
    reference = jdllm.nnx.Model(jdllm.load("models/tiny-ar", dtype="float32"))
    cluster_config = tunix.rl.rl_cluster.ClusterConfig(rollout_engine=JdllmRollout, ...)
    cluster = tunix.rl.rl_cluster.RLCluster(actor=actor, reference=reference, ...)

`JdllmRollout` implements tunix's `BaseRollout` (tunix.rl.rollout.base_rollout,
google-tunix 0.1.x): `generate(prompts, rollout_config)` returns a
`RolloutOutput` (texts; unpadded completion tokens without the stop token;
left-padded prompt tokens [B, max_prompt_length]; per-token sampling
log-probs when `return_logprobs`; `logits=None`, jdllm keeps no per-step
logits), `get_per_token_logps(prompt_tokens, completion_tokens)` scores
completions by teacher forcing (one causal forward, temperature 1, like
tunix's own), `update_params(params)` swaps the weights, and `pad_id()`,
`eos_id()`, `model()`.

The actor tunix trains is a `jdllm.nnx.Model` (the nnx view, whose state is jdllm's own
parameter pytree). tunix builds the engine with it as `rollout_actor`; the engine then rolls
out the actor's current weights at every call (tunix sees the engine's `model()` share the
actor's weights and syncs nothing), and `update_params` (the actor's `nnx.state`, a view or a
jdllm pytree) writes into the actor: no mapping function anywhere. A trainer model of your own
(not the view) goes through `param_map` (trainer weights -> jdllm params pytree) into the
engine's own weights, which tunix then syncs every step. `update_params` checks every weight's
shape and dtype and names the first that differs; the previous weights then stay in use.

When google-tunix is installed (`pip install jdllm[tunix]`) the class subclasses its
`BaseRollout` and returns its `RolloutOutput`; without it, the same class and a
field-for-field `RolloutOutput` stand alone.

Only AR policies. tunix's learner scores a completion left to right: the
actor's (and the reference's) per-token log-probs come from a causal forward
over [prompt ; completion], and `RolloutOutput` carries no reveal order. The
probability of a diffusion trajectory depends on the order its tokens were
revealed (`step_map`; TraceRL), so a tunix learner would optimise the wrong
likelihood for a diffusion policy (and a bidirectional model has no
left-to-right likelihood at all). Diffusion models (block-causal or
bidirectional configs) and diffusion paradigms raise `InputError`: train them
with `jdllm.rl.trajectory_logprobs` in an optax loop (`examples/rl_grpo.py`).
A rollout config asking for what jdllm does not produce (per-step logits, a rollout
`data_type` other than the model's) raises `InputError` naming the setting.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors, quant
from jdllm.api import tokenize
from jdllm.decode.ar import AR
from jdllm.decode.protocol import Paradigm
from jdllm.inputs import to_device
from jdllm.model import lm_head
from jdllm.rl import rollouts
from jdllm.rl.replay import check_params, teacher_forced_hidden
from jdllm.sampling import Sampling

try:  # optional: google-tunix (pip install jdllm[tunix])
    from tunix.rl.rollout import base_rollout as _tunix_base
except ImportError:  # the adapter stands alone; the class keeps tunix's interface
    _tunix_base = None

HAVE_TUNIX = _tunix_base is not None


@dataclasses.dataclass
class _RolloutOutput:
    """tunix's `RolloutOutput`, field for field (used when google-tunix is not installed)."""

    text: list[str]
    logits: list | None
    tokens: list[np.ndarray]
    left_padded_prompt_tokens: np.ndarray
    logprobs: list[np.ndarray] | None


RolloutOutput = _tunix_base.RolloutOutput if HAVE_TUNIX else _RolloutOutput
_Base = _tunix_base.BaseRollout if HAVE_TUNIX else object


@functools.partial(jax.jit, static_argnames=("cfg",))
def _completion_logps(params, prompt_tokens, completion_tokens, start, *, cfg):
    """[B, C] log p(completion token | everything before it), temperature 1."""
    toks = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
    P = prompt_tokens.shape[1]
    h = teacher_forced_hidden(params, cfg, toks, start)[:, P:]
    logp = jax.nn.log_softmax(lm_head(params, cfg, h), axis=-1)
    return jnp.take_along_axis(logp, completion_tokens[..., None], axis=-1)[..., 0]


class JdllmRollout(_Base):
    """A tunix rollout worker backed by `jdllm.rl.rollout` (see the module docstring).

    tunix builds it as `engine(rollout_actor=, tokenizer=, mesh=, rollout_config=)`; pass
    jdllm's side with `functools.partial(JdllmRollout, ...)`.

    The model: when the `rollout_actor` is a `jdllm.nnx.Model` (the view tunix trains), the
    engine and the actor are one model: every call reads the actor's current weights (tunix
    sees them share weights and syncs nothing) and `update_params` writes into the actor.
    Otherwise `model=` (a `jdllm.load`ed causal model) holds the weights, `update_params`
    replaces them (through `param_map` for trainer weights that are not jdllm's pytree) and
    `model()` is a `jdllm.nnx.Model` of them, so tunix syncs the actor into it every step.

    decoding: `jdllm.AR()` (default) or `jdllm.Speculative` (speculative sampling draws from
    the target, so its tokens follow the AR policy). param_map: callable trainer weights ->
    jdllm params pytree (default `jdllm.nnx.params_of`: the view's `nnx.state` or a jdllm
    pytree). seed: the PRNG stream when a `RolloutConfig` has none (each call then draws a
    fresh key).
    """

    def __init__(self, rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None, *, model=None,
                 decoding=None, param_map: Callable[[Any], Any] | None = None, seed: int = 0, **kwargs):
        del mesh, kwargs  # jdllm places params itself (jdllm.load(..., mesh=))
        from jdllm import nnx as jnnx  # noqa: PLC0415 (flax is imported only when tunix is wired)

        self._view = rollout_actor if isinstance(rollout_actor, jnnx.Model) else None
        if self._view is not None:
            if model is not None and model.config != self._view.config:
                raise errors.InputError(
                    "JdllmRollout: model= is another model than the jdllm.nnx.Model tunix passes as the actor "
                    "(their configs differ); leave model= out, the engine rolls out the actor")
            model = self._view.as_model()
        if model is None or not hasattr(model, "config") or not hasattr(model, "params"):
            raise errors.ArgumentTypeError(
                "JdllmRollout needs a jdllm model: the actor as a jdllm.nnx.Model (tunix passes it as "
                "rollout_actor) or model=<a jdllm.load()ed model> (functools.partial(JdllmRollout, model=...))")
        decoding = AR() if decoding is None else decoding
        name = getattr(decoding, "name", type(decoding).__name__)
        if model.config.attention != "causal" or not (isinstance(decoding, Paradigm) and decoding.is_autoregressive):
            raise errors.InputError(
                f"JdllmRollout serves autoregressive policies only (this model's attention is "
                f"{model.config.attention!r}, decoding {name!r}): a tunix learner scores completions left to "
                "right, but a diffusion trajectory's probability depends on the order its tokens were revealed "
                "(step_map), which tunix's RolloutOutput cannot carry. Train diffusion policies with "
                "jdllm.rl.trajectory_logprobs in an optax loop (examples/rl_grpo.py)")
        self._jdllm_model = dataclasses.replace(model, params=None)  # config, tokenizer, placement
        self._params = None if self._view is not None else model.params
        if rollout_config is not None:
            self._check_config(rollout_config)
        self._decoding = decoding
        self._tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        self._param_map = param_map
        self._key = jax.random.key(seed)
        eos = tuple(model.config.eos_token_ids or ())
        self._eos = eos[0] if eos else None
        pad = model.config.pad_token_id
        self._pad = int(pad) if pad is not None else (int(self._eos) if self._eos is not None else 0)

    # ------------------------------------------------------------------ tunix interface
    def generate(self, prompts, rollout_config, **kwargs) -> RolloutOutput:
        """Sample a completion of every prompt (one `jdllm.rl.rollout` call, each row its own PRNG stream)."""

        del kwargs
        if isinstance(prompts, str):
            prompts = [prompts]
        # tunix's learner passes its prompt column as a list of 0-d numpy string arrays
        prompts = [p.item() if isinstance(p, np.ndarray) and p.dtype.kind in "UO" and p.size == 1 else p
                   for p in (prompts.tolist() if isinstance(prompts, np.ndarray) and prompts.dtype.kind in "UO"
                             else prompts)]
        cfg = rollout_config
        self._check_config(cfg)
        P = int(cfg.max_prompt_length)
        ids = [p[-P:] for p in tokenize(self._jdllm_model, list(prompts), False)]  # tunix keeps the suffix
        top_k = cfg.top_k if cfg.top_k is not None and cfg.top_k > 0 else 0
        stops = tuple(int(t) for t in cfg.eos_tokens) if cfg.eos_tokens else None
        sampling = Sampling(temperature=float(cfg.temperature), top_k=int(top_k),
                                  top_p=float(cfg.top_p if cfg.top_p is not None else 1.0),
                                  max_new_tokens=int(cfg.max_tokens_to_generate), stop_token_ids=stops)
        params = self.params()
        model = dataclasses.replace(self._jdllm_model, params=params)
        state, spec = rollouts.prepare_rollout(model, ids, self._decoding, sampling, group=1)
        if cfg.seed is not None:
            key = jax.random.key(int(np.asarray(cfg.seed).reshape(-1)[0]))
        else:
            self._key, key = jax.random.split(self._key)
        ro = rollouts.compiled_rollout(self._decoding.bind_params(params), state, key, spec=spec)  # + a draft's
        toks, lps, g0, end, fin = jax.device_get((ro.tokens, ro.logprobs, ro.gen_start, ro.end, ro.finish))
        stop_ids = set(stops or ()) | ({self._eos} if self._eos is not None and stops is None else set())
        tokens, logprobs, text = [], [], []
        for b in range(len(ids)):
            t, lp = toks[b, g0[b]:end[b]], lps[b, g0[b]:end[b]]
            if t.size and int(t[-1]) in stop_ids:  # tunix's completions end before the stop token
                t, lp = t[:-1], lp[:-1]
            tokens.append(np.asarray(t, np.int32))
            logprobs.append(np.asarray(lp, np.float32))
            text.append(self._decode(t))
        padded = np.full((len(ids), P), self._pad, np.int32)
        for b, p in enumerate(ids):
            if p:
                padded[b, P - len(p):] = p
        return RolloutOutput(text=text, logits=None, tokens=tokens, left_padded_prompt_tokens=padded,
                             logprobs=logprobs if cfg.return_logprobs else None)

    def get_per_token_logps(self, prompt_tokens, completion_tokens, completion_mask=None) -> jax.Array:
        """[B, C] teacher-forced log-probs of `completion_tokens` after the left-padded `prompt_tokens`."""
        del completion_mask  # tunix masks the padded tail itself
        prompt_tokens = to_device(prompt_tokens, jnp.int32)
        completion_tokens = to_device(completion_tokens, jnp.int32)
        if prompt_tokens.ndim != 2 or completion_tokens.ndim != 2 or \
                prompt_tokens.shape[0] != completion_tokens.shape[0]:
            raise errors.InputError(f"prompt_tokens {prompt_tokens.shape} and completion_tokens "
                                    f"{completion_tokens.shape}: need [B, P] and [B, C] with the same B")
        real = prompt_tokens != self._pad
        start = jnp.where(jnp.any(real, axis=1), jnp.argmax(real, axis=1), prompt_tokens.shape[1]).astype(jnp.int32)
        return _completion_logps(self.params(), prompt_tokens, completion_tokens, start,
                                 cfg=self._jdllm_model.config)

    def update_params(self, params, filter_types=None) -> None:
        """Roll out with new weights: the actor's `nnx.state` (tunix's `sync_weights`), a
        `jdllm.nnx.Model`, a jdllm params pytree, or what `param_map` maps. Every weight must keep
        its shape and dtype (else `ConfigError` naming it, and the previous weights stay in
        use); nothing recompiles. A rollout model loaded with `quantize=` gets the new weights
        quantized the same way (the trainer keeps the float ones)."""
        del filter_types
        from jdllm import nnx as jnnx  # noqa: PLC0415

        new = self._param_map(params) if self._param_map is not None else jnnx.params_of(params)
        check_params(new, self._jdllm_model.config)
        want = self.params()["embed"].dtype
        for path, x in jax.tree_util.tree_flatten_with_path(new)[0]:
            if getattr(x, "dtype", None) != want:
                raise errors.ConfigError(
                    f"update_params: weight {jax.tree_util.keystr(path)} has dtype {getattr(x, 'dtype', type(x))}, "
                    f"the rollout runs {want}: cast the trainer's weights (or load the model with "
                    "dtype=) so they agree; the previous weights stay in use")
        qc = quant.config_of(self.params())
        if qc is not None:  # a quantized rollout model: the trainer's float weights are quantized the same way
            new = quant.quantize_params(new, qc)
        if self._view is not None:
            self._view.load_params(new)
        else:
            self._params = new

    def params(self):
        """The weights the next rollout uses (jdllm's pytree): the actor view's current ones, or
        the last `update_params`."""
        return self._view.params() if self._view is not None else self._params

    def pad_id(self) -> int:
        return self._pad

    def eos_id(self) -> int:
        return self._eos

    def model(self) -> Any:
        """The nnx model the engine rolls out: the actor view it follows, else a `jdllm.nnx.Model`
        of its own weights (a fresh view per call, whose state is the engine's params)."""
        from jdllm import nnx as jnnx  # noqa: PLC0415

        if self._view is not None:
            return self._view
        return jnnx.Model(dataclasses.replace(self._jdllm_model, params=self._params))

    # ------------------------------------------------------------------ helpers
    def _check_config(self, cfg) -> None:
        """Settings of a tunix RolloutConfig jdllm cannot honour -> InputError naming the setting."""
        if getattr(cfg, "return_logits", False):
            raise errors.InputError(
                "rollout_config.return_logits=True: JdllmRollout keeps no per-step logits (RolloutOutput.logits "
                "is None); ask for return_logprobs=True (the sampling log-probs) or score completions with "
                "get_per_token_logps")
        dtype = getattr(cfg, "data_type", None)
        have = self.params()["embed"].dtype
        if dtype is not None and jnp.dtype(dtype) != jnp.dtype(have):
            raise errors.InputError(
                f"rollout_config.data_type={jnp.dtype(dtype).name}: JdllmRollout rolls out in the model's dtype "
                f"({jnp.dtype(have).name}); load the model with dtype="
                f"{jnp.dtype(dtype).name!r} or leave data_type=None")
        P = getattr(cfg, "max_prompt_length", 1)
        if isinstance(P, bool) or not isinstance(P, (int, np.integer)) or P < 1:
            raise errors.InputError(f"rollout_config.max_prompt_length={P!r} must be an integer >= 1")

    def _decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        tok = self._tokenizer
        if tok is None:
            return ""
        return tok.decode(ids, skip_special_tokens=True)


__all__ = ["JdllmRollout", "RolloutOutput", "HAVE_TUNIX"]
