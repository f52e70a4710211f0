"""Sampling: statistics against numpy, top-k / top-p supports, seeds, token bitmasks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm import errors
from jdllm.decode import loop
from jdllm.sampling import (apply_token_bitmask, argmax, row_keys, sample, sample_rows, split_rows,
                            unpack_bitmask)
from tests.decode_fixtures import FAST_COMPILE
from tests.quick import slow

pytestmark = pytest.mark.usefixtures("fast_compile")


def _np_log_softmax(z):
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _logits(shape, seed=0, scale=2.0):
    return np.asarray(scale * jax.random.normal(jax.random.key(seed), shape), np.float32)


def test_greedy_token_and_statistics_match_numpy():
    z = _logits((3, 5, 40))
    s = sample(jnp.asarray(z), jax.random.key(0))
    logp = _np_log_softmax(z)
    tok = z.argmax(-1)
    np.testing.assert_array_equal(np.asarray(s.token), tok)
    lp = np.take_along_axis(logp, tok[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(s.logprob), lp, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s.prob), np.exp(lp), atol=1e-6)
    np.testing.assert_allclose(np.asarray(s.entropy), -(np.exp(logp) * logp).sum(-1), atol=1e-5)
    assert s.prob.dtype == s.entropy.dtype == s.logprob.dtype == jnp.float32


@slow
def test_argmax_is_numpy_argmax_with_ties_nan_and_masked_rows():
    """`sampling.argmax` (max + masked min, for XLA:CPU's speed) returns numpy's first index of the
    maximum: ties, a NaN (numpy: the first NaN), a row with every logit -inf (index 0)."""
    z = np.round(_logits((3, 5, 64), seed=3), 1)  # rounded: many ties at the maximum
    z[1, 2, 7] = np.nan
    z[1, 2, 40] = np.nan
    z[2, 4] = -np.inf
    z[0, 0, :] = z[0, 0, 9]  # the whole row tied
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(z))), np.argmax(z, axis=-1))


def test_temperature_frequencies_follow_softmax():
    z = _logits((6,), seed=1, scale=1.0)
    T, n = 0.7, 6000
    keys = jax.random.split(jax.random.key(3), n)
    toks = np.asarray(jax.vmap(lambda k: sample(jnp.asarray(z), k, temperature=T).token)(keys))
    freq = np.bincount(toks, minlength=6) / n
    np.testing.assert_allclose(freq, np.exp(_np_log_softmax(z / T)), atol=0.03)
    # the reported log-prob is that of the tempered distribution
    s = sample(jnp.asarray(z), keys[0], temperature=T)
    np.testing.assert_allclose(float(s.logprob), _np_log_softmax(z / T)[int(s.token)], atol=1e-5)


@slow
def test_top_k_and_top_p_restrict_the_support():
    z = _logits((50,), seed=2, scale=1.5)
    keys = jax.random.split(jax.random.key(4), 2000)
    toks_k = np.asarray(jax.vmap(lambda k: sample(jnp.asarray(z), k, temperature=1.0, top_k=5).token)(keys))
    top5 = set(np.argsort(-z)[:5].tolist())
    assert set(toks_k.tolist()) == top5
    s = sample(jnp.asarray(z), keys[0], temperature=1.0, top_k=5)  # renormalised over the top 5
    np.testing.assert_allclose(float(s.logprob), _np_log_softmax(z[sorted(top5)])[sorted(top5).index(int(s.token))],
                               atol=1e-5)
    p = np.exp(_np_log_softmax(z))
    order = np.argsort(-p)
    nucleus = set(order[:int(np.searchsorted(np.cumsum(p[order]), 0.6) + 1)].tolist())
    toks_p = np.asarray(jax.vmap(lambda k: sample(jnp.asarray(z), k, temperature=1.0, top_p=0.6).token)(keys))
    assert set(toks_p.tolist()) == nucleus and len(nucleus) < 50


@slow
def test_row_keys_seeds_and_splitting():
    z = jnp.asarray(_logits((4, 3, 30), seed=5, scale=0.5))
    a = sample_rows(z, row_keys(0, 4), temperature=1.0).token
    b = sample_rows(z, row_keys(0, 4), temperature=1.0).token
    c = sample_rows(z, row_keys(1, 4), temperature=1.0).token
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    nxt, step = split_rows(row_keys(0, 4))
    assert not np.array_equal(jax.random.key_data(nxt), jax.random.key_data(row_keys(0, 4)))


def test_apply_token_bitmask_matches_numpy_unpacking():
    V = 70  # not a multiple of 32: the last word is partly used
    W = -(-V // 32)
    rng = np.random.default_rng(0)
    mask = rng.integers(-2**31, 2**31, size=(2, 3, W), dtype=np.int64).astype(np.int32)
    allowed = np.unpackbits(mask.view(np.uint8).reshape(2, 3, W * 4), axis=-1, bitorder="little")[..., :V]
    np.testing.assert_array_equal(np.asarray(unpack_bitmask(jnp.asarray(mask), V)), allowed.astype(bool))
    z = _logits((2, 3, V), seed=6)
    out = np.asarray(apply_token_bitmask(jnp.asarray(z), jnp.asarray(mask)))
    np.testing.assert_array_equal(out, np.where(allowed.astype(bool), z, -np.inf))
    s = sample(jnp.asarray(out), jax.random.key(0))
    assert allowed[np.arange(2)[:, None], np.arange(3)[None], np.asarray(s.token)].all()


def _host_pieces(prep):
    """The jitted host-driven prefill / plan / step of a prepared decode (fast compile)."""
    par, ctx = prep.paradigm, prep.ctx
    opts = dict(FAST_COMPILE)
    prefill = jax.jit(lambda p, s: loop.prefill(p, s, paradigm=par, ctx=ctx), compiler_options=opts)
    plan = jax.jit(lambda s: loop.plan(s, paradigm=par, ctx=ctx), compiler_options=opts)
    step = jax.jit(lambda p, s, bm: loop.step(p, s, bm, paradigm=par, ctx=ctx), compiler_options=opts)
    return prefill, plan, step


@slow
def test_bitmask_drives_a_decode_step():
    """The paradigm step applies a bitmask over its planned slots before sampling."""
    from jdllm.api import prepare  # noqa: PLC0415
    from tests.decode_fixtures import causal_model  # noqa: PLC0415

    m = causal_model()
    prep = prepare(m, [[5, 17, 3], [9, 9]], jdllm.AR(), jdllm.Sampling(max_new_tokens=4))
    prefill, plan, step = _host_pieces(prep)
    st = prefill(m.params, prep.state)
    _, p = plan(st)
    slots = np.asarray(p.slots)[:2, 0]  # each row's next slot (rows at different positions)
    assert slots.tolist() == [4, 3]
    W = -(-m.config.vocab_size // 32)
    allow = [7, 40, 77]
    words = np.zeros((W,), np.uint32)
    for t in allow:
        words[t // 32] |= np.uint32(1 << (t % 32))
    bitmask = jnp.broadcast_to(jnp.asarray(words.view(np.int32)), (st.batch, 1, W))
    st2 = step(m.params, st, bitmask)
    new = np.asarray(st2.tokens)[[0, 1], slots]
    assert set(new.tolist()) <= set(allow)
    everything = jnp.full_like(bitmask, -1)  # all bits set: no constraint (same compile)
    free = np.asarray(step(m.params, st, everything).tokens)[[0, 1], slots]
    assert not set(free.tolist()) <= set(allow)  # without the mask the model picks other tokens


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                dict(max_new_tokens=0), dict(seed=-1)])
def test_bad_sampling_values_raise(kw):
    with pytest.raises(errors.DecodingConfigError, match=next(iter(kw))):
        jdllm.Sampling(**kw)


@slow
def test_bitmask_drives_a_block_diffusion_step():
    from jdllm.api import prepare  # noqa: PLC0415
    from tests.decode_fixtures import block_model  # noqa: PLC0415

    m = block_model()
    bd = jdllm.BlockDiffusion(block_length=4, denoising_steps=1, strategy="low_confidence_static")
    prep = prepare(m, [[5, 17, 3, 44, 9], [9, 9]], bd, jdllm.Sampling(max_new_tokens=8, stop_token_ids=()))
    prefill, _, step = _host_pieces(prep)
    st = prefill(m.params, prep.state)
    W = -(-m.config.vocab_size // 32)
    allow = [3, 33, 64]
    words = np.zeros((W,), np.uint32)
    for t in allow:
        words[t // 32] |= np.uint32(1 << (t % 32))
    bitmask = jnp.broadcast_to(jnp.asarray(words.view(np.int32)), (st.batch, 4, W))  # [B, block, words]
    before = np.asarray(st.revealed)
    after = step(m.params, st, bitmask)
    new = np.asarray(after.revealed) & ~before
    assert new[:2].sum(1).tolist() == [4, 4]  # one step per block: the whole block is revealed
    assert set(np.asarray(after.tokens)[new].tolist()) <= set(allow)
    free = step(m.params, st, jnp.full_like(bitmask, -1))
    assert not set(np.asarray(free.tokens)[np.asarray(free.revealed) & ~before].tolist()) <= set(allow)


def test_per_row_top_k_top_p_filter_matches_numpy_and_keeps_the_logits_out_of_the_branch():
    """filter_logits with per-row (traced) settings: each row's kept set is numpy's top-k then
    nucleus, rows without a filter untouched; and the runtime branch yields a [..., 1] floor, not the
    [..., V] logits (a branch passing them through made XLA copy them on every greedy step)."""
    from jdllm.sampling import NEG_INF, filter_logits

    z = np.stack([_logits((40,), seed=s, scale=1.5) for s in range(5)])
    top_k = np.array([0, 5, 0, 7, 40], np.int32)
    top_p = np.array([1.0, 1.0, 0.6, 0.5, 0.9], np.float32)
    got = np.asarray(jax.jit(lambda z, k, p: filter_logits(z, temperature=1.0, top_k=k, top_p=p))(
        jnp.asarray(z), jnp.asarray(top_k), jnp.asarray(top_p)))
    for row, k, p in zip(range(len(z)), top_k, top_p):
        x = z[row].astype(np.float32)
        keep = np.ones_like(x, bool)
        if 0 < k < x.size:
            keep &= x >= np.sort(x)[::-1][k - 1]
        if p < 1:
            xs = np.where(keep, x, -np.inf)
            order = np.argsort(-xs, kind="stable")
            probs = np.exp(xs[order] - xs[order][0])
            probs /= probs.sum()
            kept = order[(np.cumsum(probs) - probs) < p]
            keep &= x >= x[kept].min()
        np.testing.assert_array_equal(np.isfinite(got[row]) & (got[row] > NEG_INF), keep)
        np.testing.assert_array_equal(got[row][keep], x[keep])
    conds = [e for e in jax.make_jaxpr(lambda z, k, p: filter_logits(z, top_k=k, top_p=p))(
        jnp.asarray(z), jnp.asarray(top_k), jnp.asarray(top_p)).jaxpr.eqns if e.primitive.name == "cond"]
    assert conds and all(v.aval.shape[-1] == 1 for e in conds for v in e.outvars)
