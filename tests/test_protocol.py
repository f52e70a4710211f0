"""The `Paradigm` protocol's claims, checked with paradigms defined here: a paradigm is one class
plus one registry line, and jdllm drives it through its members, never by its name."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import ClassVar

import jax
import numpy as np
import pytest

import jdllm
from jdllm import constraints, rl
from jdllm.decode import protocol
from jdllm.decode.protocol import Paradigm
from jdllm.serve.engine import Engine
from tests.decode_fixtures import FAST_COMPILE, causal_model

_AR = jdllm.AR()


@dataclasses.dataclass(frozen=True)
class ToyAR(Paradigm):
    """A paradigm no jdllm module knows by name: AR's step pieces, but batches that start together
    once the pool has drained (serving's other join rule) and one length per batch."""

    name: ClassVar[str] = "toy_ar"
    joins_running_batch: ClassVar[bool] = False
    first_step_in_prefill: ClassVar[bool] = True  # AR's prefill samples the first token (takes a mask)
    fast_forward: ClassVar[bool] = False  # forced tokens are sampled one step each (no catch-up forward)
    is_autoregressive: ClassVar[bool] = True
    replay_method: ClassVar[str] = "teacher_forcing"

    def validate(self, cfg):
        _AR.validate(cfg)

    def layout(self, lengths, max_new_tokens, cfg):
        return _AR.layout(lengths, max_new_tokens, cfg)

    def prefill(self, params, ctx, state, bitmask=None):
        return _AR.prefill(params, ctx, state, bitmask)

    def plan(self, ctx, state):
        return _AR.plan(ctx, state)

    def forward(self, params, ctx, state, plan):
        return _AR.forward(params, ctx, state, plan)

    def reveal(self, ctx, state, plan, logits, bitmask=None):
        return _AR.reveal(ctx, state, plan, logits, bitmask)

    def max_iterations(self, state):
        return _AR.max_iterations(state)


@pytest.fixture
def registered():
    """ToyAR registered with its one line for this test, the registry restored afterwards."""
    protocol.register(ToyAR)
    yield ToyAR
    protocol.PARADIGMS.pop(ToyAR.name)


@pytest.mark.usefixtures("fast_compile", "registered")
def test_a_new_paradigm_is_served():
    """ToyAR, registered with one line, is served by the engine under its own join rule: a request
    arriving while a batch decodes waits for it to drain, though a row is free. Each output equals
    `jdllm.generate` with ToyAR on that prompt alone (tokens, steps, NFE, finish, log-probs)."""
    assert protocol.paradigm_class("toy_ar") is ToyAR

    m, par = causal_model(), ToyAR()
    prompts = [[5, 17, 3, 44, 9], [70, 2, 8]]
    settings = [jdllm.Sampling(max_new_tokens=8, stop_token_ids=()),
                jdllm.Sampling(max_new_tokens=8, stop_token_ids=(), temperature=0.8, seed=3)]
    eng = Engine(m, par, max_batch=2, max_prompt_tokens=8, max_new_tokens=8, steps_per_round=2,
                 compiler_options=FAST_COMPILE)
    first = eng.submit(prompts[0], settings[0])
    eng.step_round()
    second = eng.submit(prompts[1], settings[1])
    eng.step_round()
    assert (first.status, second.status) == ("running", "waiting")  # a free row, but the batch has not drained
    eng.run_until_idle()
    for p, s, r in zip(prompts, settings, (first, second)):
        want = jdllm.generate(m, [p], par, s)[0]
        got = r.output
        assert (got.token_ids, got.step_map, got.nfe, got.finish_reason) == \
            (want.token_ids, want.step_map, want.nfe, want.finish_reason)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert [t for ev in r.events if ev.kind == "tokens" for t in ev.token_ids] == got.token_ids
    assert eng.stats()["rows_free"] == 2 and eng.stats()["tracked"] == 0


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.usefixtures("fast_compile", "registered")
def test_a_new_paradigm_is_constrained():
    """The llguidance backend drives ToyAR through its members (first step in prefill, no fast-forward,
    the default masks): outputs match the regex and equal AR's constrained outputs token for token."""
    model = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    prompts = ["add:12+34=", "sort:3 1 2="]
    s = jdllm.Sampling(max_new_tokens=8)
    c = constraints.regex(r"[0-9]{1,3}")
    toy = jdllm.generate(model, prompts, ToyAR(), s, constraint=c)
    ar = jdllm.generate(model, prompts, jdllm.AR(), s, constraint=c)
    for t, a in zip(toy, ar):
        assert re.fullmatch(r"[0-9]{1,3}", t.text) and t.constraint_ok
        assert (t.token_ids, t.step_map) == (a.token_ids, a.step_map)


@pytest.mark.usefixtures("registered")
def test_a_new_paradigm_is_replayed():
    """`jdllm.rl` rolls ToyAR out and replays it by the method ToyAR names (teacher forcing): the
    replayed log-probs equal those recorded while decoding, at temperature 1."""
    model = causal_model()
    state, spec = rl.prepare_rollout(model, [[5, 17, 3, 44, 9], [70, 2, 8]], ToyAR(),
                                     jdllm.Sampling(temperature=1.0, max_new_tokens=6, stop_token_ids=()), group=2)
    with jdllm.compiler_options(**dict(FAST_COMPILE)):
        ro = jax.jit(rl.rollout, static_argnames=("spec",))(model.params, state, jax.random.key(3), spec=spec)
        lp = jax.jit(rl.trajectory_logprobs, static_argnames=("spec",))(model.params, ro, spec=spec)
    gen = np.asarray(ro.step_map) > 0
    assert gen.sum() == 4 * 6
    np.testing.assert_allclose(np.asarray(lp)[gen], np.asarray(ro.logprobs)[gen], atol=3e-4, rtol=1e-4)
    assert rl.default_method(spec) == "teacher_forcing"
