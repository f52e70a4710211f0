"""`score()`: each token's log-prob given the tokens before it, with the most likely alternatives,
from one teacher-forced forward of a causal (autoregressive) model.

This is what scoring a text needs: lm-evaluation-harness' loglikelihood tasks (multiple choice,
perplexity), OpenAI's `echo` with `logprobs` (the server's prompt log-probs), top alternatives of
a completion. Only the small results leave the device: per position the token's log-prob and the
`top_logprobs` most likely ids and log-probs, the log-softmax taken over chunks of positions so
the float32 [positions, vocab] logits never exist whole. Rows are left-padded (the padding masked
out) to quarter-octave lengths (at most ~1/8 of a row padding; `length_bucket`) and power-of-two
row counts, so calls with new lengths reuse a handful of compiled programs.

The log-probs are the model's own distribution (temperature 1, nothing filtered). A diffusion
model (block-causal or bidirectional attention) has no left-to-right likelihood: `score` refuses
it with an `InputError`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors, inputs
from jdllm.decode import common
from jdllm.model import head_logits, teacher_forced_hidden
from jdllm.sharding import auto_axes

HEAD_CHUNK = 128  # at most this many positions per log-softmax over the vocabulary (float32 [B, chunk, V])
MIN_LENGTH = 16  # the shortest padded length


@dataclasses.dataclass(frozen=True)
class Scores:
    """One row's scores. Position 0 has no context: its entries are NaN (ids -1)."""

    token_ids: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32: log p(token t | tokens < t)
    top_ids: np.ndarray  # [T, k] int32: the k most likely tokens at t, most likely first
    top_logprobs: np.ndarray  # [T, k] float32: their log-probs

    @property
    def total(self) -> float:
        """The sum of the log-probs of tokens 1 .. T-1 (the row's log-likelihood given its first token)."""
        return float(np.sum(self.logprobs[1:], dtype=np.float64))

    def is_greedy(self, begin: int = 1) -> bool:
        """Whether every token from `begin` on is the most likely one there (ties count as greedy)."""
        if self.top_ids.shape[1] == 0:
            raise errors.InputError("is_greedy needs top_logprobs >= 1 in score()")
        return bool(np.all(self.logprobs[max(begin, 1):] >= self.top_logprobs[max(begin, 1):, 0]))


def length_bucket(n: int, cap: int) -> int:
    """A padded length for n tokens: a quarter-octave bucket (at most ~1/8 of it padding) of at least
    MIN_LENGTH, but never past `cap` (the model's context) unless n is."""
    return max(n, min(common.bucket(n, MIN_LENGTH, steps_per_octave=4), cap))


def row_bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def score(model, token_ids, *, top_logprobs: int = 0) -> list[Scores]:
    """Score each row of `token_ids` (a list of token-id lists, or an int array [B, T]) under the
    causal `model`: per token its log-prob given the tokens before it and the `top_logprobs` most
    likely tokens there (0: none). Rows may differ in length. Returns one `Scores` per row."""
    cfg = model.config
    if cfg.attention != "causal":
        raise errors.InputError(
            f"score() needs a causal (autoregressive) model; this one's attention is {cfg.attention!r}, a "
            "diffusion model that has no left-to-right likelihood of a token given its prefix")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer)) or \
            not 0 <= top_logprobs <= cfg.vocab_size:
        raise errors.InputError(f"top_logprobs={top_logprobs!r} must be an integer in [0, {cfg.vocab_size}]")
    rows = inputs.id_rows(token_ids)
    if not rows or any(len(r) == 0 for r in rows):
        raise errors.InputError("score() needs at least one non-empty row of token ids")
    longest = max(len(r) for r in rows)
    if longest > cfg.max_position_embeddings:
        raise errors.SequenceTooLongError(
            f"sequence length {longest} exceeds max_position_embeddings={cfg.max_position_embeddings}; "
            "truncate the input")
    for r in rows:
        inputs.check_id_range(r, cfg.vocab_size)
    lp, top_lp, top_ids = tail_scores(model, rows, longest, int(top_logprobs))
    out = []
    for b, r in enumerate(rows):
        n = len(r)
        row_lp, row_top, row_ids = lp[b, -n:].copy(), top_lp[b, -n:].copy(), top_ids[b, -n:].copy()
        row_lp[0], row_top[0], row_ids[0] = np.nan, np.nan, -1
        out.append(Scores(token_ids=np.asarray(r, np.int32), logprobs=row_lp, top_ids=row_ids, top_logprobs=row_top))
    return out


def tail_scores(model, rows: list[np.ndarray], width: int, top: int):
    """(log-probs [B', W], top log-probs [B', W, top], top ids [B', W, top]) of each row's last W >=
    `width` tokens (checked rows, left-padded: entries before a row's first token are padding; B'
    >= len(rows)). Only those W positions run the LM head: `jdllm.loglikelihood` asks for the
    continuations alone."""
    cfg = model.config
    S = length_bucket(max(len(r) for r in rows), cfg.max_position_embeddings)
    W = min(length_bucket(width, S), S)
    tokens = np.zeros((row_bucket(len(rows)), S), np.int32)
    start = np.zeros((tokens.shape[0],), np.int32)
    for b, r in enumerate(rows):
        tokens[b, S - len(r):], start[b] = r, S - len(r)
    return jax.device_get(_score_jit(model.params, jnp.asarray(tokens), jnp.asarray(start), cfg=cfg,
                                     attn_impl=model.forward_impl, top=top, width=W, placement=model.placement))


@jax.jit(static_argnames=("cfg", "attn_impl", "top", "width", "placement"))
@auto_axes
def _score_jit(params, tokens, start, *, cfg, attn_impl, top, width, placement=None):
    """([B, W] log-probs, [B, W, top] top log-probs, [B, W, top] top ids) of the last W slots of
    left-padded rows (row b's tokens from start[b])."""
    B, S = tokens.shape
    h = teacher_forced_hidden(params, cfg, tokens, start, attn_impl)[:, S - width:]  # slot p from p - 1
    t = tokens[:, S - width:]
    c = max(d for d in range(1, min(width, HEAD_CHUNK) + 1) if width % d == 0)  # chunks that tile W: no padded rows
    n = width // c
    hc = h.reshape(B, n, c, h.shape[-1]).swapaxes(0, 1)
    tc = t.reshape(B, n, c).swapaxes(0, 1)

    def chunk(args):
        hh, tt = args
        logp = jax.nn.log_softmax(head_logits(params, cfg, hh, attn_impl), axis=-1)
        lp = jnp.take_along_axis(logp, tt[..., None], axis=-1)[..., 0]
        vals, ids = jax.lax.top_k(logp, top) if top else (logp[..., :0], jnp.zeros(logp.shape[:-1] + (0,), jnp.int32))
        return lp, vals, ids.astype(jnp.int32)

    lp, vals, ids = jax.lax.map(chunk, (hc, tc))

    def back(x):  # [n, B, c, ...] -> [B, W, ...]
        return x.swapaxes(0, 1).reshape(B, width, *x.shape[3:])

    return back(lp), back(vals), back(ids)


__all__ = ["score", "Scores"]
