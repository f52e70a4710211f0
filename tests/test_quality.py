"""AUP against hand-computed values, and quality floors on the shipped tiny models (models/tiny-*)."""

import math
import os

import numpy as np
import pytest

import jdllm
from jdllm import tasks
from tests.quick import slow
from tests.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")


def _quality():
    return load_script("benchmarks/quality.py")


# --------------------------------------------------------------------------- AUP
def test_aup_hand_computed():
    aup = _quality().aup
    # (TPF, acc%): sorted -> (1, 90), (2, 88), (3, 80); (3, 80) is more than 5 points under 90: dropped.
    # y_max = 90: W(90) = 1, W(88) = exp(-3 * (1 - 88/90)) = exp(-1/15).
    # AUP = 1 * 90 + 0.5 * (2 - 1) * (88 * exp(-1/15) + 90 * 1)
    want = 90 + 0.5 * (88 * math.exp(-1 / 15) + 90)
    assert aup([(3.0, 80.0), (1.0, 90.0), (2.0, 88.0)]) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(176.16231, abs=1e-4)


def test_aup_single_point_and_y_max_and_cap():
    aup = _quality().aup
    assert aup([(1.5, 60.0)]) == pytest.approx(90.0)  # rho_1 * y_1
    # Accuracy above the lowest-TPF point stays, and W is capped at 1 when y > y_max.
    # (1, 50), (2, 60) with y_max 55: W(60) = min(exp(3 * 5/55), 1) = 1, W(50) = exp(-3 * 5/55).
    want = 50 + 0.5 * (60 + 50 * math.exp(-3 * 5 / 55))
    assert aup([(2.0, 60.0), (1.0, 50.0)], y_max=55.0) == pytest.approx(want)
    # Exactly 5 points below the first point is kept; just over is dropped.
    assert aup([(1.0, 90.0), (2.0, 85.0)]) > aup([(1.0, 90.0), (2.0, 84.99)])
    assert aup([(1.0, 90.0), (2.0, 84.99)]) == pytest.approx(90.0)
    with pytest.raises(ValueError):
        aup([])
    with pytest.raises(ValueError):
        aup([(0.0, 50.0)])


def test_aup_rewards_parallelism_at_equal_accuracy():
    aup = _quality().aup
    assert aup([(1.0, 90.0), (3.0, 90.0)]) == pytest.approx(90 + 2 * 90)
    assert aup([(1.0, 90.0), (3.0, 90.0)]) > aup([(1.0, 90.0), (2.0, 90.0)])


# --------------------------------------------------------------------------- shipped models
SHIPPED = ("tiny-ar", "tiny-sdar", "tiny-llada")
# Floors well under the figures benchmarks/quality.py measured on 256 items (RESULTS.md):
# tiny-sdar one-token-per-step 96.1%, dynamic(0.9) 96.1% at TPF 2.14, multi_block(H<=0.5) 94.9% at TPF 3.00.
SDAR_ACC_FLOOR = 0.85
MULTI_BLOCK_TPF_FLOOR = 2.3


def _run(name: str, decoding, n: int = 200):
    """Exact match and TPF of `decoding` on the first n held-out items (one batch)."""
    model = jdllm.load(os.path.join(MODELS, name), dtype="float32")
    exs = tasks.test_set(n)
    outs = jdllm.generate(model, [e.prompt for e in exs], decoding=decoding,
                          sampling=jdllm.Sampling(temperature=0.0, max_new_tokens=12))
    acc = tasks.exact_match([tasks.decode(o.token_ids) for o in outs], exs)
    tpf = sum(len(o.token_ids) for o in outs) / sum(o.nfe for o in outs)
    return acc, tpf


def test_long_sweep_has_early_full_activation_under_both_rules():
    """The block-causal long-task sweep: multi_block at add 0.25 / decoded 0.25 for each forced-progress
    rule asked for (the setting where "every" overlaps blocks on `either`), next to block diffusion."""
    q = _quality()
    settings = q.sweep("block_causal", 4, False, ("first", "every"), 36, long=True)
    early = {(s.strategy, s.label): dict(s.kwargs) for s in settings if "dec0.25" in s.strategy}
    assert set(early) == {(c, f"H<={e}") for c in ("entropy/add0.25/dec0.25", "entropy/add0.25/dec0.25/every")
                          for e in (0.2, 0.3, 0.4, 0.5, 1.0)}
    for (curve, _), kw in early.items():
        assert kw["block_add_threshold"] == kw["decoded_token_threshold"] == 0.25
        assert kw.get("forced_progress", "first") == ("every" if curve.endswith("every") else "first")
    assert any(s.paradigm == "BlockDiffusion" for s in settings)


def test_shipped_directories_complete_and_small():
    total = 0
    for name in SHIPPED:
        d = os.path.join(MODELS, name)
        for fn in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "loss.png"):
            assert os.path.isfile(os.path.join(d, fn)), (name, fn)
        total += sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    assert total < 10 * 2**20, f"shipped models take {total / 2**20:.1f} MiB"


def test_shipped_ar_matches_transformers():
    """The shipped Qwen3 directory runs identically in transformers and jdllm."""
    import torch
    from transformers import AutoModelForCausalLM

    path = os.path.join(MODELS, "tiny-ar")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = jdllm.load(path, dtype="float32")
    ids = [tasks.encode(e.prompt + e.answer) for e in tasks.test_set(4)]
    T = min(len(r) for r in ids)
    batch = np.array([r[:T] for r in ids], np.int64)
    with torch.no_grad():
        want = hf(torch.from_numpy(batch)).logits.numpy()
    got = np.asarray(jdllm.logits(model, batch.astype(np.int32)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@slow
def test_ar_exact_match_floor():
    acc, tpf = _run("tiny-ar", jdllm.AR())
    assert acc > 0.90, f"tiny-ar exact match {acc:.3f} (measured 1.000 on 256 items)"
    assert tpf == pytest.approx(1.0)


@slow
def test_block_diffusion_dynamic_parallel_floor():
    """tiny-sdar: low_confidence_dynamic decodes > 1.5 tokens per forward and stays near one-token-per-step."""
    one_acc, one_tpf = _run("tiny-sdar", jdllm.BlockDiffusion(block_length=4, denoising_steps=4,
                                                              strategy="low_confidence_static"), n=128)
    acc, tpf = _run("tiny-sdar", jdllm.BlockDiffusion(block_length=4, denoising_steps=4,
                                                      strategy="low_confidence_dynamic", confidence_threshold=0.9), n=128)
    assert one_acc > SDAR_ACC_FLOOR, f"one token per step: {one_acc:.3f}"
    assert tpf > 1.5, f"dynamic TPF {tpf:.2f}"
    assert tpf > one_tpf
    assert acc > one_acc - 0.05, f"dynamic {acc:.3f} vs one-per-step {one_acc:.3f}"


@slow
def test_multi_block_floor():
    acc, tpf = _run("tiny-sdar", jdllm.MultiBlock(block_size=4, entropy_threshold=0.5), n=128)
    assert acc > SDAR_ACC_FLOOR and tpf > MULTI_BLOCK_TPF_FLOOR, (acc, tpf)


@slow
def test_masked_diffusion_floor():
    """tiny-llada (addition is its weak task: ~35%; sort and reverse ~99%)."""
    acc, tpf = _run("tiny-llada", jdllm.MaskedDiffusion(gen_length=12, block_length=4, steps=12,
                                                        confidence_threshold=0.9), n=128)
    assert acc > 0.65 and tpf > 1.8, (acc, tpf)
