"""jdllm.rl.tunix_bridge.JdllmRollout: tunix's rollout interface backed by jdllm (AR policies).

Two tiers. The interface tests run everywhere: without google-tunix against the same class, a
field-for-field RolloutOutput and a RolloutConfig with tunix's field names; with tunix
installed the class subclasses tunix's BaseRollout and the config is tunix's own. The tests
marked `tunix` run tunix's own GRPO learner (`RLCluster` / `GRPOLearner`) with JdllmRollout
and the `jdllm.nnx.Model` view as actor and reference; they need `pip install -e ".[tunix]"`
and skip without it. google-tunix 0.1.7 pins safetensors<0.8, which holds transformers at
5.12.1 (5.13 on needs safetensors>=0.8), so it is not in the test extra: `.ci/run` runs this
file in a second venv with the tunix extra.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdllm
import jdllm.nnx
from jdllm import errors, tasks
from jdllm.rl import tunix_bridge
from jdllm.rl.tunix_bridge import JdllmRollout
from tests.quick import slow
from tests.scripts import load_script

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


def test_refusals_name_the_setting():
    """A tunix config jdllm cannot serve: per-step logits, another rollout dtype, a diffusion actor."""
    ar = jdllm.load(os.path.join(ROOT, "models/tiny-ar"), dtype="float32")
    engine = JdllmRollout(model=ar)
    logits_config = _config()
    logits_config.return_logits = True  # tunix 0.1.7's RolloutConfig has no such field; a newer or custom one may
    with pytest.raises(errors.InputError, match="return_logits"):
        engine.generate(["add:1+2="], logits_config)
    with pytest.raises(errors.InputError, match="data_type=bfloat16"):
        JdllmRollout(model=ar, rollout_config=_config(data_type=jnp.bfloat16))
    llada = jdllm.nnx.Model(jdllm.load(os.path.join(ROOT, "models/tiny-llada"), dtype="float32"))
    with pytest.raises(errors.InputError, match="'bidirectional'"):
        JdllmRollout(rollout_actor=llada, tokenizer=None, mesh=None, rollout_config=None)
    with pytest.raises(errors.InputError, match="configs differ"):
        JdllmRollout(rollout_actor=jdllm.nnx.Model(ar), model=dataclasses.replace(
            ar, config=dataclasses.replace(ar.config, rope_theta=5.0)))


def test_engine_follows_the_nnx_actor_and_update_params_checks_every_weight():
    """Built from a jdllm.nnx.Model actor (as tunix builds it), the engine rolls out the actor's
    current weights; update_params writes into the actor, or refuses naming the weight and keeps
    the previous weights."""
    model = jdllm.load(os.path.join(ROOT, "models/tiny-ar"), dtype="float32", attn_impl="xla")
    actor = jdllm.nnx.Model(model)
    engine = JdllmRollout(rollout_actor=actor, tokenizer=None, mesh=None, rollout_config=_config())
    assert engine.model() is actor
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.params()), jax.tree.leaves(model.params)))
    prompt = ["add:1+2="]
    ids = tasks.encode(prompt[0])
    sampled = _config(seed=jnp.int32(5), max_tokens_to_generate=6, eos_tokens=[0])  # stop on pad: ~6 tokens each

    def check(out, weights):  # the rollout's log-probs are `weights`' (jdllm.logits), to float noise
        toks = out.tokens[0].tolist()
        lp = np.asarray(jax.nn.log_softmax(jdllm.logits(weights, [list(ids) + toks]), -1))[0]
        ref = [lp[len(ids) - 1 + i, t] for i, t in enumerate(toks)]
        return len(toks) > 0 and np.max(np.abs(out.logprobs[0] - ref)) < 2e-4

    before = engine.generate(prompt, sampled)
    assert len(before.tokens[0]) == 6 and check(before, model)

    # a weight changed in the actor (as an optimizer step does) is what the next rollout uses
    actor.lm_head[...] = -actor.lm_head[...]
    after = engine.generate(prompt, sampled)
    assert check(after, actor.as_model()) and not check(after, model)

    # update_params with jdllm's pytree or an nnx.state: no mapping function; it writes into the actor
    engine.update_params(model.params)
    assert actor.params()["lm_head"] is model.params["lm_head"]
    assert engine.generate(prompt, sampled).tokens[0].tolist() == before.tokens[0].tolist()
    changed = dict(model.params, lm_head=model.params["lm_head"] * 0.5)
    engine.update_params(nnx.state(jdllm.nnx.Model(dataclasses.replace(model, params=changed))))
    assert actor.params()["lm_head"] is changed["lm_head"]
    halved = engine.generate(prompt, sampled)
    assert check(halved, dataclasses.replace(model, params=changed)) and not check(halved, model)

    # wrong shape / wrong dtype: ConfigError naming the weight, the previous weights stay in use
    kept = engine.params()
    bad_shape = dict(model.params, lm_head=jnp.zeros((3, 3)))
    with pytest.raises(errors.ConfigError, match="lm_head"):
        engine.update_params(bad_shape)
    layers = list(model.params["layers"])
    layers[1] = dict(layers[1], qkv=layers[1]["qkv"].astype(jnp.bfloat16))
    with pytest.raises(errors.ConfigError, match=r"\['layers'\]\[1\]\['qkv'\].*bfloat16"):
        engine.update_params(dict(model.params, layers=tuple(layers)))
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.params()), jax.tree.leaves(kept)))
    assert engine.generate(prompt, sampled).tokens[0].tolist() == halved.tokens[0].tolist()


@slow
def test_speculative_rollouts_with_a_draft_model():
    """Speculative sampling draws from the target: the engine rolls out with the draft's weights bound
    (Speculative.bind_params), and greedy equals jdllm.generate with the same decoding."""
    target = jdllm.load(os.path.join(ROOT, "models/tiny-ar"), dtype="float32", attn_impl="xla")
    draft = jdllm.load(os.path.join(ROOT, "models/tiny-ar-draft"), dtype="float32", attn_impl="xla")
    spec = jdllm.Speculative(proposer="draft_model", draft=draft, num_draft_tokens=2)
    engine = JdllmRollout(rollout_actor=jdllm.nnx.Model(target), decoding=spec)
    prompts = [ex.prompt for ex in tasks.test_set(3, seed=2)]
    out = engine.generate(prompts, _config(temperature=0.0, return_logprobs=False, max_tokens_to_generate=6))
    ref = jdllm.generate(target, prompts, spec, jdllm.Sampling(max_new_tokens=6))
    for g, o in zip(out.tokens, ref):
        ids = list(o.token_ids)
        assert g.tolist() == (ids[:-1] if ids and ids[-1] == engine.eos_id() else ids)


@slow
@pytest.mark.tunix
@pytest.mark.skipif(not tunix_bridge.HAVE_TUNIX, reason='google-tunix is not installed (pip install -e ".[tunix]")')
def test_tunix_grpo_learner_trains_the_nnx_view_with_jdllm_rollouts():
    """tunix's own GRPOLearner for 2 steps on tiny-ar (examples/rl_tunix.py): the actor's weights
    move, and the engine's rollouts and scores are those of the trained weights."""
    from tunix.rl.rollout.base_rollout import BaseRollout  # noqa: PLC0415

    ex = load_script("examples/rl_tunix.py")
    path = os.path.join(ROOT, "models/tiny-ar")
    cluster, times = ex.run_jdllm(path, steps=2, batch=2, group=2, max_new=6, lr=3e-3)
    assert len(times["step"]) == 2 and len(times["rollout"]) == 2

    initial = jdllm.load(path, dtype="float32", attn_impl="xla")
    actor = cluster.actor_trainer.model
    engine = cluster.rollout
    assert isinstance(engine, JdllmRollout) and isinstance(engine, BaseRollout)
    assert isinstance(actor, jdllm.nnx.Model) and engine.model() is actor
    trained = actor.params()
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(initial.params))]
    assert min(moved) > 0, moved  # every weight was updated
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.params()), jax.tree.leaves(trained)))

    # the engine's rollout log-probs and teacher-forced scores = the trained forward's (jdllm.logits
    # of the actor's weights), not the initial weights'
    prompts = [ex.prompt for ex in tasks.test_set(4, seed=1)]
    out = engine.generate(prompts, _config(seed=jnp.int32(0), max_tokens_to_generate=6))
    seqs = [list(tasks.encode(p)) + out.tokens[b].tolist() for b, p in enumerate(prompts)]
    for weights, same in ((actor.as_model(), True), (initial, False)):
        full = np.asarray(jax.nn.log_softmax(jdllm.logits(weights, seqs), -1))
        T = full.shape[1]
        diffs = []
        for b in range(len(prompts)):
            n = len(out.tokens[b])
            ref = np.asarray([full[b, T - n - 1 + i, out.tokens[b][i]] for i in range(n)])
            diffs.append(np.max(np.abs(out.logprobs[b] - ref)) if n else 0.0)
        assert (max(diffs) < 2e-4) == same, diffs


@pytest.mark.skipif(importlib.util.find_spec("tunix") is not None, reason="what the example says without tunix")
def test_example_without_tunix_says_how_to_install_it():
    """Without google-tunix the example stops at once with the install line (it raised ModuleNotFoundError
    after ~20 s of loading)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from tests.scripts import ROOT, subprocess_env  # noqa: PLC0415

    res = subprocess.run([sys.executable, "examples/rl_tunix.py", "--steps", "1"], capture_output=True, text=True,
                         cwd=ROOT, env=subprocess_env(), timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert 'pip install -e ".[tunix]"' in res.stderr, res.stderr
