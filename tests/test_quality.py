"""AUP against hand-computed values, and quality floors on the shipped tiny models (models/tiny-*)."""

import importlib.util
import math
import os
import sys

import numpy as np
import pytest

import jdllm
from jdllm import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")


def _quality():
    spec = importlib.util.spec_from_file_location("quality", os.path.join(ROOT, "benchmarks", "quality.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("quality", mod)  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


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
