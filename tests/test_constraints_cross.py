"""The two constraint backends agree where both are exact: greedy AR on the same regex
(llguidance judges left to right on the host, the DFA tables on the device)."""

import pytest

import jdllm
from jdllm import constraints
from tests.quick import slow

pytestmark = slow  # the quick tier checks each backend against its own reference instead

PATTERNS = [r"[a-e]{2,4}", r"(ab|ba)+c?", r"\d( \d)*", r"(yes|no|maybe)"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_ar_dfa_equals_llguidance(pattern):
    model = jdllm.load("models/tiny-ar", dtype="float32")
    prompts = ["rev:abcd=", "sort:3 1 2=", "add:12+7="]
    s = jdllm.Sampling(temperature=0.0, max_new_tokens=10)
    guided = jdllm.generate(model, prompts, sampling=s, constraint=constraints.regex(pattern))
    dfa = jdllm.generate(model, prompts, sampling=s, constraint=constraints.regex(pattern, backend="dfa"))
    for g, d in zip(guided, dfa):
        assert g.token_ids == d.token_ids, (pattern, g.text, d.text)
        assert g.finish_reason == d.finish_reason and g.constraint_ok == d.constraint_ok
