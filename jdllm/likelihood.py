"""`loglikelihood()`: log p(continuation | context) for evaluation, on every model kind that has one.

* Causal models: exact, from `jdllm.score` (one teacher-forced forward per batch of rows): the sum
  of the continuation tokens' log-probs; greedy when each is the likeliest token there.
* Bidirectional masked-diffusion models (LLaDA, Dream): LLaDA's Monte Carlo estimate of the
  ELBO (its `get_log_likelihood` / `eval_llada.py`): `mc_samples` noisy copies of the sequence in
  batches of `mc_batch`; in each batch a random count k in [1, L] (L continuation tokens) and
  the counts k, k + L/b, k + 2L/b, ... (rounded, wrapped into [1, L]) spread over its b rows, each
  row masking that many continuation tokens chosen uniformly; the estimate is minus the mean
  over batches of sum(cross-entropy at masked tokens / (count / L)) / b. The context is never
  masked. With a one-token continuation it is exact (every row masks it, ratio 1). Logits are the
  family's own alignment (Dream's shifted ones predict a slot from the slot before it). `greedy`
  asks whether greedy decoding gives the continuation: LLaDA's `suffix_greedy_prediction`
  (unmask the single most confident token per forward, L forwards), run as `MaskedDiffusion`
  with gen_length = steps = block_length = L; off by default, as LLaDA recommends (it costs L
  forwards per request), and then every answer is `False`.
* Block-causal models with same-position logits (SDAR, TraDo): the BD3-LM form of the same ELBO.
  The row sits on its own block grid (slot 0 = its first token, right-padded with the padding
  hidden); in each batch every block holding L_j continuation tokens gets LLaDA's stratified
  counts with its own random k, each row masking that many of the block's continuation tokens;
  each noisy block is denoised seeing itself and the clean blocks before it (one pass over
  [noisy ; clean] under the BD3-LM mask, `jdllm.objectives.block_diffusion_forward`, as SDAR
  trains); the estimate is minus the mean of sum(CE / (count_j / L_j)) / b. No greedy check.
  Fast-dLLM v2 (block-causal, shifted logits) has none here: an `InputError` says so.

Rows are left-padded to quarter-octave lengths (`jdllm.scoring.length_bucket`; padding is masked
out, so a bidirectional row sees only itself) and continuation lengths likewise, so requests of new lengths reuse a
few compiled programs. Each request's noise comes from `fold_in(key(seed), i)`, i its index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors, inputs
from jdllm.model import default_positions, forward
from jdllm.scoring import length_bucket, tail_scores
from jdllm.sharding import auto_axes

SCORE_ROWS = 8  # causal rows per scoring forward


def _check_pairs(model, pairs) -> list[tuple[np.ndarray, np.ndarray]]:
    cfg = model.config
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise errors.InputError("loglikelihood() needs a non-empty list of (context ids, continuation ids) pairs")
    out = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise errors.InputError(f"request {i}: expected a (context ids, continuation ids) pair, got {pair!r}")
        ctx, cont = (inputs.id_row(x, f"request {i}: the {what}") for x, what in zip(pair, ("context", "continuation")))
        if ctx.size == 0:
            raise errors.InputError(f"request {i}: the context is empty; the first token has nothing to be "
                                    "conditioned on (lm-evaluation-harness passes the EOS token there)")
        if cont.size == 0:
            raise errors.InputError(f"request {i}: the continuation is empty")
        if ctx.size + cont.size > cfg.max_position_embeddings:
            raise errors.SequenceTooLongError(
                f"request {i}: context + continuation = {ctx.size + cont.size} tokens exceeds "
                f"max_position_embeddings={cfg.max_position_embeddings}; truncate the context")
        inputs.check_id_range(ctx, cfg.vocab_size)
        inputs.check_id_range(cont, cfg.vocab_size)
        for what, x in (("context", ctx), ("continuation", cont)):
            inputs.check_no_mask_token(x, cfg, f"request {i}: the {what}")
        out.append((ctx.astype(np.int32), cont.astype(np.int32)))
    return out


def loglikelihood(model, pairs, *, mc_samples: int = 128, mc_batch: int = 32, seed: int = 0,
                  greedy: bool = False) -> list[tuple[float, bool]]:
    """(log-likelihood, is_greedy) of each (context ids, continuation ids) pair under `model`: exact
    for causal models, a Monte Carlo ELBO estimate (`mc_samples` noisy copies in batches of
    `mc_batch`; `seed`) for masked-diffusion (LLaDA's) and block-diffusion (BD3-LM form) ones; see
    the module docstring."""
    cfg = model.config
    rows = _check_pairs(model, pairs)
    check_estimator(cfg, mc_samples=mc_samples, mc_batch=mc_batch, seed=seed, greedy=greedy)  # every model: a bad
    if cfg.attention == "causal":  # value is an error even where the exact path does not use it
        return _causal(model, rows)
    blocks = cfg.attention == "block_causal"
    if cfg.mask_token_id is None or (blocks and cfg.logit_shift):
        raise errors.InputError(
            f"loglikelihood() has no estimator for a model with {cfg.attention} attention"
            + (" and no mask token" if cfg.mask_token_id is None else " and shifted logits (Fast-dLLM v2)")
            + ": it is exact for causal models and a Monte Carlo ELBO for masked-diffusion ones (LLaDA, Dream) and "
              "same-position block-diffusion ones (SDAR)")
    key = jax.random.key(seed)
    out = []
    for i, (ctx, cont) in enumerate(rows):
        elbo = _block_elbo if blocks else _masked_elbo
        ll = elbo(model, ctx, cont, jax.random.fold_in(key, i), mc_samples // mc_batch, mc_batch)
        out.append((ll, _greedy_unmasking(model, ctx, cont) if greedy else False))
    return out


def check_estimator(cfg, *, mc_samples, mc_batch, seed, greedy) -> None:
    """The estimator's settings (`loglikelihood`, on every model; `JdllmLM`'s model_args, checked when it
    is built): InputError naming the one at fault."""
    if cfg.attention == "block_causal" and greedy:
        raise errors.InputError("greedy=True is LLaDA's check (suffix_greedy_prediction), for bidirectional "
                                "masked-diffusion models; a block-diffusion model has none here")
    if not isinstance(greedy, (bool, np.bool_)):
        raise errors.InputError(f"greedy={greedy!r} must be True or False")
    for name, v in (("mc_samples", mc_samples), ("mc_batch", mc_batch)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise errors.InputError(f"{name}={v!r} must be an integer >= 1")
    if mc_samples % mc_batch:
        raise errors.InputError(f"mc_samples={mc_samples} must be a multiple of mc_batch={mc_batch} (LLaDA's rule)")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise errors.InputError(f"seed={seed!r} must be an integer in [0, 2**32)")


def _causal(model, rows) -> list[tuple[float, bool]]:
    """Scored SCORE_ROWS at a time, longest first (rows of like length share a forward's padding),
    the LM head only at the continuations' slots (`jdllm.scoring.tail_scores`)."""
    order = sorted(range(len(rows)), key=lambda i: -(len(rows[i][0]) + len(rows[i][1])))
    out: list = [None] * len(rows)
    for i in range(0, len(order), SCORE_ROWS):
        part = order[i:i + SCORE_ROWS]
        lp, top, _ = tail_scores(model, [np.concatenate(rows[j]) for j in part], max(len(rows[j][1]) for j in part), 1)
        for b, j in enumerate(part):
            L = len(rows[j][1])
            mine, best = lp[b, -L:], top[b, -L:, 0]
            out[j] = (float(np.sum(mine, dtype=np.float64)), bool(np.all(mine >= best)))
    return out


# --------------------------------------------------------------------------- masked diffusion
def mask_counts(key, L, b: int):
    """[b] int32: LLaDA's stratified mask counts for a batch of b rows over L continuation tokens
    (k uniform in [1, L], then k + i L / b rounded half to even and wrapped into [1, L])."""
    k = jax.random.randint(key, (), 1, L + 1)
    x = jnp.round(k.astype(jnp.float32) + jnp.arange(b, dtype=jnp.float32) * (L / b)).astype(jnp.int32)
    return (x - 1) % L + 1


def noisy_rows(key, tokens, L, b: int, mask_id: int):
    """(noisy [b, S], masked [b, S] bool, counts [b]): one MC batch of LLaDA's forward process over
    a left-padded row `tokens` [S] whose last L slots are the continuation: row i masks counts[i]
    continuation slots chosen uniformly (a random permutation's first counts[i])."""
    S = tokens.shape[0]
    kc, kp = jax.random.split(key)
    counts = mask_counts(kc, L, b)
    target = jnp.arange(S) >= S - L
    noise = jnp.where(target, jax.random.uniform(kp, (b, S)), jnp.inf)
    rank = jnp.argsort(jnp.argsort(noise, axis=-1), axis=-1)  # a target slot's place in a random order
    masked = target & (rank < counts[:, None])
    return jnp.where(masked, mask_id, tokens[None]), masked, counts


@jax.jit(static_argnames=("cfg", "attn_impl", "groups", "b", "width", "placement"))
@auto_axes
def _elbo_jit(params, tokens, start, L, key, *, cfg, attn_impl, groups, b, width, placement=None):
    """minus LLaDA's loss averaged over `groups` MC batches of b rows; the head runs only at the
    `width` slots that predict the last `width` slots (L <= width of them are the continuation)."""
    S = tokens.shape[0]
    shift = int(cfg.logit_shift)
    at = jnp.broadcast_to(jnp.arange(S - width, S, dtype=jnp.int32) - shift, (b, width))
    pos = default_positions(jnp.broadcast_to(start, (b,)), 0, S)

    def batch(k):
        noisy, masked, counts = noisy_rows(k, tokens, L, b, cfg.mask_token_id)
        logits, _ = forward(params, cfg, noisy, pos, start=jnp.broadcast_to(start, (b,)), attn_impl=attn_impl,
                            logits_at=at)
        logp = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(logp, jnp.broadcast_to(tokens[S - width:], (b, width))[..., None], axis=-1)[..., 0]
        ratio = counts.astype(jnp.float32) / L
        loss = jnp.where(masked[:, S - width:], -lp, 0.0) / ratio[:, None]
        return jnp.sum(loss) / b

    losses = jax.lax.map(batch, jax.random.split(key, groups))
    return -jnp.mean(losses)


def _masked_elbo(model, ctx, cont, key, groups: int, b: int) -> float:
    cfg = model.config
    n, L = len(ctx) + len(cont), len(cont)
    S = length_bucket(n, cfg.max_position_embeddings)
    tokens = np.zeros((S,), np.int32)
    tokens[S - n:] = np.concatenate([ctx, cont])
    width = length_bucket(L, S - int(cfg.logit_shift))  # the context's first token is never predicted: L <= S - 1
    return float(_elbo_jit(model.params, jnp.asarray(tokens), jnp.int32(S - n), jnp.int32(L), key, cfg=cfg,
                           attn_impl=model.forward_impl, groups=groups, b=b, width=width,
                           placement=model.placement))


def _greedy_unmasking(model, ctx, cont) -> bool:
    """Whether greedy one-token-per-forward unmasking (LLaDA's suffix_greedy_prediction) gives `cont`."""
    from jdllm.decode.masked_diffusion import MaskedDiffusion  # noqa: PLC0415
    from jdllm.generation import generate  # noqa: PLC0415
    from jdllm.sampling import Sampling  # noqa: PLC0415

    L = len(cont)
    out = generate(model, [ctx.tolist()], MaskedDiffusion(gen_length=L, steps=L, block_length=L),
                   Sampling(max_new_tokens=L, stop_token_ids=()), apply_chat_template=False)[0]
    return list(out.token_ids) == cont.tolist()


# --------------------------------------------------------------------------- block diffusion
def noisy_block_rows(key, tokens, P, n, b: int, block: int, mask_id: int):
    """(noisy [b, S], masked [b, S], ratio [b, S]): one MC batch for a block-causal row `tokens` [S]
    (slots from 0, right-padded after n) whose continuation is slots [P, n): LLaDA's forward process
    in each block on its own (the block's L_j continuation slots, a count per row from LLaDA's
    stratified counts with the block's own k), ratio count / L_j at every slot of the block."""
    S = tokens.shape[0]
    nb = S // block
    s = jnp.arange(S)
    cont = (s >= P) & (s < n)
    L = jnp.sum(cont.reshape(nb, block), axis=1)  # [nb] continuation slots per block
    kc, kp = jax.random.split(key)
    counts = jax.vmap(lambda k, lj: mask_counts(k, jnp.maximum(lj, 1), b))(jax.random.split(kc, nb), L)  # [nb, b]
    noise = jnp.where(cont, jax.random.uniform(kp, (b, S)), jnp.inf).reshape(b, nb, block)
    rank = jnp.argsort(jnp.argsort(noise, axis=-1), axis=-1).reshape(b, S)  # place in a random order, per block
    per_slot = counts.T[:, s // block]  # [b, S]
    masked = cont & (rank < per_slot)
    ratio = per_slot / jnp.maximum(L, 1)[s // block].astype(jnp.float32)
    return jnp.where(masked, mask_id, tokens[None]), masked, ratio


@jax.jit(static_argnames=("cfg", "groups", "b", "width", "placement"))
@auto_axes
def _block_elbo_jit(params, tokens, P, n, key, *, cfg, groups, b, width, placement=None):
    """minus the mean over `groups` MC batches of sum(CE at masked slots / ratio) / b, each noisy
    block denoised under the BD3-LM mask (its own block and the clean blocks before it); the head
    only at the `width` slots before n (the continuation's L <= width among them)."""
    from jdllm.objectives import block_diffusion_forward  # noqa: PLC0415

    S = tokens.shape[0]
    at = jnp.broadcast_to(jnp.clip(n - width + jnp.arange(width, dtype=jnp.int32), 0, S - 1), (b, width))
    zeros, end = jnp.zeros((b,), jnp.int32), jnp.full((b,), n, jnp.int32)

    def batch(k):
        noisy, masked, ratio = noisy_block_rows(k, tokens, P, n, b, cfg.block_size, cfg.mask_token_id)
        logits = block_diffusion_forward(params, cfg, noisy, jnp.broadcast_to(tokens, (b, S)), zeros, end,
                                         logits_at=at)
        logp = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(logp, tokens[at][..., None], axis=-1)[..., 0]
        pick = lambda x: jnp.take_along_axis(x, at, axis=1)  # noqa: E731
        return jnp.sum(jnp.where(pick(masked), -lp / pick(ratio), 0.0)) / b

    return -jnp.mean(jax.lax.map(batch, jax.random.split(key, groups)))


def _block_elbo(model, ctx, cont, key, groups: int, b: int) -> float:
    cfg = model.config
    n, L, bs = len(ctx) + len(cont), len(cont), cfg.block_size
    S = -(-length_bucket(n, cfg.max_position_embeddings) // bs) * bs  # whole blocks from slot 0 (the row's grid)
    tokens = np.zeros((S,), np.int32)
    tokens[:n] = np.concatenate([ctx, cont])
    width = min(length_bucket(L, S), n)
    return float(_block_elbo_jit(model.params, jnp.asarray(tokens), jnp.int32(len(ctx)), jnp.int32(n), key, cfg=cfg,
                                 groups=groups, b=b, width=width, placement=model.placement))


__all__ = ["loglikelihood", "mask_counts", "noisy_rows", "noisy_block_rows"]
