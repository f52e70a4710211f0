"""`multi_block` (d3LLM) against the plain-loop reference; exact KV cache == no cache; block states."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jdllm
from jdllm import errors
from jdllm.api import prepare
from jdllm.config import ModelConfig
from jdllm.decode import loop
from jdllm.decode.multi_block import BLOCK_STATES
from jdllm.loading import Model
from jdllm.model import init_params
from tests.compiles import traces
from tests.decode_fixtures import MASK, VOCAB, assert_matches_reference, block_model
from tests.quick import slow, slow_except
from tests.reference_multi_block import STATE_CODE, multi_block_reference, states_during

pytestmark = pytest.mark.usefixtures("fast_compile")

BS = 4
PROMPTS = [[5, 17, 3, 44, 9, 12], [70, 2, 31], [8, 21, 55, 90, 13, 4, 27, 66, 1]]
MAX_NEW = 13
# threshold paths (dyadic thresholds: progress comparisons are exact in float32 and float64)
CONFIGS = {
    # blocks added early as Activated, promoted to Fully-Activated later; some parallel reveals
    "pipelined": dict(entropy_threshold=0.3, block_add_threshold=0.25, decoded_token_threshold=0.75,
                      max_blocks=3),
    # nothing under the entropy bound: one lowest-entropy token plus forced progress per block
    "forced": dict(entropy_threshold=0.0, block_add_threshold=0.5, decoded_token_threshold=0.5, max_blocks=2),
    # the next block only once the newest is full, Fully-Activated at once
    "serial": dict(entropy_threshold=0.6, block_add_threshold=1.0, decoded_token_threshold=1.0, max_blocks=4),
}


@functools.lru_cache(maxsize=None)
def bidir_model(seed: int = 3, logit_shift: bool = False) -> Model:
    """LLaDA-like (Dream-like when logit_shift) bidirectional model with a mask token."""
    cfg = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, attention="bidirectional", logit_shift=logit_shift,
                      mask_token_id=MASK, max_position_embeddings=256, eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(seed), std=0.7), attn_impl="xla")


def _mb(config, **kw):
    return jdllm.MultiBlock(block_size=BS, **{**CONFIGS[config], **kw})


def _ref(m, prompt, config, max_new=MAX_NEW, **kw):
    return multi_block_reference(m.params, m.config, prompt, max_new_tokens=max_new, block_size=BS,
                                 **{**CONFIGS[config], **kw})


def _check(out, ref):
    assert_matches_reference(out, ref)
    assert out.trace["block_steps"] == ref["entered"]
    assert [BLOCK_STATES[s] for s in out.trace["block_state"]] == ref["final"]


def _sampling(max_new=MAX_NEW, **kw):
    return jdllm.Sampling(max_new_tokens=max_new, stop_token_ids=(), **kw)


@pytest.mark.parametrize("config, shifted", slow_except([("pipelined", False), ("forced", False), ("serial", True)],
                                                     ("pipelined", False)))
def test_block_causal_matches_reference(config, shifted):
    """SDAR-like (Fast-dLLM-like when shifted) model, exact cache, mixed-length batch and batch 1."""
    m = block_model(seed=2, logit_shift=True) if shifted else block_model()
    refs = [_ref(m, p, config) for p in PROMPTS]
    outs = jdllm.generate(m, PROMPTS, _mb(config, cache_mode="exact"), _sampling())
    for out, ref in zip(outs, refs):
        _check(out, ref)
        assert MASK not in out.token_ids and len(out.token_ids) == MAX_NEW
    if config == "pipelined":
        (solo,) = jdllm.generate(m, [PROMPTS[2]], _mb(config, cache_mode="exact"), _sampling())
        _check(solo, refs[2])
    if config == "forced":  # one lowest-entropy token, plus forced ones for the other blocks in flight
        assert max(np.bincount(outs[0].step_map)) <= CONFIGS[config]["max_blocks"]


@slow
@pytest.mark.parametrize("config, shifted", [("pipelined", False), ("serial", True)])
def test_exact_cache_on_the_pallas_kernels_matches_reference(config, shifted, monkeypatch):
    """The exact cache on the Pallas kernels (interpret mode here), which read the stacked cache in
    place: a window wider than the narrowest compiled width runs as consecutive chunks of that width
    in a while loop (`ExactCache.chunked`; a switch of more than two widths copied the cache), here
    up to four chunks of one block; a row alone (scalar window offsets) and a batch, and a shifted
    (Fast-dLLM-like) model, whose first chunk takes the slot before it from prev_logits."""
    from jdllm.decode import multi_block_cache

    chunks = []
    chunked = multi_block_cache.ExactCache.chunked

    def spy(params, ctx, state, width, need, at, also):
        jax.debug.callback(lambda n: chunks.append(-(-int(n) // width)), need)
        return chunked(params, ctx, state, width, need, at, also)
    monkeypatch.setattr(multi_block_cache.ExactCache, "chunked", staticmethod(spy))
    m0 = block_model(seed=2, logit_shift=True) if shifted else block_model()
    m = Model(m0.config, m0.params, attn_impl="pallas")
    for prompts in ([PROMPTS[2]], PROMPTS):
        outs = jdllm.generate(m, prompts, _mb(config, cache_mode="exact"), _sampling())
        for p, out in zip(prompts, outs):
            _check(out, _ref(m, p, config))
    assert max(chunks) >= 2


@slow
@pytest.mark.parametrize("config, shifted", [("pipelined", False), ("forced", True)])
def test_bidirectional_matches_reference(config, shifted):
    """LLaDA-like (Dream-like when shifted) model: whole-canvas forward, mixed-length batch and batch 1."""
    m = bidir_model(4, True) if shifted else bidir_model()
    refs = [_ref(m, p, config) for p in PROMPTS]
    for out, ref in zip(jdllm.generate(m, PROMPTS, _mb(config), _sampling()), refs):
        _check(out, ref)
    if not shifted:
        (solo,) = jdllm.generate(m, [PROMPTS[1]], _mb(config), _sampling())
        _check(solo, refs[1])


# the threshold settings (progress steps of 1/4 never tie with them), entropy bound 0.5 (d3LLM's
# LLaDA default): several Fully-Activated blocks hold masks at once, so "first" and "every" differ
D3_SETTINGS = {
    "add0.1/dec0.95": dict(entropy_threshold=0.5, block_add_threshold=0.1, decoded_token_threshold=0.95),
    "add0.25/dec0.5": dict(entropy_threshold=0.5, block_add_threshold=0.25, decoded_token_threshold=0.5),
}
D3_NEW = 16  # a whole number of blocks, as d3LLM's loops need


def _family(name):
    return {"llada": bidir_model, "dream": lambda: bidir_model(4, True), "sdar": block_model}[name]()


def _d3ref(m, prompt, setting, **kw):
    return multi_block_reference(m.params, m.config, prompt, max_new_tokens=D3_NEW, block_size=BS,
                                 **D3_SETTINGS[setting], **kw)


@slow
@pytest.mark.parametrize("family, setting, solo", [
    ("llada", "add0.1/dec0.95", True), ("llada", "add0.25/dec0.5", False),
    ("dream", "add0.1/dec0.95", False), ("dream", "add0.25/dec0.5", True), ("sdar", "add0.25/dec0.5", False)])
def test_defaults_reproduce_d3llm(family, setting, solo):
    """The default MultiBlock (no cap, forced progress in the first Fully-Activated block, the family's
    selection rule) == the reference written from d3LLM's generate_multi_block / _sample_multi_block:
    tokens, step map, NFE and block trajectory; batched (mixed lengths) and batch 1."""
    m = _family(family)
    d = jdllm.MultiBlock(block_size=BS, **D3_SETTINGS[setting])
    assert d.max_blocks is None and d.forced_progress == "first" and d.selection == "auto"
    assert d.selection_rule(m.config) == ("dream" if family == "dream" else "llada")
    refs = [_d3ref(m, p, setting) for p in PROMPTS]
    for out, ref in zip(jdllm.generate(m, PROMPTS, d, _sampling(D3_NEW)), refs):
        _check(out, ref)
    if solo:
        (one,) = jdllm.generate(m, [PROMPTS[0]], d, _sampling(D3_NEW))
        _check(one, refs[0])
    # the d3LLM rules matter here: jdllm's earlier defaults (every block forced, the LLaDA rule, a cap
    # of 2 blocks) give other outputs on some row, so this test can tell them apart
    old = [_d3ref(m, p, setting, forced_progress="every", selection="llada", max_blocks=2) for p in PROMPTS]
    assert any(o["step_map"] != r["step_map"] or o["tokens"] != r["tokens"] for o, r in zip(old, refs))


@slow
@pytest.mark.parametrize("family, forced, selection", [
    ("llada", "every", "auto"), ("dream", "every", "auto"), ("llada", "first", "dream"),
    ("dream", "every", "llada"), ("sdar", "every", "dream")])
def test_options_match_reference(family, forced, selection):
    """forced_progress="every" (jdllm's variant) and an explicit selection rule follow the reference with
    the same options; each changes some output against the default."""
    m = _family(family)
    setting = "add0.25/dec0.5"
    d = jdllm.MultiBlock(block_size=BS, forced_progress=forced, selection=selection, **D3_SETTINGS[setting])
    refs = [_d3ref(m, p, setting, forced_progress=forced, selection=selection) for p in PROMPTS]
    for out, ref in zip(jdllm.generate(m, PROMPTS, d, _sampling(D3_NEW)), refs):
        _check(out, ref)
    default = [_d3ref(m, p, setting) for p in PROMPTS]
    assert any(a["step_map"] != b["step_map"] or a["tokens"] != b["tokens"] for a, b in zip(refs, default))
    if forced == "every":  # every Fully-Activated block with masks progresses each step
        assert sum(r["nfe"] for r in refs) <= sum(r["nfe"] for r in default)


def _final_state(m, prompts, decoding, sampling):
    prep = prepare(m, prompts, decoding, sampling)
    return prep, loop.compiled()(m.params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx)


@slow
def test_exact_cache_equals_no_cache_and_commits_blocks():
    """Long enough for the window to slide many blocks; greedy and sampled; cache really used."""
    m = block_model(seed=5)
    max_new = 30
    for sampling in (_sampling(max_new), _sampling(max_new, temperature=0.8, seed=3)):
        outs = {}
        for cache in ("none", "exact"):
            prep, final = _final_state(m, PROMPTS, _mb("pipelined", max_blocks=2, cache_mode=cache), sampling)
            outs[cache] = jdllm.api.outputs(prep, final)
            if cache == "exact":  # each real row committed well past the prompt blocks, never a stale block
                assert int(final.cache.length[:len(PROMPTS)].min()) > prep.ctx.prefill_len + 4 * BS
        for a, b in zip(outs["none"], outs["exact"]):
            assert a.token_ids == b.token_ids and a.step_map == b.step_map and a.nfe == b.nfe
            assert a.trace == b.trace
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    greedy = jdllm.generate(m, PROMPTS, _mb("pipelined", max_blocks=2, cache_mode="exact"), _sampling(max_new))
    for p, out in zip(PROMPTS, greedy):
        _check(out, _ref(m, p, "pipelined", max_new=max_new, max_blocks=2))


@slow
@pytest.mark.parametrize("kind, at", [("block_causal", 2), ("bidirectional", 1)])
def test_eos_early_stop(kind, at):
    """Stop token = the free run's token `at`: rows stop; with early_stop the rest becomes EOS."""
    m = block_model() if kind == "block_causal" else bidir_model()
    free = _ref(m, PROMPTS[0], "pipelined")
    stop = free["tokens"][at]
    sampling = jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
    for early in (True, False) if kind == "block_causal" else (True,):
        refs = [_ref(m, p, "pipelined", stop_ids=(stop,), early_stop=early) for p in PROMPTS]
        assert refs[0]["finish"] == "stop"
        outs = jdllm.generate(m, PROMPTS, _mb("pipelined", early_stop=early), sampling)
        for out, ref in zip(outs, refs):
            _check(out, ref)
            if out.finish_reason == "stop":
                assert out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
        if early:  # blocks wholly after the EOS were completed without ever being added
            skipped = [b for o in outs for b in o.trace["block_steps"] if b[0] < 0 and b[1] < 0 and b[2] >= 0]
            assert skipped
            assert outs[0].nfe <= free["nfe"]


@slow
def test_block_state_transitions():
    """Thresholds that force the transitions; the per-step state sequence equals the reference's.

    block_add_threshold 0.25 adds blocks while the newest is mostly masked (-> Activated),
    decoded_token_threshold 0.75 promotes them later (Activated -> Fully-Activated) or adds
    them Fully-Activated at once behind a finished block; max_blocks 2 caps the pipeline.
    """
    m = block_model()
    kw = dict(entropy_threshold=0.2, block_add_threshold=0.25, decoded_token_threshold=0.75, max_blocks=2)
    refs = [multi_block_reference(m.params, m.config, p, max_new_tokens=20, block_size=BS, **kw) for p in PROMPTS]
    outs = jdllm.generate(m, PROMPTS, jdllm.MultiBlock(block_size=BS, **kw), _sampling(20))
    kinds = set()
    for out, ref in zip(outs, refs):
        _check(out, ref)
        steps = out.trace["block_steps"]
        for t, seen in enumerate(ref["trace"], start=1):
            assert states_during(steps, t) == seen
        code = [[STATE_CODE[s] for s in states_during(steps, t)] for t in range(1, out.nfe + 1)]
        assert all(a <= b for prev, cur in zip(code, code[1:]) for a, b in zip(prev, cur)), "never backwards"
        assert max(sum(k in (1, 2) for k in s) for s in code) <= kw["max_blocks"]
        a, f, c = np.array(steps).T
        assert f[0] == 0 and a[0] < 0, "block 0 starts Fully-Activated"
        assert np.all(c >= np.maximum(a, f)) and np.all(c >= 0), "every block Completed, after activation"
        kinds |= {"activated->fully"} if np.any((a >= 0) & (f > a)) else set()
        kinds |= {"fully at once"} if np.any((a < 0) & (f > 0)) else set()
        kinds |= {"cap reached"} if max(sum(k in (1, 2) for k in s) for s in code) == kw["max_blocks"] else set()
    assert kinds == {"activated->fully", "fully at once", "cap reached"}


@slow
def test_max_forwards_stops_rows():
    m = block_model()
    with pytest.warns(RuntimeWarning, match="abort"):
        outs = jdllm.generate(m, PROMPTS, _mb("forced", max_forwards=3), _sampling())
    for p, out in zip(PROMPTS, outs):
        ref = _ref(m, p, "forced", max_forwards=3)
        _check(out, ref)
        assert out.nfe == 3 and out.finish_reason == "abort" and len(out.token_ids) < MAX_NEW


@slow
@pytest.mark.parametrize("delay, refresh, config, mixed", [
    (2, 10000, "pipelined", False), (0, 10000, "serial", False), (1, 3, "pipelined", True),
    (3, 10000, "forced", False)])
def test_approx_cache_follows_d3llm(delay, refresh, config, mixed):
    """cache_mode="approx" == d3LLM's delayed prefix cache replayed with explicit stale K/V, token for
    token, step for step, in NFE and block trajectory; mixed-length batch and batch 1."""
    m = bidir_model()
    max_new = 24
    ac = dict(cache_delay_iter=delay, refresh_interval=refresh)
    refs = [_ref(m, p, config, max_new=max_new, approx_cache=ac) for p in PROMPTS]
    d = _mb(config, cache_mode="approx", **ac)
    outs = jdllm.generate(m, PROMPTS, d, _sampling(max_new))
    for out, ref in zip(outs, refs):
        _check(out, ref)
    (solo,) = jdllm.generate(m, [PROMPTS[2]], d, _sampling(max_new))
    _check(solo, refs[2])
    kinds = {k for r in refs for k in r["kinds"]}
    assert "suffix" in kinds and "suffix+cache" in kinds  # the cache is really used
    if delay >= 1:
        assert "refresh" in kinds  # stabilising blocks force full forwards
    if mixed:  # some batch forwards serve a row in a refresh beside rows running their suffix
        assert any(len({r["kinds"][i] for r in refs if i < len(r["kinds"])}) > 1
                   for i in range(max(len(r["kinds"]) for r in refs)))
    plain = [_ref(m, p, config, max_new=max_new) for p in PROMPTS]
    assert any(r["tokens"] != p["tokens"] or r["step_map"] != p["step_map"] for r, p in zip(refs, plain)), \
        "stale K/V should change some decision, else this test cannot tell the cache from no cache"


@slow
@pytest.mark.parametrize("delay, refresh, setting", [(0, 3, "add0.25/dec0.5"), (1, 10000, "pipelined")])
def test_approx_cache_follows_d3llm_dream(delay, refresh, setting):
    """cache_mode="approx" on a Dream-style (shifted-logit) model == d3LLM's _sample_multi_block_kv_cache
    replayed: its scan goes on past blocks inside their delay, and a suffix forward predicts the slot
    at its edge from that slot's own output. Defaults otherwise (Dream rule, first-block forced
    progress, no cap); mixed-length batch. (At cache_delay_iter=2, d3LLM's Dream cache often
    refreshes past its edge and duplicates keys; the replay refuses those runs, jdllm does not copy it.)"""
    m = bidir_model(4, True)
    max_new = 24
    ac = dict(cache_delay_iter=delay, refresh_interval=refresh)
    kw = {k: v for k, v in {**CONFIGS, **D3_SETTINGS}[setting].items() if k != "max_blocks"}
    refs = [multi_block_reference(m.params, m.config, p, max_new_tokens=max_new, block_size=BS,
                                  approx_cache=ac, **kw) for p in PROMPTS]
    outs = jdllm.generate(m, PROMPTS, jdllm.MultiBlock(block_size=BS, cache_mode="approx", **ac, **kw),
                          _sampling(max_new))
    for out, ref in zip(outs, refs):
        _check(out, ref)
    assert {"suffix", "suffix+cache", "refresh"} <= {k for r in refs for k in r["kinds"]}
    plain = [multi_block_reference(m.params, m.config, p, max_new_tokens=max_new, block_size=BS, **kw)
             for p in PROMPTS]
    assert any(r["tokens"] != p["tokens"] or r["step_map"] != p["step_map"] for r, p in zip(refs, plain))


@slow
def test_approx_cache_on_the_pallas_kernels_follows_d3llm():
    """cache_mode="approx" on the Pallas kernels (interpret mode here), which read the stacked cache
    in place: the slots a row keeps (below its cache edge) are dropped from the K/V write rather
    than read back and rewritten (`jdllm.model.write_rows(keep=)`); d3LLM's replay token for token,
    with refreshes beside suffix forwards in one batch, and a row alone."""
    m0 = bidir_model()
    m = Model(m0.config, m0.params, attn_impl="pallas")
    max_new = 24
    ac = dict(cache_delay_iter=1, refresh_interval=3)
    refs = [_ref(m, p, "pipelined", max_new=max_new, approx_cache=ac) for p in PROMPTS]
    d = _mb("pipelined", cache_mode="approx", **ac)
    for out, ref in zip(jdllm.generate(m, PROMPTS, d, _sampling(max_new)), refs):
        _check(out, ref)
    (solo,) = jdllm.generate(m, [PROMPTS[2]], d, _sampling(max_new))
    _check(solo, refs[2])
    assert {"suffix+cache", "refresh"} <= {k for r in refs for k in r["kinds"]}


@slow
def test_approx_cache_with_eos_early_stop():
    """The approximate cache under EOS early stop against the replay (stop ids, early_stop).

    The blocks d3LLM's early stop creates (complete, marked cached, never stabilising) cannot
    change a token: the caching scan reaches them only once every block before them is complete,
    and then the row has stopped. Both sides model them anyway; this checks the whole path."""
    m = bidir_model()
    max_new = 24
    ac = dict(cache_delay_iter=2, refresh_interval=10000)
    free = _ref(m, PROMPTS[0], "pipelined", max_new=max_new, approx_cache=ac)
    stop = free["tokens"][5]
    refs = [_ref(m, p, "pipelined", max_new=max_new, approx_cache=ac, stop_ids=(stop,)) for p in PROMPTS]
    assert refs[0]["finish"] == "stop"
    sampling = jdllm.Sampling(max_new_tokens=max_new, stop_token_ids=(stop,))
    outs = jdllm.generate(m, PROMPTS, _mb("pipelined", cache_mode="approx", **ac), sampling)
    for out, ref in zip(outs, refs):
        _check(out, ref)
    created = [b for o in outs for b in o.trace["block_steps"] if b[0] < 0 and b[1] < 0 and b[2] >= 0]
    assert created  # the early stop did create blocks


@slow
def test_window_cache_bidirectional():
    """cache_mode="window" (jdllm's variant): off by default; refresh every step == the no-cache run;
    default refresh stays a valid decode."""
    m = bidir_model()
    assert jdllm.MultiBlock().resolved_cache_mode(m.config) == "none"
    exact = jdllm.generate(m, PROMPTS, _mb("pipelined"), _sampling())
    every = jdllm.generate(m, PROMPTS, _mb("pipelined", cache_mode="window", refresh_interval=1), _sampling())
    approx = jdllm.generate(m, PROMPTS, _mb("pipelined", cache_mode="window"), _sampling())
    for e, r, a in zip(exact, every, approx):
        assert e.token_ids == r.token_ids and e.step_map == r.step_map
        assert MASK not in a.token_ids and len(a.token_ids) == MAX_NEW
    # the Pallas kernels (their full forwards keep each windowed row's K/V outside its window by
    # dropping those slots from the write): the XLA path's tokens
    on_kernels = jdllm.generate(Model(m.config, m.params, attn_impl="pallas"), PROMPTS,
                                _mb("pipelined", cache_mode="window"), _sampling())
    for a, k in zip(approx, on_kernels):
        assert (a.token_ids, a.step_map, a.nfe) == (k.token_ids, k.step_map, k.nfe)


def test_no_retrace_on_second_call_with_same_buckets():
    m = block_model()
    d = _mb("pipelined", cache_mode="exact")
    jdllm.generate(m, PROMPTS, d, _sampling())
    with traces() as seen:
        outs = jdllm.generate(m, [[1, 2, 3, 4, 5], [9, 8], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7]], d, _sampling(11))
    assert seen["run"] == 0
    assert all(len(o.token_ids) == 11 for o in outs)


@pytest.mark.parametrize("kw, word", [
    (dict(block_size=0), "block_size"), (dict(block_size=2.5), "block_size"),
    (dict(entropy_threshold=-0.1), "entropy_threshold"), (dict(entropy_threshold=float("nan")), "entropy_threshold"),
    (dict(block_add_threshold=1.5), "block_add_threshold"),
    (dict(decoded_token_threshold=-0.2), "decoded_token_threshold"),
    (dict(max_forwards=0), "max_forwards"), (dict(max_blocks=0), "max_blocks"),
    (dict(cache_mode="dual"), "cache"), (dict(early_stop="yes"), "early_stop"),
    (dict(forced_progress="all"), "forced_progress"), (dict(selection="fastdllm"), "selection"),
    (dict(max_blocks=1.5), "max_blocks"),
    (dict(refresh_interval=0), "refresh_interval"), (dict(cache_delay_iter=-1), "cache_delay_iter"),
])
def test_bad_config_raises(kw, word):
    with pytest.raises(errors.DecodingConfigError, match=word):
        jdllm.MultiBlock(**kw)


@slow
def test_bad_model_raises():
    from tests.decode_fixtures import causal_model  # noqa: PLC0415

    with pytest.raises(errors.DecodingConfigError, match="jdllm.AR"):
        prepare(causal_model(), [[1, 2]], jdllm.MultiBlock(block_size=BS), _sampling())
    with pytest.raises(errors.DecodingConfigError, match="exact"):
        prepare(bidir_model(), [[1, 2]], jdllm.MultiBlock(block_size=BS, cache_mode="exact"), _sampling())
    for cache in ("approx", "window"):
        with pytest.raises(errors.DecodingConfigError, match=cache):
            prepare(block_model(), [[1, 2]], jdllm.MultiBlock(block_size=BS, cache_mode=cache), _sampling())
    with pytest.warns(UserWarning, match="block_size"):
        prepare(block_model(), [[1, 2]], jdllm.MultiBlock(block_size=8), _sampling(2))


def test_approx_cache_compiles_no_suffix_wider_than_the_generation(monkeypatch):
    """A suffix starts at a row's cache edge (0: a refresh over the whole canvas; else at least the
    row's base, after its prompt), so the step compiles the widths of `block_widths` up to the
    generation region, and the canvas: none in between (here the canvas 48 and 12 blocks of 4 would
    give 32 and 40 too). The tokens are d3LLM's (`test_approx_cache_follows_d3llm`)."""
    from jdllm.decode import common  # noqa: PLC0415

    m = bidir_model()
    seen, real = set(), common.forward_window

    def spy(params, ctx, state, offset, width, **kw):
        seen.add(int(width))
        return real(params, ctx, state, offset, width, **kw)
    monkeypatch.setattr(common, "forward_window", spy)
    prompt = list(range(5, 37))  # 32 tokens: P = 32, the generation bucket 16, S = 48
    lay = _mb("pipelined").layout(np.asarray([len(prompt)]), 16, m.config)
    S, P = lay.slots, lay.prefill_len
    assert (S, P) == (48, 32)
    jdllm.generate(m, [prompt], _mb("pipelined", cache_mode="approx"), _sampling(16))
    gen = [w for w in common.block_widths(BS, S) if w <= S - P]
    assert seen == set(gen) | {S}, (sorted(seen), gen)
    assert any(S - P < w < S for w in common.block_widths(BS, S))  # the test would tell


@pytest.mark.parametrize("unit", [4, 16, 32])
def test_approx_cache_window_widths(unit):
    """The approx cache's suffix widths (`common.block_widths`): whole blocks, ending with the canvas,
    and for every need the narrowest width that covers it runs at most half as many slots again as the
    need's whole blocks, at most a quarter more from 256 slots and eight blocks on."""
    from jdllm.decode.common import FINE_WIDTHS_FROM, block_widths  # noqa: PLC0415
    for S in range(unit, 40 * unit + 1, unit):
        ws = block_widths(unit, S)
        assert ws == sorted(set(ws)) and ws[-1] == S and all(w % unit == 0 and w > 0 for w in ws), (S, ws)
        for need in range(1, S + 1):
            w = next(w for w in ws if w >= need)
            blocks = -(-need // unit) * unit  # a window is whole blocks anyway
            if w == S or blocks == w:
                continue
            limit = 1.5 if blocks <= max(FINE_WIDTHS_FROM, 8 * unit) else 1.25
            assert w <= limit * blocks, (unit, S, need, w)
