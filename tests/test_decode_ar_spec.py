"""`ar_spec` (jdllm.Speculative): greedy output equals jdllm.AR token for token (prompt lookup and a
draft model, batch 1 and a mixed batch), sampled output follows the target's exact distribution
(chi-square against the distribution computed from full forwards; a wrong acceptance rule fails
the same test), rows advance independently, trajectory fields, bad input, no retrace."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

import jdllm
from jdllm.api import outputs, params_for, prepare
from jdllm.config import ModelConfig
from jdllm.decode import ar_spec, loop
from jdllm.loading import Model
from jdllm.model import init_params
from jdllm.sampling import filter_logits
from tests.compiles import traces
from tests.decode_fixtures import FAST_COMPILE, block_model, causal_model
from tests.quick import slow, slow_except
from tests.reference_decoders import full_logits

pytestmark = pytest.mark.usefixtures("fast_compile")

# repetitive prompts, so prompt lookup finds matches; one short row
PROMPTS = [[5, 17, 3, 44, 9, 5, 17, 3, 44, 9, 5, 17], [70, 2, 31], [8, 8, 21, 8, 8, 21, 8]]


@functools.lru_cache(maxsize=None)
def draft_for(target: Model, noise: float = 0.05, seed: int = 7) -> Model:
    """A draft: the target's weights plus noise (same vocabulary; agrees often, not always)."""
    leaves, tree = jax.tree.flatten(target.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + noise * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return Model(target.config, jax.tree.unflatten(tree, noisy), attn_impl="xla")


def _spec(proposer: str, m: Model, k: int = 3) -> jdllm.Speculative:
    if proposer == "draft_model":
        return jdllm.Speculative(draft=draft_for(m), num_draft_tokens=k)
    return jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=k, max_ngram=3)


def _settings():
    """Rows of different lengths (one canvas bucket with k = 3), the first with a stop token it meets."""
    return [jdllm.Sampling(max_new_tokens=n, stop_token_ids=()) for n in (13, 8, 11)]


def _fields(o):
    return (o.token_ids, o.step_map, o.nfe, o.finish_reason, o.trace)


@pytest.mark.parametrize("proposer", slow_except(["prompt_lookup", "draft_model"], "prompt_lookup"))
def test_greedy_equals_ar_and_rows_advance_independently(proposer):
    """Greedy: every row equals jdllm.AR token for token (log-probs too), alone and in a mixed batch
    (different prompt lengths, limits and a stop token). Rows move by their own accepted counts: in
    the batch each row decodes exactly as alone (step_map, nfe, trace), rows end after different
    numbers of steps, and each cache length is exactly the row's committed text (prompt + output - 1)
    for target and draft: rejected drafts leave no hole."""
    m = causal_model()
    spec = _spec(proposer, m)
    settings = _settings()
    ar = [jdllm.generate(m, [p], jdllm.AR(), s)[0] for p, s in zip(PROMPTS, settings)]
    stop = ar[0].token_ids[6]
    settings[0] = jdllm.Sampling(max_new_tokens=13, stop_token_ids=(stop,))
    ar[0] = jdllm.generate(m, [PROMPTS[0]], jdllm.AR(), settings[0])[0]
    assert ar[0].finish_reason == "stop" and len(ar[0].token_ids) <= 7

    alone = [jdllm.generate(m, [p], spec, s)[0] for p, s in zip(PROMPTS, settings)]
    prep = prepare(m, PROMPTS, spec, settings)
    final = loop.compiled()(params_for(m, spec), prep.state, paradigm=prep.paradigm, ctx=prep.ctx)
    batch = outputs(prep, final)
    assert [_fields(o) for o in batch] == [_fields(o) for o in alone]
    for got, want in zip(batch, ar):
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-4, rtol=1e-4)
        # tokens verified together share a step; nfe = prefill + one target forward per step
        assert got.step_map[0] == 1 and all(0 <= b - a <= 1 for a, b in zip(got.step_map, got.step_map[1:]))
        assert got.nfe == 1 + got.step_map[-1]
        assert 0 <= got.trace["drafts_accepted"] <= got.trace["drafts_proposed"]
    assert sum(o.trace["drafts_accepted"] for o in batch) > 0
    assert len({o.step_map[-1] for o in batch}) > 1  # rows took different numbers of steps
    want = [len(p) + len(o.token_ids) - 1 for p, o in zip(PROMPTS, batch)]
    assert np.asarray(final.cache.length)[:3].tolist() == want
    if proposer == "draft_model":
        assert np.asarray(final.extra["draft_cache"].length)[:3].tolist() == want
        assert any(o.trace["drafts_accepted"] < o.trace["drafts_proposed"] for o in batch)  # rejections too
        assert sum(o.nfe for o in batch) < sum(o.nfe for o in ar)  # fewer target forwards than AR
        assert all(o.trace["draft_forwards"] == 1 + 3 * (o.nfe - 1) for o in batch)  # prefill + k per step


# --------------------------------------------------------------------------- exact sampling
V_SMALL = 8


@functools.lru_cache(maxsize=None)
def tiny_vocab_model(seed: int, std: float = 0.5) -> Model:
    cfg = ModelConfig(model_type="qwen3", vocab_size=V_SMALL, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True,
                      max_position_embeddings=64, eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(seed), std=std), attn_impl="xla")


def _filtered_probs(logits, s: jdllm.Sampling) -> np.ndarray:
    z = filter_logits(np.asarray(logits)[None], temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)[0]
    p = np.exp(np.asarray(z, np.float64) - np.max(z))
    return p / p.sum()


def _joint_first_two(m: Model, prompt, s: jdllm.Sampling) -> np.ndarray:
    """Exact P(t1, t2) [V, V] of the target's sampling distribution, from full forwards."""
    p1 = _filtered_probs(full_logits(m.params, m.config, prompt)[-1], s)
    joint = np.zeros((V_SMALL, V_SMALL))
    for t in range(V_SMALL):
        if p1[t] > 0:
            joint[t] = p1[t] * _filtered_probs(full_logits(m.params, m.config, list(prompt) + [t])[-1], s)
    return joint


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square over cells with expected count >= 5 (the rest pooled into one cell)."""
    n = counts.sum()
    exp = probs.ravel() * n
    obs = counts.ravel()
    big = exp >= 5
    e = np.append(exp[big], exp[~big].sum())
    o = np.append(obs[big], obs[~big].sum())
    keep = e > 0
    stat = float(np.sum((o[keep] - e[keep]) ** 2 / e[keep])) + (np.inf if np.any(o[~keep] > 0) else 0.0)
    return stat, int(keep.sum()) - 1


@slow
@pytest.mark.parametrize("proposer", ["draft_model", "prompt_lookup"])
def test_sampled_output_follows_the_target_distribution(proposer, monkeypatch):
    """The first two sampled tokens over 4096 rows (independent streams) against the exact joint
    distribution of the target after temperature / top-k / top-p. The threshold (about p < 1e-4)
    is met by the exact rule and missed by one that accepts every draft."""
    target, other = tiny_vocab_model(0), tiny_vocab_model(3, std=1.5)  # a draft far from the target
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # a repetitive prompt, so prompt lookup proposes
    s = jdllm.Sampling(temperature=1.3, top_k=6, top_p=0.97, max_new_tokens=2, stop_token_ids=(), seed=11)
    spec = (jdllm.Speculative(draft=other, num_draft_tokens=2) if proposer == "draft_model"
            else jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=2, max_ngram=2))
    N = 4096
    prep = prepare(target, [prompt] * N, spec, s)
    joint = _joint_first_two(target, prompt, s)

    def counts(run):
        final = run(params_for(target, spec), prep.state, paradigm=spec, ctx=prep.ctx)
        toks = np.asarray(final.tokens)[:, len(prompt):len(prompt) + 2]
        c = np.zeros((V_SMALL, V_SMALL))
        np.add.at(c, (toks[:, 0], toks[:, 1]), 1)
        return c, final

    c, final = counts(loop.compiled())
    stat, dof = _chi2(c, joint)
    threshold = dof + 4.0 * np.sqrt(2.0 * dof)
    assert stat < threshold, (stat, threshold)
    acc = np.asarray(final.extra["accepted"]).sum()
    assert 0 < acc < np.asarray(final.extra["proposed"]).sum()  # both branches of the rule ran

    if proposer == "prompt_lookup":
        return
    # the same test fails a rule that accepts every draft (a fresh jit traces the patched rule)
    monkeypatch.setattr(ar_spec, "accept_drafts", lambda pd, qd, u, is_max, greedy: is_max | (pd >= 0))
    def fresh(params, state, *, paradigm, ctx):  # a new function: jax's trace cache cannot answer it
        return loop.run(params, state, paradigm=paradigm, ctx=ctx)

    wrong, _ = counts(loop._jit(fresh, compiler_options=FAST_COMPILE))
    assert _chi2(wrong, joint)[0] > threshold


# --------------------------------------------------------------------------- errors, retrace
def test_bad_input_raises_before_compiling():
    m = causal_model()
    E = jdllm.errors.DecodingConfigError
    for kw, word in ((dict(num_draft_tokens=0), "num_draft_tokens=0"), (dict(num_draft_tokens=1000), "1000"),
                     (dict(min_ngram=4, max_ngram=2), "min_ngram=4"), (dict(proposer="magic"), "magic"),
                     (dict(proposer="draft_model"), "draft"),
                     (dict(proposer="prompt_lookup", draft=m), "proposer='prompt_lookup'")):
        with pytest.raises(E, match=word):
            jdllm.Speculative(**kw)
    other_vocab = tiny_vocab_model(0)
    with traces() as seen:
        for target, draft, word in ((m, other_vocab, "vocab_size"), (m, block_model(), "attention"),
                                    (block_model(), m, "causal target")):
            with pytest.raises(E, match=word):
                jdllm.generate(target, [[1, 2, 3]], jdllm.Speculative(draft=draft))
    assert seen["run"] == 0

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    a = Model(m.config, m.params, tokenizer=Tok({"a": 0, "b": 1}), attn_impl="xla")
    b = Model(m.config, m.params, tokenizer=Tok({"a": 0, "c": 1}), attn_impl="xla")
    with pytest.raises(E, match="tokenizer"):
        jdllm.generate(a, [[1, 2, 3]], jdllm.Speculative(draft=b))
    # the message says how they differ: the first token id that reads differently (same size or not)
    for target, draft, how in (
            ({"a": 0, "b": 1}, {"a": 0, "c": 1}, "token id 1 is 'c' in the draft's tokenizer but 'b' in the target's"),
            ({"a": 0, "b": 1}, {"b": 0, "a": 1}, "token id 0 is 'b' in the draft's tokenizer but 'a' in the target's"),
            ({"a": 0, "b": 1}, {"a": 0}, "token id 1 is missing from the draft's tokenizer but 'b' in the target's"),
            ({"a": 0}, {"a": 0, "z": 1}, "token id 1 is 'z' in the draft's tokenizer but missing from the target's"),
            ({"a": 0, "b": 0}, {"a": 0, "b": 1}, "token id 1 is 'b' in the draft's tokenizer but missing from the "
                                                 "target's"),
            ({"a": 0, "b": 0}, {"a": 0, "c": 0}, "token 'b' is missing from the draft's tokenizer but has id 0 in "
                                                 "the target's")):
        with pytest.raises(E, match=re.escape(how)):
            jdllm.generate(Model(m.config, m.params, tokenizer=Tok(target), attn_impl="xla"), [[1, 2, 3]],
                           jdllm.Speculative(draft=Model(m.config, m.params, tokenizer=Tok(draft), attn_impl="xla")))
    assert seen["run"] == 0


@slow
def test_second_call_does_not_retrace_even_with_another_draft_of_the_same_shape():
    m = causal_model()
    run = lambda draft: jdllm.generate(m, PROMPTS, jdllm.Speculative(draft=draft, num_draft_tokens=3),  # noqa: E731
                                       _settings())
    first = run(draft_for(m))
    with traces() as seen:
        again, other = run(draft_for(m)), run(draft_for(m, seed=8))
    assert seen["run"] == 0
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == [o.token_ids for o in other]


# --------------------------------------------------------------------------- command line, shipped draft
@slow
def test_cli_generate_and_bench_with_the_shipped_draft(tmp_path, capsys):
    import json
    import os

    from jdllm import cli

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target_dir, draft_dir = os.path.join(root, "models", "tiny-ar"), os.path.join(root, "models", "tiny-ar-draft")
    prompts = ["rev:abcde="]  # batch 1, 6 new tokens: the same AR compile as the bench below
    ar = jdllm.generate(jdllm.load(target_dir), prompts, jdllm.AR(), jdllm.Sampling(max_new_tokens=6))
    args = ["generate", target_dir, "--prompt", prompts[0], "--max-new-tokens", "6", "--paradigm", "ar_spec"]
    assert cli.main(args + ["--draft", draft_dir, "--num-draft-tokens", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if not line.startswith("===")] == [o.text for o in ar]
    assert cli.main(args + ["--proposer", "prompt_lookup", "--min-ngram", "3", "--max-ngram", "2"]) == 2
    assert "min_ngram=3" in capsys.readouterr().err

    report = str(tmp_path / "bench.json")
    rc = cli.main(["bench", target_dir, "--batch", "1", "--prompt-len", "6", "--max-new-tokens", "6",
                   "--repeats", "1", "--paradigm", "ar_spec", "--proposer", "prompt_lookup", "--json", report])
    assert rc == 0 and "acceptance" in capsys.readouterr().out
    (row,) = json.load(open(report))["rows"]
    assert row["same_tokens_as_baseline"] and row["baseline"] == "ar"
    assert 0 <= row["acceptance_rate"] <= 1 and row["baseline_tokens_per_s"] > 0
