"""The tests compile with XLA CPU flags users do not get (the root conftest: LLVM level 0, the older
elemental emitters in place of the MLIR fusion emitters), because compiling is most of their time.
Here every paradigm decodes on the shipped models under XLA's own defaults (a child process whose
XLA_FLAGS is empty: what `pip install jdllm` runs) and under the tests' flags (this process), and
the two must agree token for token: the step maps, forward counts and finish reasons too, the
log-probs to 1e-4. A flag that changed what jdllm computes would fail here, not hide in every
other test's reference. The conftest's own rule (a flag of yours wins, an unknown one is left out)
is checked too.

    python tests/test_xla_cpu_codegen.py     # the cases' outputs as JSON, under this process's XLA_FLAGS
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    sys.path.insert(0, ROOT)

import jdllm  # noqa: E402
from jdllm import tasks  # noqa: E402
from tests.quick import slow  # noqa: E402
from tests.scripts import load_script, subprocess_env  # noqa: E402

MODELS = os.path.join(ROOT, "models")
RANDOM = "random:"  # a shipped model's config and tokenizer, random weights (init std 0.02: flat distributions)


def cases():
    """(model directory, decoding, sampling of each prompt) for every paradigm and cache mode
    family; sampled rows on random weights (the shipped models are too sure of their answers for
    a seed to change them), so the random streams are compared too."""
    greedy = jdllm.Sampling(max_new_tokens=12)
    sampled = [jdllm.Sampling(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3),
               jdllm.Sampling(max_new_tokens=12, temperature=0.7, top_k=20, seed=4), greedy]
    return {
        "ar": ("tiny-ar", jdllm.AR(), [greedy] * 3),
        "ar_sampled": (RANDOM + "tiny-ar", jdllm.AR(), sampled),
        "block_diffusion_sampled": (RANDOM + "tiny-sdar", jdllm.BlockDiffusion(block_length=4, denoising_steps=4),
                                    sampled),
        "ar_spec": ("tiny-ar", jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=3, max_ngram=2),
                    [greedy] * 3),
        "block_diffusion": ("tiny-sdar", jdllm.BlockDiffusion(block_length=4, denoising_steps=4,
                                                              strategy="low_confidence_dynamic",
                                                              confidence_threshold=0.9), [greedy] * 3),
        "multi_block": ("tiny-sdar", jdllm.MultiBlock(block_size=4), [greedy] * 3),
        "masked_diffusion": ("tiny-llada", jdllm.MaskedDiffusion(steps=12, block_length=12, confidence_threshold=0.9,
                                                                 cache_mode="dual"), [greedy] * 3),
        "multi_block_approx": ("tiny-llada", jdllm.MultiBlock(block_size=4, cache_mode="approx"), [greedy] * 3),
    }


def load(directory: str) -> jdllm.Model:
    if not directory.startswith(RANDOM):
        return jdllm.load(os.path.join(MODELS, directory), dtype="float32")
    import jax  # noqa: PLC0415

    from jdllm.model import init_params, unstack_layers  # noqa: PLC0415

    shipped = load(directory.removeprefix(RANDOM))
    params = unstack_layers(init_params(shipped.config, jax.random.key(0), std=0.02))
    return jdllm.Model(shipped.config, params, tokenizer=shipped.tokenizer, attn_impl=shipped.attn_impl)


def decode_all() -> dict:
    prompts = [e.prompt for e in tasks.test_set(3, seed=0)]
    got, models = {}, {}
    for name, (directory, decoding, sampling) in cases().items():
        if directory not in models:
            models[directory] = load(directory)
        outs = jdllm.generate(models[directory], prompts, decoding, sampling, apply_chat_template=False)
        got[name] = [dict(token_ids=o.token_ids, step_map=o.step_map, nfe=o.nfe, finish=o.finish_reason,
                          logprobs=[float(x) for x in o.logprobs]) for o in outs]
    return got


def test_the_tests_flags_are_added_once_and_only_where_xla_knows_them():
    root = load_script("conftest.py")
    level, emitters = root.FAST_XLA_FLAGS
    assert root.fast_xla_flags("", knows=lambda f: True) == f"{level} {emitters}"
    assert root.fast_xla_flags("", knows=lambda f: False) == level  # an unknown flag would abort XLA
    assert root.fast_xla_flags("--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=true",
                               knows=lambda f: True) == \
        "--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=true"  # yours win
    assert not root._xla_knows("--xla_no_such_flag_in_any_jaxlib=1")


@slow
def test_xla_default_cpu_flags_decode_as_the_tests_flags():
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=subprocess_env(XLA_FLAGS="", JDLLM_CACHE_DIR="off"))
    try:
        ours = decode_all()  # while the child compiles on the other core
        out, err = child.communicate(timeout=900)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    theirs = json.loads(out.splitlines()[-1])
    assert sorted(theirs) == sorted(ours)
    for name in ours:
        for row, (a, b) in enumerate(zip(ours[name], theirs[name])):
            where = f"{name} row {row}"
            assert {k: v for k, v in a.items() if k != "logprobs"} == \
                   {k: v for k, v in b.items() if k != "logprobs"}, where
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-4, err_msg=where)


if __name__ == "__main__":
    from jdllm.cli import quiet_transformers

    quiet_transformers()
    print(json.dumps(decode_all()))
