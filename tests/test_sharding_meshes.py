"""Meshes that training code brings (`jax.make_mesh`: Explicit axes by default, Auto ones, a
hand-made mesh with an extra `fsdp` axis) and jdllm inside a user's own jitted, sharded optax loop.

The multi-device checks run in subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=8
(tests/mesh_cases.py, examples/rl_own_loop.py) and compare with one device; this process keeps one
device for the rules checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jdllm
from jdllm import errors, sharding
from tests.quick import slow
from tests.scripts import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(args: list[str], devices: int | None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=subprocess_env(devices), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


OWN_LOOP = [os.path.join(ROOT, "examples", "rl_own_loop.py"), "--steps", "3", "--inner", "3", "--json"]


@pytest.fixture(scope="module")
def runs(request):
    """The subprocesses of this module's slow tests, all started when the module's first test starts
    (tests/mesh_cases.py as two processes of about equal length, the Explicit mesh and the others, and
    examples/rl_own_loop.py on 8 devices and on one: on 2 cores no core waits for another), each read by
    its test; only those whose test this run holds start."""
    held = {item.name for item in request.session.items if item.module is request.module}
    procs = {}
    if "test_training_meshes_equal_one_device" in held:
        cases = os.path.join(ROOT, "tests", "mesh_cases.py")
        procs["explicit"] = _start([cases, "explicit"], devices=8)
        procs["other_meshes"] = _start([cases, "auto", "fsdp", "data_only", "errors"], devices=8)
    if "test_own_jitted_loop_on_a_sharded_train_state" in held:
        procs["sharded"] = _start(OWN_LOOP + ["--devices", "8", "--mesh", "4x2"], devices=None)
        procs["single"] = _start(OWN_LOOP + ["--devices", "1", "--mesh", "none"], devices=None)
    yield procs
    for p in procs.values():  # read ones are done already; one whose test failed early is stopped
        p.kill()
        p.wait()


@pytest.fixture(autouse=True)
def _start_runs(runs):
    """Starts `runs` with the module's first test, whichever it is."""


def _rows(proc: subprocess.Popen) -> list[dict]:
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@slow
def test_training_meshes_equal_one_device(runs):
    """load + generate (and no retrace on a second call), logits, the host-driven steps, a rollout and
    its replay, the serving engine (and on the Explicit mesh the other paradigms' generate): on jax.make_mesh((4, 2), ("data", "model")) with Explicit and with
    Auto axes and on a hand-made data x fsdp x model mesh (rows over ("data", "fsdp")), greedy tokens
    equal one device's, logits and log-probs up to float32 summation order, every array on the
    user's mesh; a mesh axis no rule names is refused with the rule to pass."""
    rows = _rows(runs["explicit"]) + _rows(runs["other_meshes"])
    seen = {(r["mesh"], r["path"]) for r in rows if "path" in r}
    want = {("explicit", p) for p in ("generate", "logits", "host_steps", "rollout", "serve", "paradigm_ar_spec",
                                      "paradigm_multi_block", "paradigm_masked_diffusion")} \
        | {("auto", p) for p in ("generate", "logits", "rollout")} \
        | {("fsdp", p) for p in ("generate", "rollout", "serve")} | {("data_only", "logits")}
    assert want <= seen, seen
    for r in (r for r in rows if "path" in r):
        assert r["equal"], r
        assert r.get("split", True) and r.get("params_on_mesh", True), r
        assert r.get("state_on_mesh", True) and r.get("on_mesh", True) and r.get("cache_on_mesh", True), r
        assert r.get("retraced", 0) == 0, r
        assert r.get("logit_diff", 0.0) <= 1e-4 and r.get("logprob_diff", 0.0) <= 1e-4, r
        assert r.get("replay_diff", 0.0) <= 1e-4, r
    errs = {r["error"]: r["message"] for r in rows if "error" in r}
    assert errs["unnamed_fsdp"].startswith("ShardingError") and "'fsdp'" in errs["unnamed_fsdp"], errs
    assert "rules={'batch': ('data', 'fsdp')}" in errs["unnamed_fsdp"] and "'q_heads': 'model'" in errs["unnamed_fsdp"]
    assert errs["other_names"].startswith("ShardingError") and "'x'" in errs["other_names"], errs


@slow
def test_own_jitted_loop_on_a_sharded_train_state(runs):
    """examples/rl_own_loop.py: rollout + replay + GRPO loss + Adam inside the user's own jax.jit, the
    train state placed the user's way on an Explicit 4x2 mesh of 8 devices. The loss falls within
    every step (updates on one rollout), the params keep exactly the shardings they were placed with
    (no gather), the step compiles once, and the first step matches the same loop on one device."""
    sharded, single = _rows(runs["sharded"])[-1], _rows(runs["single"])[-1]
    assert sharded["devices"] == 8 and sharded["mesh"] == {"data": 4, "model": 2}
    assert sharded["axis_types"] == ["AxisType.Explicit"] * 2
    assert sharded["kept_shardings"] and sharded["split"] == sharded["matrices"] > 0
    assert sharded["train_step_traces"] == 1
    for losses in sharded["losses"]:
        assert all(b < a for a, b in zip(losses, losses[1:])), sharded["losses"]
    assert sharded["first_tokens"] == single["first_tokens"]
    np.testing.assert_allclose(sharded["losses"][0], single["losses"][0], atol=1e-5)


def _mesh(names, types=AxisType.Explicit):
    return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(names)), names, axis_types=(types,) * len(names))


def test_rules_adapt_to_the_mesh():
    """A default rule whose mesh axis the mesh lacks replicates; a size-1 extra axis needs no rule;
    a rule may name several mesh axes; a rule the user gives that names a missing axis is refused."""
    p = sharding.Placement.of(_mesh(("data",)))
    assert p.axis("batch") == "data" and p.axis("q_heads") is None and p.axis("vocab") is None
    p = sharding.Placement.of(_mesh(("data", "fsdp", "model")), {"batch": ("data", "fsdp")})
    assert p.axis("batch") == ("data", "fsdp") and p.batch_multiple() == 1 and p.axis("mlp") == "model"
    assert p.spec(("batch", "length")) == jax.sharding.PartitionSpec(("data", "fsdp"), None)
    assert sharding.Placement.of(_mesh(("data", "model", "pipeline"))).axis("batch") == "data"
    with pytest.raises(errors.ShardingError, match="'tensor'"):
        sharding.Placement.of(_mesh(("data", "model")), {"mlp": "tensor"})
    assert p.auto_mesh.axis_types == (AxisType.Auto,) * 3 and p.auto_mesh.axis_names == p.mesh.axis_names


@pytest.mark.parametrize("types", [AxisType.Explicit, AxisType.Auto])
def test_one_device_mesh_of_either_axis_type(types):
    """load(mesh=) on a one-device mesh of either axis type computes the logits of a plain load, and
    they come back on the user's mesh."""
    path = os.path.join(ROOT, "models", "tiny-ar")
    mesh = _mesh(("data", "model"), types)
    meshed = jdllm.load(path, dtype="float32", mesh=mesh)
    got = jdllm.logits(meshed, [[1, 2, 3]])
    assert got.sharding.mesh == mesh
    np.testing.assert_array_equal(np.asarray(jdllm.logits(jdllm.load(path, dtype="float32"), [[1, 2, 3]])),
                                  np.asarray(got))
