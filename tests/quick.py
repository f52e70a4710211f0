"""The quick tier: `python -m pytest -q -m "not slow"` skips every test marked `slow` (CI runs them all).

A parametrized test keeps one or two cases in the quick tier and the rest in the full suite with
`slow_except(cases, *quick)`; a whole test takes `@slow`, a whole module `pytestmark = slow`.
"""

from __future__ import annotations

import pytest

slow = pytest.mark.slow


def slow_except(cases, *quick):
    """`cases` for `pytest.mark.parametrize`, each marked `slow` except those in `quick` (same ids).

    A tuple case holds the values of several argument names, as parametrize reads it."""
    return [c if any(c is q or c == q for q in quick)
            else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=slow) for c in cases]
