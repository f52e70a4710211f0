"""The engine core's shape: rows at their own positions, the host-driven step (`plan` / `forward` /
`reveal`, `step_n`) equal to the one-jit loop, per-row sampling as data, truthful endings,
reusable prepared states and the LM head only where tokens are chosen."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm.api import outputs, prepare
from jdllm.decode import loop
from jdllm.model import KVCache, default_positions, forward
from pallas_kernels import attention_reference, visible_mask
from pallas_kernels.flash import attention as flash_attention
from tests.compiles import traces
from tests.decode_fixtures import FAST_COMPILE, block_model, causal_model
from tests.quick import slow, slow_except
from tests.scripts import ROOT
from tests.test_decode_masked import bidir_model

pytestmark = pytest.mark.usefixtures("fast_compile")

PROMPTS = [[5, 17, 3, 44, 9, 12, 60], [70, 2], [8, 8, 31, 4]]


def _paradigms():
    """(model, paradigm) pairs covering every paradigm and attention kind."""
    return [
        (causal_model(), jdllm.AR()),
        (block_model(), jdllm.BlockDiffusion(block_length=4, denoising_steps=2, confidence_threshold=0.7)),
        (block_model(), jdllm.BlockDiffusion(block_length=4, denoising_steps=4, strategy="low_confidence_static",
                                             fuse_commit=False)),
        (block_model(logit_shift=True), jdllm.MultiBlock(block_size=4, max_blocks=2)),
        (bidir_model(), jdllm.MaskedDiffusion(block_length=4, steps=8, cache_mode="dual")),
        (bidir_model(shift=True), jdllm.MultiBlock(block_size=4, cache_mode="approx", refresh_interval=3)),
    ]


def _fields(outs):
    return [(o.token_ids, o.step_map, o.nfe, o.finish_reason) for o in outs]


# --------------------------------------------------------------------------- per-row positions
def test_masking_rule_per_row_equals_each_row_alone():
    B, T, S = 3, 5, 16
    start = jnp.asarray([0, 2, 1])
    qoff, kvl = jnp.asarray([0, 7, 11]), jnp.asarray([9, 12, 16])
    for kind, bs in (("causal", 1), ("block_causal", 4), ("bidirectional", 1)):
        m = visible_mask(T, S, start=start, q_offset=qoff, kv_len=kvl, kind=kind, block_size=bs)
        for b in range(B):
            solo = visible_mask(T, S, start=start[b:b + 1], q_offset=int(qoff[b]), kv_len=int(kvl[b]),
                                kind=kind, block_size=bs)
            np.testing.assert_array_equal(np.asarray(m[b]), np.asarray(solo[0]))


@slow
@pytest.mark.parametrize("T", [3, 24])  # window kernel and prefill kernel
def test_pallas_kernels_take_per_row_offsets(T):
    B, S, H, KV, D = 3, 40, 4, 2, 16
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, S, KV, D))
    v = jax.random.normal(ks[2], (B, S, KV, D))
    start = jnp.asarray([0, 3, 1])
    qoff = jnp.asarray([0, 9, S - T])
    kvl = qoff + T
    for kind in ("causal", "block_causal"):
        kw = dict(start=start, q_offset=qoff, kv_len=kvl, kind=kind, block_size=4)
        ref = attention_reference(q, k, v, **kw)
        out = flash_attention(q, k, v, **kw, backend="interpret")
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


@slow
def test_forward_with_per_row_offsets_equals_each_row_alone():
    """Rows writing and attending at different cache positions in one call give each row's solo result."""
    m = block_model()
    cfg, B, S, T = m.config, 3, 24, 4
    toks = jax.random.randint(jax.random.key(1), (B, S), 0, cfg.vocab_size - 1)
    start = jnp.asarray([0, 4, 0])
    cache = KVCache.empty(cfg, B, S)
    _, cache = forward(m.params, cfg, toks, default_positions(start, 0, S), start=start, cache=cache, offset=0)
    off = jnp.asarray([4, 12, 20])
    win = jnp.stack([toks[b, int(off[b]):int(off[b]) + T] for b in range(B)])
    got, new = forward(m.params, cfg, win, default_positions(start, off, T), start=start,
                       cache=cache.commit(off), logits_at=jnp.asarray([[3, 0]] * B))
    for b in range(B):
        one = jax.tree.map(lambda x: x[:, b:b + 1] if x.ndim == 5 else x[b:b + 1], cache)
        o = int(off[b])
        solo, solo_cache = forward(m.params, cfg, win[b:b + 1], default_positions(start[b:b + 1], o, T),
                                   start=start[b:b + 1], cache=one.commit(o), offset=o)
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(solo[0, jnp.asarray([3, 0])]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(new.k[:, b]), np.asarray(solo_cache.k[:, 0]), atol=1e-6)


def test_lm_head_at_chosen_positions_equals_full_logits():
    m = causal_model()
    toks = jnp.asarray([[3, 4, 5, 6, 7, 8]])
    pos = default_positions(jnp.zeros((1,), jnp.int32), 0, 6)
    full, _ = forward(m.params, m.config, toks, pos, start=jnp.zeros((1,), jnp.int32))
    some, _ = forward(m.params, m.config, toks, pos, start=jnp.zeros((1,), jnp.int32),
                      logits_at=jnp.asarray([[5, 1]]))
    np.testing.assert_allclose(np.asarray(some[0]), np.asarray(full[0, [5, 1]]), atol=1e-6)


# paradigms whose serving rows sit on their own layouts (`Paradigm.row_layout`): every cache mode,
# (model, paradigm, max_new_tokens per prompt); masked_diffusion with block_length 4 asks for whole blocks
JOIN_CASES = {
    "masked_none": lambda: (bidir_model(), jdllm.MaskedDiffusion(block_length=4, confidence_threshold=0.6), (8, 12, 4)),
    "masked_prefix": lambda: (bidir_model(), jdllm.MaskedDiffusion(block_length=4, cache_mode="prefix"), (8, 12, 4)),
    "masked_dual_dream": lambda: (bidir_model(shift=True), jdllm.MaskedDiffusion(
        block_length=4, steps=12, alg="topk_margin", cache_mode="dual"), (12, 4, 8)),
    "masked_one_block_prefix_dream": lambda: (bidir_model(shift=True), jdllm.MaskedDiffusion(
        alg="maskgit_plus", cache_mode="prefix"), (9, 14, 5)),
    "masked_one_block_dual": lambda: (bidir_model(), jdllm.MaskedDiffusion(cache_mode="dual"), (9, 14, 5)),
    "masked_cfg": lambda: (bidir_model(), jdllm.MaskedDiffusion(steps=8, cfg_scale=1.5), (9, 14, 5)),
    "multi_exact": lambda: (block_model(), jdllm.MultiBlock(block_size=4, max_blocks=2), (9, 14, 5)),
    "multi_exact_shifted": lambda: (block_model(logit_shift=True), jdllm.MultiBlock(block_size=4), (9, 14, 5)),
    "multi_none_block_causal": lambda: (block_model(), jdllm.MultiBlock(block_size=4, cache_mode="none"), (9, 14, 5)),
    "multi_none_bidirectional": lambda: (bidir_model(shift=True), jdllm.MultiBlock(block_size=4), (9, 14, 5)),
    "multi_approx": lambda: (bidir_model(), jdllm.MultiBlock(block_size=4, cache_mode="approx", refresh_interval=3),
                             (9, 14, 5)),
    "multi_approx_dream": lambda: (bidir_model(shift=True), jdllm.MultiBlock(
        block_size=4, cache_mode="approx", cache_delay_iter=0, refresh_interval=4), (9, 14, 5)),
    "multi_window": lambda: (bidir_model(), jdllm.MultiBlock(block_size=4, cache_mode="window", max_blocks=1,
                                                              refresh_interval=3), (9, 14, 5)),
}


def _joined(m, par, prompts, settings, waits=(0, 2, 3)):
    """Each prompt on its own layout in one pool, joining the running batch after `waits` more steps
    (the serving engine's admission: `jdllm.serve.runner.Runner.admit`, prefilled alone and merged into
    its row); then steps until every row is done. (outputs, host arrays of the final pool)."""
    from jdllm.api import row_output
    from jdllm.serve.request import Request
    from jdllm.serve.runner import Runner

    lay = par.pool_layout(m.config, 16, 16)
    run = Runner(m, par, rows=len(prompts), slots=int(lay.slots), prefill_len=int(lay.prefill_len),
                 compiler_options=FAST_COMPILE)
    for r, (p, s, wait) in enumerate(zip(prompts, settings, waits)):
        if wait:
            run.step(wait)
        run.admit(Request(id=r, prompt_ids=p, sampling=s, stop_ids=tuple(s.stop_token_ids)), r)
    host = run.host()
    while not host["done"].all():
        run.step(4)
        host = run.host()
    trace = (lambda r: par.output_trace(host["extra"], r)) if host["extra"] is not None else (lambda r: None)
    return [row_output(host, r, p, None, trace(r)) for r, p in enumerate(prompts)], host


def assert_joined_decode_as_alone(m, par, news):
    """`PROMPTS` joining one pool at different steps (`_joined`; one row sampled) decode as each alone."""
    settings = [jdllm.Sampling(max_new_tokens=n, stop_token_ids=()) for n in news]
    settings[1] = jdllm.Sampling(max_new_tokens=news[1], stop_token_ids=(), temperature=0.8, top_k=20, seed=7)
    batch, host = _joined(m, par, PROMPTS, settings)
    alone = [jdllm.generate(m, [p], par, s)[0] for p, s in zip(PROMPTS, settings)]
    assert _fields(batch) == _fields(alone)
    assert [o.trace for o in batch] == [o.trace for o in alone]
    for b, a in zip(batch, alone):
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4)
    assert len(set(host["gen_start"].tolist())) == len(PROMPTS)  # each row on its own layout


# on the Pallas kernels (interpret mode here): the caches whose writes drop the slots a row keeps
# (`jdllm.model.write_rows(keep=)`) and whose window steps write back (prefix: one switch of writers)
PALLAS_JOIN_CASES = ("masked_prefix", "masked_one_block_prefix_dream", "multi_approx")


@slow
@pytest.mark.parametrize("which", ["ar", "block_diffusion", *JOIN_CASES, *(f"pallas-{c}" for c in PALLAS_JOIN_CASES)])
def test_rows_at_different_positions_decode_as_alone(which):
    """AR rows start generating at their own prompt ends; block-diffusion rows move to their next
    block as soon as they fill the current one: in one batch each row is at its own position, and
    each still decodes exactly as it does alone. masked_diffusion and multi_block rows (every cache
    mode) each on its own layout, joining a running batch at different steps (as a serving pool
    admits them), with their own lengths, one of them sampled: each decodes exactly as it does alone
    (tokens, step map, NFE, finish reason, block trajectory); some caches also on the Pallas kernels
    (with an int8 KV cache: tests/test_kv_int8_kernels.py)."""
    if which.startswith("pallas-"):
        m, par, news = JOIN_CASES[which.removeprefix("pallas-")]()
        m = jdllm.Model(m.config, m.params, attn_impl="pallas")
    elif which in JOIN_CASES:
        m, par, news = JOIN_CASES[which]()
    if which.startswith("pallas-") or which in JOIN_CASES:
        assert_joined_decode_as_alone(m, par, news)
        return
    m, par = _paradigms()[["ar", "block_diffusion"].index(which)]
    settings = [jdllm.Sampling(max_new_tokens=n, stop_token_ids=()) for n in (9, 14, 5)]
    prep = prepare(m, PROMPTS, par, settings)
    final = loop.compiled()(m.params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx)
    batch = outputs(prep, final)
    alone = [jdllm.generate(m, [p], par, s)[0] for p, s in zip(PROMPTS, settings)]
    assert _fields(batch) == _fields(alone)
    assert [len(o.token_ids) for o in batch] == [9, 14, 5]
    lengths = np.asarray(final.cache.length)[:3]
    assert len(set(lengths.tolist())) > 1  # the rows really ended at different cache positions


# --------------------------------------------------------------------------- the host-driven step
@functools.lru_cache(maxsize=None)
def _steps():
    return loop.compiled_steps(FAST_COMPILE)


@pytest.mark.parametrize("case", slow_except(range(6), 0))
def test_step_n_and_host_steps_equal_run(case):
    m, par = _paradigms()[case]
    sampling = jdllm.Sampling(max_new_tokens=8, stop_token_ids=(7,))
    prep = prepare(m, PROMPTS, par, sampling)
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)
    want = _fields(outputs(prep, loop.compiled()(m.params, prep.state, **kw)))

    fns = _steps()
    st = fns["prefill"](m.params, prep.state, **kw)
    calls = 0
    while not bool(np.all(np.asarray(st.done))):
        st = fns["step_n"](m.params, st, 3, **kw)
        calls += 1
        assert calls < 100
    assert _fields(outputs(prep, fns["finalize"](st))) == want
    assert calls > 1  # step_n stopped after 3 iterations and resumed

    # plan / forward / reveal one at a time, as a constraint driver would
    st = fns["prefill"](m.params, prep.state, **kw)
    while not bool(np.all(np.asarray(st.done))):
        st, plan = fns["plan"](st, **kw)
        assert plan.valid.shape == (st.batch, plan.width)
        st, logits = fns["forward"](m.params, st, plan, **kw)
        assert logits.shape == (st.batch, plan.width, m.config.vocab_size)
        st = fns["reveal"](st, plan, logits, **kw)
    assert _fields(outputs(prep, st)) == want


def test_host_steps_refuse_another_models_params_and_an_unfinished_state():
    """A host driver's two likely slips name themselves: params of another model (a shape error deep in
    the forward before) and outputs() of a state with rows still running (it returned them with
    finish_reason None)."""
    m, par = _paradigms()[1]
    prep = prepare(m, PROMPTS, par, jdllm.Sampling(max_new_tokens=8, stop_token_ids=()))
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)
    other = jdllm.load(os.path.join(ROOT, "models", "tiny-ar-draft"), dtype="float32")
    with pytest.raises(jdllm.errors.ConfigError, match=r"params weight \['embed'\] has shape \(\d+, 64\), the model "
                                                       rf"config wants \(\d+, {m.config.hidden_size}\)"):
        _steps()["prefill"](other.params, prep.state, **kw)
    with pytest.raises(jdllm.errors.ConfigError, match="params from another model config"):
        loop.compiled()(other.params, prep.state, **kw)
    # same shapes but one weight more inside the layers (qwen3's k_norm beside llada's weights): not decoded either
    llada = jdllm.load(os.path.join(ROOT, "models", "tiny-llada"), dtype="float32")
    ar = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    lp = prepare(llada, [[5, 6, 7]], jdllm.MaskedDiffusion(gen_length=4), jdllm.Sampling(max_new_tokens=4))
    with pytest.raises(jdllm.errors.ConfigError, match=r"params hold weight \['layers'\]\[0\]\['k_norm'\]"):
        loop.compiled()(ar.params, lp.state, paradigm=lp.paradigm, ctx=lp.ctx)
    st = _steps()["prefill"](m.params, prep.state, **kw)
    assert not np.all(np.asarray(st.done)[:len(PROMPTS)])
    with pytest.raises(jdllm.errors.InputError, match=r"rows \[0, 1, 2\] are still running.*finalize"):
        outputs(prep, st)


@slow
def test_planned_slots_hold_every_reveal():
    """Every token a step reveals lies in the slots its plan named (what a constraint masks)."""
    m, par = _paradigms()[3]
    prep = prepare(m, PROMPTS, par, jdllm.Sampling(max_new_tokens=12, stop_token_ids=()))
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)
    fns = _steps()
    st = fns["prefill"](m.params, prep.state, **kw)
    while not bool(np.all(np.asarray(st.done))):
        before = np.asarray(st.revealed)
        st, plan = fns["plan"](st, **kw)
        before = before | np.asarray(st.revealed)  # plan's own bookkeeping (early-stop fill) excluded
        slots, valid = np.asarray(plan.slots), np.asarray(plan.valid)
        st, logits = fns["forward"](m.params, st, plan, **kw)
        st = fns["reveal"](st, plan, logits, **kw)
        new = np.asarray(st.revealed) & ~before
        for b in range(st.batch):
            assert set(np.flatnonzero(new[b])) <= set(slots[b][valid[b]])


# --------------------------------------------------------------------------- per-row sampling
@slow
def test_new_temperature_does_not_recompile_and_rows_may_differ():
    m = causal_model()
    greedy = jdllm.Sampling(max_new_tokens=10, stop_token_ids=())
    base = jdllm.generate(m, PROMPTS, jdllm.AR(), greedy)
    hot = jdllm.Sampling(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=10, stop_token_ids=(), seed=4)
    with traces() as seen:
        sampled = jdllm.generate(m, PROMPTS, jdllm.AR(), hot)
        mixed = jdllm.generate(m, PROMPTS, jdllm.AR(), [greedy, hot, greedy])
    assert seen["run"] == 0
    assert [o.token_ids for o in sampled] != [o.token_ids for o in base]
    assert mixed[0].token_ids == base[0].token_ids and mixed[2].token_ids == base[2].token_ids
    # a per-request Sampling list: a row's sample does not depend on its place in the batch
    alone = jdllm.generate(m, [PROMPTS[1]], jdllm.AR(), [hot])
    assert mixed[1].token_ids == alone[0].token_ids
    moved = jdllm.generate(m, [PROMPTS[1], PROMPTS[0]], jdllm.AR(), [hot, greedy])
    assert moved[0].token_ids == alone[0].token_ids


@slow
def test_per_row_stop_ids():
    m = causal_model()
    free = jdllm.generate(m, [PROMPTS[0]], jdllm.AR(), jdllm.Sampling(max_new_tokens=10, stop_token_ids=()))[0]
    stop = free.token_ids[3]
    outs = jdllm.generate(m, [PROMPTS[0]] * 2, jdllm.AR(),
                          [jdllm.Sampling(max_new_tokens=10, stop_token_ids=(stop,)),
                           jdllm.Sampling(max_new_tokens=10, stop_token_ids=())])
    first = free.token_ids.index(stop)
    assert outs[0].token_ids == free.token_ids[:first + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == free.token_ids and outs[1].finish_reason == "length"


# --------------------------------------------------------------------------- truthful endings
class _ShortAR(jdllm.AR):
    """AR with an iteration guard of 3 (a distinct class: its own compile)."""

    def max_iterations(self, state):
        return 3


@slow
def test_iteration_guard_gives_abort_and_a_warning():
    m = causal_model()
    with pytest.warns(RuntimeWarning, match="abort"):
        outs = jdllm.generate(m, PROMPTS[:2], _ShortAR(), jdllm.Sampling(max_new_tokens=10, stop_token_ids=()))
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert [len(o.token_ids) for o in outs] == [4, 4]  # prefill + 3 steps


@slow
def test_max_forwards_gives_abort():
    m = block_model()
    with pytest.warns(RuntimeWarning, match="abort"):
        (o,) = jdllm.generate(m, [PROMPTS[0]], jdllm.MultiBlock(block_size=4, max_forwards=2),
                              jdllm.Sampling(max_new_tokens=16, stop_token_ids=()))
    assert o.finish_reason == "abort" and o.nfe == 2


@slow
@pytest.mark.parametrize("case", [0, 1, 4])
def test_mask_that_allows_nothing_stops_cleanly(case):
    m, par = _paradigms()[case]
    prep = prepare(m, PROMPTS[:1], par, jdllm.Sampling(max_new_tokens=8, stop_token_ids=()))
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)
    fns = _steps()
    st = fns["prefill"](m.params, prep.state, **kw)
    st, plan = fns["plan"](st, **kw)
    words = -(-m.config.vocab_size // 32)
    st, logits = fns["forward"](m.params, st, plan, **kw)
    st = fns["reveal"](st, plan, logits, jnp.zeros((st.batch, plan.width, words), jnp.int32), **kw)
    with pytest.warns(RuntimeWarning, match="invalid"):
        (o,) = outputs(prep, fns["finalize"](st))
    assert o.finish_reason == "invalid"
    assert np.all(np.isfinite(o.logprobs))


def test_non_finite_logits_finish_invalid():
    m = causal_model()
    params = jax.tree.map(lambda x: x, m.params)
    params["final_norm"] = params["final_norm"].at[0].set(jnp.nan)
    broken = jdllm.Model(m.config, params, attn_impl="xla")
    with pytest.warns(RuntimeWarning, match="invalid"):
        (o,) = jdllm.generate(broken, [PROMPTS[0]], jdllm.AR(), jdllm.Sampling(max_new_tokens=5))
    assert o.finish_reason == "invalid" and o.token_ids == []


# --------------------------------------------------------------------------- reusable prepared state
@slow
def test_prepared_state_can_be_decoded_twice():
    m, par = _paradigms()[1]
    prep = prepare(m, PROMPTS, par, jdllm.Sampling(max_new_tokens=8))
    assert prep.state.cache is None  # the KV cache is made inside the decode
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)
    first = _fields(outputs(prep, loop.compiled()(m.params, prep.state, **kw)))
    again = _fields(outputs(prep, loop.compiled()(m.params, prep.state, **kw)))
    assert first == again


@slow
def test_prepare_max_rows_caps_the_padded_batch():
    """prepare pads a batch to its shape bucket (3 prompts -> 4 rows) unless max_rows is smaller (the
    serving pool); fewer rows than prompts is an InputError."""
    from jdllm import errors

    m, par = _paradigms()[1]
    prompts, s = PROMPTS, jdllm.Sampling(max_new_tokens=8)
    assert prepare(m, prompts, par, s).state.batch == 4
    prep = prepare(m, prompts, par, s, max_rows=3)
    assert prep.state.batch == 3 and not np.asarray(prep.state.done).any()
    assert prepare(m, prompts, par, s, max_rows=8).state.batch == 4
    with pytest.raises(errors.InputError, match="max_rows=2 cannot hold 3 prompts"):
        prepare(m, prompts, par, s, max_rows=2)
