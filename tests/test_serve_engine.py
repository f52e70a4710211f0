"""The continuous-batching engine: requests joining and leaving a running pool decode exactly as
`jdllm.generate` decodes each prompt alone, without recompiling; aborted requests free their rows."""

from __future__ import annotations

import functools
import gc

import jax
import numpy as np
import pytest

import jdllm
from jdllm import errors
from jdllm.serve import engine as E
from tests.compiles import traces
from tests.decode_fixtures import FAST_COMPILE, block_model, causal_model
from tests.quick import slow, slow_except

pytestmark = pytest.mark.usefixtures("fast_compile")


def _case(which: str):
    """(model, paradigm, prompt lengths, max_new_tokens per request): one prompt bucket and one
    generation bucket each, so the alone references compile once."""
    if which == "ar":
        return causal_model(), jdllm.AR(), (7, 2, 12, 4, 15, 3, 9, 1), (9, 14, 5, 16, 3, 11, 7, 12)
    if which == "ar_spec":  # a draft model: its KV cache rides along in the row (max_new + k <= 16)
        m = causal_model()
        return (m, _spec_of(m), (7, 2, 12, 4, 15, 3, 9, 1), (9, 12, 5, 13, 3, 11, 7, 12))
    if which == "masked_diffusion":  # one block per row (block_length None): each row its own geometry
        from tests.test_decode_masked import bidir_model

        par = jdllm.MaskedDiffusion(alg="maskgit_plus", cache_mode="dual")
        return bidir_model(shift=True), par, (7, 2, 12, 4, 15, 3, 9, 1), (9, 14, 5, 16, 3, 11, 7, 12)
    if which == "multi_block":
        return block_model(), jdllm.MultiBlock(block_size=4), (7, 2, 5, 4, 6, 3, 1, 7), (10, 13, 11, 12, 10, 13, 12, 11)
    par = jdllm.BlockDiffusion(block_length=4, denoising_steps=2, confidence_threshold=0.7)
    return block_model(), par, (7, 2, 5, 4, 6, 3, 1, 7), (10, 13, 11, 12, 10, 13, 12, 11)


@functools.lru_cache(maxsize=None)
def _spec_of(m):
    from tests.test_decode_ar_spec import draft_for

    return jdllm.Speculative(draft=draft_for(m), num_draft_tokens=3)


@functools.lru_cache(maxsize=None)
def _engine(which: str) -> E.Engine:
    m, par, _, _ = _case(which)
    return E.Engine(m, par, max_batch=3, max_prompt_tokens=16, max_new_tokens=16, steps_per_round=2,
                    compiler_options=FAST_COMPILE)


def _alone(m, par, prompt, sampling):
    return jdllm.generate(m, [prompt], par, sampling)[0]


def _fields(o):
    return o.token_ids, o.step_map, o.nfe, o.finish_reason


@pytest.mark.parametrize("which", slow_except(["ar", "block_diffusion", "ar_spec", "masked_diffusion", "multi_block"],
                                              "ar"))
def test_staggered_requests_equal_generate_alone_without_recompiles(which):
    """Eight requests of mixed prompt and answer lengths arrive while others decode (three rows, so
    rows are reused); one is sampled, one stops on a stop id. Each equals generate() alone, token for
    token, step for step, NFE and finish reason; what it streamed equals its output; a second wave
    with the same buckets compiles nothing."""
    m, par, lengths, news = _case(which)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 90, size=n).tolist() for n in lengths]
    settings = [jdllm.Sampling(max_new_tokens=n, stop_token_ids=()) for n in news]
    settings[1] = jdllm.Sampling(max_new_tokens=news[1], stop_token_ids=(), temperature=0.8, top_k=20, seed=7)
    free = _alone(m, par, prompts[3], settings[3])
    settings[3] = jdllm.Sampling(max_new_tokens=news[3], stop_token_ids=(free.token_ids[4],))
    want = [_alone(m, par, p, s) for p, s in zip(prompts, settings)]
    assert want[3].finish_reason == "stop"

    eng = _engine(which)
    for wave in range(2):
        with traces() as seen:
            reqs = []
            for i, (p, s) in enumerate(zip(prompts, settings)):
                reqs.append(eng.submit(p, s))
                if i % 3 != 1:  # arrivals between rounds, sometimes two at once
                    eng.step_round()
            eng.run_until_idle()
        for r, w in zip(reqs, want):
            assert _fields(r.output) == _fields(w)
            assert r.output.trace == w.trace  # ar_spec: drafts proposed / accepted, draft forwards
            # float32 rounding: a pool row's forward may span another width than the row alone
            np.testing.assert_allclose(r.output.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
            streamed = [t for ev in r.events if ev.kind == "tokens" for t in ev.token_ids]
            assert streamed == r.output.token_ids
            assert [ev.kind for ev in r.events][-1] == "done"
        if wave == 0:  # the jitted pieces as traced (this engine's first requests)
            assert seen["admit_row"] >= 1 and seen["run_round"] == 1, dict(seen)
        else:
            assert not seen, dict(seen)  # the second wave compiled nothing
    assert eng.stats()["rows_free"] == 3 and eng.stats()["tracked"] == 0


@slow
def test_diffusion_streams_only_the_final_prefix_and_step_events():
    """Block diffusion streams the left-contiguous revealed prefix; with return_step_map each step's
    revealed positions arrive with their step_map, and together they rebuild the output."""
    m, par, _, _ = _case("block_diffusion")
    eng = _engine("block_diffusion")
    r = eng.submit([5, 9, 2, 33, 4], jdllm.Sampling(max_new_tokens=12, stop_token_ids=()), return_step_map=True)
    eng.run_until_idle()
    out = r.output
    toks = [ev for ev in r.events if ev.kind == "tokens"]
    steps = [ev for ev in r.events if ev.kind == "steps"]
    assert [t for ev in toks for t in ev.token_ids] == out.token_ids
    rebuilt = {}
    for ev in steps:
        for p, s, t in zip(ev.positions, ev.steps, ev.token_ids):
            assert p not in rebuilt
            rebuilt[p] = (t, s)
    assert [rebuilt[i] for i in range(len(out.token_ids))] == list(zip(out.token_ids, out.step_map))
    assert len(steps) > 1 and max(out.step_map) > 1  # it really decoded over several rounds and steps


def test_the_host_streams_a_round_while_the_device_runs_the_next(monkeypatch):
    """The engine dispatches round k+1 before it copies and streams round k (on a GPU the host's
    per-round work then overlaps the device's next round: at 64 rows it had left the device idle
    for ~10% of the time). A streamed round is one dispatched before; a row that finishes is taken
    by a waiting request two rounds later; every request still equals generate() alone, and what
    it streamed equals its output."""
    m, par, lens, news = _case("ar")
    eng = E.Engine(m, par, max_batch=2, max_prompt_tokens=16, max_new_tokens=16, steps_per_round=2,
                   compiler_options=FAST_COMPILE)
    log = []
    execute, process = eng.runner.execute, eng.output_processor.process

    def logged_execute(out, steps):
        view = execute(out, steps)
        log.append(("dispatch", eng.rounds + (view is not None), tuple(sorted(r.id for r, _ in out.admit))))
        return view

    def logged_process(host, running, now=None):
        log.append(("stream", tuple(sorted(req.id for _, req in running))))
        return process(host, running, now)

    monkeypatch.setattr(eng.runner, "execute", logged_execute)
    monkeypatch.setattr(eng.output_processor, "process", logged_process)
    settings = [jdllm.Sampling(max_new_tokens=n, stop_token_ids=()) for n in news[:3]]
    prompts = [list(range(3, 3 + n)) for n in lens[:3]]
    reqs = [eng.submit(p, s) for p, s in zip(prompts, settings)]
    eng.run_until_idle()
    assert log[0] == ("dispatch", 1, (reqs[0].id, reqs[1].id)) and log[1][0] == "dispatch"
    assert log[2][0] == "stream"  # round 1 streamed after round 2 was dispatched
    for i, entry in enumerate(log):
        if entry[0] == "stream":
            assert log[i - 1][0] == "dispatch"  # every stream follows a dispatch
    # the third request waited for a row: it was admitted two rounds after the stream that freed it
    joined = next(i for i, e in enumerate(log) if e[0] == "dispatch" and reqs[2].id in e[2])
    freed = max(i for i, e in enumerate(log[:joined]) if e[0] == "stream")
    assert log[freed + 1] == log[joined]
    for p, s, r in zip(prompts, settings, reqs):
        assert _fields(r.output) == _fields(_alone(m, par, p, s))
        assert [t for ev in r.events if ev.kind == "tokens" for t in ev.token_ids] == r.output.token_ids


def test_aborted_requests_free_their_rows_without_leaking():
    """1,000 requests aborted while waiting or while decoding: the pool returns to idle, no device
    array is left behind, and the next request still decodes as it does alone."""
    m, par, _, _ = _case("ar")
    eng = _engine("ar")
    s = jdllm.Sampling(max_new_tokens=16, stop_token_ids=())
    eng.submit([4, 5, 6], s)
    eng.run_until_idle()
    gc.collect()
    live = len(jax.live_arrays())
    rounds = eng.rounds
    for chunk in range(20):
        reqs = [eng.submit([3 + (chunk + i) % 80, 7], s) for i in range(50)]
        eng.step_round()  # three of them now hold rows, mid-decode
        assert eng.stats()["rows_busy"] == 3
        for r in reqs:
            eng.abort(r.id)
        eng.step_round()  # one round frees every row
        st = eng.stats()
        assert (st["rows_busy"], st["rows_free"], st["waiting"], st["tracked"]) == (0, 3, 0, 0)
        assert all(r.status == "aborted" and r.output is None for r in reqs)
    assert eng.rounds - rounds == 20 and eng.aborted == 1000
    gc.collect()
    assert len(jax.live_arrays()) <= live
    r = eng.submit([9, 8, 7, 6], s)
    eng.run_until_idle()
    assert _fields(r.output) == _fields(_alone(m, par, [9, 8, 7, 6], s))


def test_a_burst_is_prefilled_in_groups_and_each_row_equals_generate_alone(monkeypatch):
    """Requests arriving together join in batched prefills (groups of E.runner.ADMIT_GROUPS sizes,
    one prompt-length bucket each), not one prefill per request; each answer still equals
    generate() on its prompt alone, sampled rows too (each row keeps its own seed), and the rows
    land where the scheduler put them."""
    m, par = causal_model(), jdllm.AR()
    eng = E.Engine(m, par, max_batch=7, max_prompt_tokens=24, max_new_tokens=12, steps_per_round=3)
    groups = []
    admit_group = eng.runner._admit_group
    monkeypatch.setattr(eng.runner, "_admit_group", lambda g, n: (groups.append([r for _, r, _ in g]),
                                                                   admit_group(g, n))[1])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 90, size=6).tolist() for _ in range(6)] + [rng.integers(3, 90, size=20).tolist()]
    settings = [jdllm.Sampling(max_new_tokens=12 - i, stop_token_ids=()) for i in range(7)]
    settings[2] = jdllm.Sampling(max_new_tokens=9, stop_token_ids=(), temperature=0.9, top_k=30, seed=11)
    reqs = [eng.submit(p, s) for p, s in zip(prompts, settings)]
    eng.run_until_idle()
    lay = [par.row_layout(m.config, len(p), s.max_new_tokens, eng.runner.slots).prefill_len
           for p, s in zip(prompts, settings)]
    assert lay[0] == lay[5] != lay[6]  # six prompts of one bucket, one of another
    assert sorted(map(len, groups)) == [1, 1, 1, 4], groups  # 6 = 4 + 1 + 1 in one bucket, 1 in the other
    assert sorted(r for g in groups for r in g) == list(range(7))
    for r, p, s in zip(reqs, prompts, settings):
        w = _alone(m, par, p, s)
        assert _fields(r.output) == _fields(w)
        np.testing.assert_allclose(r.output.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)


def test_bounded_queue_and_bad_requests_fail_before_compiling():
    m = causal_model()
    eng = E.Engine(m, jdllm.AR(), max_batch=2, max_queue=2, max_prompt_tokens=8, max_new_tokens=8)
    s = jdllm.Sampling(max_new_tokens=4)
    with traces() as seen:  # refused before anything compiles
        for _ in range(4):  # two take the free rows at the next round, two wait for one
            eng.submit([1, 2], s)
        with pytest.raises(errors.QueueFullError, match="2 requests already wait for a row.*max_queue=2"):
            eng.submit([1, 2], s)
        with pytest.raises(errors.SequenceTooLongError, match="max_prompt_tokens=8"):
            eng.submit(list(range(9)), s)
        with pytest.raises(errors.SequenceTooLongError, match="max_new_tokens=9"):
            eng.submit([1], jdllm.Sampling(max_new_tokens=9))
        with pytest.raises(errors.TokenOutOfRangeError):
            eng.submit([1, m.config.vocab_size], s)
        with pytest.raises(errors.DecodingConfigError, match="max_batch=0"):
            E.Engine(m, jdllm.AR(), max_batch=0)
        with pytest.raises(errors.DecodingConfigError, match="is not a paradigm config"):
            E.Engine(m, type("Beam", (), {"name": "beam"})())
        from jdllm import constraints as C

        with pytest.raises(errors.ConstraintError, match="no constraint tables"):
            eng.submit([1, 2], s, constraint=C.regex("[a-c]+", backend="dfa"))
        eng.stop()
        with pytest.raises(errors.EngineStoppedError):
            eng.submit([1, 2], s)
    assert not seen, dict(seen)


def test_the_choices_of_one_request_are_queued_all_or_none():
    """`submit_many` (a request's n choices): more than max_batch + max_queue never fit (InputError);
    a group that would overflow the queue is refused whole, leaving nothing queued to abort; on an
    idle engine a group as large as the capacity is taken (issue 32: n=5 with 4 rows and max_queue=4
    was refused as a full queue, its first four choices aborted)."""
    m = causal_model()
    eng = E.Engine(m, jdllm.AR(), max_batch=2, max_queue=2, max_prompt_tokens=8, max_new_tokens=8)
    s = [jdllm.Sampling(max_new_tokens=4, seed=i) for i in range(5)]
    with traces() as seen:
        with pytest.raises(errors.InputError, match="5 requests at once.*2 \\+ 2 = 4"):
            eng.submit_many([1, 2], s)
        reqs = eng.submit_many([1, 2], s[:3])
        with pytest.raises(errors.QueueFullError, match="1 requests already wait for a row and 2 more"):
            eng.submit_many([1, 2], s[3:])
        assert eng.stats()["tracked"] == 3 and eng.stats()["waiting"] == 3
        eng.submit([1, 2], s[3])
    assert not seen, dict(seen)
    eng.run_until_idle()
    assert all(r.status == "done" for r in reqs) and eng.aborted == 0
    # one prompt per setting (an API request's batch of prompts): each request keeps its own, and a
    # batch with one bad prompt queues none of them
    batch = eng.submit_many([[1, 2], [3, 4, 5]], s[:2])
    assert [r.prompt_ids for r in batch] == [[1, 2], [3, 4, 5]]
    with pytest.raises(errors.SequenceTooLongError, match="9 tokens"):
        eng.submit_many([[1, 2], list(range(1, 10))], s[:2])
    with pytest.raises(errors.ArgumentTypeError, match="2 prompts for 3 samplings"):
        eng.submit_many([[1, 2], [3]], s[:3])
    assert eng.stats()["tracked"] == 2
    eng.run_until_idle()
    assert all(r.status == "done" for r in batch)


@slow
@pytest.mark.parametrize("cache_mode", ["none", "prefix", "dual"])
def test_masked_diffusion_joins_a_running_batch(cache_mode):
    """masked_diffusion rows keep their own block and step counters: a request takes a free row at
    any round while the others decode (no draining), whatever the cache mode, and each equals
    generate() alone; a request the paradigm cannot decode (block_length must divide its length)
    is refused at submit, before anything compiles."""
    from tests.test_decode_masked import bidir_model

    m, par = bidir_model(), jdllm.MaskedDiffusion(block_length=4, cache_mode=cache_mode)
    eng = E.Engine(m, par, max_batch=2, max_prompt_tokens=8, max_new_tokens=12, steps_per_round=1,
                   compiler_options=FAST_COMPILE)
    with traces() as seen, pytest.raises(errors.DecodingConfigError, match="block_length=4 must divide"):
        eng.submit([1, 2], jdllm.Sampling(max_new_tokens=6))
    assert not seen, dict(seen)
    prompts = [[5, 17, 3, 44, 9], [70, 2, 8], [8, 8, 31, 4], [11, 12, 13]]
    news = [12, 8, 4, 12]
    settings = [jdllm.Sampling(max_new_tokens=n, stop_token_ids=()) for n in news]
    reqs = [eng.submit(p, s) for p, s in zip(prompts[:3], settings)]
    eng.step_round()
    assert [r.status for r in reqs] == ["running", "running", "waiting"]
    while reqs[1].status == "running":
        eng.step_round()
    assert reqs[0].status == "running"  # the first is still decoding ...
    eng.step_round()
    assert reqs[2].status == "running"  # ... when the third takes the freed row
    reqs.append(eng.submit(prompts[3], settings[3]))
    eng.run_until_idle()
    for p, s, r in zip(prompts, settings, reqs):
        assert _fields(r.output) == _fields(_alone(m, par, p, s))
        assert [t for ev in r.events if ev.kind == "tokens" for t in ev.token_ids] == r.output.token_ids


@slow
@pytest.mark.parametrize("model_dir, cache_mode", [("tiny-sdar", "exact"), ("tiny-sdar", "none"),
                                                    ("tiny-llada", "approx"), ("tiny-llada", "window")])
def test_multi_block_joins_a_running_batch_with_constraints(model_dir, cache_mode):
    """multi_block rows keep their own block grid, block states and cache, on the shipped tiny models
    with on-device constraints: requests arriving while a batch decodes take free rows at once; each
    equals generate() alone on the DFA backend."""
    import os

    from jdllm import constraints as C

    m = jdllm.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", model_dir))
    par = jdllm.MultiBlock(block_size=4, cache_mode=cache_mode, refresh_interval=3)
    eng = E.Engine(m, par, max_batch=3, max_prompt_tokens=16, max_new_tokens=8, steps_per_round=1,
                   compiler_options=FAST_COMPILE, constraint_states=16, constraint_classes=16)
    prompts = ["sort:3 1 2=", "rev:abc=", "sort:9 5 7 1=", "add:12+34="]
    # all constrained (one alone-reference compile); "[0-9 ]+" leaves the sort / add answers free
    cons = [C.regex("[0-9 ]+", backend="dfa"), C.regex("[a-c]+", backend="dfa"),
            C.choice(["1 2", "7 9"], backend="dfa"), C.regex("[0-9 ]+", backend="dfa")]
    s = jdllm.Sampling(max_new_tokens=8)
    ids = [m.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    reqs = [eng.submit(p, s, constraint=c) for p, c in zip(ids[:2], cons[:2])]
    eng.step_round()
    assert reqs[0].status == "running"  # "1 2 3<eos>" takes more than one step: still decoding ...
    reqs += [eng.submit(p, s, constraint=c) for p, c in zip(ids[2:], cons[2:])]
    eng.step_round()
    assert reqs[2].status != "waiting"  # ... when the third takes a free row
    eng.run_until_idle()
    for p, c, r in zip(prompts, cons, reqs):
        want = jdllm.generate(m, [p], par, s, constraint=c)[0]
        assert _fields(r.output) == _fields(want), p
        assert r.output.trace == want.trace
        assert r.output.constraint_ok == want.constraint_ok
        assert [t for ev in r.events if ev.kind == "tokens" for t in ev.token_ids] == r.output.token_ids
    assert reqs[1].output.constraint_ok and reqs[2].output.text in ("1 2", "7 9")
    if model_dir == "tiny-sdar" and cache_mode == "exact":
        assert reqs[0].output.text == "1 2 3"  # the loose regex leaves the model's own answer
    assert eng.stats()["rows_free"] == 3 and eng.stats()["tracked"] == 0


@slow
def test_ar_spec_serves_on_device_constraints():
    """ar_spec with on-device DFA tables (verification masks every draft slot by the DFA state after
    the drafts before it): staggered constrained and free requests on tiny-ar with its shipped draft
    each equal generate() alone on the DFA backend, tokens, NFE, finish reason and draft counts."""
    import os

    from jdllm import constraints as C

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    m = jdllm.load(os.path.join(root, "models", "tiny-ar"), dtype="float32")
    par = jdllm.Speculative(num_draft_tokens=3, draft=os.path.join(root, "models", "tiny-ar-draft"))
    eng = E.Engine(m, par, max_batch=2, max_prompt_tokens=16, max_new_tokens=8, steps_per_round=2,
                   compiler_options=FAST_COMPILE, constraint_states=16, constraint_classes=16)
    prompts = ["rev:abcd=", "=ab=", "sort:3 1 2=", "rev:cba="]
    cons = [C.regex("[a-d]{3,5}", backend="dfa"), C.regex("ab[0-9]{2}", backend="dfa"),
            C.regex(r"\d( \d)*", backend="dfa"), None]
    s = jdllm.Sampling(max_new_tokens=8)
    ids = [m.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    reqs = []
    for i, (p, c) in enumerate(zip(ids, cons)):
        reqs.append(eng.submit(p, s, constraint=c))
        if i % 2:
            eng.step_round()
    eng.run_until_idle()
    for p, c, r in zip(prompts, cons, reqs):
        want = jdllm.generate(m, [p], par, s, constraint=c)[0]
        assert _fields(r.output) == _fields(want), p
        assert r.output.trace == want.trace and r.output.constraint_ok == want.constraint_ok
    assert [r.output.constraint_ok for r in reqs] == [True, True, True, None]
    assert sum(r.output.trace["drafts_accepted"] for r in reqs) >= 3
    assert eng.stats()["rows_free"] == 2 and eng.stats()["tracked"] == 0
