"""`masked_diffusion`: LLaDA / Dream / Fast-dLLM semi-autoregressive denoising on bidirectional models.

The generation region (gen_length slots after the prompt, all mask at first)
is split into `gen_length / block_length` blocks decoded left to right. Each
step runs the model, predicts every masked position of the current block and
reveals some of them:

- LLaDA (`alg=None`): `steps / num_blocks` steps per block; step i reveals
  the k_i most confident masked positions, k from LLaDA's linear schedule
  (`transfer_schedule`; with more steps than tokens per block its zero-transfer
  tail comes after the block is full and is skipped, saving those forwards).
  Confidence (`remasking`): `low_confidence` = the temperature-1 softmax
  probability of the predicted token, `random` = a
  uniform draw. Optional classifier-free guidance: a second forward with the
  prompt replaced by mask tokens, logits = un + (cfg_scale + 1) (cond - un).
- Dream (`alg=...`, logits shifted by one where the model has `logit_shift`):
  per block, timesteps t = linspace(1, eps, steps_per_block + 1); step i
  reveals floor(n_masked * (1 - t[i+1] / t[i])) positions (all on the last
  step) ranked by `maskgit_plus` (top-1 prob), `topk_margin` (top-1 minus
  top-2 prob) or `entropy` (negative entropy) of the sampled distribution;
  `origin` reveals each masked position with probability 1 - t[i+1] / t[i]
  (~ 1 / remaining steps) in random order. (Dream averages the masked count
  over the batch; here each row uses its own, so a row in a batch decodes
  exactly as it does alone.)
- Fast-dLLM `confidence_threshold`: instead of a schedule, each step reveals
  the most confident masked position of the block plus every one whose
  confidence is >= the threshold, until the block is full.

Sampling. Temperature T > 0 draws tokens by Gumbel-max. LLaDA computes
argmax(exp(l) / E^T) with E = -log(u) ~ Exp(1) in float64, because exp(l)
overflows float32; the monotone log of that is argmax(l - T log E) =
argmax(l + T g), g = -log E a standard Gumbel, which float32 evaluates without
overflow and with the same argmax (up to ties at float32 resolution; a test
checks it against numpy float64). Float64's other gift is the noise tail: a
float32 uniform u is never closer to 1 than 2^-24, which caps g at ~16.6 (and a
150k vocabulary hits that cap about once per hundred positions). So E is drawn
by inverse CDF from 64 random bits with both halves of u kept in relative
precision (`exponential_from_bits`): g reaches ~45, past float64's own ~36.7.
A token's log-prob is taken under softmax(l / T), the distribution Gumbel-max
samples from. The mask token is never proposed. top_k / top_p (Dream) cut
tokens before the draw.

Caches (Fast-dLLM; the K/V of a bidirectional model depend on every token, so
both are approximations, refreshed by one full forward over the canvas at the
first step of each block, which also reveals):
- `prefix`: later steps of the block run only slots [block start, S) against
  the cached prompt and finished blocks (one compiled window width per block).
- `dual`: later steps run only the block against the cached prefix *and*
  suffix (`model.forward(kv_len=S)` makes the cached suffix visible).
For shifted-logit models the window starts one slot earlier, so the block's
first position is predicted from fresh logits. A one-layer model's K/V depend
only on the token at their own slot, so there both caches are exact (a test
uses this); deeper models deviate, and `benchmarks/decode.py` measures it.

Batches: rows are left-padded (`start`) so every row's generation starts at
slot P and blocks line up; the batch moves to the next block once every
running row has filled the current one (a row that is done with it idles: no
forward counted, no step, PRNG stream untouched), so each row decodes exactly
as it would alone. Rows stop at the first stop token (tokens after it are not
returned). Supported models: bidirectional with a mask token (LLaDA, Dream);
block-causal models (SDAR, Fast-dLLM v2) use `BlockDiffusion` / `MultiBlock`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors
from jdllm.decode import common
from jdllm.decode.protocol import Paradigm
from jdllm.model import default_positions, forward
from jdllm.sampling import apply_token_bitmask, distribution_stats, exclude_token, filter_logits, per_row, split_rows
from jdllm.state import DecodeState, slot_index

REMASKING = ("low_confidence", "random")
CACHE_MODES = ("auto", "none", "prefix", "dual")
ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


# --------------------------------------------------------------------------- noise
def exponential_from_bits(bits: jax.Array) -> jax.Array:
    """Exp(1) samples from uint32 bits [..., 2], by inverse CDF with float64-like tails.

    The top bit picks the half of u ~ U(0, 1): u = a / 2 or u = 1 - a / 2, with
    a in (0, 1) built from the other 63 bits so it keeps relative precision down
    to 2^-63. Then E = -log(u) (large-E side) or -log1p(-a / 2) (small-E side):
    both ends of the distribution are resolved, unlike -log of a float32 u.
    """
    w1, w0 = bits[..., 0], bits[..., 1]
    coin = (w1 >> 31) == 1
    hi = (w1 & jnp.uint32(0x7FFFFFFF)).astype(jnp.float32)
    lo = w0.astype(jnp.float32) + 0.5
    half_a = (hi + lo * 2.0 ** -32) * 2.0 ** -32  # a / 2 in (0, 1/2)
    return jnp.where(coin, -jnp.log(half_a), -jnp.log1p(-half_a))


def exponential_noise(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 Exp(1) noise of `shape` (E = -log u of LLaDA's Gumbel trick)."""
    return exponential_from_bits(jax.random.bits(key, (*shape, 2), jnp.uint32))


def gumbel_argmax(logits: jax.Array, exp_noise: jax.Array, temperature: float) -> jax.Array:
    """argmax(logits + T * g), g = -log(E): LLaDA's argmax(exp(logits) / E^T) in log space."""
    return jnp.argmax(logits - temperature * jnp.log(exp_noise), axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------- schedules
def transfer_schedule(block_length: int, steps: int) -> np.ndarray:
    """LLaDA's `get_num_transfer_tokens` for one all-mask block: base = n // steps,
    the remainder spread over the first steps. [steps] int32, sums to n."""
    base, rem = divmod(block_length, steps)
    return (base + (np.arange(steps) < rem)).astype(np.int32)


def dream_ratios(steps: int, eps: float) -> np.ndarray:
    """Dream's reveal fraction per step, 1 - t[i+1] / t[i] for t = linspace(1, eps, steps + 1);
    the last step reveals everything (1.0). [steps] float32."""
    t = np.linspace(1.0, eps, steps + 1)
    r = 1.0 - t[1:] / t[:-1]
    r[-1] = 1.0
    return r.astype(np.float32)


# --------------------------------------------------------------------------- sampling a block
def block_noise(state: DecodeState, work, Bl: int, V: int):
    """(state, Exp(1) noise [B, Bl, V] (ones when no row samples), uniforms [B, Bl]) for one step;
    a row's PRNG stream advances only where `work` [B]."""
    nxt, sub = split_rows(state.key)
    keep = jax.random.key_data(state.key)
    key = jax.random.wrap_key_data(jnp.where(work[:, None], jax.random.key_data(nxt), keep),
                                   impl=jax.random.key_impl(state.key))
    state = state.replace(key=key)
    hot = state.sampling.temperature > 0  # [B]
    exp_noise = jax.lax.cond(
        jnp.any(hot), lambda: jax.vmap(lambda k: exponential_noise(jax.random.fold_in(k, 0), (Bl, V)))(sub),
        lambda: jnp.ones((state.batch, Bl, V), jnp.float32))
    uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (Bl,)))(sub)  # [B, Bl]
    return state, exp_noise, uniform


def sample_block(state: DecodeState, ctx, logits: jax.Array, exp_noise):
    """Tokens and statistics from aligned logits [B, W, V] (mask token excluded), per-row settings.

    Returns (Sample under the distribution sampled from, conf1 = temperature-1
    probability of the token (LLaDA's confidence), the sampled distribution's
    filtered logits zt)."""
    sp = state.sampling
    settings = per_row(sp.temperature, sp.top_k, sp.top_p)
    T = settings["temperature"]  # [B, 1]
    z = exclude_token(logits, ctx.model.mask_token_id)
    zt = filter_logits(z, **settings)  # [B, W, V]
    greedy = jnp.argmax(zt, axis=-1).astype(jnp.int32)
    drawn = gumbel_argmax(jnp.where(jnp.isfinite(zt), z, -jnp.inf), exp_noise, T[..., None])
    tok = jnp.where(T > 0, drawn, greedy)
    s = distribution_stats(zt, tok)
    conf1 = jnp.exp(jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), tok[..., None], axis=-1)[..., 0])
    return s, conf1, zt


# --------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class MaskedDiffusion(Paradigm):
    """Masked-diffusion decoding over bidirectional models (LLaDA, Dream, Fast-dLLM).

    gen_length: canvas of generated slots (None = Sampling.max_new_tokens; when set,
      max_new_tokens must be >= it). block_length: semi-autoregressive block (None =
      gen_length, one block); must divide gen_length. steps: total denoising steps
      (None = gen_length), a multiple of the number of blocks; steps / num_blocks per
      block (unused with confidence_threshold). remasking: LLaDA's `low_confidence` or `random`. alg: Dream's `origin`,
      `maskgit_plus`, `topk_margin` or `entropy` (None = LLaDA schedule); eps: Dream's
      final timestep. confidence_threshold: Fast-dLLM parallel decoding in (0, 1]
      (None = the step schedule). cache_mode: `none`, `prefix` or `dual` (Fast-dLLM's approximate
      caches); `auto` = the fastest exact choice, which is `none` here (`cache=` is the older
      spelling, still accepted). cfg_scale: classifier-free guidance (0 = off; needs cache_mode="none").
    """

    name: ClassVar[str] = "masked_diffusion"
    joins_running_batch: ClassVar[bool] = False  # rows share the lockstep window over one prefill length
    REMASKINGS: ClassVar[tuple[str, ...]] = REMASKING  # choices, for the CLI
    ALGS: ClassVar[tuple[str, ...]] = ALGS
    CACHE_MODES: ClassVar[tuple[str, ...]] = CACHE_MODES

    gen_length: int | None = None
    steps: int | None = None
    block_length: int | None = None
    remasking: str = "low_confidence"
    confidence_threshold: float | None = None
    cache_mode: str = "none"
    cfg_scale: float = 0.0
    alg: str | None = None
    eps: float = 1e-3

    cache: dataclasses.InitVar[str | None] = None  # the older name of cache_mode

    def __post_init__(self, cache=None):
        if cache is not None:
            object.__setattr__(self, "cache_mode", cache)
        if self.cache_mode == "auto":
            object.__setattr__(self, "cache_mode", "none")
        for f in ("gen_length", "steps", "block_length"):
            v = getattr(self, f)
            if v is not None and (int(v) != v or v < 1):
                raise errors.DecodingConfigError(f"{f}={v} must be an integer >= 1 (or None)")
        if self.remasking not in REMASKING:
            raise errors.DecodingConfigError(f"remasking={self.remasking!r} is not one of {REMASKING}")
        if self.alg is not None and self.alg not in ALGS:
            raise errors.DecodingConfigError(f"alg={self.alg!r} is not one of {ALGS} (or None for LLaDA)")
        if self.alg is not None and self.remasking == "random":
            raise errors.DecodingConfigError(
                f"remasking='random' is LLaDA's; with alg={self.alg!r} (Dream) leave remasking at its default")
        if self.cache_mode not in CACHE_MODES:
            raise errors.DecodingConfigError(f"cache_mode={self.cache_mode!r} is not one of {CACHE_MODES}")
        t = self.confidence_threshold
        if t is not None:
            if not 0 < t <= 1:
                raise errors.DecodingConfigError(f"confidence_threshold={t} must be in (0, 1] (or None)")
            if self.remasking == "random" or self.alg in ("origin", "entropy"):
                raise errors.DecodingConfigError(
                    f"confidence_threshold needs a probability-like confidence; remasking={self.remasking!r}, "
                    f"alg={self.alg!r} has none: use remasking='low_confidence' or alg='maskgit_plus' / "
                    "'topk_margin'")
        if not self.cfg_scale >= 0:
            raise errors.DecodingConfigError(f"cfg_scale={self.cfg_scale} must be >= 0 (0 = off)")
        if self.cfg_scale > 0 and self.cache_mode != "none":
            raise errors.DecodingConfigError(
                f"cfg_scale={self.cfg_scale} needs cache_mode='none' (got cache_mode={self.cache_mode!r}): the "
                "unconditional pass has no cache")
        if not 0 < self.eps < 1:
            raise errors.DecodingConfigError(f"eps={self.eps} must be in (0, 1)")
        if self.gen_length is not None:
            self.geometry(self.gen_length)

    # ----------------------------------------------------------------- host side
    def geometry(self, gen_length: int) -> tuple[int, int, int]:
        """(block_length, num_blocks, steps_per_block) for a canvas of gen_length slots."""
        G = int(gen_length)
        Bl = G if self.block_length is None else int(self.block_length)
        if G % Bl:
            raise errors.DecodingConfigError(
                f"block_length={Bl} must divide gen_length={G}; pick a divisor or change gen_length "
                "(max_new_tokens when gen_length=None)")
        nb = G // Bl
        steps = G if self.steps is None else int(self.steps)
        if steps % nb:
            raise errors.DecodingConfigError(
                f"steps={steps} must be a multiple of the number of blocks {nb} (gen_length={G} / "
                f"block_length={Bl})")
        return Bl, nb, steps // nb

    def validate(self, cfg) -> None:
        common.require_diffusion_model("masked_diffusion", cfg, ("bidirectional",),
                                       "jdllm.BlockDiffusion or jdllm.MultiBlock for block-causal models")

    def layout(self, lengths: np.ndarray, max_new_tokens: int, cfg) -> common.Layout:
        """Left padding to P = bucket(longest prompt): generation is slots [P, P + gen_length)
        in every row. S is exactly P + gen_length: a bidirectional model sees every slot."""
        G = int(max_new_tokens if self.gen_length is None else self.gen_length)
        if max_new_tokens < G:
            raise errors.DecodingConfigError(
                f"max_new_tokens={max_new_tokens} < gen_length={G}; raise max_new_tokens or set "
                "gen_length=None (then gen_length = max_new_tokens)")
        self.geometry(G)
        lengths = np.asarray(lengths, np.int64)
        P = common.bucket(int(lengths.max()))
        return common.Layout(start=(P - lengths).astype(np.int32), gen_start=np.full(len(lengths), P, np.int32),
                             slots=P + G, prefill_len=P)

    def max_iterations(self, state: DecodeState) -> int:
        # per block at most max(steps_per_block, block_length) forwards (+1 slack): a guard
        return (self.steps or 0) + 2 * state.slots + 8

    def replay_approximation(self) -> str | None:
        if self.cfg_scale > 0:
            return f"MaskedDiffusion(cfg_scale={self.cfg_scale}) samples from a classifier-free-guidance mix of two forwards"
        if self.cache_mode in ("prefix", "dual"):
            return f"MaskedDiffusion(cache_mode={self.cache_mode!r}) is Fast-dLLM's approximate cache"
        return None

    def replay_refusal(self) -> str | None:
        if self.cfg_scale > 0:
            return "the replay does not run CFG: decode RL rollouts with cfg_scale=0"
        return None

    # ----------------------------------------------------------------- device side
    def prefill(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        """No forward here: the first step's forward is the first refresh."""
        zero = jnp.zeros((), jnp.int32)
        return state.replace(extra={"block": zero, "i": zero})

    def _full_logits(self, params, ctx, state: DecodeState, with_cache: bool, at):
        """(state, logits [B, N, V] at canvas slots `at` [B, N]) of a forward over the whole canvas
        (and the cache refreshed when with_cache)."""
        S = state.slots
        pos = default_positions(state.start, 0, S)
        if self.cfg_scale > 0:
            prompt = slot_index(state) < state.gen_start[:, None]
            un = jnp.where(prompt, jnp.int32(ctx.model.mask_token_id), state.tokens)
            both, _ = forward(params, ctx.model, jnp.concatenate([state.tokens, un]), jnp.concatenate([pos, pos]),
                              start=jnp.concatenate([state.start, state.start]), attn_impl=ctx.attn_impl,
                              logits_at=jnp.concatenate([at, at]))
            cond, unc = both[:state.batch], both[state.batch:]
            return state.replace(forwards=state.forwards + 2), unc + (self.cfg_scale + 1.0) * (cond - unc)
        if not with_cache:
            raw, _ = forward(params, ctx.model, state.tokens, pos, start=state.start, attn_impl=ctx.attn_impl,
                             logits_at=at)
            return state.replace(forwards=state.forwards + 1), raw
        raw, cache = forward(params, ctx.model, state.tokens, pos, start=state.start, cache=state.cache, offset=0,
                             attn_impl=ctx.attn_impl, logits_at=at)
        return state.replace(cache=cache, forwards=state.forwards + 1), raw

    def _window_logits(self, params, ctx, state: DecodeState, lo, width: int, n: int, kv_len=None):
        """(state, logits [B, n, V] of the first n slots) of a forward over [lo, lo + width) against the cache.

        The window's K/V are not written back: the block's next step recomputes them and the next
        block's first step refreshes the whole cache, so nobody reads them. (Written, they would sit
        in the branch of a `lax.cond` whose other branch also writes the cache, and XLA would copy
        the whole cache on every step: a cost that grows with the canvas.)"""
        toks = common.window(state.tokens, lo, width)
        pos = default_positions(state.start, lo, width)
        at = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (state.batch, n))
        raw, _ = forward(params, ctx.model, toks, pos, start=state.start, cache=state.cache, offset=lo,
                         attn_impl=ctx.attn_impl, kv_len=kv_len, logits_at=at, write_cache=False)
        return state.replace(forwards=state.forwards + 1), raw

    def _block_logits(self, params, ctx, state: DecodeState, blk, i, Bl: int, nb: int):
        """(state, aligned logits [B, Bl, V] predicting the tokens of block `blk`), per the cache mode."""
        P, S = ctx.prefill_len, state.slots
        shift = int(ctx.model.logit_shift)
        b0 = P + blk * Bl
        at = jnp.broadcast_to(b0 - shift + jnp.arange(Bl, dtype=jnp.int32), (state.batch, Bl))
        if self.cache_mode == "none":
            return self._full_logits(params, ctx, state, False, at)

        def full(st):
            return self._full_logits(params, ctx, st, True, at)

        if self.cache_mode == "dual":
            def win(st):
                return self._window_logits(params, ctx, st, b0 - shift, Bl + shift, Bl, kv_len=S)
        else:
            def branch(k):
                lo = P + k * Bl - shift  # static per block: window [lo, S)
                return lambda st: self._window_logits(params, ctx, st, lo, S - lo, Bl)

            def win(st):
                return jax.lax.switch(jnp.clip(blk, 0, nb - 1), [branch(k) for k in range(nb)], st)

        return jax.lax.cond(i == 0, full, win, state)

    def plan(self, ctx, state: DecodeState):
        """The current block; the batch moves on once no running row has a masked slot left in it."""
        P, S = ctx.prefill_len, state.slots
        Bl, nb, _ = self.geometry(S - P)
        blk, i = state.extra["block"], state.extra["i"]
        filled = ~jnp.any(common.candidates(state, P + blk * Bl, Bl))
        blk = jnp.minimum(jnp.where(filled, blk + 1, blk), nb - 1)
        i = jnp.where(filled, 0, i)
        state = state.replace(extra={"block": blk, "i": i})
        return state, common.make_plan(state, P + blk * Bl, Bl)

    def forward(self, params, ctx, state: DecodeState, plan: common.Plan):
        P, S = ctx.prefill_len, state.slots
        Bl, nb, _ = self.geometry(S - P)
        state, logits = self._block_logits(params, ctx, state, state.extra["block"], state.extra["i"], Bl, nb)
        work = jnp.any(plan.valid, axis=-1)  # [B]
        state = common.count_forward(state, work)
        if self.cfg_scale > 0:
            state = common.count_forward(state, work)
        return state, logits

    def reveal(self, ctx, state: DecodeState, plan: common.Plan, logits, bitmask=None) -> DecodeState:
        P, S = ctx.prefill_len, state.slots
        Bl, nb, spb = self.geometry(S - P)
        i = state.extra["i"]
        b0, cand = plan.offset, plan.valid  # [B], [B, Bl]
        work = jnp.any(cand, axis=-1)  # [B]

        state, exp_noise, uniform = block_noise(state, work, Bl, logits.shape[-1])
        if bitmask is not None:  # [B, Bl, ceil(V/32)] over the block
            logits = apply_token_bitmask(logits, bitmask)
        state, logits = common.constrain_logits(state, logits, b0)

        s, conf1, zt = sample_block(state, ctx, logits, exp_noise)
        last = i >= spb - 1
        if self.alg is None:
            conf = uniform if self.remasking == "random" else conf1
            if self.confidence_threshold is not None:
                sel = common.select_threshold(cand, conf, self.confidence_threshold)
            else:
                k = jnp.asarray(transfer_schedule(Bl, spb))[jnp.minimum(i, spb - 1)]
                sel = common.select_top_k(cand, conf, jnp.where(i >= spb, Bl, k))
        else:
            ratio = jnp.where(last, 1.0, jnp.asarray(dream_ratios(spb, self.eps))[jnp.minimum(i, spb - 1)])
            if self.alg == "origin":
                sel = cand & (uniform < ratio)
            else:
                if self.alg == "maskgit_plus":
                    conf = s.prob
                elif self.alg == "topk_margin":
                    top2 = jnp.exp(jax.lax.top_k(jax.nn.log_softmax(zt, axis=-1), 2)[0])  # [B, Bl, 2]
                    conf = top2[..., 0] - top2[..., 1]
                else:
                    conf = -s.entropy
                if self.confidence_threshold is not None:
                    sel = common.select_threshold(cand, conf, self.confidence_threshold)
                else:
                    n = jnp.sum(cand, axis=-1).astype(jnp.float32)  # [B]
                    k = jnp.where(last, n, jnp.floor(n * ratio)).astype(jnp.int32)
                    sel = common.select_top_k(cand, conf, k)
        state = common.write_tokens(state, b0, sel, s)
        state = common.finish_rows(state)
        return state.replace(extra={**state.extra, "i": i + 1})


__all__ = ["MaskedDiffusion", "REMASKING", "CACHE_MODES", "ALGS", "transfer_schedule", "dream_ratios",
           "exponential_from_bits", "exponential_noise", "gumbel_argmax", "block_noise", "sample_block"]
