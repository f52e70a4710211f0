"""jdllm.nnx.Model: the flax nnx view of a jdllm model.

Its state is the model's parameter pytree (the same array objects, at the same paths), its
forward is `jdllm.model.forward` (logits bit-identical to the functional forward compiled the
same way, and within float32 noise of Hugging Face `transformers` for every family), it trains
with `nnx.Optimizer` + optax, and what it trained goes back to `generate` / rollouts through
`view.params()`, `view.as_model()` or `jdllm.nnx.params_of(nnx.state(view))`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hf_fixtures as fx
import jdllm
import jdllm.nnx
from jdllm import errors
from jdllm.model import default_positions, forward, to_layout
from tests.quick import slow, slow_except
from tests.scripts import load_script

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOL = 1e-4
FAMILIES = fx.BASE_FAMILIES + fx.DIFFUSION_FAMILIES


@jax.jit(static_argnames=("cfg",))
def functional_logits(params, tokens, start, *, cfg):
    """The functional forward, compiled with the same arguments as `view_logits`."""
    return forward(params, cfg, tokens, default_positions(start, 0, tokens.shape[1]), start=start)[0]


@nnx.jit(static_argnames=("attention", "block_size"))
def view_logits(view, tokens, start, attention=None, block_size=None):
    return view(tokens, start=start, attention=attention, block_size=block_size)[0]


def _paths(tree):
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@functools.lru_cache(maxsize=None)
def _tiny_ar():
    """Loaded once per session: the tests change views of it, never its own params."""
    return jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32", attn_impl="xla")


@pytest.mark.parametrize("family", slow_except(FAMILIES, "qwen3", "llada"))
def test_view_state_is_the_params_and_logits_equal_the_functional_forward(family, tmp_path):
    kw = dict(kv_heads=None) if family == "llada" else dict(kv_heads=2)
    hf_dir, ref_model = fx.build_model_dir(family, str(tmp_path / "hf"), seed=3, **kw)
    m = jdllm.load(hf_dir, dtype="float32", attn_impl="xla")
    cfg = m.config
    assert cfg.attention == fx.FAMILY_ATTENTION[family]
    view = jdllm.nnx.Model(m)

    # the state IS the pytree: the same array objects, at jdllm's names
    state = nnx.state(view)
    assert jax.tree.structure(jdllm.nnx.params_of(state)) == jax.tree.structure(m.params)
    assert _paths(view.params()) == _paths(m.params)
    for got in (view.params(), jdllm.nnx.params_of(state), jdllm.nnx.params_of(view)):
        assert all(a is b for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(m.params)))
    assert {tuple(p) for p, _ in nnx.to_flat_state(state)} == \
        {tuple(getattr(e, "key", getattr(e, "idx", None)) for e in k)
         for k, _ in jax.tree_util.tree_flatten_with_path(m.params)[0]}

    # left padding by whole blocks (the block grid lies on slots)
    V = cfg.vocab_size
    tokens = np.random.default_rng(4).integers(0, V, (2, 16)).astype(np.int32)
    start = np.array([0, 4], np.int32)
    got = np.asarray(view_logits(view, tokens, start))
    np.testing.assert_array_equal(got, np.asarray(functional_logits(m.params, tokens, start, cfg=cfg)))
    np.testing.assert_array_equal(got[:1], np.asarray(jdllm.logits(m, tokens[:1])))
    ref = fx.reference_logits(ref_model, tokens, start, cfg.attention, cfg.block_size)
    np.testing.assert_allclose(got[0], ref[0], atol=TOL)
    np.testing.assert_allclose(got[1, 4:], ref[1, 4:], atol=TOL)

    # another attention kind on request: the functional forward under that config
    other = "causal" if cfg.attention != "causal" else "bidirectional"
    got_other = np.asarray(view_logits(view, tokens, start, attention=other))
    np.testing.assert_array_equal(
        got_other, np.asarray(functional_logits(m.params, tokens, start, cfg=dataclasses.replace(cfg, attention=other,
                                                                                                 block_size=1))))
    assert np.max(np.abs(got_other[0] - got[0])) > 1e-3  # the mask matters
    np.testing.assert_allclose(got_other[0], fx.reference_logits(ref_model, tokens[:1], None, other)[0], atol=TOL)


@slow
def test_every_layout_and_block_causal_on_request():
    m = _tiny_ar()
    cfg = m.config
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    start = np.zeros(2, np.int32)
    want = np.asarray(functional_logits(m.params, tokens, start, cfg=cfg))
    for layout in ("per_layer", "stacked"):
        mm = dataclasses.replace(m, params=to_layout(m.params, cfg, layout))
        view = jdllm.nnx.Model(mm)
        assert _paths(view.params()) == _paths(mm.params)
        got = np.asarray(view_logits(view, tokens, start))
        np.testing.assert_allclose(got, want, atol=1e-5)  # another layout is another program
        np.testing.assert_array_equal(got, np.asarray(functional_logits(mm.params, tokens, start, cfg=cfg)))
    view = jdllm.nnx.Model(m)
    bc = np.asarray(view_logits(view, tokens, start, attention="block_causal", block_size=4))
    np.testing.assert_array_equal(bc, np.asarray(functional_logits(
        m.params, tokens, start, cfg=dataclasses.replace(cfg, attention="block_causal", block_size=4))))
    assert np.max(np.abs(bc - want)) > 1e-3  # the mask matters

    # tunix's calling convention: model(tokens, positions=, cache=None, attention_mask=) -> (logits, cache)
    mask = np.tril(np.ones((8, 8), bool))[None].repeat(2, 0)
    logits, cache = view(tokens, positions=default_positions(start, 0, 8), cache=None, attention_mask=mask)
    assert cache is None
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-5)


def test_training_with_nnx_optimizer_and_weights_back_to_jdllm():
    m = _tiny_ar()
    view = jdllm.nnx.Model(m)
    before = {k: v for k, v in zip(_paths(m.params), jax.tree.leaves(m.params))}
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, m.config.vocab_size, (4, 12)), jnp.int32)
    prompt = [[3, 7, 11, 5]]
    sampling = jdllm.Sampling(max_new_tokens=6)

    def loss_fn(v, t):
        logits, _ = v(t)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, t[:, 1:, None], axis=-1))

    @nnx.jit
    def train_step(v, opt, t):
        loss, grads = nnx.value_and_grad(loss_fn)(v, t)
        opt.update(v, grads)
        return loss, grads

    opt = nnx.Optimizer(view, optax.adam(1e-2), wrt=nnx.Param)
    losses = []
    for _ in range(4):
        loss, grads = train_step(view, opt, tokens)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses
    # every weight got a gradient (paths as jdllm names them)
    g = jdllm.nnx.params_of(grads)
    assert _paths(g) == _paths(m.params)
    assert all(float(jnp.max(jnp.abs(x))) > 0 for x in jax.tree.leaves(g))

    # the trained weights reach jdllm without a mapping: same paths, shapes, dtypes; every one changed
    trained = view.params()
    assert _paths(trained) == list(before)
    for (name, old), new in zip(before.items(), jax.tree.leaves(trained)):
        assert new.shape == old.shape and new.dtype == old.dtype, name
        assert not np.array_equal(np.asarray(new), np.asarray(old)), name
    assert all(a is b for a, b in zip(jax.tree.leaves(jdllm.nnx.params_of(nnx.state(view))),
                                      jax.tree.leaves(trained)))
    tm = view.as_model()
    assert tm.config == m.config and tm.tokenizer is m.tokenizer
    # generate reads them: its logits are the trained forward's, its tokens change
    np.testing.assert_array_equal(np.asarray(jdllm.logits(tm, np.asarray(tokens))),
                                  np.asarray(functional_logits(trained, tokens, jnp.zeros(4, jnp.int32), cfg=m.config)))
    gen = jdllm.generate(tm, prompt, jdllm.AR(), sampling)[0].token_ids
    P, n = len(prompt[0]), len(gen)
    seq = [prompt[0] + gen]
    assert np.argmax(np.asarray(jdllm.logits(tm, seq))[0, P - 1:P - 1 + n], -1).tolist() == gen  # greedy, trained
    assert np.argmax(np.asarray(jdllm.logits(m, seq))[0, P - 1:P - 1 + n], -1).tolist() != gen  # not the old weights


def test_one_changed_weight_changes_generation_and_rollouts():
    """A weight set through nnx is what jdllm's rollouts and generate decode with: their log-probs
    are the functional forward's under the changed weights (jdllm.logits), not the old ones'."""
    m = _tiny_ar()
    view = jdllm.nnx.Model(m)
    prompt = [3, 7, 11, 5]
    state, spec = jdllm.rl.prepare_rollout(m, [prompt], jdllm.AR(), jdllm.Sampling(max_new_tokens=6, temperature=1.0))
    key = jax.random.key(0)
    ro0 = jdllm.rl.compiled_rollout(view.params(), state, key, spec=spec)
    view.lm_head[...] = -view.lm_head[...]  # one weight changed in place, through nnx
    assert m.params["lm_head"] is not view.params()["lm_head"]  # the model handed in is untouched
    ro1 = jdllm.rl.compiled_rollout(jdllm.nnx.params_of(nnx.state(view)), state, key, spec=spec)

    def reveal_logprobs(ro, model):  # [n] log p(token) at each generated slot under `model`'s weights
        g0, e = int(ro.gen_start[0]), int(ro.end[0])
        toks = np.asarray(ro.tokens[0, int(ro.start[0]):e])
        lp = np.asarray(jax.nn.log_softmax(jdllm.logits(model, [toks.tolist()]), -1))[0]
        P = g0 - int(ro.start[0])
        return np.asarray([lp[P - 1 + i, toks[P + i]] for i in range(e - g0)]), np.asarray(ro.logprobs[0, g0:e])

    got1, want1 = reveal_logprobs(ro1, view.as_model())
    np.testing.assert_allclose(got1, want1, atol=2e-4)
    old1, _ = reveal_logprobs(ro1, m)
    assert np.max(np.abs(old1 - want1)) > 1e-2
    got0, want0 = reveal_logprobs(ro0, m)
    np.testing.assert_allclose(got0, want0, atol=2e-4)
    out = jdllm.generate(view.as_model(), [prompt], jdllm.AR(), jdllm.Sampling(max_new_tokens=4))[0].token_ids
    assert out != jdllm.generate(m, [prompt], jdllm.AR(), jdllm.Sampling(max_new_tokens=4))[0].token_ids


def test_bad_input():
    m = _tiny_ar()
    with pytest.raises(errors.ArgumentTypeError, match="jdllm.Model"):
        jdllm.nnx.Model(m.params)
    with pytest.raises(errors.ConfigError, match="embed"):
        jdllm.nnx.Model(dataclasses.replace(m, params=dict(m.params, embed=jnp.zeros((3, 3)))))
    view = jdllm.nnx.Model(m)
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(errors.InputError, match="attention='sliding'"):
        view(tokens, attention="sliding")
    with pytest.raises(errors.InputError, match="block_size="):
        view(tokens, attention="block_causal")
    with pytest.raises(errors.InputError, match=r"\[B, T\]"):
        view(jnp.zeros((4,), jnp.int32))
    with pytest.raises(errors.ArgumentTypeError, match="nnx.state"):
        jdllm.nnx.params_of([1, 2])
    V, ctx = m.config.vocab_size, m.config.max_position_embeddings
    with pytest.raises(errors.TokenOutOfRangeError, match=f"token id {V + 52} is outside the vocabulary"):
        view(np.array([[1, V + 52]]))  # host ids are checked (a device array is not fetched for it)
    with pytest.raises(errors.SequenceTooLongError, match=f"{ctx + 1} slots"):
        view(jnp.zeros((1, ctx + 1), jnp.int32))
    with pytest.raises(errors.InputError, match=r"positions has shape \[1, 3\].*must be \[B, T\]"):
        view(tokens, positions=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(errors.InputError, match=r"start has shape \[2\]"):
        view(tokens, start=jnp.zeros((2,), jnp.int32))
    with pytest.raises(errors.InputError, match=r"attention_mask has shape \[1, 4\].*\[B, T, S\]"):
        view(tokens, attention_mask=jnp.ones((1, 4), bool))
    with pytest.raises(errors.ConfigError, match="attn_impl='foo' is not one of"):
        view(tokens, attn_impl="foo")
    np.testing.assert_array_equal(view(tokens, attention="block_causal", block_size=np.int64(2))[0],
                                  view(tokens, attention="block_causal", block_size=2)[0])
    # load_params: a weight of another dtype or shape is named and nothing is written
    layers = list(m.params["layers"])
    layers[2] = dict(layers[2], down=layers[2]["down"].astype(jnp.bfloat16))
    changed = dict(m.params, embed=m.params["embed"] * 2, layers=tuple(layers))
    with pytest.raises(errors.ConfigError, match=r"\['layers'\]\[2\]\['down'\] is bfloat16"):
        view.load_params(changed)
    with pytest.raises(errors.ConfigError, match=r"\['lm_head'\]"):
        view.load_params(dict(m.params, lm_head=m.params["lm_head"][:, :3]))
    assert all(a is b for a, b in zip(jax.tree.leaves(view.params()), jax.tree.leaves(m.params)))
    view.load_params(dict(m.params, embed=changed["embed"]))
    assert view.params()["embed"] is changed["embed"]


@slow
def test_nnx_train_example_runs(capsys):
    ex = load_script("examples/nnx_train.py")
    assert ex.main(["--steps", "3", "--batch", "4"]) == 0
    printed = capsys.readouterr().out
    first, last = (float(x) for x in re.search(r"loss ([0-9.]+) -> ([0-9.]+)", printed).groups())
    assert last < first, printed


@slow
def test_view_of_a_diffusion_model_trains_with_its_own_attention():
    """LLaDA (bidirectional): a masked-token loss through the view falls; the trained weights
    decode through jdllm's masked diffusion."""
    m = jdllm.load(os.path.join(ROOT, "models", "tiny-llada"), dtype="float32", attn_impl="xla")
    view = jdllm.nnx.Model(m)
    cfg = m.config
    rng = np.random.default_rng(0)
    clean = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, (4, 16)), jnp.int32)
    hide = jnp.asarray(rng.random((4, 16)) < 0.5)
    noisy = jnp.where(hide, cfg.mask_token_id, clean)

    def loss_fn(v):
        logits, _ = v(noisy)
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, clean[..., None], -1)[..., 0]
        return jnp.sum(nll * hide) / jnp.sum(hide)

    opt = nnx.Optimizer(view, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(v, o):
        loss, grads = nnx.value_and_grad(loss_fn)(v)
        o.update(v, grads)
        return loss

    losses = [float(step(view, opt)) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    out = jdllm.generate(view.as_model(), [[5, 6, 7]], jdllm.MaskedDiffusion(steps=4, gen_length=4, block_length=4),
                         jdllm.Sampling(max_new_tokens=4))
    assert len(out[0].token_ids) == 4


def test_view_on_a_mesh_with_explicit_axes():
    """tunix enters role meshes from `jax.make_mesh` (Explicit axes) and splits the batch over them:
    the view's forward and its gradient run there (an embedding gather of explicitly sharded token
    ids was a ShardingTypeError), equal to no mesh, with the logits' rows split like the tokens'."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: PLC0415

    view = jdllm.nnx.Model(_tiny_ar())
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 40, size=(2, 9)), jnp.int32)
    start = jnp.zeros((2,), jnp.int32)

    def loss(v, t):
        return jnp.mean(v(t, start=start)[0][..., 5] ** 2)

    want = view_logits(view, tokens, start)
    want_grad = nnx.jit(nnx.grad(loss))(view, tokens)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        on_mesh = jdllm.nnx.Model(dataclasses.replace(_tiny_ar(), params=jax.device_put(
            _tiny_ar().params, NamedSharding(mesh, P()))))
        t = jax.device_put(tokens, NamedSharding(mesh, P("data")))
        got = view_logits(on_mesh, t, start)
        grad = nnx.jit(nnx.grad(loss))(on_mesh, t)
    assert jax.typeof(got).sharding.spec[0] == "data"
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(grad)), jax.tree.leaves(nnx.state(want_grad))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
