"""`jdllm.score` (each token's log-prob given its prefix, and its top alternatives) against the
transformers model's own log-softmax, against the AR decode loop's recorded log-probs, one row
against the batch it came in, and its compiles counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_fixtures as fx
import jdllm
from jdllm import errors
from tests.compiles import traces

TOL = 1e-4


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny transformers Qwen3 (GQA, 512 positions so a row spans several head chunks)."""
    d, ref = fx.build_transformers_model("qwen3", str(tmp_path_factory.mktemp("hf")), seed=3, kv_heads=2,
                                         head_dim=16, max_position_embeddings=512)
    return jdllm.load(d, dtype="float32"), ref


def _reference(ref, row):
    """transformers' log-softmax over the row: [T-1, V], entry t-1 predicting token t."""
    with torch.no_grad():
        logits = ref(input_ids=torch.as_tensor([row])).logits.float()
    return torch.log_softmax(logits[0, :-1], dim=-1).numpy()


def test_scores_match_transformers_log_softmax(qwen3):
    m, ref = qwen3
    V = m.config.vocab_size
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, V, n).tolist() for n in (200, 5, 17, 1)]  # 200: padded to 224, two head chunks
    got = jdllm.score(m, rows, top_logprobs=4)
    assert len(got) == len(rows)
    for row, sc in zip(rows, got):
        T = len(row)
        assert sc.token_ids.tolist() == row
        assert sc.logprobs.shape == (T,) and sc.top_ids.shape == (T, 4) and sc.top_logprobs.shape == (T, 4)
        assert np.isnan(sc.logprobs[0]) and np.all(np.isnan(sc.top_logprobs[0])) and np.all(sc.top_ids[0] == -1)
        if T == 1:
            continue
        want = _reference(ref, row)
        np.testing.assert_allclose(sc.logprobs[1:], want[np.arange(T - 1), row[1:]], atol=TOL)
        order = np.argsort(-want, axis=-1, kind="stable")[:, :4]
        assert np.array_equal(sc.top_ids[1:], order)
        np.testing.assert_allclose(sc.top_logprobs[1:], np.take_along_axis(want, order, -1), atol=TOL)
        assert abs(sc.total - float(want[np.arange(T - 1), row[1:]].sum())) < 1e-3


def test_a_row_scores_as_alone_and_new_lengths_reuse_the_program(qwen3):
    m, _ = qwen3
    V = m.config.vocab_size
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, V, n).tolist() for n in (20, 31, 9)]
    batch = jdllm.score(m, rows, top_logprobs=2)
    for row, sc in zip(rows, batch):
        alone = jdllm.score(m, [row], top_logprobs=2)[0]
        np.testing.assert_allclose(alone.logprobs[1:], sc.logprobs[1:], atol=1e-5)
        assert np.array_equal(alone.top_ids[1:], sc.top_ids[1:])
    with traces() as seen:  # other lengths and row counts in the same power-of-two buckets: no new trace
        jdllm.score(m, [rng.integers(0, V, 25).tolist(), rng.integers(0, V, 18).tolist(),
                        rng.integers(0, V, 32).tolist()], top_logprobs=2)
        jdllm.score(m, [rng.integers(0, V, 3).tolist()], top_logprobs=2)
    assert seen["_score_jit"] == 0, dict(seen)
    with traces() as seen:  # a new bucket does trace
        jdllm.score(m, [rng.integers(0, V, 40).tolist()], top_logprobs=2)
    assert seen["_score_jit"] == 1, dict(seen)


def test_greedy_ar_tokens_score_as_recorded_and_greedy(qwen3):
    m, _ = qwen3
    prompt = [5, 9, 2, 7]
    out = jdllm.generate(m, [prompt], decoding=jdllm.AR(),
                         sampling=jdllm.Sampling(max_new_tokens=12, stop_token_ids=()))[0]
    sc = jdllm.score(m, [prompt + out.token_ids], top_logprobs=1)[0]
    P = len(prompt)
    assert sc.is_greedy(begin=P)  # the decode loop picked the argmax at every step
    np.testing.assert_allclose(sc.logprobs[P:], out.logprobs, atol=TOL)
    assert np.array_equal(sc.top_ids[P:, 0], out.token_ids)
    flipped = prompt + [(out.token_ids[0] + 1) % m.config.vocab_size] + out.token_ids[1:]
    assert not jdllm.score(m, [flipped], top_logprobs=1)[0].is_greedy(begin=P)


def test_bad_input_is_refused():
    ar = jdllm.load("models/tiny-ar", dtype="float32")
    sdar = jdllm.load("models/tiny-sdar", dtype="float32")
    with pytest.raises(errors.InputError, match="causal"):
        jdllm.score(sdar, [[1, 2, 3]])
    with pytest.raises(errors.InputError, match="non-empty"):
        jdllm.score(ar, [[1, 2], []])
    with pytest.raises(errors.SequenceTooLongError, match="max_position_embeddings"):
        jdllm.score(ar, [[1] * (ar.config.max_position_embeddings + 1)])
    with pytest.raises(errors.InputError):
        jdllm.score(ar, [[1, ar.config.vocab_size]])
    for bad in (-1, True, 1.5, ar.config.vocab_size + 1):
        with pytest.raises(errors.InputError, match="top_logprobs"):
            jdllm.score(ar, [[1, 2]], top_logprobs=bad)
    with pytest.raises(errors.InputError, match="top_logprobs >= 1"):
        jdllm.score(ar, [[1, 2]])[0].is_greedy()
