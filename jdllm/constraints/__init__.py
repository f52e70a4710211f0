"""Constrained decoding: the public constraint constructors and the backend registry.

    c = jdllm.constraints.regex(r"\\d+")                      # llguidance backend (default)
    c = jdllm.constraints.json_schema({...}, backend="dfa")  # on-device DFA backend
    jdllm.generate(model, prompts, constraint=c)             # or one per prompt, None = free

A `Constraint` is plain, hashable data (what the user asked for); compiling it
against a model's tokenizer is the backend's job, done before anything compiles:

    "llguidance"  jdllm/constraints/guidance.py  host-side matchers (llguidance),
                  any grammar (regex, JSON schema, Lark, choice)
    "dfa"         jdllm/constraints/dfa.py       regular languages compiled to
                  token-level DFA tables used inside the jitted loop; exact under
                  out-of-order unmasking

Each backend module provides

    generate_constrained(model, prompts, decoding, sampling, constraints, *, apply_chat_template)
        -> list[jdllm.Output]     (constraints: one Constraint | None per prompt)

and sets `Output.constraint_ok` on constrained rows.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

from jdllm.errors import ArgumentTypeError, ConstraintError

BACKENDS = {"llguidance": "jdllm.constraints.guidance", "dfa": "jdllm.constraints.dfa"}
KINDS = ("regex", "json_schema", "lark", "choice")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """kind: "regex" | "json_schema" | "lark" | "choice"; source: the pattern, the schema
    as canonical JSON text (keys sorted, except the order of "properties", which is kept:
    properties are emitted in that order), the Lark grammar, or the choices as a JSON list; backend:
    a key of `BACKENDS`."""

    kind: str
    source: str
    backend: str = "llguidance"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.backend not in BACKENDS:
            raise ConstraintError(
                f"constraint backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.kind == "lark" and self.backend == "dfa":
            raise ConstraintError(
                "a Lark grammar is not a regular language the 'dfa' backend can compile; "
                "use backend='llguidance'")


def _text(name: str, value) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise ConstraintError(f"{name} is empty")
    return value


def regex(pattern: str, *, backend: str = "llguidance") -> Constraint:
    """Outputs that fully match `pattern` (Python / Rust regex syntax, anchored at both ends)."""
    return Constraint("regex", _text("regex pattern", pattern), backend)


def json_schema(schema: dict | str, *, backend: str = "llguidance") -> Constraint:
    """Outputs that are JSON documents valid under `schema` (a dict or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ArgumentTypeError(f"JSON schema must be a dict (or its JSON text), got {type(schema).__name__}")
    return Constraint("json_schema", json.dumps(_canonical(schema), separators=(",", ":")), backend)


def _canonical(node, keep_order: bool = False):
    """A schema with its keys sorted (equal schemas, equal constraints), except the keys of a
    "properties" object: llguidance and the DFA compiler emit properties in that order, so it
    decides which outputs are valid."""
    if isinstance(node, dict):
        keys = list(node) if keep_order else sorted(node)
        return {k: _canonical(node[k], keep_order=k == "properties" and not keep_order) for k in keys}
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    return node


def lark(grammar: str, *, backend: str = "llguidance") -> Constraint:
    """Outputs in the language of a Lark grammar (llguidance's dialect; start rule `start`)."""
    return Constraint("lark", _text("Lark grammar", grammar), backend)


def choice(options, *, backend: str = "llguidance") -> Constraint:
    """Outputs equal to one of `options` (non-empty strings)."""
    if isinstance(options, str) or not hasattr(options, "__iter__"):
        raise ArgumentTypeError(f"choice options must be a list of str, got {type(options).__name__}")
    opts = [_text("choice option", o) for o in options]
    if not opts:
        raise ConstraintError("choice needs at least one option")
    return Constraint("choice", json.dumps(opts), backend)


def per_row(constraint, n: int) -> list[Constraint | None]:
    """`generate`'s `constraint=` argument -> one Constraint | None per prompt."""
    rows = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * n
    if len(rows) != n:
        raise ConstraintError(f"constraint list has {len(rows)} entries for {n} prompts")
    for c in rows:
        if c is not None and not isinstance(c, Constraint):
            raise ArgumentTypeError(
                f"constraint must be a jdllm.constraints.Constraint (from regex / json_schema / lark / "
                f"choice) or None, got {type(c).__name__}")
    return rows


def backend_module(rows: list[Constraint | None]) -> Any:
    """The one backend module serving these rows (mixing backends in one call is an error)."""
    names = sorted({c.backend for c in rows if c is not None})
    if len(names) > 1:
        raise ConstraintError(f"one generate() call uses one constraint backend, got {names}")
    try:
        return importlib.import_module(BACKENDS[names[0]])
    except ModuleNotFoundError as e:
        if e.name != BACKENDS[names[0]]:
            raise
        raise ConstraintError(f"constraint backend {names[0]!r} is not built yet") from None


__all__ = ["Constraint", "regex", "json_schema", "lark", "choice", "per_row", "backend_module", "BACKENDS"]
