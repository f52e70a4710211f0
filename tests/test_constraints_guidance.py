"""The llguidance backend: greedy constrained AR equals a plain-loop reference, sampled
outputs of every supported paradigm pass independent checkers (re / json + a schema check /
the lark parser), fast-forward saves forwards without changing tokens, draft masks equal
masks computed one by one, bad constraints fail before anything compiles."""

from __future__ import annotations

import functools
import json
import re

import jax
import numpy as np
import pytest

import jdllm
from jdllm import constraints as C
from jdllm.config import ModelConfig
from jdllm.constraints import guidance as G
from jdllm.decode import loop
from jdllm.errors import ConstraintError
from jdllm.loading import Model
from jdllm.model import init_params
from tests.compiles import traces
from tests.decode_fixtures import FAST_COMPILE
from tests.quick import slow, slow_except

lark = pytest.importorskip("lark")  # in the [test] extra: never skipped in CI


pytestmark = pytest.mark.usefixtures("fast_compile")


@functools.lru_cache(maxsize=None)
def shipped(name: str) -> Model:
    return jdllm.load(f"models/{name}", dtype="float32")


@functools.lru_cache(maxsize=None)
def random_model(kind: str, seed: int = 3) -> Model:
    """Random peaked weights over the shipped character vocabulary (48 tokens, eos 1, mask 2)."""
    extra = dict(attention="block_causal", block_size=4, mask_token_id=2) if kind == "block" else {}
    cfg = ModelConfig(model_type="sdar" if kind == "block" else "qwen3", vocab_size=48, hidden_size=48,
                      intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      max_position_embeddings=128, eos_token_ids=(1,), pad_token_id=0, **extra)
    return Model(cfg, init_params(cfg, jax.random.key(seed), std=0.7), tokenizer=shipped("tiny-ar").tokenizer,
                 attn_impl="xla")


# --------------------------------------------------------------------------- independent checkers
REGEX = r"[a-e]{2,4}( [0-9]+)?"
SCHEMA = {"anyOf": [{"type": "integer", "minimum": -20, "maximum": 300}, {"type": "boolean"}, {"type": "null"}]}
LARK = 'start: "(" expr ")"\nexpr: term ("+" term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'


def schema_ok(text: str) -> bool:
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False
    if v is None or isinstance(v, bool):
        return True
    return isinstance(v, int) and -20 <= v <= 300


_parser = None


def lark_ok(text: str) -> bool:
    global _parser
    _parser = _parser or lark.Lark(LARK, start="start", parser="earley")
    try:
        _parser.parse(text)
        return True
    except lark.exceptions.LarkError:
        return False


CHECKS = [(C.regex(REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
          (C.json_schema(SCHEMA), schema_ok), (C.lark(LARK), lark_ok)]


# --------------------------------------------------------------------------- greedy AR vs a plain loop
def reference_ar(model: Model, prompts: list[list[int]], cons: list, max_new: int, T: int = 48) -> list[list[int]]:
    """Plain loop: full forward of every whole sequence (no cache, one fixed shape), a fresh llguidance
    matcher's mask, argmax; a row stops at eos."""
    import llguidance
    import llguidance.numpy

    V = model.config.vocab_size
    ms = [llguidance.LLMatcher(G.ll_tokenizer(model), G.grammar(c), log_level=0) for c in cons]
    ids, outs = [list(p) for p in prompts], [[] for _ in prompts]
    for _ in range(max_new):
        z = np.asarray(jdllm.logits(model, [r + [0] * (T - len(r)) for r in ids]))
        for b, m in enumerate(ms):
            if outs[b] and outs[b][-1] == 1:
                continue
            mask = np.zeros((1, (V + 31) // 32), np.int32)
            llguidance.numpy.fill_next_token_bitmask(m, mask)
            t = int(np.argmax(np.where(G._unpack(mask[0], V), z[b, len(ids[b]) - 1], -np.inf)))
            assert m.consume_token(t)
            outs[b].append(t)
            ids[b].append(t)
    return outs


PROMPTS = ["add:12+34=", "rev:abcd=", "sort:3 1 2="]
S16 = jdllm.Sampling(temperature=0.0, max_new_tokens=16)  # one shape bucket for every call on a model


@pytest.mark.parametrize("name", slow_except(["tiny-ar", "random"], "tiny-ar"))
def test_greedy_constrained_ar_equals_plain_loop(name):
    model = shipped("tiny-ar") if name == "tiny-ar" else random_model("causal")
    cons = [C.lark(LARK), C.regex(REGEX), C.json_schema(SCHEMA)]
    outs = jdllm.generate(model, PROMPTS, jdllm.AR(), S16, constraint=cons)
    ids = [model.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    for o, ref in zip(outs, reference_ar(model, ids, cons, 16)):
        assert o.token_ids == ref
        assert o.constraint_ok == (o.finish_reason == "stop")


# --------------------------------------------------------------------------- sampled: independent checkers
@slow
@pytest.mark.parametrize("name, decoding", [
    ("tiny-ar", jdllm.AR()),
    ("random-causal", jdllm.AR()),
    ("tiny-sdar", jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_dynamic", confidence_threshold=0.6)),
    ("random-block", jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_static", denoising_steps=2)),
    ("tiny-llada", jdllm.MaskedDiffusion(block_length=4, steps=8)),
    ("tiny-ar", jdllm.Speculative(num_draft_tokens=3)),
    ("tiny-sdar", jdllm.MultiBlock(block_size=4, entropy_threshold=1.0)),
    ("random-block", jdllm.MultiBlock(block_size=4, entropy_threshold=2.0, block_add_threshold=0.25,
                                      decoded_token_threshold=0.25, max_blocks=3)),
])
def test_sampled_outputs_pass_independent_checkers(name, decoding):
    model = {"tiny-ar": lambda: shipped("tiny-ar"), "tiny-sdar": lambda: shipped("tiny-sdar"),
             "tiny-llada": lambda: shipped("tiny-llada"),
             "random-causal": lambda: random_model("causal"), "random-block": lambda: random_model("block")}[name]()
    n = 48  # 48 rows (16 per constraint kind, each its own seed) in batches of 4: 192 generations in all
    prompts = ["add:7+8=", "rev:abc=", "sort:2 1="] * (n // 3)
    rows = [CHECKS[i % 3] for i in range(n)]
    samp = [jdllm.Sampling(temperature=1.0, max_new_tokens=16, seed=100 + i) for i in range(n)]
    stats = G.Stats()
    outs = []
    for i in range(0, n, 4):
        outs += G.generate_constrained(model, prompts[i:i + 4], decoding, samp[i:i + 4], [c for c, _ in rows[i:i + 4]],
                           stats=stats)
    finished = 0
    for (c, check), o in zip(rows, outs):
        assert o.finish_reason in ("stop", "length"), o
        body = o.text
        if o.finish_reason == "stop":
            finished += 1
            assert o.token_ids[-1] == 1 and check(body), (c.kind, body)
            assert o.constraint_ok
        else:
            assert len(o.token_ids) == 16 and o.constraint_ok == check(body), (c.kind, body)
        assert min(o.step_map) >= 1 and o.nfe >= 1
    assert finished >= n // 4  # not vacuous: a good share of rows ended with eos
    if decoding.name in ("block_diffusion", "multi_block", "masked_diffusion"):
        print(f"{name}: {stats.backtracked} re-masked provisional tokens")


# --------------------------------------------------------------------------- ar_spec
@slow
@pytest.mark.parametrize("proposer", ["prompt_lookup", "draft_model"])
def test_greedy_constrained_ar_spec_equals_constrained_ar(proposer):
    """Verification under draft-token masks keeps ar_spec exact: greedy tokens equal greedy constrained AR."""
    model = shipped("tiny-ar")
    spec = jdllm.Speculative(num_draft_tokens=3, draft="models/tiny-ar-draft" if proposer == "draft_model" else None)
    cons = [C.lark(LARK), C.regex(REGEX), C.json_schema(SCHEMA), None]
    prompts = PROMPTS + ["sort:5 3 4="]
    ref = jdllm.generate(model, prompts, jdllm.AR(), S16, constraint=cons)
    got = jdllm.generate(model, prompts, spec, S16, constraint=cons)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids and g.finish_reason == r.finish_reason == "stop"
        assert g.constraint_ok == r.constraint_ok
    assert any(g.trace["drafts_accepted"] > 0 for g in got)  # drafts were verified, not only corrections


@slow
def test_ar_spec_verification_uses_draft_masks(monkeypatch):
    """The masks `reveal` gets are the one-by-one masks after each draft (Controller.verify_masks)."""
    model = shipped("tiny-ar")
    seen = []
    orig = G.Controller.verify_masks

    def spy(self, drafts, n_draft, done):
        out = orig(self, drafts, n_draft, done)
        seen.append((drafts.copy(), n_draft.copy(), [m.deep_copy() if m is not None else None for m in self.m],
                     out.copy(), done.copy()))
        return out

    monkeypatch.setattr(G.Controller, "verify_masks", spy)
    c = C.regex("[a-d]{3,5}")
    jdllm.generate(model, ["rev:abcd=", "rev:dcba="], jdllm.Speculative(num_draft_tokens=3), S16, constraint=c)
    import llguidance.numpy

    checked = 0
    for drafts, n, ms, out, done in seen:
        for b, m in enumerate(ms):
            if done[b]:
                continue
            for i in range(int(n[b]) + 1):
                one = np.zeros((1, 2), np.int32)
                llguidance.numpy.fill_next_token_bitmask(m, one)
                ref = G._unpack(one[0], 48)
                if not ref.any():
                    break
                np.testing.assert_array_equal(G._unpack(out[b, i], 48), ref)
                checked += 1
                if i == int(n[b]) or not m.consume_token(int(drafts[b, i])):
                    break
    assert checked >= 6


# --------------------------------------------------------------------------- fast-forward
@slow
@pytest.mark.parametrize("name, decoding", [("tiny-ar", jdllm.AR()),
                                            ("tiny-sdar", jdllm.BlockDiffusion(block_length=4))])
def test_fast_forward_saves_forwards_same_tokens(name, decoding):
    model = shipped(name)
    c = C.lark('start: "name:" /[a-z]{2,4}/ ",age:" /[0-9]/')
    fast = G.generate_constrained(model, PROMPTS, decoding, S16, [c] * 3)
    slow = G.generate_constrained(model, PROMPTS, decoding, S16, [c] * 3, fast_forward=False)
    for f, w in zip(fast, slow):
        assert re.fullmatch("name:[a-z]{2,4},age:[0-9]", f.text) and f.finish_reason == "stop" and f.constraint_ok
        if decoding.name == "ar":  # the same tokens, forced ones cost no forward of their own
            assert f.token_ids == w.token_ids and w.finish_reason == "stop"
            assert w.nfe == len(w.token_ids) and f.nfe < len(f.token_ids) - 8
        else:  # diffusion: forced tokens also change what the model sees, so only the cost is compared
            assert re.fullmatch("name:[a-z]{2,4},age:[0-9]", w.text) and f.nfe <= w.nfe
    assert sum(f.nfe for f in fast) < sum(w.nfe for w in slow)


# --------------------------------------------------------------------------- draft-token masks
def test_draft_masks_equal_one_by_one():
    model = shipped("tiny-ar")
    lt = G.ll_tokenizer(model)
    tok = model.tokenizer
    cons = [C.lark(LARK), C.regex(REGEX), None]
    drafts = [tok.encode("(12+(3)", add_special_tokens=False), tok.encode("abz 1", add_special_tokens=False), [5, 6]]
    ctl = G.Controller(lt, [G.matcher(c, lt) if c else None for c in cons], 48, [0] * 3, [32] * 3, [[1]] * 3)
    got = ctl.draft_masks(drafts)
    assert got.shape == (3, 8, 2)
    for b, (c, d) in enumerate(zip(cons, drafts)):
        if c is None:
            assert (got[b] == -1).all()
            continue
        m = G.matcher(c, lt)
        for i in range(len(d) + 1):
            one = np.zeros((1, 2), np.int32)
            if not m.is_error():
                import llguidance.numpy
                llguidance.numpy.fill_next_token_bitmask(m, one)
            ok = G._unpack(got[b, i], 48)
            if m.is_error():  # the draft was cut before position i: nothing allowed
                assert not ok.any()
            else:
                np.testing.assert_array_equal(ok, G._unpack(one[0], 48))
            if i < len(d):
                m.consume_token(d[i])
    assert not ctl.m[1].is_error() and ctl.m[1].validate_tokens(drafts[1]) == 2  # matchers left untouched


# --------------------------------------------------------------------------- endings and errors
@slow
def test_length_exhausted_row_ends_length_not_ok():
    model = shipped("tiny-ar")
    s = jdllm.Sampling(temperature=1.0, max_new_tokens=5)
    outs = jdllm.generate(model, PROMPTS, sampling=s, constraint=[C.regex("[a-z]{20}"), None, C.regex("[0-9]{2,}")])
    assert outs[0].finish_reason == "length" and outs[0].constraint_ok is False
    assert re.fullmatch("[a-z]{5}", outs[0].text)
    assert outs[1].constraint_ok is None
    assert outs[2].constraint_ok == (outs[2].finish_reason == "stop")


@slow
def test_free_rows_equal_unconstrained_and_no_retrace(fast_compile):
    model = shipped("tiny-ar")
    free = jdllm.generate(model, PROMPTS, sampling=S16)
    with traces() as seen:
        mixed = jdllm.generate(model, PROMPTS, sampling=S16, constraint=[None, C.regex("[0-9]"), None])
    for b in (0, 2):
        assert (mixed[b].token_ids, mixed[b].step_map, mixed[b].nfe) == (free[b].token_ids, free[b].step_map,
                                                                         free[b].nfe)
    assert re.fullmatch("[0-9]", mixed[1].text) and mixed[1].finish_reason == "stop"
    with traces() as again:
        jdllm.generate(model, PROMPTS, sampling=S16, constraint=[C.regex("[a-c]+"), C.regex("[0-9]"), None])
    assert sum(again.values()) == 0  # the same shapes do not retrace
    assert seen["run"] == 0  # constrained calls never build the one-jit loop


@pytest.mark.parametrize("make, match", [
    (lambda: C.regex("(("), "not valid"),
    (lambda: C.json_schema({"type": "integer", "minimum": 5, "maximum": 3}), "not valid"),
    (lambda: C.lark("start: foo"), "not valid"),
    (lambda: C.regex("[A-Z]+"), "empty language"),
    (lambda: C.choice(["YES", "NO"]), "empty language"),
    (lambda: C.lark('start: x\nx: "q" x'), "empty language.*'x'"),  # no rule ends: nothing derives
    (lambda: C.json_schema(False), "empty language"),
    (lambda: C.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "empty language"),
])
def test_bad_constraints_raise_before_compiling(make, match):
    model = shipped("tiny-ar")
    steps = loop.compiled_steps(FAST_COMPILE)
    sizes = {k: f._cache_size() for k, f in steps.items()}
    with pytest.raises(ConstraintError, match=match):
        jdllm.generate(model, [[13, 14, 42]], sampling=S16, constraint=make())
    assert {k: f._cache_size() for k, f in steps.items()} == sizes


EMPTY_LARK = [
    'start: x\nx: "q" x',
    'start: a | b\na: "(" a ")"\nb: "[" a "]"',
    'start: x+\nx: "q" x',
    'start: "a" (x | y)\nx: y "b"\ny: x "c"',
    'start: x{2,3}\nx: "q" x',
    '// a comment: x\nstart: x # trailing\nx: "q" x\n  | "r" x',
]
NONEMPTY_LARK = [
    'start: x\nx: "q" x | "r"',
    'start: x*\nx: "q" x',  # x* derives the empty string
    'start: [x]\nx: "q" x',
    'start: x{0,2}\nx: "q" x',
    'start: x?\nx: "q" x',
    'start: "a" | x\nx: "q" x',
    'start: x\nx: "q" x\n  | NUMBER\nNUMBER: /[0-9]+/',
    LARK,
    'start: n\nn: %json {"type": "integer", "minimum": 0}',
    'start: x\nx: "(" x ")" | ""',
    'start: x\nx[lazy]: /[a-z]+/',
]


@pytest.mark.parametrize("grammar", EMPTY_LARK + NONEMPTY_LARK)
def test_lark_empty_language_is_found_before_decoding(grammar):
    """A Lark grammar none of whose derivations ends (a rule that always needs itself again) has an empty
    language: a ConstraintError before decoding, like an empty-language regex; a recursive rule with a way
    out, an optional or starred use of one, stays valid."""
    lt = G.ll_tokenizer(shipped("tiny-ar"))
    if grammar in EMPTY_LARK:
        with pytest.raises(ConstraintError, match="empty language"):
            G.matcher(C.lark(grammar), lt)
    else:
        G.matcher(C.lark(grammar), lt)


def test_unsatisfiable_schema_message_is_jdllm_s():
    lt = G.ll_tokenizer(shipped("tiny-ar"))
    with pytest.raises(ConstraintError) as e:
        G.matcher(C.json_schema(False), lt)
    assert "empty language" in str(e.value) and "no JSON document satisfies it" in str(e.value)
    assert "open an issue" not in str(e.value)


def test_no_tokenizer_raises():
    m = random_model("causal")
    bare = Model(m.config, m.params, tokenizer=None, attn_impl="xla")
    with pytest.raises(ConstraintError, match="tokenizer"):
        jdllm.generate(bare, [[13, 14]], sampling=jdllm.Sampling(max_new_tokens=4), constraint=C.regex("a+"))


@slow
@pytest.mark.parametrize("name, decoding", [("tiny-ar", jdllm.AR()),
                                            ("tiny-sdar", jdllm.BlockDiffusion(block_length=4))])
def test_dead_end_ends_length_not_invalid(name, decoding):
    """A grammar that needs a character the vocabulary lacks (no uppercase) after "ab": the row ends
    "length" after the valid prefix, constraint_ok False, never "invalid" or a crash."""
    outs = jdllm.generate(shipped(name), PROMPTS[:2], decoding, S16, constraint=[C.regex("ab[A-Z]"), None])
    assert outs[0].text == "ab" and outs[0].finish_reason == "length" and outs[0].constraint_ok is False
    assert outs[1].constraint_ok is None and outs[1].finish_reason == "stop"


@slow
def test_static_top2_provisional_stop_tokens_keep_free_outputs():
    """Stop tokens may be revealed provisionally: with static top-2 on tiny-sdar a constraint that the
    free answers already satisfy leaves them unchanged (the old rule, no EOS off the frontier,
    turned "iow" into "iowe")."""
    model = shipped("tiny-sdar")
    dec = jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_static", denoising_steps=2)
    prompts = ["rev:woi=", "rev:lhvh=", "rev:vrtxa=", "rev:pbj="]
    free = jdllm.generate(model, prompts, dec, S16)
    got = jdllm.generate(model, prompts, dec, S16, constraint=C.regex("[a-z]{3,6}"))
    assert [f.text for f in free] == ["iow", "hvhl", "axtrv", "jbp"]
    for f, g in zip(free, got):
        assert g.token_ids == f.token_ids and g.finish_reason == "stop" and g.constraint_ok


def test_choice_constraint():
    outs = jdllm.generate(shipped("tiny-ar"), PROMPTS, sampling=S16, constraint=C.choice(["yes", "no", "3"]))
    for out in outs:
        assert out.text in ("yes", "no", "3") and out.finish_reason == "stop" and out.constraint_ok


def test_cli_constraint_flags(tmp_path):
    import argparse

    from jdllm.generate_cli import add_constraint_arguments, constraint_from_args

    p = argparse.ArgumentParser()
    add_constraint_arguments(p)
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "g.lark").write_text(LARK)
    assert constraint_from_args(p.parse_args(["--regex", "a+"])) == C.regex("a+")
    assert constraint_from_args(p.parse_args(["--json-schema", str(tmp_path / "s.json")])) == C.json_schema(SCHEMA)
    assert constraint_from_args(p.parse_args(["--lark", str(tmp_path / "g.lark")])) == C.lark(LARK)
    assert constraint_from_args(p.parse_args([])) is None
    with pytest.raises(ConstraintError, match="cannot read"):
        constraint_from_args(p.parse_args(["--lark", str(tmp_path / "missing.lark")]))
    with pytest.raises(SystemExit):
        p.parse_args(["--regex", "a", "--lark", "x"])


# --------------------------------------------------------------------------- the structured task's models
def _json_answer_ok(text: str) -> bool:
    """tasks.JSON_SCHEMA checked by hand (json.loads + keys / types / ranges), not by llguidance."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(v, dict) and list(v) == ["w", "n"] and isinstance(v["w"], str)
            and re.fullmatch("[a-z]{2,3}", v["w"]) is not None and type(v["n"]) is int and 0 <= v["n"] <= 99)


@slow
@pytest.mark.parametrize("name, decoding", [
    ("tiny-json-ar", jdllm.AR()),
    ("tiny-json-sdar", jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_static", denoising_steps=2)),
])
def test_json_models_sampled_outputs_pass_schema(name, decoding):
    """The shipped json-task models (own alphabet with { } "), sampled at T = 1 under the task's schema:
    every row that ends "stop" passes the hand-written schema check."""
    from jdllm import tasks

    model = shipped(name)
    exs = tasks.test_set(8, seed=0, tasks=("json",))
    samp = [jdllm.Sampling(temperature=1.0, max_new_tokens=24, seed=7 + i) for i in range(8)]
    outs = jdllm.generate(model, [e.prompt for e in exs], decoding, samp,
                          constraint=C.json_schema(tasks.JSON_SCHEMA))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 6
    for o in outs:
        assert o.constraint_ok == (o.finish_reason == "stop") and (o.finish_reason != "stop" or _json_answer_ok(o.text))


# --------------------------------------------------------------------------- multi_block's rewind
@slow
def test_multi_block_rejected_stop_takes_back_eos_fill(monkeypatch):
    """tiny-sdar answers "rev:ab=" with "ba" + EOS; under [a-z]{6,8} multi_block reveals that EOS
    provisionally, fills the slots after it (early stop) and completes blocks; the matcher rejects
    it: the rewind hook must take the fill back and reopen the blocks, so the row goes on to a
    valid 6-8 letter answer (checked by re), its blocks all Completed, step numbers within NFE."""
    model = shipped("tiny-sdar")
    rejected_stops = []
    orig = G.Controller.advance

    def spy(self, tokens, revealed, done, finish):
        e = orig(self, tokens, revealed, done, finish)
        if e is not None:
            rejected_stops.extend((b, int(s)) for b in range(self.batch) for s, k in zip(e.slots[b], e.kind[b])
                                  if k == 2 and int(tokens[b, s]) in self.stops[b])
        return e

    monkeypatch.setattr(G.Controller, "advance", spy)
    prompts = ["rev:ab=", "rev:abc=", "sort:2 1=", "add:1+2="]
    dec = jdllm.MultiBlock(block_size=4, entropy_threshold=1.0)
    outs = jdllm.generate(model, prompts, dec, S16, constraint=C.regex("[a-z]{6,8}"))
    assert len({b for b, _ in rejected_stops}) == 4  # every row had a provisional EOS rejected
    for o in outs:
        assert re.fullmatch("[a-z]{6,8}", o.text) and o.finish_reason == "stop" and o.constraint_ok, o
        assert 1 <= min(o.step_map) and max(o.step_map) <= o.nfe
        assert all(s == 3 for s in o.trace["block_state"]), o.trace  # Completed
        assert all(c >= 0 for _, _, c in o.trace["block_steps"])


# --------------------------------------------------------------------------- ar_spec at a dead end
@slow
def test_ar_spec_dead_end_inside_drafts_equals_ar():
    """A grammar that dead-ends after "ab" (ab[A-Z]: no uppercase in the vocabulary), with drafts
    that run into it (the draft model answers "ab" to "rev:ba=", "abc" to "rev:cba="), and one
    that outlives max_new_tokens: greedy ar_spec ends
    every row where greedy constrained AR does ("length", constraint_ok False), the same tokens;
    nothing emitted is ever taken back (no backtrack: draft cache and counters stay in step), and
    accepted drafts never outnumber the tokens returned."""
    model = shipped("tiny-ar")
    spec = jdllm.Speculative(num_draft_tokens=3, draft="models/tiny-ar-draft")
    prompts = ["rev:ba=", "=ab=", "rev:abc=", "rev:cba="]
    cons = [C.regex("ab[A-Z]"), C.regex("ab[A-Z]"), C.regex("[a-z]{20}"), C.regex("abc[A-Z]")]
    ref = jdllm.generate(model, prompts, jdllm.AR(), S16, constraint=cons)
    stats = G.Stats()
    got = G.generate_constrained(model, prompts, spec, S16, cons, stats=stats)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids and g.finish_reason == r.finish_reason == "length"
        assert g.constraint_ok is False and r.constraint_ok is False
        assert g.trace["drafts_accepted"] <= len(g.token_ids) and 1 <= min(g.step_map)
    assert [len(g.token_ids) for g in got] == [2, 2, 16, 3]
    assert stats.backtracked == 0
    assert any(g.trace["drafts_accepted"] >= 2 and max(g.step_map) == 1 for g in got)  # drafts ran into it


@slow
def test_ar_spec_rewind_keeps_draft_cache_within_target():
    """The ar_spec hook `apply_edits` calls: a re-masked slot lowers the target's cache, and the
    draft model's cache no further than it (a guard: greedy verification never emits a token the
    grammar rejects)."""
    from jdllm import api

    model = shipped("tiny-ar")
    spec = jdllm.Speculative(num_draft_tokens=3, draft="models/tiny-ar-draft")
    prep = api.prepare(model, ["rev:abcd="], spec, S16)
    steps = loop.compiled_steps(FAST_COMPILE)
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)
    state = steps["prefill"](api.params_for(model, spec), prep.state, None, **kw)
    state = steps["step"](api.params_for(model, spec), state, **kw)
    g0 = int(state.gen_start[0])
    assert int(state.cache.length[0]) > g0 and int(state.extra["draft_cache"].length[0]) > g0
    e = [np.array(x, np.int32) for x in ([[g0]], [[0]], [[2]])] + [np.zeros(1, bool), np.zeros(1, np.int32),
                                                                  np.zeros(1, np.int32)]
    state = G.apply_edits(state, *e, fill=2, paradigm=spec, ctx=prep.ctx)
    assert int(state.cache.length[0]) == g0 and int(state.extra["draft_cache"].length[0]) == g0
    assert not bool(state.revealed[0, g0]) and int(state.step_map[0, g0]) == 0
