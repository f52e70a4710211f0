"""The window shapes a decode program compiles (`common.switch_width`).

On a GPU at small batch a forward costs one read of the weights whatever its window, so the
paradigms' narrower window shapes (block diffusion's commit / no-commit windows, multi_block's
power-of-two widths) are merged into one: fewer whole-model forwards in the program (each one
more compile), the same tokens. `DecodeCtx.merge_tokens` forces the GPU rule on the CPU here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdllm
from jdllm.api import outputs, prepare
from jdllm.model import KVCache
from jdllm.decode import common, loop
from tests.decode_fixtures import FAST_COMPILE, block_model
from tests.quick import slow
from tests.test_decode_multi_block import bidir_model

PROMPTS = [[5, 17, 3, 44, 9, 12], [70, 2, 31]]
DECODE = loop.compiled(FAST_COMPILE)


def _norms_in_program(model, prep) -> int:
    """RMS norms in the traced decode program, every branch counted: each whole-model forward
    holds 2 per layer (+ q/k norms) and a final one, so fewer forwards mean fewer norms."""
    jaxpr = jax.make_jaxpr(lambda p, s: loop.run(p, s, paradigm=prep.paradigm, ctx=prep.ctx))(
        model.params, prep.state)
    return str(jaxpr).count("rsqrt")


def _run(model, decoding, merge):
    prep = prepare(model, PROMPTS, decoding, jdllm.Sampling(max_new_tokens=11))
    prep = dataclasses.replace(prep, ctx=dataclasses.replace(prep.ctx, merge_tokens=merge))
    outs = outputs(prep, DECODE(model.params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx))
    return prep, [(o.token_ids, o.step_map, o.nfe, o.finish_reason) for o in outs]


CASES = {
    "block_diffusion": (lambda: block_model(), jdllm.BlockDiffusion(block_length=4, denoising_steps=2)),
    "multi_block_exact": (lambda: block_model(), jdllm.MultiBlock(block_size=4, entropy_threshold=0.3,
                                                                  block_add_threshold=0.25, max_blocks=2)),
    "multi_block_approx": (lambda: bidir_model(), jdllm.MultiBlock(block_size=4, entropy_threshold=0.3,
                                                                   block_add_threshold=0.25, cache_mode="approx")),
    "multi_block_nocache": (lambda: block_model(), jdllm.MultiBlock(block_size=4, cache_mode="none")),
}


@slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_window_shapes_give_the_same_tokens_with_fewer_forwards(case):
    make, decoding = CASES[case]
    model = make()
    every, out_every = _run(model, decoding, merge=0)  # the CPU rule: every width compiles
    merged, out_merged = _run(model, decoding, merge=10_000)  # everything weight-bound: one shape
    assert out_merged == out_every
    n_every, n_merged = _norms_in_program(model, every), _norms_in_program(model, merged)
    assert n_merged < n_every, (n_merged, n_every)


def test_compiled_widths_keep_what_is_not_weight_bound():
    ctx = common.DecodeCtx(model=block_model().config, merge_tokens=64)
    assert common.compiled_widths(ctx, 1, [8, 16, 32, 64, 128, 96]) == [64, 96, 128]
    assert common.compiled_widths(ctx, 4, [8, 16, 32, 64]) == [16, 32, 64]
    assert common.compiled_widths(ctx, 128, [8, 16]) == [8, 16]
    assert common.compiled_widths(dataclasses.replace(ctx, merge_tokens=0), 1, [8, 16]) == [8, 16]
    cpu = common.DecodeCtx(model=block_model().config)
    assert common.weight_bound_tokens(cpu) == (0 if jax.default_backend() != "gpu" else
                                               common.GPU_WEIGHT_BOUND_TOKENS)
    np.testing.assert_equal(common.compiled_widths(cpu, 1, [4, 8]), [4, 8] if jax.default_backend() != "gpu"
                            else [8])


def test_merge_bound_from_the_environment(monkeypatch):
    """`JDLLM_MERGE_TOKENS=N` sets the merge bound for the process (a benchmark variant: 128 on a
    GPU so that wide windows keep their narrower shapes), read when the decode program is traced; a
    decode's own `merge_tokens` wins. The program it compiles traces fewer forwards and gives the
    tokens of the program that compiles every width; a bad value is a jdllm error naming it."""
    from jdllm import errors  # noqa: PLC0415
    from tests.compiles import traces  # noqa: PLC0415

    ctx = common.DecodeCtx(model=block_model().config)
    monkeypatch.setenv(common.MERGE_TOKENS_ENV, "64")
    assert common.weight_bound_tokens(ctx) == 64
    assert common.compiled_widths(ctx, 1, [8, 16, 32, 64, 128]) == [64, 128]
    assert common.weight_bound_tokens(dataclasses.replace(ctx, merge_tokens=0)) == 0
    make, decoding = CASES["multi_block_exact"]
    model = make()
    sampling = jdllm.Sampling(max_new_tokens=9)  # shapes of this test alone: no compile to reuse
    prep = prepare(model, PROMPTS, decoding, sampling)
    with traces() as seen:  # the program is traced here, under the environment's bound
        merged = outputs(prep, DECODE(model.params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx))
    assert seen["run"] == 1
    n_merged = _norms_in_program(model, prep)
    every = dataclasses.replace(prep, ctx=dataclasses.replace(prep.ctx, merge_tokens=0))
    out_every = outputs(every, DECODE(model.params, every.state, paradigm=every.paradigm, ctx=every.ctx))
    assert [(o.token_ids, o.step_map, o.nfe) for o in merged] == [(o.token_ids, o.step_map, o.nfe) for o in out_every]
    assert n_merged < _norms_in_program(model, every), n_merged
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv(common.MERGE_TOKENS_ENV, bad)
        with pytest.raises(errors.ConfigError, match=common.MERGE_TOKENS_ENV):
            common.weight_bound_tokens(ctx)


@pytest.mark.parametrize("scaled", [False, True])
def test_in_turn_equals_a_switch(scaled):
    """`common.in_turn` (the chain of two-way conditionals that keeps the cache in place on the
    kernels) gives what a switch gives, whichever branch runs: the taken forward's cache writes,
    the last slot included (the branches not taken write its original value back; the chain then
    restores what the taken one left there; one forward leaves it alone), its hidden states and its
    forward count. `scaled`: an int8 cache, whose scales are restored alike."""
    model = bidir_model()
    prep = prepare(model, PROMPTS, CASES["multi_block_approx"][1], jdllm.Sampling(max_new_tokens=8))
    S = prep.state.slots
    k = jax.random.normal(jax.random.key(1), KVCache.empty(model.config, prep.state.batch, S).k.shape)
    scales = {}
    if scaled:
        k = jnp.round(k * 40).astype(jnp.int8)
        ks = jax.random.uniform(jax.random.key(2), k.shape[:-1] + (1,))
        scales = dict(k_scale=ks, v_scale=2 * ks)
    state = prep.state.replace(cache=KVCache(k=k, v=-k, length=jnp.zeros((prep.state.batch,), jnp.int32), **scales))
    N, D = 3, 5

    def forward_of(j, width):  # writes the last `width` slots; a negative width: the first ones
        cut = slice(S - width, None) if width > 0 else slice(0, -width)

        def fwd(st):
            c = st.cache
            k = c.k.at[:, :, cut].set(j + 1)
            v = c.v.at[:, :, cut].set(-(j + 1))
            if scaled:
                c = dataclasses.replace(c, k_scale=c.k_scale.at[:, :, cut].set(j + 0.5),
                                        v_scale=c.v_scale.at[:, :, cut].set(j + 0.25))
            st = st.replace(cache=dataclasses.replace(c, k=k, v=v), forwards=st.forwards + 1)
            return st, jnp.full((st.batch, N, D), float(j + 1), jnp.float32)
        return fwd

    forwards = [forward_of(j, w) for j, w in enumerate((2, -4, 8, S))]
    chain = jax.jit(lambda b, st: common.in_turn(b, forwards, st))
    switch = jax.jit(lambda b, st: jax.lax.switch(b, forwards, st))
    for b in range(len(forwards)):
        (got, h), (want, hw) = chain(np.int32(b), state), switch(np.int32(b), state)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(h), np.asarray(hw))
