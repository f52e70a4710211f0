"""`jdllm.loglikelihood`: exact sums for causal models against transformers' log-softmax; LLaDA's Monte
Carlo ELBO for masked-diffusion models against a plain loop over the same noisy rows scored by the
transformers reference (LLaDA and Dream alignments), the block-diffusion (SDAR) ELBO against a loop
denoising each block alone after the clean blocks before it, its mask counts against LLaDA's formula, the
one-token case exact, and the greedy check against a plain loop of LLaDA's suffix_greedy_prediction."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import hf_fixtures as fx
import jdllm
from jdllm import errors
from jdllm.likelihood import mask_counts, noisy_block_rows, noisy_rows
from jdllm.scoring import length_bucket


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_causal_sums_match_transformers(tmp_path):
    d, ref = fx.build_transformers_model("qwen2", str(tmp_path / "hf"), seed=4, kv_heads=2)
    m = jdllm.load(d, dtype="float32")
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 128, n).tolist(), rng.integers(0, 128, k).tolist()) for n, k in ((5, 3), (1, 7), (12, 1))]
    ctx0 = pairs[0][0]  # and a continuation that is the reference's greedy one
    with torch.no_grad():
        seq = list(ctx0)
        for _ in range(4):
            seq.append(int(ref(input_ids=torch.as_tensor([seq])).logits[0, -1].argmax()))
    pairs.append((ctx0, seq[len(ctx0):]))
    got = jdllm.loglikelihood(m, pairs)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        row = ctx + cont
        with torch.no_grad():
            lp = _log_softmax(ref(input_ids=torch.as_tensor([row])).logits[0].numpy())
        want = sum(lp[t - 1, row[t]] for t in range(len(ctx), len(row)))
        assert abs(ll - want) < 1e-3 * max(1.0, abs(want))
        assert greedy == all(int(np.argmax(lp[t - 1])) == row[t] for t in range(len(ctx), len(row)))
    assert [g for _, g in got] == [False, False, False, True]


def test_mask_counts_follow_llada_and_rows_mask_that_many():
    for L, b in ((1, 4), (5, 16), (7, 3), (32, 32), (3, 8)):
        for s in range(6):
            c = np.asarray(mask_counts(jax.random.key(s), L, b))
            k = int(c[0])  # the batch's random start: x_0 = k
            want = ((np.round(k + np.arange(b) * (L / b)).astype(int) - 1) % L) + 1  # eval_llada's _forward_process
            assert np.array_equal(c, want), (L, b, c, want)
            assert c.min() >= 1 and c.max() <= L
    S, L, b, mask = 16, 5, 8, 99
    tokens = np.arange(S, dtype=np.int32)
    seen = np.zeros(S)
    for s in range(40):
        noisy, masked, counts = (np.asarray(x) for x in noisy_rows(jax.random.key(s), tokens, L, b, mask))
        assert np.array_equal(masked.sum(1), counts)
        assert not masked[:, :S - L].any()  # the context (and padding) is never masked
        assert np.array_equal(noisy, np.where(masked, mask, tokens[None]))
        seen += masked.sum(0)
    share = seen[S - L:] / seen[S - L:].sum()  # every continuation slot equally likely
    assert np.all(np.abs(share - 1 / L) < 0.05), share


@pytest.fixture(scope="module", params=["llada", "Dream"])
def diffusion(request, tmp_path_factory):
    d, ref = fx.build_family_dir(request.param, str(tmp_path_factory.mktemp(request.param)), seed=5, kv_heads=2)
    return jdllm.load(d, dtype="float32"), ref


def _reference_elbo(m, ref, ctx, cont, seed, index, groups, b):
    """LLaDA's get_log_likelihood as a plain loop over the same noisy rows, unpadded, scored by the
    transformers model under a bidirectional mask."""
    cfg = m.config
    row = np.asarray(ctx + cont, np.int32)
    n, L = len(row), len(cont)
    S = length_bucket(n, cfg.max_position_embeddings)
    padded = np.zeros(S, np.int32)
    padded[S - n:] = row
    shift = int(cfg.logit_shift)
    losses = []
    for k in jax.random.split(jax.random.fold_in(jax.random.key(seed), index), groups):
        noisy, masked, counts = (np.asarray(x)[:, S - n:] if x.ndim == 2 else np.asarray(x)
                                 for x in noisy_rows(k, padded, L, b, cfg.mask_token_id))
        logits = fx.reference_logits(ref, noisy, kind="bidirectional")
        total = 0.0
        for i in range(b):
            lp = _log_softmax(logits[i])
            for s in np.flatnonzero(masked[i]):
                total += -lp[s - shift, row[s]] / (counts[i] / L)
        losses.append(total / b)
    return -float(np.mean(losses))


def test_masked_diffusion_elbo_equals_llada_loop(diffusion):
    m, ref = diffusion
    rng = np.random.default_rng(2)
    pairs = [(rng.integers(0, 120, 6).tolist(), rng.integers(0, 120, 4).tolist()),
             (rng.integers(0, 120, 3).tolist(), rng.integers(0, 120, 9).tolist())]
    got = jdllm.loglikelihood(m, pairs, mc_samples=24, mc_batch=8, seed=7)
    for i, ((ctx, cont), (ll, greedy)) in enumerate(zip(pairs, got)):
        want = _reference_elbo(m, ref, ctx, cont, 7, i, 3, 8)
        assert abs(ll - want) < 1e-4 * max(1.0, abs(want)), (ll, want)
        assert greedy is False  # not asked for
    again = jdllm.loglikelihood(m, pairs, mc_samples=24, mc_batch=8, seed=7)
    assert again == got
    assert jdllm.loglikelihood(m, pairs, mc_samples=24, mc_batch=8, seed=8) != got  # the seed draws the noise


def test_one_token_continuation_is_exact(diffusion):
    """L = 1: every row masks the token with ratio 1, so the estimate is log p(token | context, [MASK])."""
    m, ref = diffusion
    ctx, cont = [5, 17, 33, 2], [41]
    (ll, _), = jdllm.loglikelihood(m, [(ctx, cont)], mc_samples=8, mc_batch=4)
    logits = fx.reference_logits(ref, np.asarray([ctx + [m.config.mask_token_id]]), kind="bidirectional")[0]
    want = _log_softmax(logits[len(ctx) - int(m.config.logit_shift)])[cont[0]]
    assert abs(ll - want) < 1e-4


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    d, ref = fx.build_family_dir("sdar", str(tmp_path_factory.mktemp("sdar")), seed=6, kv_heads=2, block_size=4)
    return jdllm.load(d, dtype="float32"), ref


def _reference_block_elbo(m, ref, ctx, cont, seed, index, groups, b):
    """The block-diffusion ELBO as a plain loop: each block with masked continuation slots denoised
    alone, its noisy copy after the clean blocks before it (cut at the row's end), by the
    transformers model under the block-causal mask; sum(CE / ratio) / b per batch, minus the mean."""
    bs = m.config.block_size
    row = np.asarray(ctx + cont, np.int32)
    n, P = len(row), len(ctx)
    S = -(-length_bucket(n, m.config.max_position_embeddings) // bs) * bs
    padded = np.zeros(S, np.int32)
    padded[:n] = row
    losses = []
    for k in jax.random.split(jax.random.fold_in(jax.random.key(seed), index), groups):
        noisy, masked, _ = (np.asarray(x) for x in noisy_block_rows(k, padded, P, n, b, bs, m.config.mask_token_id))
        total = 0.0
        for i in range(b):
            for j0 in range(0, n, bs):
                slots = [s for s in range(j0, min(j0 + bs, n)) if masked[i, s]]
                if not slots:
                    continue
                ratio = len(slots) / len([s for s in range(j0, min(j0 + bs, n)) if s >= P])  # the block's share masked
                seq = np.concatenate([row[:j0], noisy[i, j0:min(j0 + bs, n)]])
                lp = _log_softmax(fx.reference_logits(ref, seq[None], kind="block_causal", block_size=bs)[0])
                total += sum(-lp[s, row[s]] / ratio for s in slots)
        losses.append(total / b)
    return -float(np.mean(losses))


def test_block_diffusion_elbo_equals_the_per_block_loop(sdar):
    m, ref = sdar
    rng = np.random.default_rng(3)
    pairs = [(rng.integers(0, 120, 5).tolist(), rng.integers(0, 120, 6).tolist()),  # context ends mid-block
             (rng.integers(0, 120, 8).tolist(), rng.integers(0, 120, 3).tolist())]  # the row ends mid-block
    got = jdllm.loglikelihood(m, pairs, mc_samples=16, mc_batch=8, seed=2)
    for i, ((ctx, cont), (ll, greedy)) in enumerate(zip(pairs, got)):
        want = _reference_block_elbo(m, ref, ctx, cont, 2, i, 2, 8)
        assert abs(ll - want) < 1e-4 * max(1.0, abs(want)), (ll, want)
        assert greedy is False
    padded = np.zeros(16, np.int32)
    padded[:11] = np.arange(1, 12)
    for s in range(20):  # each block's counts in [1, L_j], only continuation slots masked
        _, masked, ratio = (np.asarray(x) for x in noisy_block_rows(jax.random.key(s), padded, 5, 11, 8, 4, 99))
        assert not masked[:, :5].any() and not masked[:, 11:].any()
        per_block = masked[:, :12].reshape(8, 3, 4).sum(-1)  # blocks [4, 8) and [8, 12) hold 3 continuation slots
        assert np.all((per_block[:, 1:] >= 1) & (per_block[:, 1:] <= 3)) and np.all(per_block[:, 0] == 0)
        np.testing.assert_allclose(ratio[:, 5:8], np.repeat(per_block[:, 1:2] / 3, 3, axis=1))
        np.testing.assert_allclose(ratio[:, 8:11], np.repeat(per_block[:, 2:3] / 3, 3, axis=1))


def test_block_diffusion_one_token_is_exact(sdar):
    m, ref = sdar
    ctx, cont = [5, 17, 33, 2, 9, 60], [41]
    (ll, _), = jdllm.loglikelihood(m, [(ctx, cont)], mc_samples=8, mc_batch=4)
    seq = np.asarray([ctx + [m.config.mask_token_id]])
    want = _log_softmax(fx.reference_logits(ref, seq, kind="block_causal", block_size=4)[0, -1])[cont[0]]
    assert abs(ll - want) < 1e-4


def _suffix_greedy(m, ctx, L) -> list[int]:
    """LLaDA's suffix_greedy_prediction as a plain loop: each forward fills the single most confident
    masked position with its argmax."""
    mask = m.config.mask_token_id
    seq = list(ctx) + [mask] * L
    for _ in range(L):
        lp = np.asarray(jax.nn.log_softmax(jdllm.logits(m, [seq])[0], axis=-1))
        open_ = [s for s in range(len(ctx), len(seq)) if seq[s] == mask]
        best = max(open_, key=lambda s: (lp[s].max(), -s))
        seq[best] = int(np.argmax(lp[best]))
    return seq[len(ctx):]


def test_greedy_check_is_llada_suffix_greedy_prediction():
    m = jdllm.load("models/tiny-llada", dtype="float32")
    enc = lambda s: m.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    ctx = enc("sort:3 1 2=")
    pred = _suffix_greedy(m, ctx, 5)
    wrong = [(t + 1) % 40 + 3 for t in pred]
    got = jdllm.loglikelihood(m, [(ctx, pred), (ctx, wrong)], mc_samples=8, mc_batch=8, greedy=True)
    assert [g for _, g in got] == [True, False]
    assert got[0][0] > got[1][0]


def test_bad_requests_are_refused():
    ar = jdllm.load("models/tiny-ar", dtype="float32")
    llada = jdllm.load("models/tiny-llada", dtype="float32")
    sdar = jdllm.load("models/tiny-sdar", dtype="float32")
    with pytest.raises(errors.InputError, match="greedy=True"):
        jdllm.loglikelihood(sdar, [([4, 5], [3])], greedy=True)
    fast_dllm = jdllm.Model(sdar.config.replace(logit_shift=True), sdar.params)
    with pytest.raises(errors.InputError, match="Fast-dLLM v2"):
        jdllm.loglikelihood(fast_dllm, [([4, 5], [3])])
    with pytest.raises(errors.InputError, match="context is empty"):
        jdllm.loglikelihood(ar, [([], [3])])
    with pytest.raises(errors.InputError, match="continuation is empty"):
        jdllm.loglikelihood(ar, [([1], [])])
    with pytest.raises(errors.InputError, match="pairs"):
        jdllm.loglikelihood(ar, [])
    with pytest.raises(errors.SequenceTooLongError):
        jdllm.loglikelihood(ar, [([1] * 60, [2] * 10)])
    with pytest.raises(errors.InputError, match="multiple of mc_batch"):
        jdllm.loglikelihood(llada, [([1], [4])], mc_samples=10, mc_batch=4)
    with pytest.raises(errors.InputError, match="mc_batch"):
        jdllm.loglikelihood(llada, [([1], [4])], mc_batch=0)
    # each side is one row of integer ids, checked as score() and generate() check them (floats
    # were truncated, a 2-D context flattened, bools taken as ids 0 / 1)
    for pair, match in [(([5.7, 6.2], [7]), "context holds float64"), (([[5, 6], [7, 8]], [6]), r"context has shape"),
                        (([True], [False]), "context holds bool"), (("sort:", [6]), "context is text"),
                        ((5, [6]), r"context has shape \(\)"), (([5], None), "continuation holds object")]:
        with pytest.raises(errors.ArgumentTypeError, match=match):
            jdllm.loglikelihood(ar, [pair])
    mask = llada.config.mask_token_id
    with pytest.raises(errors.InputError, match=f"request 0: the context holds the mask token id {mask} at position 1"):
        jdllm.loglikelihood(llada, [([5, mask, 6], [7])], mc_samples=4, mc_batch=4)
    for seed in ("x", -1, 2**32, 1.5):
        with pytest.raises(errors.InputError, match="seed="):
            jdllm.loglikelihood(llada, [([5], [6])], mc_samples=4, mc_batch=4, seed=seed)
    # the same settings on a causal model, whose exact path uses none of them but greedy: refused all the same
    for kw, match in ((dict(mc_samples=-5), "mc_samples=-5"), (dict(seed="x"), "seed='x'"),
                      (dict(greedy="yes"), "greedy='yes'")):
        with pytest.raises(errors.InputError, match=match):
            jdllm.loglikelihood(ar, [([5], [6])], **kw)
