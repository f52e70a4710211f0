"""The examples no other test runs, run as a user runs them, and held to what they print they check.

Each runs in a child process (`python examples/NAME.py`, the tests' XLA flags) and must exit 0.
Where an example prints a check of its own (constrained output matching its grammar, a served
request equal to `generate()` alone, two cache modes giving the same tokens), every such line must
say it held, and there must be as many as the example makes. quickstart.py runs in `.ci/run`'s
first command; attention, multihost, nnx_train, quantize, rl_*, train_tiny have tests of their own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.quick import slow_except
from tests.scripts import ROOT, subprocess_env


def _count(out: str, good: str, bad: str, n: int) -> None:
    assert bad not in out, out
    assert out.count(good) == n, (good, out)


def _constrained(out):  # every row under a grammar: llguidance and the DFA, 5 paradigms
    _count(out, "constraint_ok=True", "constraint_ok=False", 14)


def _constrained_diffusion(out):
    constrained = out.split("unconstrained:")[0]  # the unconstrained rows need not match
    _count(constrained, "matches=True ", "matches=False", 4)


def _host_loop(out):
    """Row 0's mask bans the digits 2-9 in every step: none may appear in its answer."""
    answer = re.search(r"'sort:3 1 2=' -> '(.*)' \(finish", out)
    assert answer is not None, out
    assert not re.search("[2-9]", answer.group(1)), answer.group(1)


def _masked_diffusion(out):  # five schedules of three prompts, each with its steps
    assert out.count("  NFE ") == 5 * 3 and out.count("    steps: ") == 5 * 3, out


def _multi_block(out):
    _count(out, "give identical tokens and step maps: True", "step maps: False", 1)


def _speculative(out):  # its own asserts check the greedy rows against AR; 6 printed
    _count(out, "same as AR: True", "same as AR: False", 6)


def _evaluate(out):  # five harness runs, each on a trained model: the right answers
    got = re.findall(r"^(\S+)\s+(sort_\w+)\s+(acc|exact_match) ([0-9.]+)", out, re.M)
    assert len(got) == 5 and all(float(v) >= 0.75 for *_, v in got), out


def _score(out):  # six candidates checked against logits(); the right answer and only it greedy
    _count(out, "same as logits(): True", "same as logits(): False", 6)
    assert "'sort:3 1 2=' -> '1 2 3'" in out and "'rev:abc=' -> 'cba'" in out and out.count("greedy True") == 2, out


def _serve(out):
    _count(out, "same as generate() alone: True", "alone: False", 5)


def _serve_spec_constrained(out):
    _count(out, "same as alone: True", "same as alone: False", 6)
    assert out.count("(constraint_ok True)") == 2 and "constraint_ok False" not in out, out


CHECKS = {"constrained": _constrained, "constrained_diffusion": _constrained_diffusion, "host_loop": _host_loop,
          "masked_diffusion": _masked_diffusion, "multi_block": _multi_block, "speculative": _speculative,
          "score": _score, "evaluate": _evaluate, "serve": _serve, "serve_spec_constrained": _serve_spec_constrained}


@pytest.mark.parametrize("name", slow_except(sorted(CHECKS), "host_loop"))
def test_example_runs_and_its_checks_hold(name):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", f"{name}.py")], capture_output=True,
                         text=True, cwd=ROOT, env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    CHECKS[name](res.stdout)


def test_every_example_is_run_by_some_test():
    """A new example gets a check here or a test of its own (one that names examples/NAME.py)."""
    tests_dir = os.path.join(ROOT, "tests")
    text = "".join(open(os.path.join(tests_dir, f)).read() for f in os.listdir(tests_dir) if f.endswith(".py"))
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        text += f.read()
    for f in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        name = f.removesuffix(".py")
        if f.endswith(".py") and name not in CHECKS:
            assert re.search(rf"examples/{name}\.py|\"examples\", \"{name}\.py\"", text), f
