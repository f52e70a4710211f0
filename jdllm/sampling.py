"""Token sampling: greedy / temperature / top-k / top-p with per-row PRNG keys.

Every sampler returns the token and three float32 statistics of the
distribution it was drawn from — the token's probability (the "confidence"
diffusion paradigms rank by), the distribution's entropy and the token's
log-prob — so paradigms never recompute a softmax. Under greedy decoding
(temperature 0) that distribution is the softmax of the filtered logits at
temperature 1 and the token is its argmax.

Tokens can be excluded before sampling: the mask token (a diffusion model must
never propose it) and, optionally, tokens a packed int32 bitmask disallows
(`apply_token_bitmask`, the llguidance layout: bit j of word i allows token
32 * i + j).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors, inputs

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are drawn and when generation stops.

    temperature: 0 = greedy; > 0 divides the logits; at most `jdllm.inputs.MAX_TEMPERATURE` (2). top_k: 0 = off.
    top_p: nucleus mass in (0, 1]; 1 = off. max_new_tokens: tokens generated
    per prompt at most (the default 256 is clipped to what the model's context
    leaves; a note says so when an output runs to the context's end). seed: with one Sampling for a batch, row b draws from
    fold_in(seed, b); with one Sampling per prompt, each row from fold_in(seed, 0).
    stop_token_ids: tokens that end a row (kept in the output); None = the
    model's eos_token_ids; () = never stop early.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        inputs.normalize_fields(self, ints=("top_k", "max_new_tokens", "seed"), reals=("temperature", "top_p"))
        inputs.check_temperature(self.temperature)
        if self.top_k < 0:
            raise errors.DecodingConfigError(f"top_k={self.top_k} must be an integer >= 0 (0 = off)")
        inputs.check_top_p(self.top_p)
        if self.max_new_tokens < 1:
            raise errors.DecodingConfigError(
                f"max_new_tokens={self.max_new_tokens} must be an integer >= 1")
        if not 0 <= self.seed < 2**32:
            raise errors.DecodingConfigError(f"seed={self.seed} must be an integer in [0, 2**32)")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            hint = f"stop_token_ids=[{ids}] for one id, " if isinstance(ids, numbers.Integral) else ""
            if not isinstance(ids, (str, bytes)) and hasattr(ids, "__iter__"):
                ids = tuple(ids)
            if not isinstance(ids, tuple) or any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
                                                 for t in ids):
                raise errors.ArgumentTypeError(
                    f"Sampling(stop_token_ids={self.stop_token_ids!r}): expected a list or tuple of integer "
                    f"token ids ({hint}None for the model's eos ids, () for none)")
            if any(t < 0 for t in ids):
                raise errors.DecodingConfigError(
                    f"stop_token_ids={tuple(ids)} holds a negative id; token ids are >= 0")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sample(NamedTuple):
    """What a sampler returns; every field has the shape of the sampled positions."""

    token: jax.Array  # int32
    prob: jax.Array  # float32: probability of `token` (confidence)
    entropy: jax.Array  # float32: entropy of the distribution (nats)
    logprob: jax.Array  # float32: log-prob of `token`


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """Packed int32 bitmask [..., ceil(V/32)] -> bool [..., V] (True = allowed)."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[..., :, None] >> shifts) & 1  # [..., W, 32]
    bits = bits.reshape(*bitmask.shape[:-1], bitmask.shape[-1] * 32)
    return bits[..., :vocab_size].astype(bool)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Set the logits of tokens the bitmask disallows to -inf. logits [..., V]."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    return jnp.where(allowed, logits, NEG_INF)


def exclude_token(logits: jax.Array, token_id: int | None) -> jax.Array:
    """Logits with one token id (e.g. the mask token) made impossible."""
    if token_id is None:
        return logits
    return logits.at[..., token_id].set(NEG_INF)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings as data ([B] arrays in the decode state), so a new
    temperature / top-k / top-p never recompiles and rows of one batch may differ."""

    temperature: jax.Array  # [B] float32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] float32; 1 = off

    @classmethod
    def of(cls, settings) -> "RowSampling":
        """From one `Sampling` per row (host side)."""
        return cls(temperature=inputs.to_device([s.temperature for s in settings], np.float32),
                   top_k=inputs.to_device([s.top_k for s in settings], np.int32),
                   top_p=inputs.to_device([s.top_p for s in settings], np.float32))


def _static(x) -> bool:
    return isinstance(x, (int, float))


def _when(flag, fn, x):
    """fn(x) where `flag` holds: decided in Python for Python values, else a runtime `lax.cond`
    (data, not a compile-time constant: no recompile when the setting changes)."""
    if isinstance(flag, bool):
        return fn(x) if flag else x
    return jax.lax.cond(jnp.any(flag), fn, lambda y: y, x)


def filter_logits(logits: jax.Array, *, temperature=0.0, top_k=0, top_p=1.0) -> jax.Array:
    """Temperature-scaled, top-k / top-p filtered float32 logits [..., V] (filtered = -inf).

    Settings are Python numbers or arrays that broadcast against logits[..., 0]
    (e.g. [B, 1] for one setting per row); top-k and top-p (one sort of the
    vocabulary) run only when some position asks for them. Ties with the k-th
    logit are kept.
    """
    z = logits.astype(jnp.float32)
    V = z.shape[-1]
    if _static(temperature):
        z = z / temperature if temperature > 0 else z
    else:
        t = jnp.asarray(temperature, jnp.float32)[..., None]
        z = jnp.where(t > 0, z / jnp.where(t > 0, t, 1.0), z)
    use_k = (0 < top_k < V) if _static(top_k) else (top_k > 0) & (top_k < V)
    use_p = (top_p < 1.0) if _static(top_p) else top_p < 1.0

    def floor(z):  # [..., 1]: the smallest logit kept (-inf: all)
        zs = -jnp.sort(-z, axis=-1)  # descending
        k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), z.shape[:-1])[..., None]
        kth = jnp.take_along_axis(zs, jnp.clip(k - 1, 0, V - 1), axis=-1)  # [..., 1]
        on_k = jnp.broadcast_to(jnp.asarray(use_k), z.shape[:-1])[..., None]
        zs = jnp.where(on_k & (zs < kth), NEG_INF, zs)
        ps = jax.nn.softmax(zs, axis=-1)
        keep = (jnp.cumsum(ps, axis=-1) - ps) < jnp.asarray(top_p, jnp.float32)[..., None]  # keeps the first
        cutoff = jnp.min(jnp.where(keep, zs, jnp.inf), axis=-1, keepdims=True)
        on_p = jnp.broadcast_to(jnp.asarray(use_p), z.shape[:-1])[..., None]
        return jnp.maximum(jnp.where(on_k, kth, NEG_INF), jnp.where(on_p, cutoff, NEG_INF))

    # the runtime branch yields only the [..., 1] floor: a branch passing the [..., V] logits through
    # made XLA copy them whenever no row filters (greedy multi_block on an H100, deviceless compile:
    # 124-139 MiB of float32 logits per step)
    if isinstance(use_k | use_p, bool):
        return jnp.where(z < floor(z), NEG_INF, z) if (use_k | use_p) else z
    lo = jax.lax.cond(jnp.any(use_k | use_p), floor, lambda y: jnp.full(y.shape[:-1] + (1,), NEG_INF, y.dtype), z)
    return jnp.where(z < lo, NEG_INF, z)


def distribution_stats(z: jax.Array, token: jax.Array) -> Sample:
    """prob / entropy / logprob of `token` under softmax(z). z [..., V], token [...].

    A position whose logits are all -inf (nothing allowed) or not finite gets
    prob 0, entropy 0 and logprob -inf instead of NaN (`allowed_any` flags it).
    """
    ok = allowed_any(z)[..., None]
    logp = jax.nn.log_softmax(jnp.where(ok, z, 0.0), axis=-1)
    logp = jnp.where(ok & jnp.isfinite(z), logp, NEG_INF)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    lp = jnp.take_along_axis(logp, token[..., None], axis=-1)[..., 0]
    return Sample(token=token.astype(jnp.int32), prob=jnp.exp(lp), entropy=entropy, logprob=lp)


def allowed_any(z: jax.Array) -> jax.Array:
    """[...] bool: some token has a finite logit, none is NaN (a token can be drawn)."""
    return jnp.any(z > NEG_INF, axis=-1) & ~jnp.any(jnp.isnan(z), axis=-1)


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (the first index of the maximum; a NaN counts as the maximum), int32,
    as a max and a masked min: two reductions that vectorise. XLA:CPU runs jnp.argmax as one
    (value, index) reduce that does not: 13.9 against 1.5 ms over [576, 4096] on one core, 6% of
    a multi_block step that picks from the whole canvas."""
    m = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == m) | jnp.isnan(x)  # a NaN anywhere makes m NaN: then the first NaN, as jnp.argmax
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def sample(logits: jax.Array, key: jax.Array, *, temperature=0.0, top_k=0, top_p=1.0) -> Sample:
    """Draw one token per position from logits [..., V] with one key (greedy ignores it).

    Settings are Python numbers (per-row arrays go through `sample_rows`); temperature 0 = argmax."""
    z = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    token = jax.random.categorical(key, z, axis=-1) if temperature > 0 else argmax(z)
    return distribution_stats(z, token)


def sample_rows(logits: jax.Array, keys: jax.Array, *, temperature=0.0, top_k=0, top_p=1.0,
                slots: jax.Array | None = None) -> Sample:
    """logits [B, T, V], keys [B] (one stream per row) -> Sample of [B, T].

    Settings: Python numbers or [B] arrays (one per row). Position t of row b
    draws with fold_in(keys[b], slots[b, t]) (slots default: t), so a token's
    draw depends on its slot, not on how many positions were sampled with it.
    """
    B, T = logits.shape[:2]
    slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if slots is None else slots
    settings = per_row(temperature, top_k, top_p)
    z = filter_logits(logits, **settings)
    greedy = argmax(z)

    def draw(_):
        pos_keys = jax.vmap(lambda k, sl: jax.vmap(lambda p: jax.random.fold_in(k, p))(sl))(keys, slots)
        return jax.vmap(jax.vmap(lambda zz, k: jax.random.categorical(k, zz)))(z, pos_keys).astype(jnp.int32)

    t = settings["temperature"]
    if _static(t):
        token = draw(None) if t > 0 else greedy
    else:
        token = jnp.where(t > 0, _when(t > 0, draw, greedy), greedy)
    return distribution_stats(z, token)


def per_row(temperature=0.0, top_k=0, top_p=1.0) -> dict:
    """[B] settings -> [B, 1], to broadcast against positions [B, T] (Python numbers pass through)."""
    f = lambda x: x if _static(x) else jnp.asarray(x)[:, None]  # noqa: E731
    return dict(temperature=f(temperature), top_k=f(top_k), top_p=f(top_p))


def row_keys(seed, batch: int | None = None, stream=None) -> jax.Array:
    """[B] typed keys: row b draws from fold_in(key(seed[b]), stream[b]).

    seed: one int for the batch or [B]; stream default: the row index b (one
    `Sampling` shared by a batch gives each row its own stream), pass zeros to
    make a row's draws independent of its place in the batch."""
    seed = jnp.asarray(seed, jnp.uint32)
    B = batch if seed.ndim == 0 else seed.shape[0]
    seed = jnp.broadcast_to(seed, (B,))
    stream = jnp.arange(B, dtype=jnp.uint32) if stream is None else jnp.asarray(stream, jnp.uint32)
    return jax.vmap(lambda s, b: jax.random.fold_in(jax.random.key(s), b))(seed, stream)


def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Advance every row's stream: keys [B] -> (next keys [B], step keys [B])."""
    both = jax.vmap(jax.random.split)(keys)  # [B, 2]
    return both[:, 0], both[:, 1]
