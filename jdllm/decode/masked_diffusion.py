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
  the cached prompt and finished blocks (one compiled window width per block
  start of a batch sharing the prompt bucket).
- `dual`: later steps run only the block against the cached prefix *and*
  suffix (`model.forward(kv_len=S)` makes the cached suffix visible).
For shifted-logit models the window starts one slot earlier, so the block's
first position is predicted from fresh logits. A one-layer model's K/V depend
only on the token at their own slot, so there both caches are exact (a test
uses this); deeper models deviate, and `benchmarks/decode.py` measures it.

Batches: every row follows its own schedule. `state.extra` holds each row's
block index and step-in-block counter [B], and its geometry (block_length,
number of blocks, steps per block) comes from its own generation length
(limit - gen_start), so a row moves to its next block as soon as it has filled
the current one and never waits for, or depends on, its neighbours.
`generate` left-pads a batch (`start`) so every row's generation starts at
slot P; a serving pool (`jdllm.serve`) places each request on its own layout,
moved right so its canvas ends at the pool canvas's end as it ends alone
(`row_layout`), and rows join a running batch at any step. Each row draws its
noise relative to its own block, so sampled rows, too, decode exactly as
alone. The prefix and dual caches refresh per row (see `masked_diffusion_cache.refresh_or_window`):
a step where some row starts a block runs one whole-canvas forward for the
batch, in which the other rows keep their cached K/V outside their window.
Rows stop at the first stop token (tokens after it are not returned).
Supported models: bidirectional with a mask token (LLaDA, Dream);
block-causal models (SDAR, Fast-dLLM v2) use `BlockDiffusion` / `MultiBlock`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors, inputs, sampling
from jdllm.decode import common
from jdllm.decode import masked_diffusion_cache as cache_forwards
from jdllm.decode.protocol import Paradigm
from jdllm.sampling import apply_token_bitmask, distribution_stats, exclude_token, filter_logits, per_row, split_rows
from jdllm.state import DecodeState

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
    return sampling.argmax(logits - temperature * jnp.log(exp_noise))


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
def block_noise(state: DecodeState, work, Bl: int, V: int, align=None):
    """(state, Exp(1) noise [B, Bl, V] (ones when no row samples), uniforms [B, Bl]) for one step;
    a row's PRNG stream advances only where `work` [B]. align [B], optional: row b's draws move
    right by align[b] (position j takes draw j - align[b]): drawn relative to a block that starts
    align[b] slots into the window (a draw's value depends only on its index, not on Bl)."""
    nxt, sub = split_rows(state.key)
    keep = jax.random.key_data(state.key)
    key = jax.random.wrap_key_data(jnp.where(work[:, None], jax.random.key_data(nxt), keep),
                                   impl=jax.random.key_impl(state.key))
    state = state.replace(key=key)
    hot = state.sampling.temperature > 0  # [B]

    def aligned(x):  # x [B, Bl, ...] -> x[b, j - align[b]]
        if align is None:
            return x
        idx = jnp.clip(jnp.arange(Bl, dtype=jnp.int32)[None] - align[:, None], 0, Bl - 1)
        return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)

    exp_noise = jax.lax.cond(
        jnp.any(hot), lambda: aligned(jax.vmap(lambda k: exponential_noise(jax.random.fold_in(k, 0), (Bl, V)))(sub)),
        lambda: jnp.ones((state.batch, Bl, V), jnp.float32))
    uniform = aligned(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (Bl,)))(sub))  # [B, Bl]
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
    greedy = sampling.argmax(zt)
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
        inputs.normalize_fields(self, ints=("gen_length", "steps", "block_length"),
                                reals=("confidence_threshold", "cfg_scale", "eps"),
                                optional=("gen_length", "steps", "block_length", "confidence_threshold"))
        for f in ("gen_length", "steps", "block_length"):
            v = getattr(self, f)
            if v is not None and v < 1:
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
    def reads_kv_cache(self, cfg) -> bool:
        return self.cache_mode != "none"  # "none": every step a full forward of the canvas

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
            return (f"MaskedDiffusion(cfg_scale={self.cfg_scale}) samples from a classifier-free-guidance mix of "
                    "two forwards")
        if self.cache_mode in ("prefix", "dual"):
            return f"MaskedDiffusion(cache_mode={self.cache_mode!r}) is Fast-dLLM's approximate cache"
        return None

    def replay_refusal(self) -> str | None:
        if self.cfg_scale > 0:
            return "the replay does not run CFG: decode RL rollouts with cfg_scale=0"
        return None

    # ----------------------------------------------------------------- serving
    def row_layout(self, cfg, length: int, max_new: int, slots: int) -> common.Layout:
        """The prompt's own layout moved right on the pool canvas, so the row's canvas ends at the
        pool's last slot as it ends at its own alone: a bidirectional forward over the pool canvas
        then sees exactly the slots it sees alone (and `limit` stops at the canvas end, so a
        request asking for more than gen_length still gets gen_length)."""
        lay = super().row_layout(cfg, length, max_new, slots)
        alone = self.layout(np.asarray([length]), max_new, cfg)
        return common.right_aligned(lay, slots - alone.slots)

    # ----------------------------------------------------------------- per-row geometry
    def _width(self, ctx, S: int) -> int:
        """Static width of a step's window: block_length, or (one block) the generation region
        S - prefill_len, which holds every row's whole generation (`DecodeCtx.prefill_len`)."""
        return int(self.block_length) if self.block_length is not None else S - ctx.prefill_len

    def _static_steps_per_block(self) -> int | None:
        """steps_per_block when the config fixes it for every gen_length, else None."""
        if self.gen_length is not None:
            return self.geometry(self.gen_length)[2]
        if self.block_length is None and self.steps is not None:
            return int(self.steps)  # one block
        if self.block_length is not None and self.steps is None:
            return int(self.block_length)  # steps = gen_length: block_length steps per block
        return None

    def _rows(self, state: DecodeState):
        """Each row's (block_length, num_blocks, steps_per_block) [B] from its own generation length
        limit - gen_start (`geometry` per row; python ints when gen_length fixes them)."""
        if self.gen_length is not None:
            return self.geometry(self.gen_length)
        G = jnp.maximum(state.limit - state.gen_start, 1)  # idle pool rows: 1
        Bl = G if self.block_length is None else jnp.full_like(G, int(self.block_length))
        nb = jnp.maximum(G // Bl, 1)
        steps = G if self.steps is None else jnp.full_like(G, int(self.steps))
        return Bl, nb, jnp.maximum(steps // nb, 1)

    def _dream_ratio(self, spb, i, W: int):
        """Dream's reveal fraction at step i of a block of spb steps ([B]; `dream_ratios` exactly)."""
        static = self._static_steps_per_block()
        if static is not None:
            return jnp.asarray(dream_ratios(static, self.eps))[jnp.minimum(i, static - 1)]
        M = int(self.steps) if self.steps is not None else W  # bounds steps_per_block
        table = np.ones((M + 1, M), np.float32)
        for n in range(1, M + 1):
            table[n, :n] = dream_ratios(n, self.eps)
        return jnp.asarray(table)[jnp.clip(spb, 1, M), jnp.clip(i, 0, jnp.maximum(spb - 1, 0))]

    def _block_start(self, state: DecodeState):
        """[B] first slot of each row's current block."""
        Bl = self._rows(state)[0]
        return state.gen_start + state.extra["block"] * Bl

    # ----------------------------------------------------------------- device side
    def prefill(self, params, ctx, state: DecodeState, bitmask=None) -> DecodeState:
        """No forward here: the first step's forward is the first refresh. Each row keeps its own
        block index and step-in-block counter."""
        zero = jnp.zeros((state.batch,), jnp.int32)
        return state.replace(extra={"block": zero, "i": zero})

    def plan(self, ctx, state: DecodeState):
        """Each row's current block; a row moves to its next block once it has no masked slot left in
        this one (rows of a batch sit in different blocks and steps, none waits for another)."""
        Bl, nb, _ = self._rows(state)
        W = self._width(ctx, state.slots)
        blk, i = state.extra["block"], state.extra["i"]
        filled = ~jnp.any(common.candidates(state, state.gen_start + blk * Bl, W), axis=-1)
        blk = jnp.minimum(jnp.where(filled, blk + 1, blk), nb - 1)
        i = jnp.where(filled, 0, i)
        state = state.replace(extra={**state.extra, "block": blk, "i": i})
        return state, common.make_plan(state, state.gen_start + blk * Bl, W)

    def forward(self, params, ctx, state: DecodeState, plan: common.Plan):
        """The forward per cache mode (module docstring), one for the batch; a row whose block starts
        (its step 0) refreshes its cache while the others run their own window (see
        `masked_diffusion_cache.refresh_or_window`)."""
        shift = int(ctx.model.logit_shift)
        at = plan.slots - shift  # [B, W] the slots whose logits predict the window
        work = jnp.any(plan.valid, axis=-1)  # [B]
        if self.cache_mode == "none":  # each working row needs [its start, S); a serving pool narrows to them
            S = state.slots
            need = S - jnp.min(jnp.where(work, state.start, S))
            state, logits = common.switch_width(
                ctx, state, common.suffix_widths(ctx, S), need,
                lambda w: lambda st: cache_forwards.full_logits(self, params, ctx, st, at, S - w))
        else:
            state, logits = cache_forwards.refresh_or_window(self, params, ctx, state, plan, at, work)
        state = common.count_forward(state, work)
        if self.cfg_scale > 0:
            state = common.count_forward(state, work)
        return state, logits

    def reveal(self, ctx, state: DecodeState, plan: common.Plan, logits, bitmask=None) -> DecodeState:
        W = plan.width
        Bl, nb, spb = self._rows(state)
        i = state.extra["i"]
        c, cand = plan.offset, plan.valid  # [B], [B, W]
        work = jnp.any(cand, axis=-1)  # [B]
        # a window wider than the row's one block starts before it (clamped to the canvas): the
        # noise is drawn block-relative, as the row alone draws it
        align = None if self.block_length is not None else self._block_start(state) - c
        state, exp_noise, uniform = block_noise(state, work, W, logits.shape[-1], align)
        if bitmask is not None:  # [B, W, ceil(V/32)] over the window
            logits = apply_token_bitmask(logits, bitmask)
        state, logits = common.constrain_logits(state, logits, c)

        s, conf1, zt = sample_block(state, ctx, logits, exp_noise)
        last = i >= spb - 1
        if self.alg is None:
            conf = uniform if self.remasking == "random" else conf1
            if self.confidence_threshold is not None:
                sel = common.select_threshold(cand, conf, self.confidence_threshold)
            else:  # LLaDA's `transfer_schedule(Bl, spb)[i]`; past the schedule: everything left
                k = Bl // spb + (jnp.minimum(i, spb - 1) < Bl % spb)
                sel = common.select_top_k(cand, conf, jnp.where(i >= spb, W, k))
        else:
            ratio = jnp.where(last, 1.0, self._dream_ratio(spb, i, W))
            ratio = jnp.broadcast_to(ratio, (state.batch,))[:, None]
            if self.alg == "origin":
                sel = cand & (uniform < ratio)
            else:
                if self.alg == "maskgit_plus":
                    conf = s.prob
                elif self.alg == "topk_margin":
                    top2 = jnp.exp(jax.lax.top_k(jax.nn.log_softmax(zt, axis=-1), 2)[0])  # [B, W, 2]
                    conf = top2[..., 0] - top2[..., 1]
                else:
                    conf = -s.entropy
                if self.confidence_threshold is not None:
                    sel = common.select_threshold(cand, conf, self.confidence_threshold)
                else:
                    n = jnp.sum(cand, axis=-1).astype(jnp.float32)  # [B]
                    k = jnp.where(jnp.broadcast_to(last, n.shape), n, jnp.floor(n * ratio[:, 0])).astype(jnp.int32)
                    sel = common.select_top_k(cand, conf, k)
        state = common.write_tokens(state, c, sel, s)
        state = common.finish_rows(state)
        return state.replace(extra={**state.extra, "i": i + 1})


__all__ = ["MaskedDiffusion", "REMASKING", "CACHE_MODES", "ALGS", "transfer_schedule", "dream_ratios",
           "exponential_from_bits", "exponential_noise", "gumbel_argmax", "block_noise", "sample_block"]
