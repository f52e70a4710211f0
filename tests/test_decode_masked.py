"""`masked_diffusion` (LLaDA / Dream / Fast-dLLM) against the plain-loop reference, caches, errors."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jdllm
from jdllm import errors
from jdllm.config import ModelConfig
from jdllm.decode.masked_diffusion import (dream_ratios, exponential_from_bits, exponential_noise, gumbel_argmax,
                                           transfer_schedule)
from jdllm.loading import Model
from jdllm.model import init_params
from jdllm.sampling import row_keys
from tests.compiles import traces
from tests.decode_fixtures import assert_matches_reference
from tests.quick import slow
from tests.reference_masked_diffusion import llada_gumbel_argmax, masked_diffusion_reference, num_transfer_tokens

pytestmark = pytest.mark.usefixtures("fast_compile")

VOCAB, MASK = 96, 95
PROMPTS = [[5, 17, 3, 44, 9, 12], [70, 2, 31], [8, 21, 55, 90, 13, 4, 27, 66, 1]]
G = 16
SEED = 7


@functools.lru_cache(maxsize=None)
def bidir_model(shift: bool = False, layers: int = 2, seed: int = 3) -> Model:
    """LLaDA-like (same-position logits) or Dream-like (shifted, qkv bias) tiny bidirectional model.

    Init std 0.7 so the distributions are peaked and greedy confidences rarely tie."""
    cfg = ModelConfig(model_type="dream" if shift else "llada", vocab_size=VOCAB, hidden_size=48,
                      intermediate_size=96, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                      attention="bidirectional", logit_shift=shift, qkv_bias=shift, mask_token_id=MASK,
                      max_position_embeddings=256, eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(seed), std=0.7), attn_impl="xla")


def _sampling(temperature=0.0, stop=(), max_new=G):
    return jdllm.Sampling(max_new_tokens=max_new, temperature=temperature, seed=SEED, stop_token_ids=stop)




def _run_and_compare(m, kw, *, temperature=0.0, prompts=PROMPTS, stop=(), solo=False):
    """jdllm on the mixed-length batch (and prompt 0 alone) vs the reference per prompt.

    Row b of a call draws from the stream row_keys(seed, B)[b]; the reference gets that key."""
    outs = jdllm.generate(m, prompts, jdllm.MaskedDiffusion(**kw), _sampling(temperature, stop))
    keys = row_keys(SEED, len(prompts))
    refs = [masked_diffusion_reference(m.params, m.config, p, gen_length=G, temperature=temperature, key=keys[b],
                                       stop_ids=stop, **kw) for b, p in enumerate(prompts)]
    for out, ref in zip(outs, refs):
        assert_matches_reference(out, ref)
        assert MASK not in out.token_ids
    if solo:
        (one,) = jdllm.generate(m, [prompts[0]], jdllm.MaskedDiffusion(**kw), _sampling(temperature, stop))
        assert_matches_reference(one, refs[0])
    return outs, refs


# --------------------------------------------------------------------------- sampling pieces
def test_gumbel_log_space_argmax_equals_llada_float64():
    """argmax(l + T * -log E) in float32 == LLaDA's argmax(exp(l) / E^T) in float64 (same noise)."""
    rng = np.random.default_rng(0)
    N, V = 2000, 64
    logits = rng.normal(0, 4, (N, V)).astype(np.float32)
    logits[: N // 2] += 95.0  # exp() of these overflows float32; float64 and the log form do not
    E = np.asarray(exponential_noise(jax.random.key(1), (N, V)))
    for T in (0.3, 1.0, 2.5):
        ours = np.asarray(gumbel_argmax(jax.numpy.asarray(logits), jax.numpy.asarray(E), T))
        ref = llada_gumbel_argmax(logits, E, T)
        # the two may only disagree where float64's top two scores tie to float32 resolution
        score = logits.astype(np.float64) - T * np.log(E.astype(np.float64))
        top2 = np.sort(score, axis=-1)[:, -2:]
        tie = (top2[:, 1] - top2[:, 0]) < 1e-4 * np.maximum(1.0, np.abs(top2[:, 1]))
        assert np.all((ours == ref) | tie) and np.mean(tie) < 0.01
    # LLaDA's formula evaluated in float32 breaks on those rows (inf / inf ties): why the log form
    with np.errstate(over="ignore", invalid="ignore"):
        naive = np.argmax(np.exp(logits) / E.astype(np.float32) ** np.float32(1.0), axis=-1)
    assert np.mean(naive[: N // 2] != llada_gumbel_argmax(logits, E, 1.0)[: N // 2]) > 0.5


def test_exponential_noise_distribution_and_tails():
    E = np.asarray(exponential_noise(jax.random.key(3), (400_000,)), np.float64)
    g = -np.log(E)
    assert E.min() > 0 and np.isfinite(g).all()
    assert abs(E.mean() - 1.0) < 0.01 and abs(g.mean() - np.euler_gamma) < 0.01
    assert abs(g.var() - np.pi ** 2 / 6) < 0.03
    assert abs(np.mean(E < 0.01) - (1 - np.exp(-0.01))) < 1e-3
    # extreme bits reach far past float32-uniform's cap (-log(-log(1 - 2^-24)) ~ 16.6) on both sides
    extreme = np.array([[0x00000000, 0], [0x80000000, 0], [0xFFFFFFFF, 0xFFFFFFFF], [0x7FFFFFFF, 0xFFFFFFFF]],
                       np.uint32)
    e = np.asarray(exponential_from_bits(jax.numpy.asarray(extreme)), np.float64)
    assert -np.log(e[0]) > 40  # smallest E: largest Gumbel
    assert e[1] > 40  # largest E (u ~ 2^-64)
    assert abs(e[2] - np.log(2)) < 1e-6 and abs(e[3] - np.log(2)) < 1e-6  # both halves meet at the median


def test_schedules_match_published_definitions():
    for n, steps in [(4, 2), (8, 3), (32, 32), (3, 8)]:
        assert transfer_schedule(n, steps).tolist() == num_transfer_tokens(n, steps)
    r = dream_ratios(4, 1e-3)
    t = np.linspace(1, 1e-3, 5)
    np.testing.assert_allclose(r[:-1], 1 - t[1:-1] / t[:-2], rtol=1e-6)
    assert r[-1] == 1.0
    assert abs(dream_ratios(1000, 1e-9)[10] - 1 / 990) < 1e-6  # ~ 1 / remaining steps


# --------------------------------------------------------------------------- LLaDA / Fast-dLLM
@pytest.mark.parametrize("kw,temperature,solo", [
    (dict(steps=8, block_length=8), 0.0, True),  # low_confidence, 2 tokens per step
    pytest.param(dict(steps=16, block_length=8, remasking="random"), 0.0, False, marks=slow),
    pytest.param(dict(block_length=4, confidence_threshold=0.6), 0.0, False, marks=slow),  # Fast-dLLM parallel
    pytest.param(dict(steps=8, block_length=8, cfg_scale=1.5), 0.0, False, marks=slow),
    pytest.param(dict(steps=8, block_length=4), 0.8, False, marks=slow),  # Gumbel sampling
    pytest.param(dict(steps=32, block_length=8), 0.0, False, marks=slow),  # more steps than tokens per block
], ids=["low_confidence", "random", "threshold", "cfg", "temperature", "more_steps_than_tokens"])
def test_llada_matches_reference(kw, temperature, solo):
    m = bidir_model()
    outs, refs = _run_and_compare(m, kw, temperature=temperature, solo=solo)
    if "confidence_threshold" not in kw:  # the schedule fixes the number of forwards
        nb = G // kw["block_length"]
        # the schedule's zero-transfer tail (steps > tokens per block) comes after the block is full: skipped
        per_block = min(kw.get("steps", G) // nb, kw["block_length"])
        assert all(o.nfe == nb * per_block * (2 if kw.get("cfg_scale") else 1) for o in outs)
        assert all(len(o.token_ids) == G and o.finish_reason == "length" for o in outs)
    if kw.get("steps") == 32:  # one token per step, step_map dense
        assert all(sorted(o.step_map) == list(range(1, G + 1)) for o in outs)


# --------------------------------------------------------------------------- Dream
@slow
@pytest.mark.parametrize("kw,temperature", [
    (dict(steps=8, alg="origin"), 0.0),
    (dict(steps=8, block_length=8, alg="maskgit_plus"), 0.0),
    (dict(steps=8, alg="topk_margin"), 0.0),
    (dict(steps=8, alg="entropy"), 0.0),
    (dict(block_length=8, alg="maskgit_plus", confidence_threshold=0.5), 0.0),
    (dict(steps=8, alg="maskgit_plus"), 0.7),
], ids=["origin", "maskgit_plus", "topk_margin", "entropy", "threshold", "temperature"])
def test_dream_matches_reference(kw, temperature):
    m = bidir_model(shift=True)
    _run_and_compare(m, kw, temperature=temperature, solo=kw["alg"] == "maskgit_plus" and temperature == 0)


@slow
def test_stop_token_ends_rows():
    m = bidir_model()
    kw = dict(steps=16, block_length=4)
    free = masked_diffusion_reference(m.params, m.config, PROMPTS[0], gen_length=G, **kw)
    stop = free["tokens"][5]
    outs, refs = _run_and_compare(m, kw, stop=(stop,))
    assert refs[0]["finish"] == "stop"
    for out in outs:
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
    assert outs[0].nfe < 16  # it stopped before the last block


# --------------------------------------------------------------------------- caches
@slow
@pytest.mark.parametrize("shift", [False, True], ids=["llada", "dream"])
def test_caches_exact_on_one_layer_model(shift):
    """With one layer every K/V depends only on its own slot's token, so the prefix and dual
    caches (stale only through context) must reproduce the no-cache run exactly."""
    m = bidir_model(shift=shift, layers=1)
    kw = dict(block_length=8, confidence_threshold=0.7, alg="maskgit_plus" if shift else None)
    base = jdllm.generate(m, PROMPTS, jdllm.MaskedDiffusion(**kw), _sampling())
    for cache in ("prefix", "dual"):
        got = jdllm.generate(m, PROMPTS, jdllm.MaskedDiffusion(cache_mode=cache, **kw), _sampling())
        for b, c in zip(base, got):
            assert c.token_ids == b.token_ids and c.step_map == b.step_map and c.nfe == b.nfe
            np.testing.assert_allclose(c.logprobs, b.logprobs, atol=1e-4)


@slow
@pytest.mark.parametrize("shift,kw", [
    (False, dict(steps=8, block_length=8)),
    (True, dict(block_length=8, alg="maskgit_plus", confidence_threshold=0.5)),
], ids=["llada_schedule", "dream_threshold"])
def test_caches_on_deeper_model_match_cache_reference_and_deviation_is_measured(shift, kw, record_property):
    """Two layers: the caches are approximations. Each must compute Fast-dLLM's approximation
    exactly (the reference refreshes the cache with a full forward at each block's first step,
    then runs only the suffix / the block against it), produce well-formed outputs, and its
    deviation from the exact run is recorded, not asserted away."""
    m = bidir_model(shift=shift, layers=2)
    base = jdllm.generate(m, PROMPTS, jdllm.MaskedDiffusion(**kw), _sampling())
    for cache in ("prefix", "dual"):
        got = jdllm.generate(m, PROMPTS, jdllm.MaskedDiffusion(cache_mode=cache, **kw), _sampling())
        for p, o in zip(PROMPTS, got):
            assert_matches_reference(o, masked_diffusion_reference(m.params, m.config, p, gen_length=G, cache=cache, **kw))
            assert len(o.token_ids) == G and MASK not in o.token_ids
            # block by block: every token of block j is revealed during that block's steps
            assert max(o.step_map[:8]) < min(o.step_map[8:])
        if "steps" in kw:
            assert all(np.bincount(o.step_map)[1:].tolist() == [2] * 8 and o.nfe == 8 for o in got)
        diff = np.mean([np.mean(np.asarray(o.token_ids) != b.token_ids) for o, b in zip(got, base)])
        record_property(f"{cache}_token_diff_fraction", float(diff))
        # the first step is computed from the same full forward in every mode
        assert all(o.token_ids[i] == b.token_ids[i] for o, b in zip(got, base)
                   for i in range(G) if b.step_map[i] == 1)


@slow
@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_cache_on_the_pallas_kernels_matches_the_cache_reference(cache):
    """On the Pallas kernels (interpret mode here) a dual-cache block step writes its block's K/V back
    into the cache, and a prefix-cache window step its window (one switch over the widths, a refresh
    the widest), so that the step's conditionals update the cache in place; nobody reads those K/V
    before they are recomputed, so the batch (rows at their own blocks) and a row alone still
    compute Fast-dLLM's caches exactly."""
    ref_model = bidir_model(layers=2)
    m = Model(ref_model.config, ref_model.params, attn_impl="pallas")
    kw = dict(block_length=8, confidence_threshold=0.5, cache_mode=cache)
    for prompts in (PROMPTS, PROMPTS[:1]):
        got = jdllm.generate(m, prompts, jdllm.MaskedDiffusion(**kw), _sampling())
        xla = jdllm.generate(ref_model, prompts, jdllm.MaskedDiffusion(**kw), _sampling())
        for p, o, x in zip(prompts, got, xla):
            assert_matches_reference(o, masked_diffusion_reference(m.params, m.config, p, gen_length=G, cache=cache,
                                                                   block_length=8, confidence_threshold=0.5))
            assert o.token_ids == x.token_ids and o.step_map == x.step_map and o.nfe == x.nfe


def test_no_retrace_with_same_buckets():
    m = bidir_model()
    dec = jdllm.MaskedDiffusion(steps=8, block_length=8)
    jdllm.generate(m, PROMPTS, dec, _sampling())
    other = [[1, 2, 3, 4, 5], [9, 9], [7, 6, 5, 4, 3, 2, 1, 8, 9, 10, 11]]  # same batch / prompt buckets
    with traces() as seen:
        outs = jdllm.generate(m, other, dec, _sampling())
    assert seen["run"] == 0
    ref = masked_diffusion_reference(m.params, m.config, other[2], gen_length=G, steps=8, block_length=8)
    assert_matches_reference(outs[2], ref)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw,match", [
    (dict(steps=0), "steps=0"),
    (dict(block_length=2.5), "block_length=2.5"),
    (dict(remasking="high"), "remasking='high'"),
    (dict(alg="greedy"), "alg='greedy'"),
    (dict(cache_mode="suffix"), "cache_mode='suffix'"),
    (dict(cache="suffix"), "cache_mode='suffix'"),  # the older field name is still accepted
    (dict(confidence_threshold=1.5), "confidence_threshold=1.5"),
    (dict(confidence_threshold=0.9, remasking="random"), "confidence_threshold"),
    (dict(confidence_threshold=0.9, alg="origin"), "confidence_threshold"),
    (dict(cfg_scale=-1.0), "cfg_scale=-1.0"),
    (dict(cfg_scale=1.0, cache_mode="dual"), "cache_mode='none'"),
    (dict(gen_length=16, block_length=5), "block_length=5 must divide gen_length=16"),
    (dict(gen_length=16, block_length=4, steps=6), "steps=6 must be a multiple"),
    (dict(eps=0.0), "eps=0.0"),
    (dict(alg="entropy", remasking="random"), "remasking='random'"),
])
def test_bad_config_raises(kw, match):
    with pytest.raises(errors.DecodingConfigError, match=match.replace("(", r"\(")):
        jdllm.MaskedDiffusion(**kw)


def test_bad_model_or_lengths_raise_before_compiling():
    with traces() as seen:
        _bad_model_or_lengths()
    assert seen["run"] == 0


def _bad_model_or_lengths():
    causal = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(errors.DecodingConfigError, match="mask token"):
        jdllm.generate(Model(causal, params=None), [[1, 2]], jdllm.MaskedDiffusion())  # refused before any use
    blk = causal.replace(attention="block_causal", block_size=4, mask_token_id=MASK)
    with pytest.raises(errors.DecodingConfigError, match="bidirectional"):
        jdllm.generate(Model(blk, params=None), [[1, 2]], jdllm.MaskedDiffusion())
    m = bidir_model()
    with pytest.raises(errors.DecodingConfigError, match="block_length=4 must divide gen_length=10"):
        jdllm.generate(m, [[1, 2]], jdllm.MaskedDiffusion(block_length=4), _sampling(max_new=10))
    with pytest.raises(errors.DecodingConfigError, match="max_new_tokens=8 < gen_length=16"):
        jdllm.generate(m, [[1, 2]], jdllm.MaskedDiffusion(gen_length=16), _sampling(max_new=8))
    with pytest.raises(errors.DecodingConfigError, match="steps=6 must be a multiple"):
        jdllm.generate(m, [[1, 2]], jdllm.MaskedDiffusion(steps=6, block_length=4), _sampling())
    with pytest.raises(errors.TokenOutOfRangeError):
        jdllm.generate(m, [[1, VOCAB + 3]], jdllm.MaskedDiffusion(), _sampling())
