"""jdllm.rl.tunix_bridge.JdllmRollout: tunix's rollout interface backed by jdllm (AR policies).

google-tunix is an optional extra (it pins an older transformers and pulls ~40 packages), so CI runs
this against the interface itself: the same class, a field-for-field RolloutOutput, a RolloutConfig
with tunix's field names. With tunix installed the class subclasses tunix's BaseRollout and the
config is tunix's own; the same assertions run. Nothing here skips.
"""

from __future__ import annotations

import dataclasses
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm import errors, tasks
from jdllm.rl import tunix_bridge
from jdllm.rl.tunix_bridge import JdllmRollout
from tests.quick import slow

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIELDS = ("text", "logits", "tokens", "left_padded_prompt_tokens", "logprobs")


def _config(**kw):
    base = dict(max_tokens_to_generate=8, temperature=1.0, top_p=1.0, top_k=None, seed=None, max_prompt_length=16,
                eos_tokens=None, return_logprobs=True)
    base.update(kw)
    if tunix_bridge.HAVE_TUNIX:
        from tunix.rl.rollout.base_rollout import RolloutConfig  # noqa: PLC0415

        return RolloutConfig(**base)
    return types.SimpleNamespace(**base)


@slow
def test_tunix_rollout_interface_on_tiny_ar():
    model = jdllm.load(os.path.join(ROOT, "models/tiny-ar"), dtype="float32", attn_impl="xla")
    if tunix_bridge.HAVE_TUNIX:
        from tunix.rl.rollout.base_rollout import BaseRollout  # noqa: PLC0415

        assert issubclass(JdllmRollout, BaseRollout)
    # tunix builds the engine as engine(rollout_actor=, tokenizer=, mesh=, rollout_config=)
    engine = JdllmRollout(rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None, model=model)
    prompts = [ex.prompt for ex in tasks.test_set(6, seed=0)]
    out = engine.generate(prompts, _config(seed=jnp.int32(3)))
    assert [f.name for f in dataclasses.fields(out)] == list(FIELDS)
    assert out.logits is None and len(out.text) == len(out.tokens) == len(out.logprobs) == len(prompts)

    # left-padded prompts: right-aligned token ids, pad elsewhere
    P = out.left_padded_prompt_tokens
    assert P.shape == (len(prompts), 16)
    for b, p in enumerate(prompts):
        ids = tasks.encode(p)
        np.testing.assert_array_equal(P[b, 16 - len(ids):], ids)
        assert np.all(P[b, :16 - len(ids)] == engine.pad_id())
        assert engine.eos_id() not in out.tokens[b].tolist()  # completions end before the stop token
        assert out.text[b] == tasks.decode(out.tokens[b])

    # the recorded sampling log-probs (T=1) = teacher forcing by get_per_token_logps = an independent
    # reference: log_softmax of jdllm.logits over prompt + completion
    C = max(len(t) for t in out.tokens)
    comp = np.full((len(prompts), C), engine.pad_id(), np.int32)
    for b, t in enumerate(out.tokens):
        comp[b, :len(t)] = t
    lp = np.asarray(engine.get_per_token_logps(P, comp))
    assert lp.shape == (len(prompts), C)
    seqs = [list(tasks.encode(p)) + out.tokens[b].tolist() for b, p in enumerate(prompts)]
    full = np.asarray(jax.nn.log_softmax(jdllm.logits(model, seqs), -1))  # one call, rows left-padded
    T = full.shape[1]
    for b in range(len(prompts)):
        n = len(out.tokens[b])
        ref = np.asarray([full[b, T - n - 1 + i, out.tokens[b][i]] for i in range(n)])
        np.testing.assert_allclose(out.logprobs[b], ref, atol=2e-4)
        np.testing.assert_allclose(lp[b, :n], ref, atol=2e-4)

    # the same seed gives the same samples; greedy equals jdllm.generate
    again = engine.generate(prompts, _config(seed=jnp.int32(3)))
    assert all(np.array_equal(a, b) for a, b in zip(again.tokens, out.tokens))
    greedy = engine.generate(prompts, _config(temperature=0.0, return_logprobs=False))
    ref = jdllm.generate(model, prompts, jdllm.AR(), jdllm.Sampling(max_new_tokens=8))
    assert greedy.logprobs is None
    for g, o in zip(greedy.tokens, ref):
        ids = list(o.token_ids)
        assert g.tolist() == (ids[:-1] if ids and ids[-1] == engine.eos_id() else ids)

    # update_params: new weights are used (through param_map), wrong shapes refused
    engine2 = JdllmRollout(model=model, param_map=lambda w: w["jdllm"])
    scaled = jax.tree.map(lambda x: x * 0.5, model.params)
    engine2.update_params({"jdllm": scaled})
    assert not np.allclose(np.asarray(engine2.get_per_token_logps(P, comp)), lp, atol=1e-3)
    bad = dict(model.params, embed=jnp.zeros((3, 3)))
    with pytest.raises(errors.ConfigError):
        engine2.update_params({"jdllm": bad})


def test_tunix_rollout_refuses_diffusion_policies():
    """A tunix learner scores completions left to right: a diffusion policy's likelihood is order-dependent."""
    llada = jdllm.load(os.path.join(ROOT, "models/tiny-llada"), dtype="float32")
    with pytest.raises(errors.InputError, match="step_map"):
        JdllmRollout(model=llada, decoding=jdllm.MaskedDiffusion())
    ar = jdllm.load(os.path.join(ROOT, "models/tiny-ar"), dtype="float32")
    with pytest.raises(errors.InputError, match="autoregressive"):
        JdllmRollout(model=ar, decoding=jdllm.BlockDiffusion(block_length=4))
    with pytest.raises(errors.ArgumentTypeError):
        JdllmRollout(rollout_actor=None, tokenizer=None, mesh=None, rollout_config=None)
