"""Trajectory log-likelihood: replay a rollout under (new) params, differentiably.

The policy's probability of a diffusion trajectory depends on the order in
which tokens were revealed (TraceRL). `step_map` records it: the token
revealed at step t was chosen from a forward over the canvas holding the
prompt and every token revealed before t, with all other generated slots set
to the mask token. The replay rebuilds those canvases from `step_map` and runs
`jdllm.model.forward` on them; the log-prob of each token is taken under the
distribution the rollout sampled from (mask token excluded, the row's
temperature / top-k / top-p), so under the rollout's own params it equals the
log-prob recorded at decode time.

Methods (`method=`):
- "teacher_forcing" (AR): one causal forward over the canvas.
- "packed" (block-causal models, `block_diffusion`): one forward over
  [clean canvas ; J step copies] under one attention mask: copy j holds, in
  every block, the tokens revealed before that block's (j+1)-th step; its
  queries see the clean earlier blocks and their own block (BD3-LM's pairing,
  with J = block_length / shrink copies). One forward per trajectory.
- "per_step" (any paradigm; the default for `masked_diffusion` and
  `multi_block`, whose steps see several blocks in flight or the whole
  bidirectional canvas): one canvas copy per step group, all in one batched
  forward (K = max_steps / shrink copies of S slots).

shrink k merges k neighbouring steps into one (TraceRL's shrink): their
tokens are scored from the canvas before the first of them. k = 1 is exact;
k > 1 is the cheaper approximation TraceRL trains with.

The LM head runs once per scored slot (hidden states are gathered first).
Replay matches decode time exactly for every paradigm with an exact forward:
AR, block_diffusion, masked_diffusion with cache_mode="none" and multi_block with
cache "none"/"exact" (with `early_stop`, slots filled by the EOS fill are
replayed as visible from the step after the leftmost stop token; a fill that
overwrote earlier reveals is not recoverable from the final state).

Approximate caches (masked_diffusion cache_mode="prefix"/"dual", multi_block
cache_mode="approx"/"window" with refresh_interval > 1) sampled from logits the
exact forward does not give, and classifier-free guidance (cfg_scale > 0)
from a mix of two forwards the replay does not run: `trajectory_logprobs`
raises `InputError` for them (`approximate_decode(spec)` says why) unless
`cached_as_exact=True`, which replays the exact (no-cache) counterpart; the
log-probs then differ from the recorded ones by the cache's approximation
error (the importance ratio exp(new - old) absorbs it in GRPO; use
`old_logprobs` from a replay under the rollout's params rather than
`Rollout.logprobs` if the ratio should start at exactly 1). CFG is never
replayed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors
from jdllm.model import check_params, default_positions, forward, lm_head, predicts_next, teacher_forced_hidden
from jdllm.rl.rollouts import Rollout, RolloutSpec
from jdllm.sampling import exclude_token, filter_logits, per_row
from jdllm.sharding import auto_axes

METHODS = ("auto", "teacher_forcing", "packed", "per_step")


# --------------------------------------------------------------------------- checks
def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_rollout(ro: Rollout, spec: RolloutSpec, shrink: int = 1) -> None:
    """Host-side checks of a rollout against the spec it is replayed with (skipped for traced arrays).

    Shapes agree, the rollout came from the same paradigm, and each row's reveal
    steps are 1..T without gaps (AR: one token per step, left to right; block
    diffusion: blocks finished one after another) with T <= spec.max_steps.
    """
    if isinstance(shrink, bool) or not isinstance(shrink, (int, np.integer)) or shrink < 1:
        raise errors.InputError(f"shrink={shrink!r} must be an integer >= 1 (1 = exact replay)")
    if not isinstance(ro, Rollout):
        raise errors.ArgumentTypeError(f"expected a jdllm.rl.Rollout, got {type(ro).__name__}")
    if ro.paradigm and ro.paradigm != spec.paradigm.name:
        raise errors.InputError(f"the rollout came from paradigm {ro.paradigm!r} but is replayed as "
                                f"{spec.paradigm.name!r}: replay it with the spec it was decoded with")
    B, S = ro.tokens.shape
    for name in ("step_map", "logprobs", "prompt_mask", "answer_mask"):
        shp = tuple(getattr(ro, name).shape)
        if shp != (B, S):
            raise errors.InputError(f"rollout.{name} has shape {shp}, tokens have {(B, S)}")
    for name in ("start", "gen_start", "end", "finish", "nfe", "active"):
        shp = tuple(getattr(ro, name).shape)
        if shp != (B,):
            raise errors.InputError(f"rollout.{name} has shape {shp}, expected {(B,)}")
    if B < spec.rows:
        raise errors.InputError(f"rollout has {B} rows, the spec {spec.rows} ({spec.prompts} prompts x "
                                f"group {spec.group})")
    if not (_concrete(ro.step_map) and _concrete(ro.gen_start)):
        return
    smap, g0 = np.asarray(ro.step_map), np.asarray(ro.gen_start)
    for b in range(B):
        st = smap[b]
        if np.any(st[:g0[b]] != 0) or np.any(st < 0):
            raise errors.InputError(f"row {b}: step_map is nonzero inside the prompt or negative")
        used = np.unique(st[st > 0])
        if used.size == 0:
            continue
        if used[0] != 1 or used[-1] != used.size:
            missing = sorted(set(range(1, int(used[-1]) + 1)) - set(used.tolist()))[:5]
            raise errors.InputError(f"row {b}: step_map has gaps (steps {missing} reveal nothing); "
                                    "a step_map must number the steps 1, 2, 3, ...")
        if used[-1] > spec.max_steps:
            raise errors.InputError(f"row {b}: {int(used[-1])} steps > spec.max_steps={spec.max_steps}")
        why = spec.paradigm.check_step_map(st, spec.ctx.model)
        if why is not None:
            raise errors.InputError(f"row {b}: {why}")


# --------------------------------------------------------------------------- log-probs
def token_logprobs(logits, tokens, ro: Rollout, mask_id) -> jax.Array:
    """log p(tokens) [B, N] under the rollout rows' sampling distribution (mask token excluded)."""
    z = exclude_token(logits, mask_id)
    sp = ro.sampling
    zt = filter_logits(z, **per_row(sp.temperature, sp.top_k, sp.top_p))
    logp = jax.nn.log_softmax(zt, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _gather_rows(h, rows_idx, slot_idx):
    """h [C, B, L, D], per [B, S] copy and position indices -> [B, S, D]."""
    b = jnp.arange(h.shape[1])[:, None]
    return h[rows_idx, b, slot_idx]


def approximate_decode(spec: RolloutSpec) -> str | None:
    """Why the decode's logits are not the exact forward's (an approximate cache, CFG, an int8 KV cache),
    or None if they are."""
    why = spec.paradigm.replay_approximation()
    cfg = spec.ctx.model
    if why is None and cfg.kv_cache_dtype == "int8" and spec.paradigm.reads_kv_cache(cfg):
        why = ("the model was loaded with kv_cache='int8': the decode attended to int8 keys and values, the replay "
               "attends to exact ones")
    return why


def default_method(spec: RolloutSpec) -> str:
    """The paradigm's own replay method (`Paradigm.replay_method`)."""
    return spec.paradigm.replay_method


def replay_cost(spec: RolloutSpec, slots: int, method: str = "auto", shrink: int = 1) -> dict:
    """Model passes of one replay: {"passes": forwards in sequence, "tokens": positions run per row}."""
    method = default_method(spec) if method == "auto" else method
    if method == "teacher_forcing":
        return {"passes": 1, "tokens": slots}
    if method == "packed":
        J = math.ceil(spec.ctx.model.block_size / shrink)
        return {"passes": 1, "tokens": (J + 1) * slots}
    K = math.ceil(spec.max_steps / shrink)
    return {"passes": 1, "tokens": K * slots}  # the bound; copies=replay_copies(ro) runs only the rows' own


def replay_copies(ro: Rollout, shrink: int = 1, multiple: int | None = None) -> int:
    """Host side: the canvas copies a bounded `per_step` replay of `ro` needs (`copies=` of
    `trajectory_logprobs`): sum over rows of ceil(row's last step / shrink), rounded up to a
    multiple of `multiple` (default: the row count) so that batches of similar length share one compile.
    """
    if isinstance(shrink, bool) or not isinstance(shrink, (int, np.integer)) or shrink < 1:
        raise errors.InputError(f"shrink={shrink!r} must be an integer >= 1 (1 = exact replay)")
    smap = np.asarray(jax.device_get(ro.step_map))
    need = int(np.sum(-(-smap.max(axis=1) // shrink)))
    m = int(multiple or smap.shape[0])
    if m < 1:
        raise errors.InputError(f"multiple={multiple!r} must be >= 1")
    return max(m, -(-need // m) * m)


@auto_axes
def trajectory_logprobs(params, ro: Rollout, *, spec: RolloutSpec, shrink: int = 1, method: str = "auto",
                        attn_impl: str = "xla", cached_as_exact: bool = False, copies: int | None = None) -> jax.Array:
    """[B, S] float32: log-prob of each generated token under `params`, replaying `ro.step_map`
    (0 where nothing was generated). Differentiable in params; pure (jit with spec, shrink, method,
    copies static).

    copies (per_step only): run only the canvas copies the rows use, `copies` of them in all
    (`replay_copies(ro, shrink)` on the host gives a bucketed bound), instead of
    ceil(spec.max_steps / shrink) for every row: rows that stopped early cost no more forwards.
    Too few copies raise InputError on concrete step maps; under jit the slots past
    the bound come back NaN, so a loss built on them is NaN, never silently wrong.

    A rollout decoded with an approximate cache raises InputError unless
    cached_as_exact=True (replay the exact no-cache forward instead); CFG always raises.
    On a mesh with Explicit axes it runs with them treated as Auto (`jdllm.sharding.auto_axes`).
    """
    if method not in METHODS:
        raise errors.InputError(f"method={method!r} is not one of {METHODS}")
    why = approximate_decode(spec)
    refusal = spec.paradigm.replay_refusal()  # never replayable (e.g. CFG: the replay runs no guidance)
    if why is not None and (not cached_as_exact or refusal is not None):
        hint = (f"; {refusal}" if refusal is not None else
                "; its log-probs are not the exact forward's. Pass cached_as_exact=True to replay the exact "
                "(no-cache) forward anyway (log-probs then differ by the cache's error), or decode with "
                "cache_mode='none'/'exact'")
        raise errors.InputError(f"the rollout cannot be replayed exactly: {why}{hint}")
    check_rollout(ro, spec, shrink)
    cfg = spec.ctx.model
    check_params(params, cfg, allow_extra=True)  # the rollout's bound params (a draft beside them) replay too
    method = default_method(spec) if method == "auto" else method
    if method == "teacher_forcing" and cfg.attention != "causal":
        raise errors.InputError(f"method='teacher_forcing' needs a causal model, this one is {cfg.attention!r}")
    if method == "packed" and (cfg.attention != "block_causal" or spec.paradigm.replay_method != "packed"):
        raise errors.InputError("method='packed' replays block_diffusion on block-causal models; use 'per_step'")
    if method == "per_step" and spec.paradigm.is_autoregressive:
        method = "teacher_forcing"
    if method != "teacher_forcing" and cfg.mask_token_id is None:
        raise errors.ConfigError("a diffusion replay needs the model's mask_token_id")
    if copies is not None:
        if method != "per_step":
            raise errors.InputError(f"copies={copies!r} bounds the 'per_step' replay; method is {method!r}")
        if isinstance(copies, bool) or not isinstance(copies, (int, np.integer)) or copies < 1:
            raise errors.InputError(f"copies={copies!r} must be an integer >= 1 (see rl.replay_copies)")
        need = replay_copies(ro, shrink, multiple=1) if _concrete(ro.step_map) else 0
        if need > copies:
            raise errors.InputError(f"copies={copies} < the {need} step copies "
                                    "this rollout's rows use: take it from rl.replay_copies(ro, shrink)")
    over = None
    if method == "teacher_forcing":
        h = teacher_forced_hidden(params, cfg, ro.tokens, ro.start, attn_impl)
    elif method == "packed":
        h = _packed(params, cfg, ro, shrink, attn_impl)
    elif copies is None:
        h = _per_step(params, cfg, ro, math.ceil(spec.max_steps / shrink), shrink, attn_impl)
    else:
        h, over = _per_step_bounded(params, cfg, ro, int(copies), shrink, attn_impl)
    logits = lm_head(params, cfg, h)  # [B, S, V]
    lp = token_logprobs(logits, ro.tokens, ro, cfg.mask_token_id)
    if over is not None:
        lp = jnp.where(over, jnp.nan, lp)
    return jnp.where(ro.step_map > 0, lp, 0.0)


def _steps(ro: Rollout, shrink: int):
    """(visible_from [B, S]: first step-copy index that shows the slot, group [B, S]: the copy that scores it)."""
    B, S = ro.tokens.shape
    s = jnp.arange(S, dtype=jnp.int32)[None]
    gen = s >= ro.gen_start[:, None]
    smap = ro.step_map
    # a token revealed at step t is visible to steps > t: copies k with k * shrink + 1 > t
    vis = -(-smap // shrink)
    # multi_block's EOS fill (generated, step 0, not a mask): visible after the leftmost same-id token's step
    same = (ro.tokens[:, :, None] == ro.tokens[:, None, :]) & (s[:, :, None] > s[:, None, :])  # [B, j, i<j]
    src = same & (smap[:, None, :] > 0) & gen[:, None, :]
    fill_step = jnp.min(jnp.where(src, smap[:, None, :], jnp.iinfo(jnp.int32).max), axis=-1)
    never = jnp.iinfo(jnp.int32).max // 2
    return vis, fill_step, gen, never


def _visible_from(ro: Rollout, shrink: int, mask_id):
    """[B, S]: the first step-copy index whose canvas shows the slot (0: prompt; never: stays masked)."""
    vis, fill_step, gen, never = _steps(ro, shrink)
    smap = ro.step_map
    is_fill = gen & (smap == 0) & (ro.tokens != mask_id) & (fill_step < never)
    return jnp.where(~gen, 0, jnp.where(smap > 0, vis, jnp.where(is_fill, -(-fill_step // shrink), never)))


def _per_step(params, cfg, ro: Rollout, K: int, shrink: int, attn_impl):
    B, S = ro.tokens.shape
    mask_id = cfg.mask_token_id
    visible_from = _visible_from(ro, shrink, mask_id)
    smap = ro.step_map
    k = jnp.arange(K, dtype=jnp.int32)[:, None, None]
    toks = jnp.where(visible_from[None] <= k, ro.tokens[None], mask_id).reshape(K * B, S)
    start = jnp.tile(ro.start, K)
    pos = default_positions(start, 0, S)
    _, _, h = forward(params, cfg, toks, pos, start=start, attn_impl=attn_impl, return_hidden=True,
                      logits_at=jnp.zeros((K * B, 1), jnp.int32))
    h = h.reshape(K, B, S, -1)
    shift = predicts_next(cfg)
    group = jnp.clip((smap - 1) // shrink, 0, K - 1)
    src = jnp.clip(jnp.arange(S) - shift, 0, S - 1)[None]
    return _gather_rows(h, group, jnp.broadcast_to(src, (B, S)))


def _per_step_bounded(params, cfg, ro: Rollout, C: int, shrink: int, attn_impl):
    """The per_step replay over C copies laid out row after row (row b owns ceil(its last step / shrink)
    of them) instead of a [K, B] grid: -> (hidden [B, S, D], over [B, S] slots whose copy is past C)."""
    B, S = ro.tokens.shape
    mask_id = cfg.mask_token_id
    visible_from = _visible_from(ro, shrink, mask_id)
    smap = ro.step_map
    n = -(-jnp.max(smap, axis=1) // shrink)  # [B] copies of each row
    end = jnp.cumsum(n)
    first = end - n  # [B] the row's first copy
    c = jnp.arange(C, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(end, c, side="right"), 0, B - 1)  # [C] the row copy c belongs to
    k = c - first[row]  # [C] its step group
    toks = jnp.where(visible_from[row] <= k[:, None], ro.tokens[row], mask_id)  # [C, S]
    start = ro.start[row]
    pos = default_positions(start, 0, S)
    _, _, h = forward(params, cfg, toks, pos, start=start, attn_impl=attn_impl, return_hidden=True,
                      logits_at=jnp.zeros((C, 1), jnp.int32))  # [C, S, D]
    group = jnp.clip((smap - 1) // shrink, 0, None)
    idx = first[:, None] + group  # [B, S]
    over = idx >= C
    shift = predicts_next(cfg)
    src = jnp.broadcast_to(jnp.clip(jnp.arange(S) - shift, 0, S - 1)[None], (B, S))
    return h[jnp.clip(idx, 0, C - 1), src], over


def packed_attention_mask(S: int, W: int, J: int, start) -> jax.Array:
    """[B, L, L] bool over [clean ; copy 1 .. copy J] (L = (J + 1) S): clean slots block-causal; a
    copy's slot in block k sees clean blocks < k and its own copy's block k; keys < start hidden."""
    s = jnp.arange(S, dtype=jnp.int32)
    blk = s // W
    qb, kb = blk[:, None], blk[None, :]
    causal = kb <= qb
    before = kb < qb
    same = kb == qb
    zero = jnp.zeros((S, S), bool)
    rows = [[causal] + [zero] * J]
    for j in range(J):
        rows.append([before] + [same if i == j else zero for i in range(J)])
    m = jnp.block(rows)  # [L, L]
    valid = jnp.tile(s[None, :] >= jnp.asarray(start, jnp.int32)[:, None], (1, J + 1))  # [B, L]
    return m[None] & valid[:, None, :]


def _packed(params, cfg, ro: Rollout, shrink: int, attn_impl):
    B, S = ro.tokens.shape
    W, mask_id = cfg.block_size, cfg.mask_token_id
    if S % W:
        raise errors.InputError(f"canvas of {S} slots is not a whole number of {W}-slot blocks")
    J = math.ceil(W / shrink)
    smap = ro.step_map
    s = jnp.arange(S, dtype=jnp.int32)[None]
    gen = s >= ro.gen_start[:, None]
    big = jnp.iinfo(jnp.int32).max
    blocks = smap.reshape(B, S // W, W)
    first = jnp.min(jnp.where(blocks > 0, blocks, big), axis=-1)  # [B, NB] first step of each block
    first = jnp.repeat(first, W, axis=1)  # [B, S]
    group = jnp.where(smap > 0, (smap - first) // shrink, 0)  # step group within the block
    visible_from = jnp.where(~gen, 0, jnp.where(smap > 0, group + 1, big // 2))  # copy index j (0-based)
    j = jnp.arange(J, dtype=jnp.int32)[:, None, None]
    copies = jnp.where(visible_from[None] <= j, ro.tokens[None], mask_id)  # [J, B, S]
    seq = jnp.concatenate([ro.tokens] + [copies[i] for i in range(J)], axis=1)  # [B, (J+1) S]
    pos = jnp.tile(default_positions(ro.start, 0, S), (1, J + 1))
    mask = packed_attention_mask(S, W, J, ro.start)
    _, _, h = forward(params, cfg, seq, pos, start=ro.start, attn_impl="xla", attn_mask=mask, return_hidden=True,
                      logits_at=jnp.zeros((B, 1), jnp.int32))
    shift = predicts_next(cfg)
    p = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
    g = jnp.clip(group, 0, J - 1)
    idx = (g + 1) * S + p - shift
    if shift:  # a block's first slot is predicted by the clean last slot of the block before
        idx = jnp.where(p % W == 0, p - 1, idx)
    idx = jnp.clip(idx, 0, (J + 1) * S - 1)
    del attn_impl  # an explicit mask runs on the XLA path
    return jnp.take_along_axis(h, idx[..., None], axis=1)


__all__ = ["trajectory_logprobs", "replay_copies", "token_logprobs", "check_rollout", "check_params", "replay_cost",
           "packed_attention_mask", "default_method", "approximate_decode", "METHODS"]
