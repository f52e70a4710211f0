"""The command line on bad input and edge cases (issue 19), run as a user runs it: in a subprocess.

Every refusal exits with code 2, prints one `jdllm <command>: error: ...` line
naming the value and the fix, and no Python traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.quick import slow, slow_except
from tests.scripts import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_AR, TINY_SDAR, TINY_LLADA = (os.path.join(ROOT, "models", n) for n in ("tiny-ar", "tiny-sdar", "tiny-llada"))
ENV = subprocess_env()


def jdllm(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "jdllm.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=env or ENV, timeout=timeout)


def refused(res, *fragments):
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    for f in fragments:
        assert f in res.stderr, (f, res.stderr)


# --------------------------------------------------------------------------- convert data loss
@slow
def test_convert_refuses_an_out_dir_that_contains_the_source(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(TINY_AR, copy / "tiny-ar")
    (copy / "sentinel.txt").write_text("precious")
    res = jdllm("convert", copy / "tiny-ar", copy, "--overwrite", "--quiet")
    refused(res, "OutputExistsError", "contains the input directory")
    assert (copy / "sentinel.txt").read_text() == "precious"
    assert (copy / "tiny-ar" / "model.safetensors").exists()
    res = jdllm("convert", copy / "tiny-ar", copy / "tiny-ar" / "inside", "--overwrite", "--quiet")
    refused(res, "inside the input directory")
    assert not (copy / "tiny-ar" / "inside").exists()


@slow
def test_convert_overwrite_never_deletes_what_is_not_a_checkpoint(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "sentinel.txt").write_text("precious")
    refused(jdllm("convert", TINY_AR, out, "--overwrite", "--quiet"), "not a jdllm checkpoint", "--overwrite")
    assert (out / "sentinel.txt").read_text() == "precious"
    afile = tmp_path / "afile"
    afile.write_text("precious")
    refused(jdllm("convert", TINY_AR, afile, "--overwrite", "--quiet"), "is a file")
    assert afile.read_text() == "precious"


def test_convert_checks_the_output_location_first(tmp_path):
    blocker = tmp_path / "regular-file"
    blocker.write_text("x")
    refused(jdllm("convert", TINY_AR, blocker / "out", "--quiet"), "OutputPathError", "is a file, not a directory")
    assert blocker.read_text() == "x"


def test_convert_read_only_location_is_an_error_not_a_traceback(tmp_path, monkeypatch):
    from convert.io import convert_checkpoint
    from jdllm import errors

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("tempfile.TemporaryFile", read_only)
    with pytest.raises(errors.OutputPathError, match="Read-only file system"):
        convert_checkpoint(TINY_AR, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- generate / bench
@slow
def test_text_the_tokenizer_cannot_encode():
    res = jdllm("generate", TINY_AR, "--prompt", "Add:1+2=")
    refused(res, "InputError", "'A'", "position 0", "0123456789")


@slow
def test_cudnn_on_a_cpu_and_version():
    refused(jdllm("generate", TINY_AR, "--prompt", "add:1+2=", "--attn-impl", "cudnn"), "cudnn", "auto")
    res = jdllm("--version")
    assert res.returncode == 0 and res.stdout.strip().startswith("jdllm ")


def test_bench_json_into_a_missing_directory_fails_before_the_benchmark():
    t0 = time.perf_counter()
    res = jdllm("bench", TINY_AR, "--json", "/nonexistent-dir/x.json")
    refused(res, "OutputPathError", "/nonexistent-dir")
    assert "| batch |" not in res.stdout and time.perf_counter() - t0 < 60


def test_bench_json_that_is_a_directory_and_a_negative_seed_fail_before_the_benchmark(tmp_path):
    res = jdllm("bench", TINY_AR, "--json", tmp_path)
    refused(res, "OutputPathError", "is a directory", "out.json")
    assert "| batch |" not in res.stdout
    refused(jdllm("bench", TINY_AR, "--seed", "-1"), "InputError", "--seed -1")


@slow
def test_defaults_fit_the_shipped_models(tmp_path):
    """No --max-new-tokens / --block-size: the shipped 64-token models still answer, without a note about
    the default that does not fit (the output stopped long before the context's end); a note when the
    context's end did cut the output short."""
    res = jdllm("generate", TINY_SDAR, "--prompt", "sort:3 1 2=", "--paradigm", "multi_block")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "1 2 3" and "note:" not in res.stderr, res.stderr
    res = jdllm("generate", TINY_AR, "--prompt", "sort:3 1 2=", "--stop-token-id", "2")
    assert res.returncode == 0, res.stderr
    assert "note: max_new_tokens: the default 256 does not fit" in res.stderr and "after 53 tokens" in res.stderr
    res = jdllm("generate", TINY_SDAR, "--prompt", "sort:3 1 2=", "--paradigm", "block_diffusion")
    assert res.returncode == 0 and res.stdout.strip() == "1 2 3", res.stderr
    report = tmp_path / "b.json"
    res = jdllm("bench", TINY_AR, "--batch", "1", "--repeats", "1", "--json", report)
    assert res.returncode == 0, res.stderr
    rows = json.loads(report.read_text())
    assert rows["prompt_len"] + rows["max_new_tokens"] <= 64 and rows["rows"][0]["tokens"] >= 1


@slow
def test_prompts_keep_their_order():
    rev_abc = "30,17,34,40,13,14,15,42"  # "rev:abc=" in the shipped character tokenizer
    res = jdllm("generate", TINY_AR, "--prompt-ids", rev_abc, "--prompt", "sort:3 1 2=", "--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out == ["=== prompt 0 ===", "cba", "=== prompt 1 ===", "1 2 3"]


@slow
def test_constraints_with_an_empty_language_or_bad_syntax_are_refused(tmp_path):
    """An empty-language Lark grammar (no derivation ends) is a ConstraintError before decoding, as an
    empty-language regex is, and a regex the DFA backend cannot read says what is wrong with it."""
    (tmp_path / "g.lark").write_text('start: x\nx: "q" x\n')
    res = jdllm("generate", TINY_AR, "--prompt", "sort:3 1 2=", "--max-new-tokens", "8", "--lark", tmp_path / "g.lark")
    refused(res, "ConstraintError", "empty language", "'x'")
    assert res.stdout == ""
    res = jdllm("generate", TINY_AR, "--prompt", "sort:3 1 2=", "--max-new-tokens", "8", "--regex", "([",
                "--constraint-backend", "dfa")
    refused(res, "ConstraintError", "unterminated character set at position 1")


def test_help_lists_per_paradigm_defaults_and_choices():
    res = jdllm("generate", "--help")
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    assert "multi_block: default 'auto', one of auto, none, exact, approx, window" in text
    assert "masked_diffusion: default 'none', one of auto, none, prefix, dual" in text
    assert "one of low_confidence, random" in text and "maskgit_plus" in text
    assert "block_diffusion: default 0.9" in text and "masked_diffusion: default None" in text


@slow
def test_masked_diffusion_takes_cache_auto():
    res = jdllm("generate", TINY_LLADA, "--prompt", "sort:3 1 2=", "--paradigm", "masked_diffusion",
                "--cache-mode", "auto", "--max-new-tokens", "8")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


@slow
def test_non_finite_weights_are_refused_at_load(tmp_path):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "nan-model"
    shutil.copytree(TINY_AR, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    res = jdllm("generate", bad, "--prompt", "add:1+2=", "--max-new-tokens", "4")
    refused(res, "NonFiniteWeightsError", "model.layers.1.mlp.up_proj.weight", "--no-check-finite")
    res = jdllm("generate", bad, "--prompt", "add:1+2=", "--max-new-tokens", "4", "--no-check-finite")
    assert res.returncode == 0, res.stderr


@slow
def test_no_pytorch_notice():
    """transformers prints "PyTorch was not found" when torch is absent; jdllm's entry points hide it."""
    hide_torch = "import sys; sys.modules['torch'] = None; "
    control = subprocess.run([sys.executable, "-c", hide_torch + "import transformers"], capture_output=True,
                             text=True, env=ENV)
    assert "PyTorch was not found" in control.stderr  # the notice exists when nothing silences it
    run = (hide_torch + "from jdllm.cli import main; "
           f"sys.exit(main(['generate', {TINY_AR!r}, '--prompt', 'add:1+2=', '--max-new-tokens', '4']))")
    res = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, env=ENV, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "PyTorch was not found" not in res.stderr


@slow
def test_loading_leaves_the_environment_alone():
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # (jax and transformers set variables of their own on import; what is checked is jdllm's doing)
    code = ("import os, jax, transformers, jdllm; jax.devices(); before = dict(os.environ); "
            "m = jdllm.load('models/tiny-ar'); "
            "assert m.tokenizer is not None; assert dict(os.environ) == before, "
            "set(os.environ.items()) ^ set(before.items())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("when", slow_except(["importing", "compiling"], "importing"))
def test_ctrl_c_exits_130_without_a_traceback(when):
    """Ctrl-C while importing / compiling: exit code 130, one line, no traceback, no crash.

    "compiling" signals once the CLI says it compiles, with the compilation cache off so that it
    does: a fixed delay raced the run's end once start-up got shorter (a warm cache finished it)."""
    env = {**ENV, "JDLLM_CACHE_DIR": "off"} if when == "compiling" else ENV
    proc = subprocess.Popen([sys.executable, "-m", "jdllm.cli", "generate", TINY_SDAR, "--prompt", "sort:3 1 2=",
                             "--paradigm", "multi_block", "--max-new-tokens", "40"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    head = ""
    if when == "importing":
        time.sleep(0.3)
    else:
        while "compiling" not in head and proc.poll() is None:
            head += proc.stderr.readline()
        assert "compiling" in head, head
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = head + err
    assert proc.returncode == 130, (proc.returncode, err)
    assert "interrupted" in err and "Traceback" not in err


def _wait_until_importing(proc, timeout=60.0):
    """Block until `proc` is importing numpy (its shared library is mapped). A fixed sleep raced
    the interpreter's own start-up on a loaded machine: a SIGINT before `python -m convert` has run
    its first line kills the process with no handler to answer it. Falls back to a short sleep
    where /proc is unavailable."""
    maps = f"/proc/{proc.pid}/maps"
    if not os.path.exists(maps):
        time.sleep(0.1)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with open(maps) as f:
            if "numpy" in f.read():
                return
        time.sleep(0.005)


def test_ctrl_c_during_convert(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "convert", TINY_AR, str(tmp_path / "out"), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    _wait_until_importing(proc)  # while it starts up (a KeyboardInterrupt mid-conversion: test_convert.py)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "interrupted" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_a_default_step_count_follows_the_block_length_given(capsys):
    """--block-length 3 alone on tiny-sdar (block_diffusion's default 4 steps cannot split 3 slots):
    3 steps and a note, not an error about --denoising-steps the user never gave; a given step count
    that does not divide is still an error, and one that divides is kept."""
    import jdllm as J  # noqa: PLC0415
    from jdllm import cli, errors  # noqa: PLC0415
    from jdllm.generate_cli import decoding_from_args  # noqa: PLC0415

    cfg = J.load(TINY_SDAR).config
    parse = lambda *a: cli.build_parser().parse_args(["generate", TINY_SDAR, "--prompt", "x", *a])  # noqa: E731
    d = decoding_from_args(parse("--paradigm", "block_diffusion", "--block-length", "3"), cfg)
    assert (d.block_length, d.denoising_steps) == (3, 3)
    assert "--denoising-steps is 3 (one token a step): the default 4 does not divide --block-length 3" in \
        capsys.readouterr().err
    d = decoding_from_args(parse("--paradigm", "block_diffusion", "--block-length", "8"), cfg)
    assert (d.block_length, d.denoising_steps) == (8, 4) and "note" not in capsys.readouterr().err
    assert decoding_from_args(parse("--block-length", "6", "--denoising-steps", "3"), cfg).denoising_steps == 3
    with pytest.raises(errors.DecodingConfigError, match="denoising_steps=2 must be"):
        decoding_from_args(parse("--paradigm", "block_diffusion", "--block-length", "3", "--denoising-steps", "2"),
                           cfg)
