"""`ar` paradigm: matches a plain-loop reference and transformers generate() under greedy."""

from __future__ import annotations

import numpy as np
import pytest

import jdllm
from tests.decode_fixtures import assert_matches_reference, causal_model
from tests.quick import slow
from tests.reference_decoders import ar_reference

pytestmark = pytest.mark.usefixtures("fast_compile")

PROMPTS = [[5, 17, 3, 44, 9, 12, 60], [70, 2, 31], [8, 8, 21, 55, 90, 13, 4, 4, 27, 66, 1, 30]]
MAX_NEW = 12




def test_ar_batch1_matches_reference():
    m = causal_model()
    for p in PROMPTS[:2]:
        ref = ar_reference(m.params, m.config, p, max_new_tokens=MAX_NEW)
        (out,) = jdllm.generate(m, [p], jdllm.AR(), jdllm.Sampling(max_new_tokens=MAX_NEW))
        assert_matches_reference(out, ref)
        assert out.step_map == list(range(1, MAX_NEW + 1))


@slow
def test_ar_batch_rows_equal_prompts_alone():
    m = causal_model()
    outs = jdllm.generate(m, PROMPTS, jdllm.AR(), jdllm.Sampling(max_new_tokens=MAX_NEW))
    assert len(outs) == len(PROMPTS)
    for p, out in zip(PROMPTS, outs):
        assert_matches_reference(out, ar_reference(m.params, m.config, p, max_new_tokens=MAX_NEW))


@slow
def test_ar_stop_token_ends_row_and_is_kept():
    m = causal_model()
    free = [ar_reference(m.params, m.config, p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    stop = free[0]["tokens"][4]  # a token the first row is known to produce
    sampling = jdllm.Sampling(max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
    outs = jdllm.generate(m, PROMPTS, jdllm.AR(), sampling)
    refs = [ar_reference(m.params, m.config, p, max_new_tokens=MAX_NEW, stop_ids=(stop,)) for p in PROMPTS]
    assert refs[0]["finish"] == "stop" and len(refs[0]["tokens"]) <= 5
    for out, ref in zip(outs, refs):
        assert_matches_reference(out, ref)
        assert stop not in out.token_ids[:-1]


@slow
def test_ar_sampling_seeds():
    m = causal_model()
    run = lambda seed: jdllm.generate(  # noqa: E731
        m, PROMPTS[:2], jdllm.AR(), jdllm.Sampling(temperature=1.5, max_new_tokens=MAX_NEW, seed=seed))
    a, b, c = run(0), run(0), run(1)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    greedy = jdllm.generate(m, PROMPTS[:2], jdllm.AR(), jdllm.Sampling(max_new_tokens=MAX_NEW))
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]
    # log-probs are those of the sampled tokens under the tempered distribution: finite, <= 0
    assert all(np.isfinite(o.logprobs).all() and max(o.logprobs) <= 0 for o in a)


def _hf_qwen3(tmp_path):
    """A tiny transformers Qwen3 with weights scaled up (peaked distributions), saved and loaded."""
    torch = pytest.importorskip("torch")
    from tests.hf_fixtures import make_transformers_model

    model = make_transformers_model("qwen3", seed=3, vocab_size=96, hidden_size=32, intermediate_size=64,
                                    max_position_embeddings=256, eos_token_id=95)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(5.0)
    model.save_pretrained(tmp_path)
    return model, jdllm.load(str(tmp_path), dtype="float32", attn_impl="xla")


@slow
def test_ar_greedy_equals_transformers_generate(tmp_path):
    import torch

    torch.set_num_threads(1)
    hf, m = _hf_qwen3(tmp_path)
    prompts = [[5, 17, 3, 44, 9], [70, 2, 31, 12, 40, 41, 7, 8, 88]]
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])  # left padding, as transformers expects
    attn = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        free = hf.generate(ids, attention_mask=attn, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[:, T:].tolist()
    outs = jdllm.generate(m, prompts, jdllm.AR(), jdllm.Sampling(max_new_tokens=16, stop_token_ids=()))
    assert [o.token_ids for o in outs] == free
    # a token the first row produces mid-way as eos: transformers stops at the same place
    stop = free[0][5]
    with torch.no_grad():
        eos = hf.generate(ids, attention_mask=attn, max_new_tokens=16, do_sample=False, eos_token_id=stop,
                          pad_token_id=0)[:, T:].tolist()
    outs = jdllm.generate(m, prompts, jdllm.AR(), jdllm.Sampling(max_new_tokens=16, stop_token_ids=(stop,)))
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 6
    for out, ref in zip(outs, eos):
        n = ref.index(stop) + 1 if stop in ref else len(ref)
        assert out.token_ids == ref[:n]
        assert out.finish_reason == ("stop" if stop in ref else "length")
