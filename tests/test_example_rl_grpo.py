"""examples/rl_grpo.py on the README's base install (`pip install -e .`: no matplotlib) and at its edges:
`--eval-every 0` (never between the before / after evaluations), `--steps 1` (a rate that includes the
compile, said so, not 1e9 optimizer steps/s)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.quick import slow
from tests.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rl_grpo():
    return load_script("examples/rl_grpo.py")


@slow
def test_one_step_without_matplotlib_and_without_periodic_evals(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError, as uninstalled
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out = tmp_path / "rl"
    code = _rl_grpo().main(["--model", os.path.join(ROOT, "models", "tiny-llada"), "--steps", "1", "--prompts", "3",
                            "--group", "2", "--train-groups", "0", "--eval-items", "6", "--eval-every", "0",
                            "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    log = json.loads((out / "rl.json").read_text())
    assert [e["step"] for e in log["evals"]] == [0, 1]  # before and after only
    assert not (out / "rl.png").exists() and "matplotlib" in printed and "rl.png" in printed
    rate = float(re.search(r"([0-9.]+) optimizer steps/s", printed).group(1))
    assert 0 < rate < 1000 and "compil" in printed.split("optimizer steps/s")[1].splitlines()[0]
    assert (out / "config.json").exists() and "reloaded from" in printed


def test_bad_arguments_are_argparse_errors(capsys):
    mod = _rl_grpo()
    for args in (["--eval-every", "-1"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as e:
            mod.main(args)
        assert e.value.code == 2
    assert "--eval-every" in capsys.readouterr().err
