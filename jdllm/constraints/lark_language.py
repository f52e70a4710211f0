"""Is a Lark grammar's language empty? (llguidance compiles such a grammar without complaint.)

A grammar such as

    start: x
    x: "q" x

is valid, but no string derives from `start`: every derivation of `x` needs `x` again, so a
matcher allows "q", "qq", ... forever and never accepts. The check is the textbook one
(a symbol is *productive* when one of its alternatives holds only productive items; iterate
to the fixpoint; the language is empty iff `start` is not productive), run on the grammar
text in llguidance's Lark dialect:

    rules and terminals    name: ..., NAME: ..., ?name / !name, name.2, name[lazy, stop=""]
    alternatives           a | b (a line may continue the rule above it)
    items                  "lit"i, "a".."z", /regex/flags, NAME, name, (group), [optional],
                           <special token>, <[ids]>, @grammar, %json {...}, %regex {...}
    repetition             ?  *  +  ~ N  ~ N..M  {N}  {N,}  {,M}  {N,M}
    directives             %import (names it imports count as productive), %ignore,
                           %declare, %llguidance {...}

Literals, regexes, special tokens, other grammars and inline schemas are taken as productive
(a terminal that can match nothing is left to the matcher's first-mask check); an item
repeated at least zero times (`?`, `*`, `[...]`, `{0,..}`) is always productive. Anything
the reader does not understand gives no verdict (None): the check only reports emptiness it
has proven.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_NUMBER = re.compile(r"-?\d+")


class _Unknown(Exception):
    """Syntax this reader does not follow: no verdict."""


# --------------------------------------------------------------------------- tokens
def _tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) pairs; kinds: nl name num str regex atom (special / @ref / %json / %regex) punct pct."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            out.append(("nl", c))
            i += 1
        elif c in " \t\r\f\v":
            i += 1
        elif text.startswith("//", i) or c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                raise _Unknown
            j += 1
            if j < n and text[j] == "i":
                j += 1
            out.append(("str", text[i:j]))
            i = j
        elif c == "/":
            j = i + 1
            while j < n and text[j] != "/":
                if text[j] == "\n":
                    raise _Unknown
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                raise _Unknown
            j += 1
            while j < n and text[j] in "imslux":
                j += 1
            out.append(("regex", text[i:j]))
            i = j
        elif c == "<":
            j = text.find(">", i)
            if j < 0 or "\n" in text[i:j]:
                raise _Unknown
            out.append(("atom", text[i:j + 1]))
            i = j + 1
        elif c == "@":
            m = re.compile(r"@[A-Za-z0-9_-]+").match(text, i)
            if not m:
                raise _Unknown
            out.append(("atom", m.group()))
            i = m.end()
        elif c == "%":
            m = _NAME.match(text, i + 1)
            if not m:
                raise _Unknown
            word = m.group()
            i = m.end()
            if word in ("json", "regex", "llguidance"):  # followed by one JSON object
                while i < n and text[i] in " \t\r\n":
                    i += 1
                i = _json_end(text, i)
                out.append(("atom" if word != "llguidance" else "pct", "%" + word))
            else:
                out.append(("pct", "%" + word))
        elif text.startswith("..", i) or text.startswith("->", i):
            out.append(("punct", text[i:i + 2]))
            i += 2
        elif c.isdigit() or (c == "-" and i + 1 < n and text[i + 1].isdigit()):
            m = _NUMBER.match(text, i)
            out.append(("num", m.group()))
            i = m.end()
        elif _NAME.match(text, i):
            m = _NAME.match(text, i)
            out.append(("name", m.group()))
            i = m.end()
        elif c in ":|()[]?*+~{},.=!&":
            out.append(("punct", c))
            i += 1
        else:
            raise _Unknown
    return out


def _json_end(text: str, i: int) -> int:
    """The index just past the balanced JSON object (or value up to the line's end) starting at i."""
    if i >= len(text) or text[i] != "{":
        j = text.find("\n", i)
        return len(text) if j < 0 else j
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c == '"':
            j += 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
        elif c == "{" or c == "[":
            depth += 1
        elif c == "}" or c == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise _Unknown


# --------------------------------------------------------------------------- statements
def _statements(toks):
    """Split into (head tokens, body tokens) per definition and the names %import brings in."""
    lines, cur = [], []
    for t in toks:
        if t[0] == "nl":
            if cur:
                lines.append(cur)
            cur = []
        else:
            cur.append(t)
    if cur:
        lines.append(cur)
    defs: dict[str, list] = {}
    imported: set[str] = set()
    last = None
    for line in lines:
        colon = _header_colon(line)
        if colon is not None:
            head = [t for t in line[:colon] if t[1] not in ("?", "!")]
            name = head[0][1]
            last = defs.setdefault(name, [])
            if last:
                last.append(("punct", "|"))  # a second definition adds alternatives
            last.extend(line[colon + 1:])
        elif line[0][0] == "pct":
            last = None
            if line[0][1] == "%import":
                names = [t[1] for t in line[1:] if t[0] == "name"]
                # %import common.NUMBER [-> ALIAS] / %import common (A, B): the last names are defined
                if "->" in [t[1] for t in line]:
                    imported.add(names[-1])
                else:
                    imported.update(names)
        elif last is not None:
            last.extend(line)  # a continuation line (`| more`) of the rule above
        else:
            raise _Unknown
    return defs, imported


def _header_colon(line) -> int | None:
    """Index of the `:` ending a definition header (`?name.2[params]:`), or None."""
    i = 0
    if line[i][1] in ("?", "!"):
        i += 1
    if i >= len(line) or line[i][0] != "name":
        return None
    i += 1
    if i < len(line) and line[i][1] == "." and i + 1 < len(line) and line[i + 1][0] == "num":
        i += 2
    if i < len(line) and line[i][1] == "[":
        depth = 0
        while i < len(line):
            depth += {"[": 1, "]": -1}.get(line[i][1], 0) if line[i][0] == "punct" else 0
            i += 1
            if depth == 0:
                break
    if i < len(line) and line[i][1] == ":":
        return i
    return None


# --------------------------------------------------------------------------- expressions
# an expression: ("alt", [seq, ...]) | ("seq", [item, ...]) | ("opt", expr) | ("sym", name) | ("lit",)
class _Parser:
    def __init__(self, toks):
        self.t, self.i = toks, 0

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else ("end", "")

    def take(self, text=None):
        tok = self.peek()
        if text is not None and tok[1] != text:
            raise _Unknown
        self.i += 1
        return tok

    def expansions(self):
        alts = [self.sequence()]
        while self.peek()[1] == "|":
            self.take()
            alts.append(self.sequence())
        return ("alt", alts)

    def sequence(self):
        items = []
        while self.peek()[0] != "end" and self.peek()[1] not in ("|", ")", "]"):
            if self.peek()[1] == "->":  # an alias names the alternative: no effect on the language
                self.take()
                if self.take()[0] != "name":
                    raise _Unknown
                continue
            items.append(self.item())
        return ("seq", items)

    def item(self):
        atom = self.atom()
        while True:
            tok = self.peek()
            if tok[1] in ("?", "*"):
                self.take()
                atom = ("opt", atom)
            elif tok[1] == "+":
                self.take()
            elif tok[1] == "~":
                self.take()
                lo = self.take()
                if lo[0] != "num":
                    raise _Unknown
                if self.peek()[1] == "..":
                    self.take()
                    if self.take()[0] != "num":
                        raise _Unknown
                if int(lo[1]) == 0:
                    atom = ("opt", atom)
            elif tok[1] == "{":
                self.take()
                lo = 0
                if self.peek()[0] == "num":
                    lo = int(self.take()[1])
                if self.peek()[1] == ",":
                    self.take()
                    if self.peek()[0] == "num":
                        self.take()
                self.take("}")
                if lo == 0:
                    atom = ("opt", atom)
            else:
                return atom

    def atom(self):
        kind, text = self.take()
        if kind == "str":
            if self.peek()[1] == "..":  # a character range "a".."z"
                self.take()
                if self.take()[0] != "str":
                    raise _Unknown
            return ("lit",)
        if kind in ("regex", "atom"):
            return ("lit",)
        if kind == "name":
            return ("sym", text)
        if text == "(":
            e = self.expansions()
            self.take(")")
            return e
        if text == "[":
            e = self.expansions()
            self.take("]")
            return ("opt", e)
        raise _Unknown


def _productive(e, prod: set[str], defined: set[str]) -> bool:
    kind = e[0]
    if kind == "lit" or kind == "opt":
        return True
    if kind == "sym":
        return e[1] in prod or e[1] not in defined  # an undefined name is the matcher's error to report
    if kind == "seq":
        return all(_productive(x, prod, defined) for x in e[1])
    return any(_productive(x, prod, defined) for x in e[1])


def _symbols(e, out: set[str]) -> set[str]:
    if e[0] == "sym":
        out.add(e[1])
    elif e[0] == "opt":
        _symbols(e[1], out)
    elif e[0] in ("seq", "alt"):
        for x in e[1]:
            _symbols(x, out)
    return out


def unproductive_rules(grammar: str, start: str = "start") -> list[str] | None:
    """The rules reachable from `start` from which no string derives, `start` first, when the grammar's
    language is empty; [] when it is not; None when this reader cannot tell (unfamiliar syntax)."""
    try:
        defs, imported = _statements(_tokens(grammar))
        bodies = {}
        for name, toks in defs.items():
            p = _Parser(toks)
            bodies[name] = p.expansions()
            if p.i != len(toks):
                raise _Unknown
    except (_Unknown, IndexError, ValueError):
        return None
    if start not in bodies:
        return None
    defined = set(bodies) - imported
    prod = set(imported)
    changed = True
    while changed:
        changed = False
        for name, body in bodies.items():
            if name not in prod and _productive(body, prod, defined):
                prod.add(name)
                changed = True
    if start in prod:
        return []
    seen, order, todo = {start}, [start], [start]
    while todo:
        for s in sorted(_symbols(bodies[todo.pop()], set())):
            if s in bodies and s not in prod and s not in seen:
                seen.add(s)
                order.append(s)
                todo.append(s)
    return order
