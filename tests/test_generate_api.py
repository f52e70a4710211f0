"""generate(): compile reuse across calls, the pure function under a user's jit, text prompts,
the CLI, and bad input rejected before anything compiles."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jdllm
from jdllm import cli, errors
from jdllm.api import outputs, prepare
from jdllm.decode.loop import run as decode
from tests.compiles import traces
from tests.decode_fixtures import block_model, causal_model
from tests.quick import slow

pytestmark = pytest.mark.usefixtures("fast_compile")

BD = jdllm.BlockDiffusion(block_length=4, denoising_steps=2, confidence_threshold=0.7)


@slow
def test_second_call_with_same_buckets_does_not_retrace():
    m = causal_model()
    jdllm.generate(m, [[1, 2, 3], [4, 5, 6, 7, 8]], jdllm.AR(), jdllm.Sampling(max_new_tokens=10))
    # other prompt lengths and max_new_tokens, same buckets (prompt <= 16, new <= 16, batch 2)
    with traces() as seen:
        outs = jdllm.generate(m, [[9] * 7, [3] * 12], jdllm.AR(), jdllm.Sampling(max_new_tokens=14, seed=5))
    assert [len(o.token_ids) for o in outs] == [14, 14]
    assert seen["run"] == 0
    with traces() as seen:
        jdllm.generate(m, [[9] * 20, [3]], jdllm.AR(), jdllm.Sampling(max_new_tokens=10))  # prompt bucket 32
    assert seen["run"] == 1

    b = block_model()
    jdllm.generate(b, [[1, 2, 3, 4, 5, 6], [7, 8, 9]], BD, jdllm.Sampling(max_new_tokens=13))
    with traces() as seen:
        jdllm.generate(b, [[1, 2, 3, 4, 5, 6, 7], [8, 9]], BD, jdllm.Sampling(max_new_tokens=11))
    assert seen["run"] == 0


@slow
def test_pure_decode_inside_a_user_jit_and_vmap_equals_generate():
    b = block_model()
    prompts = [[5, 17, 3, 44, 9, 12], [70, 2, 31]]
    sampling = jdllm.Sampling(max_new_tokens=9, stop_token_ids=())
    prep = prepare(b, prompts, BD, sampling)

    @jax.jit
    def user_fn(params, state):
        final = decode(params, state, paradigm=prep.paradigm, ctx=prep.ctx)
        return final, final.tokens.sum()  # the user's own computation on the trajectory

    final, _ = user_fn(b.params, prep.state)
    mine = outputs(prep, final)
    ref = jdllm.generate(b, prompts, BD, sampling)
    assert [o.token_ids for o in mine] == [o.token_ids for o in ref]
    assert [o.step_map for o in mine] == [o.step_map for o in ref]
    assert [o.nfe for o in mine] == [o.nfe for o in ref]

    # vmap over a leading axis of states (e.g. rollout groups), inside jit
    other = prepare(b, [[9, 9, 1], [4, 8, 15, 16, 23]], BD, sampling)
    stacked = jax.tree.map(lambda *x: jax.numpy.stack(x), prep.state, other.state)
    finals = jax.jit(jax.vmap(lambda st: decode(b.params, st, paradigm=prep.paradigm, ctx=prep.ctx)))(stacked)
    first = outputs(prep, jax.tree.map(lambda x: x[0], finals))
    second = outputs(other, jax.tree.map(lambda x: x[1], finals))
    assert [o.token_ids for o in first] == [o.token_ids for o in ref]
    assert [o.token_ids for o in second] == [o.token_ids for o in jdllm.generate(b, other.prompts, BD, sampling)]


def test_text_prompts_outputs_and_cli(tmp_path, capsys):
    from tests.hf_fixtures import build_model_dir

    d = str(tmp_path / "sdar")
    build_model_dir("sdar", d, tokenizer=True, vocab_size=128, max_position_embeddings=128)
    m = jdllm.load(d, dtype="float32", attn_impl="xla")
    prompts = ["the quick brown fox", "hello world"]
    outs = jdllm.generate(m, prompts, BD, jdllm.Sampling(max_new_tokens=7))
    for p, o in zip(prompts, outs):
        assert o.prompt_ids == m.tokenizer.encode(p, add_special_tokens=False)
        assert o.text == m.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert len(o.step_map) == len(o.logprobs) == len(o.token_ids) >= 1
        assert o.finish_reason in ("stop", "length") and o.nfe >= 1
        assert (o.finish_reason == "stop") == (o.token_ids[-1] in m.config.eos_token_ids)
    with pytest.raises(errors.InputError, match="chat template"):
        jdllm.generate(m, prompts, BD, apply_chat_template=True)
    # (the fixture tokenizer only knows the characters of its training corpus)
    m.tokenizer.chat_template = ("{% for m in messages %}user says {{ m['content'] }} {% endfor %}"
                                 "{% if add_generation_prompt %}model says{% endif %}")
    prep = prepare(m, prompts, BD, jdllm.Sampling(max_new_tokens=7), apply_chat_template=True)
    rendered = m.tokenizer.apply_chat_template([{"role": "user", "content": prompts[0]}], tokenize=False,
                                               add_generation_prompt=True)
    assert rendered == "user says the quick brown fox model says"
    assert prep.prompts[0] == m.tokenizer.encode(rendered, add_special_tokens=False)

    rc = cli.main(["generate", d, "--prompt", prompts[0], "--paradigm", "block_diffusion",
                   "--block-length", "4", "--denoising-steps", "2", "--confidence-threshold", "0.7",
                   "--max-new-tokens", "7", "--show-steps"])
    out = capsys.readouterr().out
    assert rc == 0
    assert outs[0].text in out
    shown = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(shown) == max(outs[0].step_map)  # one line per step, tokens grouped by step
    ids = ",".join(map(str, outs[0].prompt_ids))
    rc = cli.main(["generate", d, "--prompt-ids", ids, "--block-length", "4", "--denoising-steps", "2",
                   "--confidence-threshold", "0.7", "--max-new-tokens", "7"])
    assert rc == 0 and capsys.readouterr().out.splitlines()[0] == outs[0].text  # default paradigm: block
    assert cli.main(["generate", d]) == 2 and "--prompt-ids" in capsys.readouterr().err
    rc = cli.main(["generate", d, "--prompt", "x", "--paradigm", "block_diffusion", "--denoising-steps", "3"])
    assert rc == 2 and "denoising_steps=3" in capsys.readouterr().err

    report = str(tmp_path / "bench.json")
    rc = cli.main(["bench", d, "--batch", "2", "--prompt-len", "5", "--max-new-tokens", "7", "--repeats", "1",
                   "--block-length", "4", "--denoising-steps", "2", "--json", report])
    assert rc == 0 and "| 2 |" in capsys.readouterr().out
    import json

    (row,) = json.load(open(report))["rows"]
    assert row["tokens"] == 2 * 7  # stop tokens off: every row runs to 7
    assert row["tpf"] >= 1 and row["nfe"] <= 7  # fused commits: >= 1 token per forward


def test_show_steps_formatting():
    from jdllm.generate_cli import format_steps

    out = jdllm.Output(token_ids=[10, 11, 12, 13], text=None, step_map=[2, 1, 2, 3], logprobs=[0.0] * 4, nfe=3,
                       finish_reason="length")
    plain = format_steps(None, out, colour=False).splitlines()
    assert plain == ["step    1: '11'", "step    2: '10' '12'", "step    3: '13'"]
    coloured = format_steps(None, out, colour=True)
    assert coloured.count("\033[") == 8 and "3 steps" in coloured  # one colour + reset per token


def _no_compile(fn, exc, match):
    with traces() as seen, pytest.raises(exc, match=match):
        fn()
    assert seen["run"] == 0


def test_bad_input_raises_before_compiling():
    c, b = causal_model(), block_model()
    ok = jdllm.Sampling(max_new_tokens=4)
    _no_compile(lambda: jdllm.generate(c, [[1, 2]], BD, ok), errors.DecodingConfigError, "mask token")
    _no_compile(lambda: jdllm.generate(b, [[1, 2]], jdllm.AR(), ok), errors.DecodingConfigError, "causal")
    for kw, match in [(dict(block_length=4, denoising_steps=3), "denoising_steps=3"),
                      (dict(block_length=4, denoising_steps=8), "denoising_steps=8"),
                      (dict(confidence_threshold=0.0), r"confidence_threshold=0.0 must be in \(0, 1\]"),
                      (dict(confidence_threshold=1.5), "confidence_threshold=1.5"),
                      (dict(eb_threshold=0.0), "eb_threshold"), (dict(strategy="random"), "strategy='random'"),
                      (dict(block_length=0), "block_length=0")]:
        _no_compile(lambda: jdllm.BlockDiffusion(**kw), errors.DecodingConfigError, match)
    # block_length=None (the model's 4) meets denoising_steps once the model is known, still before compiling
    _no_compile(lambda: jdllm.generate(b, [[1, 2]], jdllm.BlockDiffusion(denoising_steps=3), ok),
                errors.DecodingConfigError, r"denoising_steps=3 .*the model's block_size=4")
    _no_compile(lambda: jdllm.generate(b, [], BD, ok), errors.InputError, "at least one prompt")
    for bad, name in [(5, "int"), ((p for p in [[1, 2]]), "generator"), (np.array(5), "ndarray")]:
        _no_compile(lambda: jdllm.generate(b, bad, BD, ok), errors.ArgumentTypeError, f"prompts is a {name}")
    _no_compile(lambda: jdllm.generate(b, [[1, 2], []], BD, ok), errors.InputError, "prompt 1 is empty")
    _no_compile(lambda: jdllm.generate(b, [[1, 2, 500]], BD, ok), errors.TokenOutOfRangeError, "500")
    _no_compile(lambda: jdllm.generate(b, [[1] * 250], BD, jdllm.Sampling(max_new_tokens=10)),
                errors.SequenceTooLongError, "max_position_embeddings=256")
    _no_compile(lambda: jdllm.generate(b, ["text"], BD, ok), errors.InputError, "no tokenizer")
    _no_compile(lambda: jdllm.generate(b, [[1]], "block_diffusion", ok), errors.DecodingConfigError,
                "not a paradigm config")
    _no_compile(lambda: jdllm.generate(b, [[1]], jdllm.BlockDiffusion, ok), errors.DecodingConfigError,
                r"pass an instance such as BlockDiffusion\(\)")
    with pytest.warns(UserWarning, match="block_length=8 differs from the model's trained block_size=4"):
        prep = prepare(b, [[1, 2, 3]], jdllm.BlockDiffusion(block_length=8, denoising_steps=4), ok)
    assert prep.ctx.model.block_size == 8  # the forward's block grid follows block_length
    assert np.all(np.asarray(prep.state.start) % 8 == 0)


def test_jax_array_prompts_are_token_ids_like_numpy_ones():
    """A jax.Array [B, T] or [T] is a batch / one prompt of ids, as a numpy array is (it used to be
    "needs at least one prompt")."""
    import jax.numpy as jnp  # noqa: PLC0415

    c = causal_model()
    s = jdllm.Sampling(max_new_tokens=3)
    want = [o.token_ids for o in jdllm.generate(c, [[5, 6], [7, 8]], jdllm.AR(), s)]
    assert [o.token_ids for o in jdllm.generate(c, jnp.array([[5, 6], [7, 8]]), jdllm.AR(), s)] == want
    assert jdllm.generate(c, jnp.array([5, 6]), jdllm.AR(), s)[0].token_ids == want[0]
