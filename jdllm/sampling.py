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
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jdllm import errors

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are drawn and when generation stops.

    temperature: 0 = greedy; > 0 divides the logits. top_k: 0 = off.
    top_p: nucleus mass in (0, 1]; 1 = off. max_new_tokens: tokens generated
    per prompt at most. seed: row b of a call uses the stream fold_in(seed, b).
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
        import numbers  # noqa: PLC0415 (numbers.Integral / Real also admit NumPy scalars)

        for name in ("temperature", "top_k", "top_p", "max_new_tokens", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise errors.ArgumentTypeError(
                    f"Sampling({name}={v!r}): expected a number, got {type(v).__name__}")
        if not 0 <= self.temperature < float("inf"):
            raise errors.DecodingConfigError(
                f"temperature={self.temperature} must be finite and >= 0 (0 = greedy)")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise errors.DecodingConfigError(f"top_k={self.top_k} must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise errors.DecodingConfigError(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise errors.DecodingConfigError(
                f"max_new_tokens={self.max_new_tokens} must be an integer >= 1")
        if int(self.seed) != self.seed or not 0 <= self.seed < 2**32:
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


def filter_logits(logits: jax.Array, *, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Temperature-scaled, top-k / top-p filtered float32 logits [..., V] (filtered = -inf)."""
    z = logits.astype(jnp.float32)
    if temperature > 0:
        z = z / temperature
    V = z.shape[-1]
    if 0 < top_k < V:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]  # [..., 1]
        z = jnp.where(z < kth, NEG_INF, z)
    if top_p < 1.0:
        zs = jnp.sort(z, axis=-1)[..., ::-1]  # descending
        ps = jax.nn.softmax(zs, axis=-1)
        keep = (jnp.cumsum(ps, axis=-1) - ps) < top_p  # always keeps the first
        cutoff = jnp.min(jnp.where(keep, zs, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z < cutoff, NEG_INF, z)
    return z


def distribution_stats(z: jax.Array, token: jax.Array) -> Sample:
    """prob / entropy / logprob of `token` under softmax(z). z [..., V], token [...]."""
    logp = jax.nn.log_softmax(z, axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    lp = jnp.take_along_axis(logp, token[..., None], axis=-1)[..., 0]
    return Sample(token=token.astype(jnp.int32), prob=jnp.exp(lp), entropy=entropy, logprob=lp)


def sample(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> Sample:
    """Draw one token per position from logits [..., V] with one key (greedy ignores it)."""
    z = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0:
        token = jnp.argmax(z, axis=-1)
    else:
        token = jax.random.categorical(key, z, axis=-1)
    return distribution_stats(z, token)


def sample_rows(logits: jax.Array, keys: jax.Array, *, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0) -> Sample:
    """logits [B, T, V], keys [B] (one stream per row) -> Sample of [B, T]."""
    fn = lambda lg, k: sample(lg, k, temperature=temperature, top_k=top_k, top_p=top_p)  # noqa: E731
    return jax.vmap(fn)(logits, keys)


def row_keys(seed: int, batch: int) -> jax.Array:
    """[B] typed keys: row b draws from fold_in(key(seed), b)."""
    base = jax.random.key(seed)
    return jax.vmap(lambda b: jax.random.fold_in(base, b))(jnp.arange(batch, dtype=jnp.uint32))


def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Advance every row's stream: keys [B] -> (next keys [B], step keys [B])."""
    both = jax.vmap(jax.random.split)(keys)  # [B, 2]
    return both[:, 0], both[:, 1]
