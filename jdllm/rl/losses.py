"""RL losses over trajectory log-likelihoods: GRPO and plain policy gradient.

Pure functions of arrays: `logprobs` [B, S] from `trajectory_logprobs` under
the params being trained, `mask` [B, S] the tokens that count
(`Rollout.answer_mask`), `advantages` [B] one per row. They drop into
`jax.value_and_grad` and an optax update.

aggregate: "sequence" (GRPO's: mean over a row's tokens, then over rows) or
"token" (DAPO / Dr. GRPO style: mean over every token of the batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors
from jdllm.sharding import auto_axes

AGGREGATES = ("sequence", "token")


@auto_axes
def group_advantages(rewards, group: int, *, normalize_std: bool = True, eps: float = 1e-6,
                     active=None) -> jax.Array:
    """GRPO advantages [B]: each reward minus its group's mean (divided by the group's std).

    rewards [B] with rows prompt-major (row = prompt * group + sample, as
    `prepare_rollout` lays them out); rows past `active` (batch padding) get 0. With `active`
    ([batch], `Rollout.active`) the rewards may stop at the real rows (`spec.rows`, one per text
    of `rl.texts`): the padding rows' are taken as 0.
    """
    if isinstance(group, np.integer):
        group = int(group)
    if isinstance(group, bool) or not isinstance(group, int) or group < 2:
        raise errors.InputError(f"group={group!r}: GRPO compares samples of one prompt, it needs an int group >= 2")
    if not isinstance(normalize_std, (bool, np.bool_)):
        raise errors.InputError(f"normalize_std={normalize_std!r} must be True or False")
    _number("eps", eps, 0.0)
    if not isinstance(rewards, jax.core.Tracer):  # host values (a reward function's): checked here
        _check_rewards(rewards)
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1:
        raise errors.InputError(f"rewards has shape {r.shape}: give one reward per row, [B]")
    if active is not None:
        active = jnp.asarray(active)
        if active.ndim != 1 or active.shape[0] < r.shape[0]:
            raise errors.InputError(f"active has shape {active.shape} for {r.shape[0]} rewards: give "
                                    "Rollout.active, one flag per row of the batch")
        real = None if isinstance(active, jax.core.Tracer) else int(np.sum(np.asarray(active)))
        if real is not None and r.shape[0] not in (real, active.shape[0]):
            raise errors.InputError(f"{r.shape[0]} rewards for {real} real rows ({active.shape[0]} with the batch "
                                    "padding): give one reward per real row (spec.rows, as rl.texts lists them) "
                                    "or one per batch row")
        r = jnp.concatenate([r, jnp.zeros((active.shape[0] - r.shape[0],), jnp.float32)])
    B = r.shape[0]
    n = B // group
    if n == 0:
        raise errors.InputError(f"{B} rewards for group={group}: need at least one whole group")
    g = r[:n * group].reshape(n, group)
    a = g - jnp.mean(g, axis=1, keepdims=True)
    if normalize_std:
        a = a / (jnp.std(g, axis=1, keepdims=True) + eps)
    a = jnp.concatenate([a.reshape(-1), jnp.zeros((B - n * group,), jnp.float32)])
    if active is not None:
        a = jnp.where(active, a, 0.0)
    return a


def _check_rewards(rewards) -> None:
    """Host-side: rewards are finite numbers (a NaN would spread to its group's advantages and the loss)."""
    try:
        host = np.asarray(rewards)
    except (TypeError, ValueError) as e:  # ragged lists, say
        raise errors.InputError(f"rewards are not an array of numbers ({e}): give one float per row") from None
    if host.dtype == object or not (np.issubdtype(host.dtype, np.number) or host.dtype == bool):
        raise errors.InputError(f"rewards hold {host.dtype} values: give one float per row")
    bad = np.flatnonzero(~np.isfinite(host.astype(np.float64).reshape(-1)))
    if bad.size:
        raise errors.InputError(f"rewards[{int(bad[0])}] is {host.reshape(-1)[bad[0]]}: every reward must be finite "
                                "(a reward function that failed for a row should say so, or give it a number)")


def _number(name: str, v, lo: float, *, above: bool = False) -> None:
    """A finite real >= lo (> lo with `above`), else an InputError naming it."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v) \
            or v < lo or (above and v == lo):
        raise errors.InputError(f"{name}={v!r} must be a finite number {'>' if above else '>='} {lo}")


def _check(logprobs, mask, advantages, aggregate):
    if aggregate not in AGGREGATES:
        raise errors.InputError(f"aggregate={aggregate!r} is not one of {AGGREGATES}")
    if logprobs.shape != mask.shape:
        raise errors.InputError(f"logprobs {logprobs.shape} and mask {mask.shape} differ in shape")
    if advantages.shape != logprobs.shape[:1]:
        raise errors.InputError(f"advantages {advantages.shape}: need one per row, {logprobs.shape[:1]}")


def _aggregate(per_token, mask, aggregate: str):
    m = mask.astype(jnp.float32)
    if aggregate == "token":
        return jnp.sum(per_token * m) / jnp.maximum(jnp.sum(m), 1.0)
    per_row = jnp.sum(per_token * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    rows = jnp.any(mask, axis=1).astype(jnp.float32)
    return jnp.sum(per_row) / jnp.maximum(jnp.sum(rows), 1.0)


@auto_axes
def pg_loss(logprobs, advantages, mask, *, aggregate: str = "sequence") -> jax.Array:
    """REINFORCE: -mean(A * log p) over the masked tokens."""
    logprobs, mask, advantages = jnp.asarray(logprobs), jnp.asarray(mask), jnp.asarray(advantages)
    _check(logprobs, mask, advantages, aggregate)
    m = mask.astype(bool)  # as grpo_loss reads it: a slot counts or not (and NaN outside the mask stays out)
    return -_aggregate(jnp.where(m, advantages[:, None] * logprobs, 0.0), m, aggregate)


@auto_axes
def grpo_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps: float = 0.2, clip_eps_high: float | None = None,
              ref_logprobs=None, kl_coef: float = 0.0, aggregate: str = "sequence", return_stats: bool = False):
    """GRPO's clipped surrogate (+ kl_coef * KL to a reference policy), to minimise.

    ratio = exp(logprobs - old_logprobs) per token; the objective per token is
    min(ratio A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) A) - kl_coef * KL,
    KL the k3 estimator exp(ref - new) - (ref - new) - 1 (ref_logprobs [B, S],
    e.g. the replay under frozen initial params). old_logprobs are treated as
    constants (the rollout's own log-probs or a replay under the rollout's
    params). return_stats: also a dict of the clip fraction, mean ratio and KL.
    """
    logprobs, old, mask = jnp.asarray(logprobs), jnp.asarray(old_logprobs), jnp.asarray(mask)
    advantages = jnp.asarray(advantages, jnp.float32)
    _check(logprobs, mask, advantages, aggregate)
    if old.shape != logprobs.shape:
        raise errors.InputError(f"old_logprobs {old.shape} and logprobs {logprobs.shape} differ in shape")
    _number("clip_eps", clip_eps, 0.0, above=True)
    if clip_eps_high is not None:
        _number("clip_eps_high", clip_eps_high, 0.0, above=True)
    _number("kl_coef", kl_coef, 0.0)
    if ref_logprobs is not None and tuple(np.shape(ref_logprobs)) != logprobs.shape:
        raise errors.InputError(f"ref_logprobs {tuple(np.shape(ref_logprobs))} and logprobs {logprobs.shape} differ in "
                                "shape")
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    old = jax.lax.stop_gradient(old)
    m = mask.astype(bool)
    delta = jnp.where(m, logprobs - old, 0.0)
    ratio = jnp.exp(delta)
    A = advantages[:, None]
    surrogate = jnp.minimum(ratio * A, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + hi) * A)
    per_token = -surrogate
    kl = jnp.zeros_like(logprobs)
    if kl_coef:
        if ref_logprobs is None:
            raise errors.InputError(f"kl_coef={kl_coef} needs ref_logprobs")
        ref = jax.lax.stop_gradient(jnp.asarray(ref_logprobs))
        d = jnp.where(m, ref - logprobs, 0.0)
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
    loss = _aggregate(per_token, m, aggregate)
    if not return_stats:
        return loss
    clipped = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + hi)
    stats = {"clip_frac": _aggregate(clipped.astype(jnp.float32), m, "token"),
             "ratio": _aggregate(ratio, m, "token"), "kl": _aggregate(kl, m, "token")}
    return loss, stats


__all__ = ["group_advantages", "grpo_loss", "pg_loss", "AGGREGATES"]
