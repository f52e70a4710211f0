"""Host side of the "dfa" backend: a regex / JSON schema / choice -> token-level DFA tables.

    pattern = regex_of(constraint)                        # JSON schema -> regex: outlines-core
    dfa = compile_pattern(pattern, token_strings(tok, V), stop_ids=(eos,), mask_id=m)
    dfa.next_state [Q, C], dfa.token_class [V], dfa.accepting [Q], dfa.live [Q], dfa.start

How: the regex becomes a character DFA (`interegular`); every token's text is
walked through it from every state at once (numpy, one step per character
position), giving the token-level transition table [Q, V]; tokens with
identical columns share a class, so the device tables are [Q, C] plus one
int32 per token. (outlines-core 0.2.x's own token `Index` drops transitions
that loop back through a final state, e.g. it accepts only "" for `(ab)*`, so
the token walk is done here; its JSON-schema -> regex translation is used.)

The token DFA has two extra states besides the regex's: DEAD (0: nothing
completes) and ENDED (a stop token was read in an accepting state; every later
token is free, since the output is cut at the stop token). Stop tokens move
accepting states to ENDED, every other state to DEAD; special tokens without
text and the mask token go to DEAD. ENDED is accepting, so a row may end by
LENGTH in any accepting state or by a stop token after an accepted prefix.
States are then minimised (Moore refinement over token classes): Q counts
equivalence classes of states, DEAD included.

A cap (`max_states`) is enforced while the character automaton is built: every
automaton interegular builds along the way (it composes a regex from smaller
ones) may have at most `CHAR_STATES_PER_STATE * max_states` states, so a regex
whose DFA blows up (`[ab]*a[ab]{14}`: 2**15 states) is refused in milliseconds
instead of after building every state. (The token DFA has at most the character
DFA's states plus DEAD and ENDED, and about as many when the tokenizer spells
every character the regex uses; what passes the margin is counted exactly after
minimisation. A tokenizer that lacks most of a regex's characters can have a
much smaller token DFA than the character automaton: such a regex may be
refused although its token DFA would have fit.) interegular's own state lookup is a list search,
quadratic in the states; ours (`_crawl`) is a dict, and builds the same automaton.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import re

import numpy as np

from jdllm.errors import ConstraintError

DEAD = 0
CHAR_STATES_PER_STATE = 4  # the character automata's cap, per token-DFA state allowed


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDFA:
    """A token-level DFA (numpy). State 0 is DEAD."""

    next_state: np.ndarray  # [Q, C] int32
    token_class: np.ndarray  # [V] int32
    accepting: np.ndarray  # [Q] bool
    live: np.ndarray  # [Q] bool: an accepting state is reachable
    start: int
    min_tokens: int  # fewest tokens from start to an accepting state
    max_tokens: int | None = None  # most tokens a row can read staying live; None: unbounded (a loop, or a stop id)

    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    @property
    def num_classes(self) -> int:
        return self.next_state.shape[1]

    def walk(self, tokens, q: int | None = None) -> int:
        """The state after reading `tokens` from `q` (default: start)."""
        q = self.start if q is None else q
        for t in tokens:
            q = int(self.next_state[q, self.token_class[int(t)]])
        return q

    def accepts(self, tokens) -> bool:
        return bool(self.accepting[self.walk(tokens)])

    def table_bytes(self) -> int:
        return self.next_state.nbytes + self.token_class.nbytes + self.accepting.nbytes + self.live.nbytes


# --------------------------------------------------------------------------- constraint -> regex
def _refs_cycle(schema) -> str | None:
    """A "$ref" that reaches itself (a recursive, hence non-regular, schema), or None."""
    defs = {}

    def collect(node, path):
        if isinstance(node, dict):
            defs[path] = node
            for k, v in node.items():
                collect(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                collect(v, f"{path}/{i}")

    collect(schema, "#")

    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str):
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    def reach(ref, seen):
        target = defs.get(ref.rstrip("/") or "#")
        if target is None:
            return None
        for r in refs(target):
            if r in seen:
                return r
            hit = reach(r, seen | {r})
            if hit:
                return hit
        return None

    for r in refs(schema):
        hit = reach(r, {r})
        if hit:
            return hit
    return None


def regex_of(kind: str, source: str) -> str:
    """The regex a constraint stands for (regex: itself; json_schema via outlines-core; choice: an alternation)."""

    if kind == "regex":
        return source
    if kind == "choice":
        return "|".join(re.escape(o) for o in json.loads(source))
    if kind == "json_schema":
        schema = json.loads(source)
        if schema is False:
            raise ConstraintError("JSON schema false has an empty language: no JSON document is valid under it; "
                                  "fix the schema")
        cyc = _refs_cycle(schema)
        if cyc is not None:
            raise ConstraintError(
                f"JSON schema is recursive ($ref {cyc!r} reaches itself): not a regular language the 'dfa' "
                "backend can compile exactly; use backend='llguidance'")
        try:
            from outlines_core.json_schema import build_regex_from_schema  # noqa: PLC0415 (optional: the constraints extra)
        except ImportError:
            raise ConstraintError("the 'dfa' backend needs outlines-core for JSON schemas: "
                                  "pip install 'jdllm[constraints]'") from None
        try:
            return build_regex_from_schema(source)
        except Exception as e:  # noqa: BLE001  (outlines-core raises ValueError / its own errors)
            msg = str(e).split("\n")[0].strip()  # its first line; the rest asks users to open an issue upstream
            if msg.startswith("Unsupported JSON Schema structure"):
                raise ConstraintError(f"the 'dfa' backend (outlines-core) does not support this JSON schema: "
                                      f"{msg}; simplify the schema") from None
            raise ConstraintError(f"JSON schema cannot be compiled to a regex: {msg}") from None
    raise ConstraintError(f"constraint kind {kind!r} is not supported by the 'dfa' backend; "
                          "use backend='llguidance'")


# --------------------------------------------------------------------------- vocabulary
def token_strings(tokenizer, vocab_size: int) -> list[str | None]:
    """Each token id's text (None: a special token or an id past the tokenizer, never matched by a regex)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    n = min(vocab_size, len(tokenizer))
    toks = tokenizer.convert_ids_to_tokens(list(range(n)))
    out: list[str | None] = []
    for i, t in enumerate(toks):
        if i in special or t is None:
            out.append(None)
            continue
        s = tokenizer.convert_tokens_to_string([t])
        out.append(None if "\ufffd" in s else s)  # a partial UTF-8 byte sequence: not matched
    return out + [None] * (vocab_size - n)


# --------------------------------------------------------------------------- compile
_CRAWL_LIMIT = contextvars.ContextVar("jdllm_crawl_limit", default=None)  # None: not ours, interegular's crawl


class _TooManyStates(Exception):
    pass


def _state_key(state):
    """A hashable stand-in for an interegular crawl state, equal exactly when the states are `==`
    (the states are ints, frozensets / sets of hashables, or dicts of ints)."""
    if isinstance(state, dict):
        return dict, frozenset(state.items())
    if isinstance(state, (set, frozenset)):
        return frozenset(state)
    return state


def _crawl(fsm_module, alphabet, initial, final, follow, limit):
    """interegular.fsm.crawl (breadth-first, states numbered as it numbers them), with a dict lookup
    instead of a list search, stopping once more than `limit` states are found."""
    states, index, finals, table = [initial], {}, set(), {}
    try:
        index[_state_key(initial)] = 0
    except TypeError:
        pass
    i = 0
    while i < len(states):
        state = states[i]
        if final(state):
            finals.add(i)
        table[i] = {}
        for transition in alphabet.by_transition:
            try:
                nxt = follow(state, transition)
            except fsm_module.OblivionError:
                continue
            try:
                key = _state_key(nxt)
                j = index.get(key)
            except TypeError:  # an unhashable state: interegular's list search
                key, j = None, next((k for k, s in enumerate(states) if s == nxt), None)
            if j is None:
                j = len(states)
                states.append(nxt)
                if key is not None:
                    index[key] = j
                if j >= limit:
                    raise _TooManyStates(j + 1)
            table[i][transition] = j
        i += 1
    return fsm_module.FSM(alphabet=alphabet, states=range(len(states)), initial=0, finals=finals, map=table,
                          __no_validation__=True)


@functools.lru_cache(maxsize=None)
def _interegular():
    """interegular, its `crawl` routed through `_crawl` while this module builds an automaton (other
    callers keep interegular's own)."""
    try:
        import interegular  # noqa: PLC0415 (optional: the constraints extra)
        import interegular.fsm as fsm_module  # noqa: PLC0415
    except ImportError:
        raise ConstraintError("the 'dfa' backend needs interegular: pip install 'jdllm[constraints]'") from None
    theirs = fsm_module.crawl
    if not getattr(theirs, "_jdllm", False):
        def crawl(alphabet, initial, final, follow):
            limit = _CRAWL_LIMIT.get()
            if limit is None:
                return theirs(alphabet, initial, final, follow)
            return _crawl(fsm_module, alphabet, initial, final, follow, limit)

        crawl._jdllm = True
        fsm_module.crawl = crawl
    return interegular


def _char_dfa(pattern: str, max_states: int | None = None):
    """The regex's character DFA (interegular); with `max_states`, ConstraintError as soon as an
    automaton built along the way passes CHAR_STATES_PER_STATE * max_states states."""
    interegular = _interegular()
    limit = float("inf") if max_states is None else CHAR_STATES_PER_STATE * max_states
    token = _CRAWL_LIMIT.set(limit)
    try:
        return interegular.parse_pattern(pattern).to_fsm()
    except _TooManyStates as e:
        raise ConstraintError(
            f"regex {_short(pattern)}: its automaton passes {e.args[0] - 1} states while being built "
            f"({CHAR_STATES_PER_STATE} x the limit of at most {max_states} DFA states, constraint_states), so it "
            "was refused before growing further; simplify the constraint or raise that limit") from None
    except ConstraintError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConstraintError(f"regex {pattern!r} cannot be compiled to a DFA: {_regex_problem(pattern, e)}") from None
    finally:
        _CRAWL_LIMIT.reset(token)


def _short(pattern: str, limit: int = 120) -> str:
    return repr(pattern) if len(pattern) <= limit else repr(pattern[:limit]) + f"... ({len(pattern)} characters)"


def _regex_problem(pattern: str, e: Exception) -> str:
    """What is wrong with a pattern interegular refused: Python's `re` names a syntax error and its
    position (interegular's InvalidSyntax often carries no message); otherwise interegular's reason."""
    try:
        re.compile(pattern)
    except re.error as err:
        return f"it is not a valid regex: {err}"
    except (RecursionError, OverflowError):  # fall through to interegular's reason
        pass
    reason = str(e).strip() or f"{type(e).__name__}, syntax interegular does not read"
    return f"{reason} (a DFA takes regular syntax only: no look-around, no back-references)"


def _minimise(nxt: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """Moore refinement: [Q] block id of each state (block of DEAD is 0)."""
    part = accepting.astype(np.int64)
    while True:
        sig = np.concatenate([part[:, None], part[nxt]], axis=1)
        _, new = np.unique(sig, axis=0, return_inverse=True)
        new = new.reshape(-1)
        if len(np.unique(new)) == len(np.unique(part)):
            part = new
            break
        part = new
    # renumber so the DEAD block is 0
    order = [part[DEAD]] + [p for p in dict.fromkeys(part.tolist()) if p != part[DEAD]]
    remap = {p: i for i, p in enumerate(order)}
    return np.array([remap[p] for p in part.tolist()], np.int32)


@functools.lru_cache(maxsize=64)
def _compile_cached(pattern: str, strings: tuple, stop_ids: tuple, mask_id, max_states) -> TokenDFA:
    fsm = _char_dfa(pattern, max_states)
    states = sorted(fsm.states)
    idx = {s: i + 1 for i, s in enumerate(states)}  # 0 = DEAD
    NQ = len(states) + 1
    ENDED = NQ
    NQ += 1
    symbols = sorted(set(fsm.alphabet.values()), key=repr)
    sym_id = {s: i for i, s in enumerate(symbols)}
    NSYM = len(symbols) + 1  # last symbol = padding (identity)
    char_T = np.zeros((NQ, NSYM), np.int32)  # DEAD everywhere by default
    for s, row in fsm.map.items():
        for sym, t in row.items():
            char_T[idx[s], sym_id[sym]] = idx[t]
    char_T[:, NSYM - 1] = np.arange(NQ)
    char_T[ENDED, :] = ENDED  # ENDED reads anything (its row is overwritten per token below)

    def sym_of(ch):
        return sym_id[fsm.alphabet[ch]]

    V = len(strings)
    L = max([len(s) for s in strings if s is not None] + [1])
    syms = np.full((V, L), NSYM - 1, np.int32)
    for v, s in enumerate(strings):
        if s:
            syms[v, :len(s)] = [sym_of(ch) for ch in s]
    lengths = np.array([len(s) if s else 0 for s in strings])
    order = np.argsort(-lengths, kind="stable")  # longest first: step k walks only tokens longer than k
    cur = np.broadcast_to(np.arange(NQ, dtype=np.int32)[:, None], (NQ, V)).copy()  # [Q, V] in `order`
    syms_o = syms[order]
    for k in range(L):
        n = int(np.count_nonzero(lengths > k))
        cur[:, :n] = char_T[cur[:, :n], syms_o[None, :n, k]]
    state = np.empty_like(cur)
    state[:, order] = cur
    finals = np.zeros(NQ, bool)
    for s in fsm.finals:
        finals[idx[s]] = True
    text = np.array([s is not None for s in strings])
    state[:, ~text] = DEAD
    state[ENDED, :] = ENDED
    stops = [t for t in stop_ids if 0 <= t < V]
    for t in stops:
        state[:, t] = np.where(finals, ENDED, DEAD)
        state[ENDED, t] = ENDED
    if mask_id is not None and 0 <= mask_id < V:
        state[:, mask_id] = DEAD
    accepting = finals.copy()
    accepting[ENDED] = True

    # token classes over the vocabulary, then minimise states, then classes again
    cols, token_class = np.unique(state.T, axis=0, return_inverse=True)  # [C, Q]
    nxt = cols.T.astype(np.int32)  # [Q, C]
    block = _minimise(nxt, accepting)
    NB = int(block.max()) + 1
    rep = np.array([np.flatnonzero(block == b)[0] for b in range(NB)])
    nxt_b = block[nxt[rep]]  # [NB, C]
    acc_b = accepting[rep]
    start = int(block[idx[fsm.initial]])
    cols2, cls2 = np.unique(nxt_b.T, axis=0, return_inverse=True)
    nxt_b = cols2.T.astype(np.int32)
    token_class = cls2.reshape(-1)[token_class.reshape(-1)].astype(np.int32)
    # live: an accepting state is reachable (backward fixpoint)
    live = acc_b.copy()
    while True:
        new = live | np.any(live[nxt_b], axis=1)
        if (new == live).all():
            break
        live = new
    # fewest tokens to acceptance from start (BFS over classes actually used by some token)
    used = np.zeros(nxt_b.shape[1], bool)
    used[token_class] = True
    dist = np.full(NB, -1)
    dist[start] = 0
    frontier = [start]
    while frontier:
        nf = []
        for q in frontier:
            for t in np.unique(nxt_b[q, used]):
                if dist[t] < 0:
                    dist[t] = dist[q] + 1
                    nf.append(int(t))
        frontier = nf
    reach_acc = [d for d, a in zip(dist, acc_b) if a and d >= 0]
    if not reach_acc:
        raise ConstraintError(f"regex {pattern!r} matches no string this tokenizer can produce")
    if max_states is not None and NB > max_states:
        raise ConstraintError(f"regex {_short(pattern)} compiles to {NB} DFA states; at most {max_states} states fit "
                              "(constraint_states); simplify the constraint or raise that limit")
    return TokenDFA(next_state=nxt_b, token_class=token_class, accepting=acc_b, live=live, start=start,
                    min_tokens=int(min(reach_acc)), max_tokens=_longest_live_walk(nxt_b, live, used, start))


def _longest_live_walk(nxt, live, used, start: int) -> int | None:
    """The most tokens a walk from `start` can read through live states (token classes in `used`),
    or None when a loop of live states is reachable (as the ENDED state's is once a stop id is
    allowed): the longest string of a finite language, in tokens."""
    succ = [sorted({int(t) for t in nxt[q, used] if live[t]}) if live[q] else [] for q in range(nxt.shape[0])]
    longest: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(start, iter(succ[start]))]
    on_path.add(start)
    while stack:  # iterative DFS: post-order longest path, a back edge is a loop
        q, it = stack[-1]
        t = next(it, None)
        if t is None:
            stack.pop()
            on_path.discard(q)
            longest[q] = max((longest[u] + 1 for u in succ[q]), default=0)
        elif t in on_path:
            return None
        elif t not in longest:
            on_path.add(t)
            stack.append((t, iter(succ[t])))
    return longest[start]


def compile_pattern(pattern: str, strings, *, stop_ids=(), mask_id=None, max_states: int | None = None) -> TokenDFA:
    """Token DFA of `pattern` over a vocabulary given as each id's text (None = never matched).
    max_states: ConstraintError when the DFA has more states, raised while the character automaton
    is built once that passes CHAR_STATES_PER_STATE * max_states states."""
    return _compile_cached(pattern, tuple(strings), tuple(sorted(set(int(t) for t in stop_ids))),
                           None if mask_id is None else int(mask_id), None if max_states is None else int(max_states))


__all__ = ["TokenDFA", "regex_of", "token_strings", "compile_pattern", "DEAD", "CHAR_STATES_PER_STATE"]
