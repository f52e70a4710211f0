"""Progress lines for long compiles (`jdllm.compile_progress`): the command line prints them on
stderr the first time a program compiles (and says when it came from the compilation cache);
the Python API prints nothing."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import jdllm
from jdllm import compile_progress
from jdllm.config import ModelConfig
from tests.quick import slow
from tests.scripts import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SDAR = os.path.join(ROOT, "models", "tiny-sdar")


def cli_generate(env):
    return subprocess.run([sys.executable, "-m", "jdllm.cli", "generate", TINY_SDAR, "--prompt-ids", "5,6,7",
                           "--max-new-tokens", "8"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=subprocess_env(**env))


@slow
def test_cli_prints_the_compile_then_the_cache_hit(tmp_path):
    env = {"JDLLM_CACHE_DIR": str(tmp_path / "cache")}
    first = cli_generate(env)
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    assert "jdllm generate: compiling block_diffusion for batch 1 × 16 slots …" in lines, first.stderr
    assert any(re.fullmatch(r"jdllm generate: block_diffusion for batch 1 × 16 slots: compiled in \d+\.\d s", x)
               for x in lines), first.stderr
    second = cli_generate(env)  # a new process: the program comes from the persistent cache
    assert second.returncode == 0, second.stderr
    assert re.search(r"block_diffusion for batch 1 × 16 slots: loaded from the compilation cache in \d+\.\d s",
                     second.stderr), second.stderr
    assert first.stdout == second.stdout


@slow
def test_library_quiet_watch_prints_once_per_program(capfd):
    cfg = ModelConfig.from_hf(TINY_SDAR)  # a config no other test uses: its programs are not compiled yet
    model = jdllm.Model.random(ModelConfig.from_dict({**cfg.to_dict(), "max_position_embeddings": 56}))
    jdllm.generate(model, [[5, 6, 7]], sampling=jdllm.Sampling(max_new_tokens=8))  # show() off: the library
    assert capfd.readouterr().err == ""                                              # prints nothing
    sampling = jdllm.Sampling(max_new_tokens=12)  # another shape: another program
    slots = jdllm.prepare(model, [[5, 6, 7]], sampling=sampling).state.tokens.shape[1]
    label = f"block_diffusion for batch 1 × {slots} slots"
    buf = io.StringIO()
    with compile_progress.show("test", stream=buf, every=0.2):
        jdllm.generate(model, [[5, 6, 7]], sampling=sampling)
        first = buf.getvalue()
        jdllm.generate(model, [[8, 9, 10]], sampling=sampling)  # same shapes: no compile, no line
    assert buf.getvalue() == first
    lines = first.splitlines()
    assert lines[0] == f"test: compiling {label} …", first
    assert re.fullmatch(rf"test: {label}: (compiled|loaded from the compilation cache) in \d+\.\d s", lines[-1]), first
    assert all(re.fullmatch(rf"test: compiling {label} … \d+ s", x) for x in lines[1:-1]), first  # elapsed time
    assert capfd.readouterr().err == ""


def test_serving_engine_announces_its_prefill_and_step_programs():
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    model = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    engine = Engine(model, max_batch=1, max_prompt_tokens=5, max_new_tokens=3)
    buf = io.StringIO()
    with compile_progress.show("jdllm serve", stream=buf):
        engine.generate([[5, 6, 7]], jdllm.Sampling(max_new_tokens=3))
    text = buf.getvalue()
    slots = engine.slots
    for piece in ("prefill", "step"):
        assert f"jdllm serve: compiling ar {piece} for batch 1 × {slots} slots …\n" in text, text
        assert re.search(rf"jdllm serve: ar {piece} for batch 1 × {slots} slots: \w", text), text
