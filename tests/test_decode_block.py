"""`block_diffusion` paradigm against the plain-loop SDAR reference, fused vs unfused commit."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm.decode.block_diffusion import STRATEGIES
from tests.decode_fixtures import MASK, assert_matches_reference, block_model
from tests.quick import slow, slow_except
from tests.reference_decoders import block_diffusion_reference

pytestmark = pytest.mark.usefixtures("fast_compile")

B = 4
PROMPTS = [[5, 17, 3, 44, 9, 12], [70, 2, 31], [8, 21, 55, 90, 13, 4, 27, 66, 1],
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
MAX_NEW = 13
KW = dict(block_length=B, denoising_steps=2, confidence_threshold=0.7, eb_threshold=0.5)


def _bd(strategy, **kw):
    return jdllm.BlockDiffusion(strategy=strategy, **{**KW, **kw})


def _ref(m, prompt, strategy, **kw):
    return block_diffusion_reference(m.params, m.config, prompt, strategy=strategy, max_new_tokens=MAX_NEW,
                                     **{**KW, **kw})


def _check(out, ref, fused=True):
    assert_matches_reference(out, ref, nfe_key="nfe_fused" if fused else "nfe")


@pytest.mark.parametrize("strategy", slow_except(STRATEGIES, "low_confidence_dynamic"))
def test_strategy_matches_reference_batch1_and_batch(strategy):
    m = block_model()
    sampling = jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=())
    refs = [_ref(m, p, strategy) for p in PROMPTS]
    (solo,) = jdllm.generate(m, [PROMPTS[0]], _bd(strategy), sampling)
    _check(solo, refs[0])
    outs = jdllm.generate(m, PROMPTS, _bd(strategy), sampling)
    for out, ref in zip(outs, refs):
        _check(out, ref)
        assert MASK not in out.token_ids and len(out.token_ids) == MAX_NEW
    if strategy in ("low_confidence_static", "sequential"):  # k = block / steps per step
        assert all(max(np.bincount(o.step_map)) == B // KW["denoising_steps"] for o in outs)


@slow
def test_pallas_kernels_write_the_narrow_window_and_match_reference():
    """On the Pallas kernels (interpret mode here) the narrow window's K/V are written back too, so the
    step's window switch updates the cache in place; nobody reads them before they are recomputed,
    so a batch (rows at their own blocks, both window widths) still matches the reference."""
    m0 = block_model()
    m = jdllm.Model(m0.config, m0.params, attn_impl="pallas")
    sampling = jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=())
    for strategy in ("low_confidence_static", "low_confidence_dynamic"):
        outs = jdllm.generate(m, PROMPTS, _bd(strategy), sampling)
        for p, out in zip(PROMPTS, outs):
            _check(out, _ref(m, p, strategy))


@slow
def test_fused_commit_equals_unfused_with_one_forward_less_per_block():
    m = block_model()
    sampling = jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=())
    fused = jdllm.generate(m, PROMPTS, _bd("low_confidence_dynamic"), sampling)
    unfused = jdllm.generate(m, PROMPTS, _bd("low_confidence_dynamic", fuse_commit=False), sampling)
    for p, f, u in zip(PROMPTS, fused, unfused):
        assert f.token_ids == u.token_ids and f.step_map == u.step_map
        np.testing.assert_allclose(f.logprobs, u.logprobs, atol=1e-5)
        first = len(p) // B  # block index (positions) of the first decode block
        last = (len(p) + len(f.token_ids) - 1) // B
        commits = (last - first) + int(first > 0)  # filled blocks committed, prompt blocks included
        assert u.nfe - f.nfe == commits > 0
        _check(u, _ref(m, p, "low_confidence_dynamic"), fused=False)


def test_stop_token_ends_rows_early():
    m = block_model()
    free = _ref(m, PROMPTS[0], "low_confidence_dynamic")
    stop = free["tokens"][5]
    sampling = jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
    outs = jdllm.generate(m, PROMPTS, _bd("low_confidence_dynamic"), sampling)
    refs = [_ref(m, p, "low_confidence_dynamic", stop_ids=(stop,)) for p in PROMPTS]
    assert refs[0]["finish"] == "stop"
    for out, ref in zip(outs, refs):
        _check(out, ref)
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == stop and stop not in out.token_ids[:-1]


@slow
def test_shifted_logit_model_matches_reference():
    m = block_model(seed=2, logit_shift=True)
    sampling = jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=())
    outs = jdllm.generate(m, PROMPTS, _bd("low_confidence_dynamic"), sampling)
    for p, out in zip(PROMPTS, outs):
        _check(out, _ref(m, p, "low_confidence_dynamic"))


def test_mask_token_is_never_proposed():
    m = block_model()
    # make the mask token the model's favourite everywhere: it must still never be revealed
    head = m.params["lm_head"].at[:, MASK].set(50.0 * jnp.abs(m.params["lm_head"]).max())
    biased = dataclasses.replace(m, params={**m.params, "lm_head": head})
    (out,) = jdllm.generate(biased, [PROMPTS[0]], _bd("low_confidence_dynamic"),
                            jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=()))
    assert MASK not in out.token_ids and len(out.token_ids) == MAX_NEW
    ref = _ref(biased, PROMPTS[0], "low_confidence_dynamic")
    _check(out, ref)


def test_sampled_rows_follow_their_own_seed_stream():
    m = block_model()
    run = lambda prompts, seed: jdllm.generate(  # noqa: E731
        m, prompts, _bd("low_confidence_dynamic"),
        jdllm.Sampling(temperature=1.0, max_new_tokens=MAX_NEW, seed=seed, stop_token_ids=()))
    a, b, c = run(PROMPTS, 3), run(PROMPTS, 3), run(PROMPTS, 4)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    greedy = jdllm.generate(m, PROMPTS, _bd("low_confidence_dynamic"),
                            jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=()))
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]
    # a row's stream advances only when it samples, so row 0 does not depend on its batch mates
    (alone,) = run([PROMPTS[0]], 3)
    assert alone.token_ids == a[0].token_ids and alone.step_map == a[0].step_map


@slow
@pytest.mark.parametrize("threshold", [0.7, 0.3])
def test_sdar_dynamic_minimum_matches_reference(threshold):
    """SDAR's rule (all > threshold, at least k = block / steps per step) against its plain-loop
    reference, token for token, step for step and in NFE (fused and unfused); lmdeploy's differs."""
    m = block_model()
    sampling = jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=())
    kw = dict(dynamic_minimum="sdar", confidence_threshold=threshold)
    refs = [_ref(m, p, "low_confidence_dynamic", **kw) for p in PROMPTS]
    (solo,) = jdllm.generate(m, [PROMPTS[1]], _bd("low_confidence_dynamic", **kw), sampling)
    _check(solo, refs[1])
    outs = jdllm.generate(m, PROMPTS, _bd("low_confidence_dynamic", **kw), sampling)
    unfused = jdllm.generate(m, PROMPTS, _bd("low_confidence_dynamic", fuse_commit=False, **kw), sampling)
    lmdeploy = jdllm.generate(m, PROMPTS, _bd("low_confidence_dynamic", confidence_threshold=threshold), sampling)
    k = B // KW["denoising_steps"]
    sizes = set()
    for p, out, u, ref in zip(PROMPTS, outs, unfused, refs):
        _check(out, ref)
        _check(u, ref, fused=False)
        assert MASK not in out.token_ids and len(out.token_ids) == MAX_NEW
        # every step reveals k, or more when more than k are above the threshold, or the block's rest
        gen = len(p) % B  # the first block's prompt remainder sits pre-revealed
        for b0 in range(-gen, MAX_NEW, B):
            block = [s for s in out.step_map[max(b0, 0):b0 + B]]
            counts = np.bincount(block)[min(block):]
            assert len(counts) <= KW["denoising_steps"]
            sizes |= set(counts.tolist())
    assert min(sizes) >= 1 and k in sizes
    if threshold == 0.3:
        assert max(sizes) > k  # more than k above the threshold: all of them
    if threshold == 0.7:  # lmdeploy's top-1 minimum takes more steps here
        assert sum(o.nfe for o in lmdeploy) > sum(o.nfe for o in outs)
        assert [o.step_map for o in lmdeploy] != [o.step_map for o in outs]


def test_bad_dynamic_minimum_raises():
    from jdllm import errors  # noqa: PLC0415

    with pytest.raises(errors.DecodingConfigError, match="dynamic_minimum"):
        jdllm.BlockDiffusion(dynamic_minimum="fast")
