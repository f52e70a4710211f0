"""The constraint constructors and generate()'s constraint= plumbing (backend-independent)."""

import pytest

import jdllm
from jdllm import constraints
from jdllm.errors import ArgumentTypeError, ConstraintError
from tests.quick import slow


def test_constructors_are_hashable_data():
    a = constraints.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    b = constraints.json_schema('{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a == b and hash(a) == hash(b) and a.kind == "json_schema"
    assert constraints.regex("a+").backend == "llguidance"
    assert constraints.regex("a+", backend="dfa").backend == "dfa"
    assert constraints.choice(["yes", "no"]).source == '["yes", "no"]'


def test_json_schema_keeps_property_order():
    """Properties are emitted in the schema's order (llguidance): the canonical text sorts every key
    but the property names, so {"w", "n"} and {"n", "w"} are different constraints."""
    props = {"w": {"type": "string"}, "n": {"type": "integer"}}
    a = constraints.json_schema({"type": "object", "properties": props, "required": ["w", "n"]})
    b = constraints.json_schema({"required": ["w", "n"], "properties": dict(reversed(props.items())),
                                 "type": "object"})
    assert a != b
    assert a.source.index('"w"') < a.source.index('"n"') and b.source.index('"n"') < b.source.index('"w"')


@pytest.mark.parametrize("make, err", [
    (lambda: constraints.regex(""), ConstraintError),
    (lambda: constraints.regex(3), ArgumentTypeError),
    (lambda: constraints.regex("a", backend="nope"), ConstraintError),
    (lambda: constraints.json_schema("{not json"), ConstraintError),
    (lambda: constraints.json_schema([1]), ArgumentTypeError),
    (lambda: constraints.lark("start: 'a'", backend="dfa"), ConstraintError),
    (lambda: constraints.choice([]), ConstraintError),
    (lambda: constraints.choice("yes"), ArgumentTypeError),
])
def test_bad_constraints_raise(make, err):
    with pytest.raises(err):
        make()


def test_per_row_and_backend_mixing():
    c = constraints.regex("a")
    assert constraints.per_row(c, 3) == [c, c, c]
    assert constraints.per_row([c, None], 2) == [c, None]
    with pytest.raises(ConstraintError, match="2 entries for 3 prompts"):
        constraints.per_row([c, None], 3)
    with pytest.raises(ArgumentTypeError):
        constraints.per_row(["a+"], 1)
    with pytest.raises(ConstraintError, match="one constraint backend"):
        constraints.backend_module([c, constraints.regex("b", backend="dfa")])


@slow
def test_all_free_rows_take_the_unconstrained_path():
    model = jdllm.load("models/tiny-ar", dtype="float32")
    s = jdllm.Sampling(temperature=0.0, max_new_tokens=4)
    free = jdllm.generate(model, ["rev:ab="], sampling=s)
    none = jdllm.generate(model, ["rev:ab="], sampling=s, constraint=[None])
    assert free[0].token_ids == none[0].token_ids and none[0].constraint_ok is None
