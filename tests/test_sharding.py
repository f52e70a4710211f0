"""Sharded decoding (jdllm.sharding): equality with one device on 8 fake CPU devices, the
multi-process path with jax.distributed, and the errors a bad mesh or rules table raises.

The meshes need several devices, so those checks run in subprocesses with
XLA_FLAGS=--xla_force_host_platform_device_count=N; this process keeps its one device.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import jdllm
from jdllm import errors, sharding
from tests.quick import slow, slow_except
from tests.scripts import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def equality_run():
    """tests/sharding_cases.py started once, in the background, when the module's first test starts:
    it compiles on one core while the other tests of this module use the other (CI has two)."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "sharding_cases.py"), "quick"],
                            env=subprocess_env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    proc.kill()
    proc.communicate()


@pytest.fixture(autouse=True)
def _start_equality_run(request):
    """Starts the equality run with the module's first test, when this run holds the test that reads it
    (`-m "not slow"` deselects that test: then nothing starts)."""
    if any(item.name == "test_sharded_decoding_equals_one_device" for item in request.session.items):
        request.getfixturevalue("equality_run")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@slow
@pytest.mark.parametrize("source", ["hf", "converted"])
def test_two_processes_give_the_same_tokens_as_one(source, tmp_path):
    """examples/multihost.py in 2 processes (jax.distributed, 2 CPU devices each, gloo collectives)
    loading the shipped tiny-sdar (its Hugging Face directory, or the jdllm checkpoint `convert`
    makes of it: Orbax restoring each process's slices) into one 2x2 global mesh == one process on
    one device."""
    model_dir = os.path.join(ROOT, "models", "tiny-sdar")
    if source == "converted":
        from convert.io import convert_checkpoint  # noqa: PLC0415

        model_dir = convert_checkpoint(model_dir, str(tmp_path / "ck"), dtype="float32", progress=False)
    port = _free_port()
    args = [sys.executable, os.path.join(ROOT, "examples", "multihost.py"), "--model", model_dir,
            "--coordinator", f"localhost:{port}", "--num-processes", "2", "--mesh", "data=2,model=2",
            "--max-new-tokens", "8", "--ignore-eos", "--json"]
    procs = [subprocess.Popen(args + ["--process-id", str(i)], env=subprocess_env(2), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = _json_lines(outs[0][0])[0]
    assert got["processes"] == 2 and got["devices"] == 4 and got["mesh"] == {"data": 2, "model": 2}

    model = jdllm.load(model_dir, dtype="float32")
    ref = jdllm.generate(model, [[3, 4, 5, 6, 7], [8, 9, 10]],
                         sampling=jdllm.Sampling(max_new_tokens=8, stop_token_ids=()))
    assert got["tokens"] == [o.token_ids for o in ref]
    assert got["step_map"] == [o.step_map for o in ref]
    assert got["nfe"] == [o.nfe for o in ref]


def test_mesh_and_rules_errors():
    with pytest.raises(errors.ShardingError, match="part 'tensor=4'"):
        sharding.parse_mesh_spec("data=2,tensor=4")
    with pytest.raises(errors.ShardingError, match="twice"):
        sharding.parse_mesh_spec("data=2,data=4")
    with pytest.raises(errors.ShardingError, match="needs 8 devices but 1"):
        sharding.make_mesh("data=2,model=4")
    with pytest.raises(errors.ShardingError, match="'experts'"):
        sharding.make_rules({"experts": "model"})
    mesh = sharding.make_mesh("data=1")
    with pytest.raises(errors.ShardingError, match="'tensor'"):
        sharding.Placement.of(mesh, {"mlp": "tensor"})
    with pytest.raises(errors.ArgumentTypeError, match="Mesh"):
        jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), mesh="data=2")
    with pytest.raises(errors.ShardingError, match="needs a mesh"):
        jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), rules={"mlp": None})


@pytest.mark.parametrize("command", slow_except([["generate", "--prompt-ids", "1,2"], ["serve", "--port", "1"]],
                                                 ["generate", "--prompt-ids", "1,2"]))
def test_cli_mesh_option_refuses_a_bad_mesh(command):
    res = subprocess.run([sys.executable, "-m", "jdllm.cli", command[0], os.path.join(ROOT, "models", "tiny-ar"),
                          "--mesh", "data=2,model=4", *command[1:]], capture_output=True, text=True,
                         cwd=ROOT, env=subprocess_env(1), timeout=300)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "needs 8 devices but 1" in res.stderr, res.stderr


def test_engine_mesh_errors():
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    model = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    with pytest.raises(errors.ShardingError, match="needs a mesh"):
        Engine(model, rules={"mlp": None})
    with pytest.raises(errors.ArgumentTypeError, match="Mesh"):
        Engine(model, mesh="data=2")


def test_one_device_mesh_is_a_no_op():
    """A 1x1 mesh: load(mesh=) places every weight on it and computes the logits of a plain load."""
    path = os.path.join(ROOT, "models", "tiny-ar")
    plain = jdllm.load(path, dtype="float32")
    meshed = jdllm.load(path, dtype="float32", mesh=sharding.make_mesh("data=1,model=1"))
    assert meshed.placement is not None and meshed.params["layers"][0]["qkv"].sharding.mesh.shape["model"] == 1
    np.testing.assert_array_equal(np.asarray(jdllm.logits(plain, [[1, 2, 3]])),
                                  np.asarray(jdllm.logits(meshed, [[1, 2, 3]])))


@slow
def test_sharded_decoding_equals_one_device(equality_run):
    """Every paradigm on the 2x4 mesh (the Pallas kernels per shard on 1x8), an RL
    rollout on sharded params, the serving engine on 2x4 with staggered requests: greedy tokens, step maps, NFE and finish reasons equal to one device's;
    logits equal up to float32 summation order; weights really split over `model`; no retrace on a
    second call. (`python tests/sharding_cases.py all` runs every paradigm x 8x1 / 1x8 / 2x4.)"""
    out, err = equality_run.communicate(timeout=600)
    assert equality_run.returncode == 0, err[-3000:]
    rows = _json_lines(out)
    seen = {(r["paradigm"], r["mesh"]) for r in rows if "paradigm" in r}
    assert {(name, "2x4") for name in ("ar", "ar_spec", "block_diffusion", "multi_block", "masked_diffusion")} \
        | {("pallas_block_diffusion", "1x8"), ("pallas_logits", "2x4"), ("rl_rollout", "2x4"),
           ("serve_block_diffusion", "2x4"), ("quant_int8_block_diffusion", "2x4")} <= seen, seen
    for r in (r for r in rows if "paradigm" in r):
        assert r["equal"], r
        assert r["split"], r
        assert r.get("retraced", 0) == 0, r
        # logits: sums over sharded heads / MLP columns add in another order (float32); the
        # peaked test weights (logits ~20) amplify that to a relative ~1e-5
        assert r.get("logit_diff", 0.0) <= 1e-5, r
        assert r.get("peaked_diff", 0.0) <= 5e-5 * r.get("peaked_scale", 1.0), r
    errs = {r["error"]: r["message"] for r in rows if "error" in r}
    assert "kv_heads" in errs["indivisible"] and "['layers']['k']" in errs["indivisible"]
    assert "ShardingError" == errs["indivisible_type"]
    assert errs["engine_rows"].startswith("ShardingError") and "'data'" in errs["engine_rows"]
