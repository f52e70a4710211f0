"""What a first `jdllm.load` and `jdllm.generate` compile besides the decode program.

`jnp.asarray` of a NumPy array is a `lax.stage`: an XLA program compiled per shape and dtype. The
host data a first `generate` moves to the device (tokens, masks, per-row settings, stop ids) once
compiled 20 such programs beside the decode on tiny-ar, and `load` one per distinct weight shape;
on a GPU each is an XLA:GPU compile in the cold process and a persistent-cache load in a warm one,
paid by every first call; the serving engine compiled one per count of rows it closed. Host data
now moves by `jdllm.inputs.to_device` (a transfer), row indices as NumPy scalars. The
programs are counted in a fresh process (`jax.monitoring`'s compile events), so what earlier tests
compiled cannot hide one.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

from jdllm.inputs import to_device
from tests.scripts import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import collections, json, sys
import jax
names = collections.Counter()
phase = ["load"]
def seen(event, secs, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        names[phase[0] + " " + str(kw.get("fun_name"))] += 1
jax.monitoring.register_event_duration_secs_listener(seen)
import jdllm
S = jdllm.Sampling(max_new_tokens=6, stop_token_ids=())
ar = jdllm.load(sys.argv[1] + "/tiny-ar", dtype="float32")
q8 = jdllm.load(sys.argv[1] + "/tiny-ar", dtype="float32", quantize="int8")
sdar = jdllm.load(sys.argv[1] + "/tiny-sdar", dtype="float32")
phase[0] = "generate"
jdllm.generate(ar, [[5, 6, 7], [8, 9]], jdllm.AR(), S)
jdllm.generate(q8, [[5, 6, 7], [8, 9]], jdllm.AR(), S)
jdllm.generate(sdar, [[5, 6, 7], [8, 9]], jdllm.BlockDiffusion(block_length=4, denoising_steps=4), S)
from jdllm.serve.engine import Engine
phase[0] = "serve"
eng = Engine(ar, jdllm.AR(), max_batch=2, max_prompt_tokens=8, max_new_tokens=8, steps_per_round=2)
for wave in ("serve", "serve again"):
    phase[0] = wave
    for i, p in enumerate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]):  # rows freed and reused
        eng.submit(p, jdllm.Sampling(max_new_tokens=3 + i, stop_token_ids=()))
        eng.step_round()
    eng.run_until_idle()
print(json.dumps(names))
"""


def test_a_first_load_and_generate_compile_no_program_per_host_array():
    env = subprocess_env(JDLLM_CACHE_DIR="off")
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(ROOT, "models")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    names = collections.Counter(json.loads(out.stdout.strip().splitlines()[-1]))
    # the three decode programs were seen: the listener works
    assert names["generate jit(run)"] == 3, names
    # per generate: the decode and one program making the state's zeroed fields and PRNG keys
    assert {n for n in names if n.startswith("generate")} == {"generate jit(run)", "generate jit(_fresh_arrays)"}, names
    # load: only the fusion of q / k / v and gate / up (one concatenate per distinct shape)
    assert {n for n in names if n.startswith("load")} <= {"load jit(concatenate)"}, names
    # the serving engine: its pool's buffers, its two pieces and a row state's fresh arrays, once; a
    # second wave nothing
    assert {n for n in names if n.startswith("serve ")} == {
        "serve jit(with_buffers)", "serve jit(_fresh_arrays)", "serve jit(admit_row)", "serve jit(run_round)"}, names
    assert not any(n.startswith("serve again") for n in names), names
    assert not any("stage" in n or "convert_element_type" in n for n in names), names


def test_to_device_moves_host_data_like_jnp_asarray():
    import jax
    import jax.numpy as jnp
    import numpy as np

    for x, dtype in ((np.arange(6, dtype=np.int64).reshape(2, 3), None), ([0.5, 1.0], np.float32),
                     (np.ones((2, 2), bool), None), ([1, 2], np.int32), (3, None)):
        got, want = to_device(x, dtype), jnp.asarray(x, dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    a = jnp.arange(3)
    assert to_device(a) is a  # a device array passes through
    assert to_device(a, jnp.float32).dtype == jnp.float32
    assert isinstance(to_device([1, 2]), jax.Array)
