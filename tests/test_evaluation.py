"""lm-evaluation-harness' own evaluator (`lm_eval.simple_evaluate`) on the `jdllm` model type, with tasks
from local YAML and JSONL files: multiple choice on a causal model (exact log-likelihoods) and on a
masked-diffusion and a block-diffusion one (the ELBOs), all equal to `jdllm.loglikelihood` on the pairs the harness
builds; generation on a block-diffusion model equal to `jdllm.generate` cut at `until`; rolling
log-likelihood equal to the sum of the windows' token log-probs from `jdllm.logits`; the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jdllm
from jdllm import errors
from tests.scripts import ROOT, subprocess_env

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files; datasets reads this on import
lm_eval = pytest.importorskip("lm_eval")

SORTS = [("3 1 2", "1 2 3"), ("9 4 7", "4 7 9"), ("5 8 2", "2 5 8"), ("6 1 4", "1 4 6")]


def _tasks(tmp_path) -> str:
    """Three tasks over local files: multiple choice, generation and perplexity."""
    rows = []
    for q, a in SORTS:
        choices = [a, a[::-1], q]
        rows.append({"q": f"sort:{q}=", "choices": choices, "label": 0})
    with open(tmp_path / "mc.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(tmp_path / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"sort:{q}={a}"}) + "\n" for q, a in SORTS[:2])
    data = lambda name: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / name}\ntest_split: test\n"  # noqa: E731
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + data("mc.jsonl") + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (tmp_path / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + data("mc.jsonl") + "output_type: generate_until\ndoc_to_text: '{{q}}'\n"
        "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: [' 9']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (tmp_path / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n" + data("text.jsonl") + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
    return str(tmp_path)


def _evaluate(lm, tasks, path):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=path),
                                   log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return _tasks(tmp_path_factory.mktemp("tasks"))


def _arguments(sample) -> list[tuple[str, str]]:
    """A logged sample's requests' (context, continuation) texts."""
    a = sample["arguments"]
    items = a.values() if isinstance(a, dict) else a
    return [(x["arg_0"], x["arg_1"]) if isinstance(x, dict) else tuple(x) for x in items]


@pytest.mark.parametrize("name", ["tiny-ar", "tiny-llada", "tiny-sdar"])
def test_multiple_choice_scores_are_jdllm_loglikelihood(name, task_dir):
    from jdllm.evaluation import JdllmLM

    model = jdllm.load(os.path.join(ROOT, "models", name), dtype="float32")
    lm = JdllmLM(model=model, mc_samples=16, mc_batch=8, seed=3)
    res = _evaluate(lm, ["tiny_mc"], task_dir)
    samples = sorted(res["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(SORTS)
    for s in samples:
        pairs = [lm._encode_pair(c, k) for c, k in _arguments(s)]
        got = [float(r[0][0]) for r in s["resps"]]
        if model.config.attention == "causal":
            want = [ll for ll, _ in jdllm.loglikelihood(model, pairs)]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:  # the ELBO: its noise depends on the request's place, so each choice alone, bounded instead
            assert all(np.isfinite(got)) and all(g <= 0 for g in got)
        assert s["acc"] == float(int(np.argmax(got)) == 0)
    assert res["results"]["tiny_mc"]["acc,none"] == np.mean([s["acc"] for s in samples])
    if model.config.attention != "causal":  # the right answers: the trained model's ELBO picks them
        assert res["results"]["tiny_mc"]["acc,none"] >= 0.75


def test_masked_diffusion_requests_are_scored_in_order_with_their_seeds(task_dir):
    """Each request i is scored as `jdllm.loglikelihood([pair], seed=seed + i)`: reproducible and
    independent of the other requests."""
    from lm_eval.api.instance import Instance

    from jdllm.evaluation import JdllmLM

    model = jdllm.load(os.path.join(ROOT, "models", "tiny-llada"), dtype="float32")
    lm = JdllmLM(model=model, mc_samples=16, mc_batch=8, seed=3)
    reqs = [Instance("loglikelihood", {}, (f"sort:{q}=", a), i) for i, (q, a) in enumerate(SORTS)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    for i, ((q, a), (ll, greedy)) in enumerate(zip(SORTS, got)):
        (want, _), = jdllm.loglikelihood(model, [lm._encode_pair(f"sort:{q}=", a)], mc_samples=16, mc_batch=8,
                                         seed=3 + i)
        assert ll == want and greedy is False


def test_generation_is_jdllm_generate_cut_at_until(task_dir):
    from jdllm.evaluation import JdllmLM

    model = jdllm.load(os.path.join(ROOT, "models", "tiny-sdar"), dtype="float32")
    lm = JdllmLM(model=model, paradigm="block_diffusion", denoising_steps=2, batch_size=3)
    res = _evaluate(lm, ["tiny_gen"], task_dir)
    samples = sorted(res["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    outs = jdllm.generate(model, [lm.tok_encode(f"sort:{q}=") for q, _ in SORTS],
                          jdllm.BlockDiffusion(block_length=model.config.block_size, denoising_steps=2),
                          jdllm.Sampling(max_new_tokens=8))
    for s, o in zip(samples, outs):
        assert s["resps"][0][0] == o.text.split(" 9")[0]
    assert any(" 9" in o.text for o in outs)  # `until` did cut something
    assert res["results"]["tiny_gen"]["exact_match,none"] == np.mean([s["exact_match"] for s in samples])


def test_rolling_loglikelihood_sums_the_windows(task_dir):
    from jdllm.evaluation import JdllmLM

    model = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    lm = JdllmLM(model=model, max_length=6)  # windows of 6 tokens: several per text
    res = _evaluate(lm, ["tiny_ppl"], task_dir)
    for s in sorted(res["samples"]["tiny_ppl"], key=lambda s: s["doc_id"]):
        from lm_eval.utils import get_rolling_token_windows

        ids, want = lm.tok_encode(s["doc"]["text"]), 0.0
        windows = list(get_rolling_token_windows(ids, lm.eot_token_id, 6, 1))  # the harness' own windows
        assert len(windows) >= 2
        for inp, preds in windows:  # each window's input scored whole; its last len(preds) positions count
            logp = np.asarray(jax.nn.log_softmax(jdllm.logits(model, [inp])[0], axis=-1))
            T, n = len(inp), len(preds)
            want += float(sum(logp[T - n + j, preds[j]] for j in range(n)))
        assert abs(float(s["resps"][0][0]) - want) < 1e-3 * max(1.0, abs(want))


def test_bad_model_args_are_refused():
    from jdllm.evaluation import JdllmLM

    model = jdllm.load(os.path.join(ROOT, "models", "tiny-llada"), dtype="float32")
    with pytest.raises(errors.InputError, match="unknown model_args"):
        JdllmLM(model=model, blok_length=4)
    with pytest.raises(errors.InputError, match="one of path= "):
        JdllmLM()
    with pytest.raises(errors.InputError, match="max_length"):
        JdllmLM(model=model, max_length=10**6)
    lm = JdllmLM(model=model)
    with pytest.raises(errors.InputError, match="causal"):
        lm.loglikelihood_rolling([type("Request", (), {"args": ("x",)})()])
    # what lm-eval's model_args parser makes of bad strings, refused when the model is built
    for kw, match in ((dict(seed="abc"), "seed='abc' must be an integer"), (dict(max_length=0), "max_length=0"),
                      (dict(check_greedy="maybe"), "check_greedy='maybe'"), (dict(mc_samples=0), "mc_samples=0"),
                      (dict(mc_samples=10, mc_batch=4), "multiple of mc_batch"),
                      (dict(max_gen_toks=1.5), "max_gen_toks=1.5"), (dict(batch_size=0), "batch_size=0"),
                      (dict(max_gen_toks=float("nan")), "max_gen_toks=nan"), (dict(max_length=float("inf")), "max_length=inf")):
        with pytest.raises(errors.InputError, match=match):
            JdllmLM(model=model, **kw)
    with pytest.raises(errors.DecodingConfigError, match="'block_diffusion' needs a block-causal"):
        JdllmLM(model=model, paradigm="block_diffusion")
    with pytest.raises(errors.DecodingConfigError, match="fuse_commit='no'"):
        JdllmLM(model=jdllm.load(os.path.join(ROOT, "models", "tiny-sdar")), paradigm="block_diffusion",
                fuse_commit="no")
    with pytest.raises(errors.InputError, match=r"'A' \(U\+0041\) at position 0"):
        lm.tok_encode("Add:1+2=")
    with pytest.raises(errors.InputError, match="no chat template"):
        lm.apply_chat_template([{"role": "user", "content": "sort:1 2="}])


def test_none_model_arg_is_the_none_choice():
    """lm-eval parses `cache_mode=none` to None; on a block-causal model that is multi_block's cache_mode='none',
    not its default 'auto' (which is the exact cache there)."""
    from lm_eval.utils import simple_parse_args_string  # noqa: PLC0415

    from jdllm.evaluation import JdllmLM  # noqa: PLC0415

    args = simple_parse_args_string("paradigm=multi_block,cache_mode=none,max_forwards=None")
    lm = JdllmLM(model=jdllm.load(os.path.join(ROOT, "models", "tiny-sdar")), **args)
    assert (lm.decoding.cache_mode, lm.decoding.max_forwards, lm.decoding.block_size) == ("none", None, 4)


def test_command_line_runs_the_harness(task_dir, tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "jdllm.evaluation", "--model", "jdllm", "--model_args",
                          f"path={os.path.join(ROOT, 'models', 'tiny-ar')},dtype=float32", "--tasks", "tiny_mc",
                          "--include_path", task_dir, "--output_path", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "tiny_mc" in res.stdout and "acc" in res.stdout, res.stdout
    found = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f.startswith("results")]
    assert found and json.load(open(found[0]))["results"]["tiny_mc"]["acc,none"] == 1.0
