"""JAX's persistent compilation cache, on by default for jdllm (`jdllm.compile_cache`).

Where the directory goes and the bad-input cases are checked in-process through `resolve`
(it prepares the directory and warns or raises, but changes no JAX setting); what JAX then
does with it (entries written by a generate, none when off, JAX's own setting winning, a run
that goes on after a warning) in subprocesses, where JAX's global config starts fresh. Every
subprocess generates on tiny-ar's weights (without its tokenizer, which costs each process
~2 s of CPU to import) and must give the same tokens and log-probs as a run without the cache.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import warnings

import pytest

from jdllm import compile_cache, errors
from tests.quick import slow
from tests.scripts import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_AR = os.path.join(ROOT, "models", "tiny-ar")
CHILD = r"""
import json, sys, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jax
    import jdllm
    from jdllm import compile_cache
    model = jdllm.load(sys.argv[1], dtype="float32")
    outs = jdllm.generate(model, [[5, 6, 7], [8, 9]], sampling=jdllm.Sampling(max_new_tokens=6, stop_token_ids=()))
st = compile_cache.status()
print(json.dumps(dict(tokens=[o.token_ids for o in outs], logprobs=[o.logprobs for o in outs],
                      warnings=[str(w.message) for w in caught if "cache" in str(w.message)],
                      path=st.path, source=st.source,
                      min_time=jax.config.jax_persistent_cache_min_compile_time_secs)))
"""


class Child:
    """Generate on tiny-ar in a fresh process under `env` (None removes a variable), started at
    once; `result()` waits for its outputs, cache warnings and `compile_cache.status()`. HOME and
    XDG_CACHE_HOME point into `tmp`, so nothing reaches the user's cache."""

    def __init__(self, tmp, model_dir, **env):
        full = subprocess_env(HOME=str(tmp / "home"), XDG_CACHE_HOME=str(tmp / "xdg"))
        for k in ("JDLLM_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR"):
            full.pop(k, None)
        full.update({k: str(v) for k, v in env.items() if v is not None})
        self.tmp = tmp
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=full, cwd=ROOT)
        self.out = None

    def result(self) -> dict:
        if self.out is None:
            stdout, stderr = self.proc.communicate(timeout=300)
            assert self.proc.returncode == 0, stderr
            self.out = json.loads(stdout.strip().splitlines()[-1])
        return self.out


def entries(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(compile_cache.ENTRY_SUFFIX)) if os.path.isdir(path) else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The subprocesses, all started together (they run side by side; each test waits for its own)."""
    def tmp(name):
        return tmp_path_factory.mktemp(name)

    model = tmp("tiny-ar-weights")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(TINY_AR, name), model / name)
    jax_tmp, bad_tmp = tmp("theirs"), tmp("unwritable")
    (bad_tmp / "file").write_text("x")
    started = dict(
        off=Child(tmp("off"), model, JDLLM_CACHE_DIR="off"),
        moved=Child(tmp("moved"), model, JDLLM_CACHE_DIR=tmp("moved-cache") / "c"),
        default=Child(tmp("default"), model),
        jax=Child(jax_tmp, model, JAX_COMPILATION_CACHE_DIR=jax_tmp / "theirs", JDLLM_CACHE_DIR=jax_tmp / "ours"),
        unwritable=Child(bad_tmp, model, JDLLM_CACHE_DIR=bad_tmp / "file" / "cache"))
    started["model"] = model
    yield started
    for c in started.values():
        if isinstance(c, Child) and c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


@pytest.fixture(scope="module")
def reference(runs):
    """tiny-ar's outputs without the cache (JDLLM_CACHE_DIR=off: nothing written anywhere)."""
    out = runs["off"].result()
    assert out["source"] == "off" and out["path"] is None and out["warnings"] == []
    assert not os.path.exists(runs["off"].tmp / "xdg") and not os.path.exists(runs["off"].tmp / "home")
    return out


def same(out, ref):
    assert (out["tokens"], out["logprobs"]) == (ref["tokens"], ref["logprobs"])


# --------------------------------------------------------------------------- where it goes (in-process)
def test_default_dir_is_a_jdllm_folder_in_the_user_cache_dir(tmp_path):
    assert compile_cache.default_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "jdllm" / "xla")
    home = os.path.join(os.path.expanduser("~"), ".cache", "jdllm", "xla")
    assert compile_cache.default_dir({}) == home
    assert compile_cache.default_dir({"XDG_CACHE_HOME": "relative/dir"}) == home  # XDG: relative is ignored
    st = compile_cache.resolve({"XDG_CACHE_HOME": str(tmp_path)})
    assert st == compile_cache.Status(str(tmp_path / "jdllm" / "xla"), "jdllm") and os.path.isdir(st.path)


def test_env_moves_it_off_disables_it_and_jax_own_setting_wins(tmp_path):
    assert compile_cache.resolve({"JDLLM_CACHE_DIR": str(tmp_path / "c")}).path == str(tmp_path / "c")
    assert compile_cache.resolve({"JDLLM_CACHE_DIR": " OFF "}) == compile_cache.Status(None, "off")
    theirs = {"JAX_COMPILATION_CACHE_DIR": "/their/dir", "JDLLM_CACHE_DIR": str(tmp_path / "c2")}
    assert compile_cache.resolve(theirs) == compile_cache.Status("/their/dir", "jax")
    assert compile_cache.resolve({"JDLLM_CACHE_DIR": "off"}, jax_dir="/set/in/jax.config").source == "jax"
    assert not os.path.exists(tmp_path / "c2")


def test_a_file_path_is_a_jdllm_error_naming_it(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with pytest.raises(errors.CacheDirError, match="not-a-dir.*is a file.*JDLLM_CACHE_DIR=off") as info:
        compile_cache.resolve({"JDLLM_CACHE_DIR": str(f)})
    assert isinstance(info.value, errors.JdllmError)


def test_an_unusable_dir_warns_once_and_turns_the_cache_off(tmp_path):
    (tmp_path / "file").write_text("x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = compile_cache.resolve({"JDLLM_CACHE_DIR": str(tmp_path / "file" / "sub")})  # cannot be created
    assert st == compile_cache.Status(None, "unusable")
    assert len(caught) == 1 and "cannot be written" in str(caught[0].message)
    with warnings.catch_warnings(record=True) as caught:  # the default dir in the way: a warning, not an error
        warnings.simplefilter("always")
        st = compile_cache.resolve({"XDG_CACHE_HOME": str(tmp_path / "file")})
    assert st.source == "unusable" and len(caught) == 1


def test_unreadable_entries_are_removed_with_one_warning(tmp_path):
    (tmp_path / "jit_a-0123-cache").write_bytes(b"garbage, not zstd")
    (tmp_path / "jit_b-4567-cache").write_bytes(b"")
    (tmp_path / "jit_c-89ab-cache").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 8)  # a zstd frame: kept
    (tmp_path / "notes.txt").write_text("not an entry: kept")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = compile_cache.resolve({"JDLLM_CACHE_DIR": str(tmp_path)})
    assert st.source == "jdllm" and len(caught) == 1 and "2 unreadable entries" in str(caught[0].message)
    assert sorted(os.listdir(tmp_path)) == ["jit_c-89ab-cache", "notes.txt"]


# --------------------------------------------------------------------------- what JAX does with it (subprocesses)
@slow
def test_generate_fills_the_dir_and_a_warm_process_gives_the_same_outputs(runs, reference):
    cold = runs["moved"].result()
    d = pathlib.Path(cold["path"])
    assert cold["source"] == "jdllm" and d.name == "c" and cold["warnings"] == []
    names = entries(d)
    assert any("run" in n for n in names), names  # the decode program
    same(cold, reference)
    for n in names:  # corrupt every entry: the next process removes them, warns once, compiles again
        (d / n).write_bytes(b"\0garbage")
    warm = Child(runs["moved"].tmp, runs["model"], JDLLM_CACHE_DIR=d).result()
    assert len(warm["warnings"]) == 1 and "unreadable entries" in warm["warnings"][0], warm["warnings"]
    same(warm, reference)
    assert entries(d) == names  # written again


@slow
def test_default_dir_used(runs, reference):
    on = runs["default"].result()
    default = runs["default"].tmp / "xdg" / "jdllm" / "xla"
    assert on["path"] == str(default) and entries(default)
    assert on["min_time"] == compile_cache.MIN_COMPILE_TIME_SECS
    same(on, reference)


@slow
def test_jax_compilation_cache_dir_wins(runs, reference):
    out = runs["jax"].result()
    tmp = runs["jax"].tmp
    assert out["source"] == "jax" and out["path"] == str(tmp / "theirs") and not os.path.exists(tmp / "ours")
    assert out["min_time"] == 1.0  # JAX's own default: jdllm changed none of JAX's settings
    same(out, reference)


@slow
def test_unwritable_dir_one_warning_and_the_right_outputs(runs, reference):
    out = runs["unwritable"].result()
    assert out["source"] == "unusable" and len(out["warnings"]) == 1, out["warnings"]
    assert "cannot be written" in out["warnings"][0]
    same(out, reference)


def test_cli_names_a_file_cache_dir_and_exits_2(tmp_path):
    f = tmp_path / "cache-file"
    f.write_text("x")
    env = subprocess_env(JDLLM_CACHE_DIR=str(f))
    res = subprocess.run([sys.executable, "-m", "jdllm.cli", "generate", TINY_AR, "--prompt-ids", "5,6"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"jdllm generate: error: CacheDirError: JDLLM_CACHE_DIR={f} is a file" in res.stderr, res.stderr
