"""The "dfa" constraint backend: exact masks under any reveal order (against a brute-force oracle),
joint consistency, budget awareness, every paradigm's sampled outputs match, greedy AR against a
plain-loop reference masked by brute force, and purity under jit(vmap)."""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm import constraints
from jdllm.constraints import dfa, dfa_compile, dfa_device
from jdllm.errors import ConstraintError
from compiles import traces
from decode_fixtures import FAST_COMPILE
from reference_decoders import _distribution, full_logits
from tests.quick import slow

# --------------------------------------------------------------------------- the exhaustive oracle
# tiny vocabulary: 0 = pad (special), 1 = stop, 2 = mask, then texts (multi-character ones too)
TEXTS = ["a", "b", "ab", "1", "2", " ", "{\"a\":", "}"]
STRINGS = [None, None, None] + TEXTS
STOP, MASK = 1, 2
V = len(STRINGS)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PATTERNS = [r"ab|ba|a1", r"(ab|1){1,2}2?", r"\d( \d)*", r"(a|b)*b", "SCHEMA"]


def _pattern(p):
    return dfa_compile.regex_of("json_schema", json.dumps(SCHEMA)) if p == "SCHEMA" else p


def _valid(pattern, seq):
    """The output a row returns for this completed window, judged by Python's re."""
    text = []
    for t in seq:
        if t == STOP:
            return re.fullmatch(pattern, "".join(text)) is not None
        if STRINGS[t] is None:
            return False
        text.append(STRINGS[t])
    return re.fullmatch(pattern, "".join(text)) is not None


def _oracle(pattern, window):
    """window: token or None (masked) per slot -> per masked slot the set of tokens with a valid completion."""
    holes = [i for i, t in enumerate(window) if t is None]
    alphabet = [t for t in range(V) if t != MASK]
    allowed = {i: set() for i in holes}
    for fill in itertools.product(alphabet, repeat=len(holes)):
        seq = list(window)
        for i, t in zip(holes, fill):
            seq[i] = t
        if _valid(pattern, seq):
            for i, t in zip(holes, fill):
                allowed[i].add(t)
    return allowed


def _fake_state(windows, prompt=2):
    """The DecodeState fields the DP reads (a dict), for rows whose generation is `windows` (None = masked)."""
    B, L = len(windows), len(windows[0])
    S = prompt + L
    tokens = np.full((B, S), MASK, np.int32)
    revealed = np.zeros((B, S), bool)
    tokens[:, :prompt], revealed[:, :prompt] = 3, True  # a prompt the DFA must ignore
    for b, w in enumerate(windows):
        for i, t in enumerate(w):
            if t is not None:
                tokens[b, prompt + i], revealed[b, prompt + i] = t, True
    return dict(tokens=jnp.asarray(tokens), revealed=jnp.asarray(revealed),
                gen_start=jnp.full((B,), prompt, jnp.int32), limit=jnp.full((B,), S, jnp.int32))


def _ns(st):
    return types.SimpleNamespace(**st, slots=st["tokens"].shape[1])


@functools.partial(jax.jit, static_argnums=(3,))
def _allowed(tab, st, offset, width):
    return dfa_device.allowed_tokens(tab, _ns(st), offset, width)


@jax.jit
def _joint(tab, st, offset, sel, token, score):
    return dfa_device.joint_select(tab, _ns(st), offset, sel, token, score)


def _random_windows(rng, pattern, L, n):
    """Windows with some slots revealed, consistent or not with the pattern (a mix of both)."""
    out = []
    while len(out) < n:
        w = [rng.randrange(V) if rng.random() < 0.4 else None for _ in range(L)]
        w = [None if t == MASK else t for t in w]
        out.append(w)
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_masks_equal_the_exhaustive_oracle(pattern):
    pat = _pattern(pattern)
    d = dfa_compile.compile_pattern(pat, STRINGS, stop_ids=[STOP], mask_id=MASK)
    rng = random.Random(hash(pattern) % 1000)
    L = 5
    windows = _random_windows(rng, pat, L, 12) + [[None] * L]
    tab = dfa_device.stack([d] * len(windows), V)
    st = _fake_state(windows)
    ok = np.asarray(_allowed(tab, st, 2, L))  # [B, L, V]
    checked = 0
    for b, w in enumerate(windows):
        want = _oracle(pat, w)
        for i, t in enumerate(w):
            if t is None:
                got = {v for v in range(V) if ok[b, i, v]}
                assert got == want[i], (pattern, w, i)
                checked += bool(want[i])
    assert checked > 0


@jax.jit
def _draft_allowed(tab, st, drafts):
    return dfa_device.draft_allowed(tab, _ns(st), *dfa_device.reachable(tab, _ns(st)), 2, drafts)


@pytest.mark.parametrize("pattern", [PATTERNS[1], PATTERNS[2], "SCHEMA"])
def test_draft_masks_equal_the_oracle_after_each_draft(pattern):
    """ar_spec's verification masks (`draft_allowed`): slot i's mask after drafts[:i] equals the
    exhaustive oracle's set for the window with drafts[:i] revealed and the rest masked (the
    one-by-one masks), for drafts valid or not."""
    pat = _pattern(pattern)
    d = dfa_compile.compile_pattern(pat, STRINGS, stop_ids=[STOP], mask_id=MASK)
    rng = random.Random(hash(pattern) % 997)
    L, K = 5, 3
    drafts = [[rng.choice([t for t in range(V) if t != MASK]) for _ in range(K)] for _ in range(8)]
    tab = dfa_device.stack([d] * len(drafts), V)
    st = _fake_state([[None] * L] * len(drafts))
    ok = np.asarray(_draft_allowed(tab, st, jnp.asarray(drafts)))
    checked = 0
    for b, dr in enumerate(drafts):
        for i in range(K + 1):
            want = _oracle(pat, list(dr[:i]) + [None] * (L - i))[i]
            assert {v for v in range(V) if ok[b, i, v]} == want, (pattern, dr, i)
            checked += bool(want)
    assert checked > 0


@pytest.mark.parametrize("pattern", [r"(ab|1){1,2}2?"])
def test_joint_reveal_is_greedy_in_confidence_order(pattern):
    """Tokens chosen together (each allowed on its own) are cut to the ones that complete together,
    taken best-first: the same set a one-by-one brute-force check keeps."""
    pat = _pattern(pattern)
    d = dfa_compile.compile_pattern(pat, STRINGS, stop_ids=[STOP], mask_id=MASK)
    rng = random.Random(7)
    L, rows = 4, []
    w = [None] * L
    allowed = _oracle(pat, w)
    while len(rows) < 16:
        tok = [rng.choice(sorted(allowed[i])) for i in range(L)]
        sel = [rng.random() < 0.7 for _ in range(L)]
        score = [rng.random() for _ in range(L)]
        rows.append((w, tok, sel, score))
    tab = dfa_device.stack([d] * len(rows), V)
    st = _fake_state([r[0] for r in rows])
    keep = np.asarray(_joint(
        tab, st, 2, jnp.asarray([r[2] for r in rows]), jnp.asarray([r[1] for r in rows], jnp.int32),
        jnp.asarray([r[3] for r in rows], jnp.float32)))
    inconsistent = 0
    for b, (w, tok, sel, score) in enumerate(rows):
        cur = list(w)
        want = [False] * L
        for i in sorted((i for i in range(L) if sel[i]), key=lambda i: -score[i]):
            trial = list(cur)
            trial[i] = tok[i]
            if any(_oracle(pat, trial)[j] for j in [k for k in range(L) if trial[k] is None][:1]) or (
                    None not in trial and _valid(pat, trial)):
                cur, want[i] = trial, True
        inconsistent += want != list(sel)
        assert list(keep[b]) == want, (w, tok, sel, score)
    assert inconsistent > 0  # the test exercised the one-by-one path


def test_budget_is_part_of_the_backward_pass():
    """With 3 slots left, `1{3}` must put a digit everywhere and never a stop token; with 4, a stop
    is fine at the end only."""
    d = dfa_compile.compile_pattern(r"1{3}", STRINGS, stop_ids=[STOP], mask_id=MASK)
    for L in (3, 4):
        tab = dfa_device.stack([d], V)
        st = _fake_state([[None] * L])
        ok = np.asarray(_allowed(tab, st, 2, L))[0]
        want = _oracle(r"1{3}", [None] * L)
        assert [set(np.flatnonzero(ok[i])) for i in range(L)] == [want[i] for i in range(L)]
    assert d.min_tokens == 3


def test_compile_errors_and_table_shapes():
    with pytest.raises(ConstraintError, match="llguidance"):
        dfa_compile.regex_of("json_schema", json.dumps(
            {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}))
    with pytest.raises(ConstraintError, match="cannot be compiled"):
        dfa_compile.compile_pattern("(a", STRINGS)
    # the message says what is wrong (interegular's own error says nothing for a syntax error)
    with pytest.raises(ConstraintError, match=r"regex '\(\[' cannot be compiled to a DFA: it is not a valid regex: "
                                              r"unterminated character set at position 1"):
        dfa_compile.compile_pattern("([", STRINGS)
    with pytest.raises(ConstraintError, match="missing \\), unterminated subpattern at position 0"):
        dfa_compile.compile_pattern("(a", STRINGS)
    with pytest.raises(ConstraintError, match="min repeat greater than max repeat"):
        dfa_compile.compile_pattern("a{2,1}", STRINGS)
    # schema false (or one outlines-core cannot read): a jdllm message, not outlines-core's "open an issue"
    for schema, what in ((False, "empty language"), ({"not": {}}, "outlines-core.*does not support")):
        with pytest.raises(ConstraintError, match=what) as e:
            dfa_compile.regex_of("json_schema", json.dumps(schema))
        assert "open an issue" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConstraintError, match="matches no string"):
        dfa_compile.compile_pattern("zz", STRINGS)
    d = dfa_compile.compile_pattern(r"\d( \d)*", STRINGS, stop_ids=[STOP], mask_id=MASK)
    # token classes: tokens with identical columns share one; every state reachable is distinct
    cols = {tuple(d.next_state[:, d.token_class[t]]) for t in range(V)}
    assert len(cols) == d.num_classes and d.num_classes < V
    assert d.accepts([6, 8, 7, STOP]) and not d.accepts([6, 7]) and d.accepts([6, 8, 6])


def test_compile_stops_as_soon_as_the_automaton_passes_the_state_cap():
    """A regex whose DFA blows up (`[ab]*a[ab]{14}`: 2**15 states) is refused within a second, as
    soon as its automaton passes the cap, rather than after building every state (issue 32: 112 s
    against a cap of 32); under the cap the tables are the uncapped ones, and the character
    automaton is the one interegular builds."""
    import interegular

    for pattern, states in (("[ab]*a[ab]{14}", 32), ("(a|b|ab|1|2| )*a(a|b|1|2){12}", 64)):
        t = time.perf_counter()
        with pytest.raises(ConstraintError, match=f"while being built .*at most {states} DFA states"):
            dfa_compile.compile_pattern(pattern, STRINGS, stop_ids=[STOP], mask_id=MASK, max_states=states)
        assert time.perf_counter() - t < 1.0, pattern
    with pytest.raises(ConstraintError, match="34 DFA states.* at most 32 states"):  # within 4x: the exact count
        dfa_compile.compile_pattern("a{31}", STRINGS, stop_ids=[STOP], mask_id=MASK, max_states=32)
    for pattern in (r"\d( \d)*", "(ab|1){1,2}2?", "[ab]*a[ab]{3}", _pattern("SCHEMA")):
        capped = dfa_compile.compile_pattern(pattern, STRINGS, stop_ids=[STOP], mask_id=MASK, max_states=64)
        free = dfa_compile.compile_pattern(pattern, STRINGS, stop_ids=[STOP], mask_id=MASK)
        for f in ("next_state", "token_class", "accepting", "live"):
            np.testing.assert_array_equal(getattr(capped, f), getattr(free, f))
        assert (capped.start, capped.min_tokens) == (free.start, free.min_tokens)
        ours, theirs = dfa_compile._char_dfa(pattern), interegular.parse_pattern(pattern).to_fsm()
        assert (ours.map, ours.finals, ours.initial) == (theirs.map, theirs.finals, theirs.initial)


# --------------------------------------------------------------------------- generation
REGEXES = [r"\d( \d)*", r"[a-c]+ \d\d?", r"(1|22)+"]


def _check_outputs(model, outs, rows, max_new):
    tok = model.tokenizer
    for o, c in zip(outs, rows):
        assert o.finish_reason in ("stop", "length"), o
        assert o.constraint_ok is True
        text = tok.decode(o.token_ids, skip_special_tokens=True)
        assert re.fullmatch(c.source, text), (c.source, text)
        if o.finish_reason == "length":
            assert len(o.token_ids) == max_new


@slow
@pytest.mark.parametrize("path, decoding", [
    ("models/tiny-sdar", jdllm.BlockDiffusion(block_length=4, strategy="low_confidence_dynamic")),
    ("models/tiny-sdar", jdllm.MultiBlock(block_size=4, max_blocks=3, block_add_threshold=0.1,
                                          decoded_token_threshold=0.1)),
    ("models/tiny-llada", jdllm.MaskedDiffusion(steps=4, block_length=4, remasking="random")),
    ("models/tiny-ar", jdllm.AR()),
    ("models/tiny-ar", jdllm.Speculative(num_draft_tokens=3)),
], ids=["block_diffusion", "multi_block", "masked_diffusion", "ar", "ar_spec"])
def test_sampled_outputs_always_match(path, decoding, fast_compile):
    """Temperature 1, many seeds, several regexes per batch (random unmasking orders): every output
    matches; a second batch with other regexes in the same table buckets does not retrace."""

    model = jdllm.load(path, dtype="float32")
    max_new = 8
    prompts = ["sort:3 1 2=", "add:12+34=", "rev:abc=", "sort:9 0="] * 8
    for round_ in range(2):
        rows = [constraints.regex(REGEXES[(i + round_) % 3], backend="dfa") for i in range(len(prompts))]
        samp = [jdllm.Sampling(temperature=1.0, max_new_tokens=max_new, seed=100 * round_ + i)
                for i in range(len(prompts))]
        with traces() as seen:
            outs = jdllm.generate(model, prompts, decoding=decoding, sampling=samp, constraint=rows)
        if round_:
            assert seen["run"] == 0
        _check_outputs(model, outs, rows, max_new)


def test_greedy_ar_equals_a_brute_force_masked_reference(fast_compile):
    """Greedy AR under a finite regex = a plain loop that masks each step with the set of next tokens
    some string of the (enumerated) language continues with. (The llguidance-backend equivalence is
    for after both backends are merged.)"""
    model = jdllm.load("models/tiny-ar", dtype="float32")
    lang = {" ".join(p) for k in (1, 2, 3) for p in itertools.product("123", repeat=k)}
    pattern = r"[1-3]( [1-3]){0,2}"
    assert lang == {s for s in lang if re.fullmatch(pattern, s)}
    vocab = model.tokenizer.get_vocab()
    eos = model.config.eos_token_ids[0]
    prompts = ["sort:3 1 2=", "rev:abc=", "add:9+9="]
    outs = jdllm.generate(model, prompts, decoding=jdllm.AR(), sampling=jdllm.Sampling(max_new_tokens=8),
                          constraint=constraints.regex(pattern, backend="dfa"))
    for p, o in zip(prompts, outs):
        seq = [vocab[ch] for ch in p]
        text, got = "", []
        for _ in range(8):
            allowed = {vocab[s[len(text)]] for s in lang if s.startswith(text) and len(s) > len(text)}
            if text in lang:
                allowed.add(eos)
            z = full_logits(model.params, model.config, seq)[-1:].copy()
            z[0, [t for t in range(z.shape[1]) if t not in allowed]] = -np.inf
            t = int(_distribution(z, model.config.mask_token_id)[0][0])
            seq.append(t)
            got.append(t)
            if t == eos:
                break
            text += model.tokenizer.decode([t])
        assert o.token_ids == got, (p, o.text, model.tokenizer.decode(got))


@slow
def test_greedy_ar_spec_equals_greedy_ar(fast_compile):
    """ar_spec verifies under the DFA's masks after each draft: greedy tokens equal greedy constrained
    AR's (free rows too), and drafts are accepted, not only corrected. (Sampled ar_spec outputs:
    `test_sampled_outputs_always_match`, with prompt-lookup drafts.)"""
    model = jdllm.load("models/tiny-ar", dtype="float32")
    spec = jdllm.Speculative(num_draft_tokens=3, draft="models/tiny-ar-draft")
    prompts = ["rev:abcd=", "=ab=", "sort:3 1 2=", "rev:cba="]
    rows = [constraints.regex(p, backend="dfa") for p in ("[a-d]{3,5}", "ab[0-9]{2}", r"\d( \d)*")] + [None]
    s = jdllm.Sampling(max_new_tokens=8)
    ref = jdllm.generate(model, prompts, decoding=jdllm.AR(), sampling=s, constraint=rows)
    got = jdllm.generate(model, prompts, decoding=spec, sampling=s, constraint=rows)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids and g.finish_reason == r.finish_reason == "stop"
        assert g.constraint_ok == r.constraint_ok
    assert [r.constraint_ok for r in ref] == [True, True, True, None]
    assert sum(g.trace["drafts_accepted"] for g in got) >= 3


@slow
def test_constrained_rollout_is_pure_under_jit_vmap():
    """The constrained decode (tables in the state) runs under jax.jit(jax.vmap(...)) and does not
    retrace when called again with other seeds and another regex of the same table buckets."""
    from jdllm import api
    from jdllm.decode import loop

    model = jdllm.load("models/tiny-sdar", dtype="float32")
    dec = jdllm.BlockDiffusion(block_length=4)
    prompts = ["sort:3 1 2=", "rev:abc="]

    def prepared(pattern, seed):
        samp = jdllm.Sampling(temperature=1.0, max_new_tokens=8, seed=seed)
        prep = api.prepare(model, prompts, dec, samp)
        c = [constraints.regex(pattern, backend="dfa")] * len(prompts)
        return prep, prep.state.replace(constraint=dfa.tables(model, c, prep.state))

    traces = []

    @functools.partial(jax.jit, compiler_options=dict(FAST_COMPILE))
    def rollouts(params, states):
        traces.append(1)
        return jax.vmap(lambda s: loop.run(params, s, paradigm=dec, ctx=prep.ctx))(states)

    for pattern, seeds in ((r"\d( \d)*", (0, 1)), (r"[1-3]( [1-3])*", (3, 4))):
        preps = [prepared(pattern, s) for s in seeds]
        prep = preps[0][0]
        states = jax.tree.map(lambda *x: jnp.stack(x), *[s for _, s in preps])
        final = rollouts(model.params, states)
        for i in range(len(seeds)):
            one = jax.tree.map(lambda x: x[i], final)
            for o in api.outputs(prep, one):
                text = model.tokenizer.decode(o.token_ids, skip_special_tokens=True)
                assert o.finish_reason in ("stop", "length") and re.fullmatch(pattern, text), (pattern, text)
    assert len(traces) == 1


def test_generate_refuses_before_compiling():
    """Bad constraints raise ConstraintError naming the problem, before any decode compiles."""
    model = jdllm.load("models/tiny-sdar", dtype="float32")
    s = jdllm.Sampling(max_new_tokens=4)
    with traces() as seen:
        rec = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
        with pytest.raises(ConstraintError, match="recursive.*llguidance"):
            jdllm.generate(model, ["rev:ab="], sampling=s, constraint=constraints.json_schema(rec, backend="dfa"))
        with pytest.raises(ConstraintError, match="shortest match takes 5 tokens but max_new_tokens=4"):
            jdllm.generate(model, ["rev:ab="], sampling=s, constraint=constraints.regex(r"\d{5}", backend="dfa"))
        with pytest.raises(ConstraintError, match="matches no string"):
            jdllm.generate(model, ["rev:ab="], sampling=s, constraint=constraints.regex(r"[A-Z]+", backend="dfa"))
        # no stop id allowed: a row ends only when full, so a finite language must reach the budget (it
        # used to decode, dead-end and return an empty "abort" row)
        no_stop = jdllm.Sampling(max_new_tokens=4, stop_token_ids=())
        with pytest.raises(ConstraintError, match="must fill max_new_tokens=4, but the constraint's longest match "
                                                  "takes 3 tokens"):
            jdllm.generate(model, ["rev:ab="], sampling=no_stop, constraint=constraints.regex(r"\d{2,3}", backend="dfa"))
    assert seen["run"] == 0
    d = dfa.compile(model, constraints.regex(r"(ab|abcd)", backend="dfa"), ())
    assert (d.min_tokens, d.max_tokens) == (2, 4)
    assert dfa.compile(model, constraints.regex(r"a+b", backend="dfa"), ()).max_tokens is None  # a loop
    assert dfa.compile(model, constraints.regex(r"ab", backend="dfa")).max_tokens is None  # after EOS: anything
    for budget in (2, 3):  # budgets the language can fill pass
        dfa.check_budget(dfa.compile(model, constraints.regex(r"\d{2,3}", backend="dfa"), ()), budget)
