"""jdllm.rl: pure rollouts with group sampling (no recompile on new params / keys), trajectory
log-likelihood replay equal to the decode-time log-probs for every paradigm (greedy and temperature 1)
with gradients matching finite differences, GRPO / PG losses against a numpy reference, a few optax
steps that lower the loss on a fixed batch, and bad-input errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdllm
from jdllm import errors, rl
from tests.compiles import traces
from tests.decode_fixtures import FAST_COMPILE, block_model, causal_model
from tests.quick import slow, slow_except
from tests.test_decode_masked import bidir_model

PROMPTS = [[5, 17, 3, 44, 9], [70, 2, 8]]
GROUP = 2


@functools.lru_cache(maxsize=None)
def _jit_rollout():
    return jax.jit(rl.rollout, static_argnames=("spec",), compiler_options=dict(FAST_COMPILE))


@functools.lru_cache(maxsize=None)
def _jit_replay():
    return jax.jit(rl.trajectory_logprobs, static_argnames=("spec", "shrink", "method", "attn_impl", "cached_as_exact", "copies"),
                   compiler_options=dict(FAST_COMPILE))


def _cases():
    """(id, model, paradigm) covering every paradigm, attention kind and logit shift."""
    return [
        ("ar", causal_model(), jdllm.AR()),
        ("block", block_model(), jdllm.BlockDiffusion(block_length=4, denoising_steps=2, confidence_threshold=0.7)),
        ("block_shift", block_model(logit_shift=True),
         jdllm.BlockDiffusion(block_length=4, denoising_steps=4, strategy="low_confidence_static",
                              fuse_commit=False)),
        ("masked", bidir_model(), jdllm.MaskedDiffusion(block_length=4, steps=6)),
        ("masked_dream", bidir_model(shift=True), jdllm.MaskedDiffusion(block_length=4, steps=4, alg="entropy")),
        ("multi_block", block_model(), jdllm.MultiBlock(block_size=4, max_blocks=2)),
        ("multi_block_bidir", bidir_model(), jdllm.MultiBlock(block_size=4, early_stop=False)),
        ("ar_spec", causal_model(), jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=2, max_ngram=2)),
    ]


CASES = {c[0]: c[1:] for c in _cases()}


@functools.lru_cache(maxsize=None)
def _rollout(name, temperature, max_new=8, stop=()):
    model, paradigm = CASES[name]
    state, spec = rl.prepare_rollout(model, PROMPTS, paradigm,
                                     jdllm.Sampling(temperature=temperature, max_new_tokens=max_new,
                                                    stop_token_ids=stop), group=GROUP)
    ro = _jit_rollout()(model.params, state, jax.random.key(7), spec=spec)
    return model, spec, ro


@pytest.mark.parametrize("name", slow_except(list(CASES), "block"))
def test_replay_equals_decode_logprobs(name):
    """Under the rollout's own params the replay reproduces every recorded log-prob (greedy and T=1)."""
    for temperature in (0.0, 1.0):
        model, spec, ro = _rollout(name, temperature)
        lp = _jit_replay()(model.params, ro, spec=spec)
        smap = np.asarray(ro.step_map)
        assert (smap > 0).sum() >= spec.rows * 4  # something was generated
        gen = smap > 0
        np.testing.assert_allclose(np.asarray(lp)[gen], np.asarray(ro.logprobs)[gen], atol=3e-4, rtol=1e-4)
        assert np.all(np.asarray(lp)[~gen] == 0)
        if temperature > 0:
            toks = np.asarray(ro.tokens).reshape(len(PROMPTS), GROUP, -1)
            assert any(not np.array_equal(t[0], t[1]) for t in toks)  # the group's samples differ


def test_per_step_replay_of_block_diffusion_equals_packed():
    """The one-forward packed replay and the one-copy-per-step replay agree (and both equal decode)."""
    model, spec, ro = _rollout("block", 1.0)
    packed = _jit_replay()(model.params, ro, spec=spec, method="packed")
    per_step = _jit_replay()(model.params, ro, spec=spec, method="per_step")
    np.testing.assert_allclose(np.asarray(packed), np.asarray(per_step), atol=3e-4)
    assert rl.replay_cost(spec, ro.slots, "packed")["tokens"] < rl.replay_cost(spec, ro.slots, "per_step")["tokens"]


@slow
def test_shrink_merges_steps():
    """shrink=2 scores a step's tokens from the canvas two steps back: equal where a token's step is the
    first of its pair, different elsewhere (so the merge is real), and the packed and per-step forms agree."""
    model, spec, ro = _rollout("masked", 1.0)
    exact = np.asarray(_jit_replay()(model.params, ro, spec=spec))
    merged = np.asarray(_jit_replay()(model.params, ro, spec=spec, shrink=2))
    smap = np.asarray(ro.step_map)
    first = (smap > 0) & (smap % 2 == 1)
    np.testing.assert_allclose(merged[first], exact[first], atol=3e-4)
    second = (smap > 0) & (smap % 2 == 0)
    assert np.abs(merged[second] - exact[second]).max() > 1e-3


@slow
def test_bounded_per_step_replay_runs_only_the_rows_steps():
    """copies=replay_copies(ro): the per_step replay over only the copies the rows use equals the full
    [K, B] grid (shrink 1 and 2), needs fewer copies when rows stop early, and
    too few copies raise (concrete) or give NaN (traced), never a silently wrong log-prob."""
    model, spec, ro = _rollout("multi_block_bidir", 1.0)
    for shrink in (1, 2):
        full = _jit_replay()(model.params, ro, spec=spec, shrink=shrink)
        c = rl.replay_copies(ro, shrink, multiple=1)
        assert c < ro.batch * -(-spec.max_steps // shrink)  # rows of 2 and 5 steps, K = 8
        bounded = _jit_replay()(model.params, ro, spec=spec, shrink=shrink, copies=c)
        np.testing.assert_allclose(np.asarray(bounded), np.asarray(full), atol=3e-5)
    with pytest.raises(errors.InputError, match="copies"):
        rl.trajectory_logprobs(model.params, ro, spec=spec, copies=c - 1)
    short = _jit_replay()(model.params, ro, spec=spec, copies=2)  # traced: no host check
    assert np.isnan(np.asarray(short)).any()


@slow
@pytest.mark.parametrize("name", ["ar", "block_shift", "masked"])
def test_replay_gradient_matches_finite_differences(name):
    """d/de sum(log p(trajectory; params + e v)) at e = 0 along the unit gradient direction v (= |grad|)
    against central differences."""
    model, spec, ro = _rollout(name, 1.0)
    mask = ro.answer_mask

    def f(params):
        return jnp.sum(jnp.where(mask, rl.trajectory_logprobs(params, ro, spec=spec), 0.0))

    g = jax.jit(jax.grad(f), compiler_options=dict(FAST_COMPILE))(model.params)
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
    v = jax.tree.map(lambda x: x / norm, g)  # unit direction along the gradient: d f / d e = |g|
    directional = float(norm)
    fj = jax.jit(f, compiler_options=dict(FAST_COMPILE))
    eps = 1e-3  # the peaked test models curve fast: keep the third-order term small
    fd = float(fj(jax.tree.map(lambda p, d: p + eps * d, model.params, v))
               - fj(jax.tree.map(lambda p, d: p - eps * d, model.params, v))) / (2 * eps)
    assert directional > 0.1
    np.testing.assert_allclose(directional, fd, rtol=2e-2)


@slow
def test_approximate_caches_raise_unless_replayed_as_exact():
    """A dual-cache (Fast-dLLM) rollout raises InputError; cached_as_exact=True replays the no-cache
    forward, which on a one-layer model (K/V depend only on their own slot's token, so the dual cache is
    exact there) equals the recorded log-probs. CFG always raises (the replay runs no guidance)."""
    sampling = jdllm.Sampling(temperature=1.0, max_new_tokens=8, stop_token_ids=())
    model = bidir_model(layers=1)
    state, spec = rl.prepare_rollout(model, PROMPTS, jdllm.MaskedDiffusion(block_length=4, steps=4, cache_mode="dual"),
                                     sampling, group=GROUP)
    assert "approximate cache" in rl.approximate_decode(spec)
    ro = _jit_rollout()(model.params, state, jax.random.key(3), spec=spec)
    with pytest.raises(errors.InputError, match="approximate cache.*cached_as_exact=True"):
        rl.trajectory_logprobs(model.params, ro, spec=spec)
    lp = _jit_replay()(model.params, ro, spec=spec, cached_as_exact=True)
    gen = np.asarray(ro.step_map) > 0
    assert gen.sum() >= spec.rows * 4
    np.testing.assert_allclose(np.asarray(lp)[gen], np.asarray(ro.logprobs)[gen], atol=3e-4, rtol=1e-4)
    _, spec_cfg = rl.prepare_rollout(model, PROMPTS, jdllm.MaskedDiffusion(block_length=4, steps=4, cfg_scale=1.0),
                                     sampling, group=GROUP)
    assert "guidance" in rl.approximate_decode(spec_cfg)
    with pytest.raises(errors.InputError, match="CFG"):
        rl.trajectory_logprobs(model.params, ro, spec=spec_cfg, cached_as_exact=True)
    _, spec_none = rl.prepare_rollout(model, PROMPTS, jdllm.MaskedDiffusion(block_length=4, steps=4), sampling,
                                      group=GROUP)
    assert rl.approximate_decode(spec_none) is None


def test_int8_kv_cache_rollouts_are_replayed_only_as_approximate():
    """A rollout decoded over an int8 KV cache attended to quantized keys and values: replaying it as exact
    is refused like an approximate cache's (it was silent, log-probs off by up to 0.02 on tiny-sdar).
    A paradigm that reads no cache (masked diffusion, cache_mode='none') decodes the same logits with it,
    and replays as exact."""
    import os  # noqa: PLC0415

    from tests.scripts import ROOT  # noqa: PLC0415

    sampling = jdllm.Sampling(temperature=1.0, max_new_tokens=8, stop_token_ids=())
    sdar = jdllm.load(os.path.join(ROOT, "models", "tiny-sdar"), dtype="float32", kv_cache="int8")
    state, spec = rl.prepare_rollout(sdar, ["sort:3 1 2="], jdllm.BlockDiffusion(), sampling, group=2)
    assert "kv_cache='int8'" in rl.approximate_decode(spec)
    ro = rl.compiled_rollout(sdar.params, state, jax.random.key(0), spec=spec)
    with pytest.raises(errors.InputError, match="kv_cache='int8'.*cached_as_exact=True"):
        rl.trajectory_logprobs(sdar.params, ro, spec=spec)
    assert np.all(np.isfinite(np.asarray(rl.trajectory_logprobs(sdar.params, ro, spec=spec, cached_as_exact=True))))
    llada = jdllm.load(os.path.join(ROOT, "models", "tiny-llada"), dtype="float32", kv_cache="int8")
    state, spec = rl.prepare_rollout(llada, ["sort:3 1 2="], jdllm.MaskedDiffusion(gen_length=8, steps=8), sampling,
                                     group=2)
    assert rl.approximate_decode(spec) is None
    ro = rl.compiled_rollout(llada.params, state, jax.random.key(0), spec=spec)
    gen = np.asarray(ro.step_map) > 0
    np.testing.assert_allclose(np.asarray(rl.trajectory_logprobs(llada.params, ro, spec=spec))[gen],
                               np.asarray(ro.logprobs)[gen], atol=1e-5)


@slow
def test_rollout_is_pure_and_does_not_recompile():
    """A second rollout with new params and a new key reuses the compile; the same key gives the same
    trajectory, another key another one; batch-padding rows are inactive and return nothing."""
    model, paradigm = CASES["ar"]
    state, spec = rl.prepare_rollout(model, PROMPTS, paradigm, jdllm.Sampling(temperature=1.0, max_new_tokens=6),
                                     group=3)
    f = _jit_rollout()
    a = f(model.params, state, jax.random.key(1), spec=spec)
    params2 = jax.tree.map(lambda x: x * 1.01, model.params)
    with traces() as seen:
        b = f(params2, state, jax.random.key(2), spec=spec)
        c = f(model.params, state, jax.random.key(1), spec=spec)
    assert seen["rollout"] == 0 and seen["run"] == 0
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert state.batch == 8 and spec.rows == 6
    np.testing.assert_array_equal(np.asarray(a.active), [True] * 6 + [False] * 2)
    assert not np.asarray(a.answer_mask)[6:].any()
    # the prompt mask holds each row's own prompt
    toks, pm = np.asarray(a.tokens), np.asarray(a.prompt_mask)
    for r in range(6):
        assert toks[r][pm[r]].tolist() == PROMPTS[r // 3]
    # log-probs are those of the tokens under the sampling distribution (finite, <= 0)
    lp = np.asarray(a.logprobs)[np.asarray(a.answer_mask)]
    assert np.all(np.isfinite(lp)) and np.all(lp <= 0)


def _np_grpo(lp, old, adv, mask, eps, kl_coef, ref):
    out = []
    for b in range(lp.shape[0]):
        terms = []
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            r = np.exp(lp[b, t] - old[b, t])
            term = -min(r * adv[b], np.clip(r, 1 - eps, 1 + eps) * adv[b])
            d = ref[b, t] - lp[b, t]
            terms.append(term + kl_coef * (np.exp(d) - d - 1))
        if terms:
            out.append(np.mean(terms))
    return np.mean(out)


def test_losses_match_numpy_reference():
    rng = np.random.default_rng(0)
    lp, old, ref = (rng.normal(-1.0, 0.3, (4, 6)).astype(np.float32) for _ in range(3))
    mask = rng.random((4, 6)) < 0.7
    rewards = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
    adv = np.asarray(rl.group_advantages(rewards, 2))
    g = rewards.reshape(2, 2)
    np.testing.assert_allclose(adv, ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)).ravel(),
                               rtol=1e-5)
    # one reward per real row (what rl.texts gives) with the batch's `active`: the padding rows' are 0,
    # the same advantages as rewards padded by hand; a numpy int group is an int
    active = np.array([True] * 4 + [False] * 4)
    padded = rl.group_advantages(np.concatenate([rewards, np.full(4, 9.0, np.float32)]), 2, active=active)
    short = rl.group_advantages(rewards, np.int64(2), active=active)
    np.testing.assert_array_equal(np.asarray(short), np.asarray(padded))
    np.testing.assert_allclose(np.asarray(short)[:4], adv, rtol=1e-6)
    got = rl.grpo_loss(lp, old, adv, mask, clip_eps=0.2, ref_logprobs=ref, kl_coef=0.1)
    np.testing.assert_allclose(float(got), _np_grpo(lp, old, adv, mask, 0.2, 0.1, ref), rtol=1e-4, atol=1e-7)
    pg = rl.pg_loss(lp, adv, mask, aggregate="token")
    np.testing.assert_allclose(float(pg), -np.sum(adv[:, None] * lp * mask) / mask.sum(), rtol=1e-5)


@slow
def test_grpo_steps_lower_the_loss_on_a_fixed_batch():
    """Three Adam steps of GRPO (+ KL to the initial params) through the replay lower the loss."""
    model, spec, ro = _rollout("masked", 1.0)
    rewards = jnp.sum(jnp.where(ro.answer_mask, ro.tokens % 2, 0), axis=1).astype(jnp.float32)
    adv = rl.group_advantages(rewards, spec.group, active=ro.active)
    ref = rl.trajectory_logprobs(model.params, ro, spec=spec)

    def loss_fn(params):
        lp = rl.trajectory_logprobs(params, ro, spec=spec)
        return rl.grpo_loss(lp, ro.logprobs, adv, ro.answer_mask, ref_logprobs=ref, kl_coef=0.01)

    opt = optax.adam(1e-4)

    @functools.partial(jax.jit, compiler_options=dict(FAST_COMPILE))
    def update(params, opt_state):
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    params, st = model.params, opt.init(model.params)
    losses = []
    for _ in range(4):
        params, st, loss = update(params, st)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1e-2 and all(b < a for a, b in zip(losses, losses[1:])), losses
    # the sign: trajectories with a positive advantage became more likely, those with a negative one less
    m = np.asarray(ro.answer_mask)
    gain = ((np.asarray(_jit_replay()(params, ro, spec=spec)) - np.asarray(ref)) * m).sum(1)
    a = np.asarray(adv)
    assert gain[a > 0].mean() > 0 > gain[a < 0].mean(), (gain, a)


def test_rewards_loss_settings_and_group_indices_are_checked():
    """What a training loop gets wrong is named, not folded into the update: a NaN reward (it spread to its
    group's advantages and made the loss NaN), fewer rewards than real rows (the missing ones were taken
    as 0), loss settings that are no numbers or negative, a reference of another shape (broadcast into a
    wrong KL), group indices that are no ints (0.7 selected group 0, "01" groups 0 and 1)."""
    import types  # noqa: PLC0415

    active = np.array([True] * 4 + [False] * 4)
    for bad, match in (([1.0, float("nan"), 0.0, 1.0], r"rewards\[1\] is nan"), ([1.0, np.inf], r"rewards\[1\] is inf"),
                       (["a", "b"], "hold <U1 values"), ([[1.0], [1.0, 2.0]], "not an array of numbers")):
        with pytest.raises(errors.InputError, match=match):
            rl.group_advantages(bad, 2)
    with pytest.raises(errors.InputError, match="3 rewards for 4 real rows"):
        rl.group_advantages([1.0, 0.0, 1.0], 2, active=active)
    with pytest.raises(errors.InputError, match="normalize_std='no'"):
        rl.group_advantages([1.0, 0.0], 2, normalize_std="no")
    with pytest.raises(errors.InputError, match="eps='x'"):
        rl.group_advantages([1.0, 0.0], 2, eps="x")
    lp = np.zeros((2, 3), np.float32)
    mask = np.array([[True, False, False], [False, False, False]])
    for kw, match in ((dict(clip_eps_high=float("nan")), "clip_eps_high=nan"), (dict(clip_eps_high=-1.0), "clip_eps_high"),
                      (dict(kl_coef=-1.0, ref_logprobs=lp), "kl_coef=-1.0"), (dict(clip_eps="0.2"), "clip_eps='0.2'"),
                      (dict(kl_coef=0.1, ref_logprobs=lp[0]), r"ref_logprobs \(3,\)"),
                      (dict(kl_coef=0.1, ref_logprobs=lp[:, :1]), r"ref_logprobs \(2, 1\)")):
        with pytest.raises(errors.InputError, match=match):
            rl.grpo_loss(lp, lp, np.ones(2), mask, **kw)
    # pg_loss reads the mask as grpo_loss does (a slot counts or not), and NaN outside it stays out
    weights = np.array([[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    nan_outside = np.where(mask, 0.0, np.nan).astype(np.float32) + np.float32(-1.0)
    assert float(rl.pg_loss(nan_outside, np.array([2.0, 0.0]), weights)) == 2.0  # -A * log p at the one slot
    assert float(rl.grpo_loss(nan_outside, nan_outside, np.array([2.0, 0.0]), weights)) == -2.0  # -ratio * A
    spec = types.SimpleNamespace(prompts=3, group=2)
    for groups in ([0.7], "01", [True], 1, None):
        with pytest.raises(errors.InputError, match="list of prompt indices"):
            rl.select_groups(None, spec, groups)


@slow
def test_bad_input_errors():
    model, spec, ro = _rollout("masked", 1.0)
    with pytest.raises(errors.InputError, match="group >= 2"):
        rl.group_advantages(jnp.zeros(4), 1)
    with pytest.raises(errors.InputError, match=r"rewards has shape \(4, 2\)"):
        rl.group_advantages(jnp.zeros((4, 2)), 2)
    with pytest.raises(errors.InputError, match=r"active has shape \(2,\) for 4 rewards"):
        rl.group_advantages(jnp.zeros(4), 2, active=jnp.ones(2, bool))
    with pytest.raises(errors.InputError, match="shrink=0"):
        rl.trajectory_logprobs(model.params, ro, spec=spec, shrink=0)
    gap = ro.step_map.at[0].set(jnp.where(ro.step_map[0] > 0, ro.step_map[0] * 2, 0))
    with pytest.raises(errors.InputError, match="gaps"):
        rl.trajectory_logprobs(model.params, rl.Rollout(**{**ro.__dict__, "step_map": gap}), spec=spec)
    with pytest.raises(errors.InputError, match="another paradigm|from paradigm"):
        _, spec_ar, _ = _rollout("ar", 1.0)
        rl.trajectory_logprobs(model.params, ro, spec=spec_ar)
    with pytest.raises(errors.InputError, match="shape"):
        rl.trajectory_logprobs(model.params, rl.Rollout(**{**ro.__dict__, "logprobs": ro.logprobs[:, :3]}),
                               spec=spec)
    other = causal_model().params
    with pytest.raises(errors.ConfigError, match="another model config"):
        rl.trajectory_logprobs(other, ro, spec=spec)
    # a rollout with weights of other shapes is refused naming the weight (it used to decode garbage)
    state, spec_m = rl.prepare_rollout(CASES["masked"][0], PROMPTS, CASES["masked"][1],
                                       jdllm.Sampling(max_new_tokens=4), group=GROUP)
    for key in (0, jnp.zeros(3, jnp.uint32), jax.random.split(jax.random.key(0))):
        with pytest.raises(errors.ArgumentTypeError, match="pass one PRNG key"):
            rl.rollout(model.params, state, key, spec=spec_m)
    lm_head = model.params["lm_head"]
    with pytest.raises(errors.ConfigError, match=r"\['lm_head'\] has shape"):
        rl.rollout(dict(model.params, lm_head=lm_head[:, :7]), state, jax.random.key(0), spec=spec_m)
    with pytest.raises(errors.InputError, match="group="):
        rl.prepare_rollout(CASES["masked"][0], PROMPTS, CASES["masked"][1], jdllm.Sampling(max_new_tokens=4),
                           group=0)
    # an AR step_map must be 1, 2, 3, ... left to right
    m_ar, spec_ar, ro_ar = _rollout("ar", 1.0)
    swapped = jnp.where(ro_ar.step_map == 1, 2, jnp.where(ro_ar.step_map == 2, 1, ro_ar.step_map))
    with pytest.raises(errors.InputError, match="left to right"):
        rl.trajectory_logprobs(m_ar.params, rl.Rollout(**{**ro_ar.__dict__, "step_map": swapped}), spec=spec_ar)
    with pytest.raises(errors.InputError, match="advantages"):
        rl.grpo_loss(ro.logprobs, ro.logprobs, jnp.zeros(3), ro.answer_mask)
    # select_groups keeps whole groups (rows g * G .. g * G + G - 1) in the given order, with a matching spec
    sub, sub_spec = rl.select_groups(ro, spec, [1, 0])
    assert sub_spec.prompts == 2 and sub_spec.group == spec.group and sub.batch == 2 * GROUP
    order = [GROUP + j for j in range(GROUP)] + list(range(GROUP))
    np.testing.assert_array_equal(np.asarray(sub.tokens), np.asarray(ro.tokens)[order])
    np.testing.assert_array_equal(np.asarray(sub.sampling.temperature), np.asarray(ro.sampling.temperature)[order])
    with pytest.raises(errors.InputError, match="groups="):
        rl.select_groups(ro, spec, [len(PROMPTS)])


def test_rollout_notes_a_clipped_default_once_per_call():
    """prepare_rollout returns no Outputs to judge which rows the context cut short: a default
    max_new_tokens the context clips gets one note for the call (the same text every call, so Python's
    warning filter shows it once per call site); an explicit value gets none."""
    import warnings  # noqa: PLC0415

    model = jdllm.load("models/tiny-ar", dtype="float32")  # 64-token context: 256 does not fit
    with pytest.warns(UserWarning, match="rollouts generate at most what each prompt's context leaves") as rec:
        rl.prepare_rollout(model, ["sort:3 1 2=", "rev:abc="], jdllm.AR(), jdllm.Sampling(temperature=1.0), group=2)
    assert len([w for w in rec if "max_new_tokens" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rl.prepare_rollout(model, ["sort:3 1 2="], jdllm.AR(), jdllm.Sampling(temperature=1.0, max_new_tokens=8),
                           group=2)
