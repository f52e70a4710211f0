"""Device side of the "dfa" backend: the tables as a pytree in the decode state, and the
dynamic program that keeps every reveal completable, in any order, inside the jitted loop.

A row's canvas is read as a word over the token DFA: generation slots that are
revealed read their token, masked ones read "any token", every other slot
(prompt, padding, past `limit`) reads nothing. Per slot s:

    F[s]   states reachable at s from the start state (forward pass)
    G[s]   states from which the rest of the canvas, up to `limit`, can end
           accepting (backward pass; budget-aware: the masked slots left are
           exactly the tokens a completion may still use)

A masked slot s may take token t iff some q in F[s] has next(q, t) in G[s+1]:
exactly the tokens that keep at least one full completion. Tokens revealed
together in one step are made jointly consistent by `joint`: the step's
selected reveals are accepted in confidence order, each kept only if the
window's assignment so far still completes (one forward pass over the window
per check; the common case, all consistent, costs one pass).

`DFATables` sits in `DecodeState.constraint` (None = unconstrained: the
paradigms then trace exactly what they traced before). Its arrays are jit
arguments, bucketed in Q and C, so a new regex with the same buckets reuses
the compile. Free rows carry a one-state table that allows everything.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jdllm.decode.common import bucket, rank, window
from jdllm.inputs import to_device
from jdllm.state import generated_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFATables:
    """Per-row token DFAs, padded to shared buckets. State 0 of each row is DEAD."""

    next_state: jax.Array  # [B, Q, C] int32
    token_class: jax.Array  # [B, V] int32
    accepting: jax.Array  # [B, Q] bool
    start: jax.Array  # [B] int32
    any_step: jax.Array  # [B, Q, Q] float32: 1 where some class moves q -> q'
    # the last mask's reachability sets [B, S+1, Q] (F, G of `reachable`), reused by the reveal that
    # follows it in the same step (the canvas has not changed in between); None: recomputed
    fwd: jax.Array | None = None
    bwd: jax.Array | None = None

    @property
    def num_states(self) -> int:
        return self.next_state.shape[1]

    # ----------------------------------------------------------- hooks the decode loop calls
    def mask_logits(self, state, logits: jax.Array, offset):
        """(tables, logits [B, W, V] predicting slots [offset, offset + W) with -inf where no completion
        remains). The returned tables keep this step's F / G for `joint`."""
        W = logits.shape[1]
        F, G = reachable(self, state)
        ok = _allowed_tokens(self, state, F, G, offset, W)
        return self._keeping(F, G), jnp.where(ok, logits, -jnp.inf)

    def draft_mask(self, state, offset, drafts: jax.Array):
        """(tables, ok [B, K+1, V]): ar_spec's verification masks for slots offset + i, i = 0..K, each
        the tokens allowed once drafts [B, K] [:i] are read at the slots before it (every later slot
        still masked). The returned tables keep this step's F / G for `joint`."""
        F, G = reachable(self, state)
        ok = draft_allowed(self, state, F, G, offset, drafts)
        return self._keeping(F, G), ok

    def _keeping(self, F, G) -> "DFATables":
        """These tables holding this step's F / G for `joint` (tables built without them stay so)."""
        return self if self.fwd is None else dataclasses.replace(self, fwd=F, bwd=G)

    def joint(self, state, offset, sel: jax.Array, token: jax.Array, score: jax.Array) -> jax.Array:
        """sel [B, W] reduced so the step's reveals are jointly completable (confidence order)."""
        FG = None if self.fwd is None else (self.fwd, self.bwd)
        return joint_select(self, state, offset, sel, token, score, FG)


def stack(dfas: list, vocab: int, q_bucket: int | None = None, c_bucket: int | None = None,
          slots: int | None = None) -> DFATables:
    """One DFATables from per-row TokenDFAs (None: free row), padded to power-of-two Q and C (>= 8:
    small regexes share one compile). slots: the canvas size, to keep each step's F / G for its
    reveal (one DP per step instead of two)."""

    Q = bucket(max([d.num_states for d in dfas if d is not None] + [2]), 8)
    C = bucket(max([d.num_classes for d in dfas if d is not None] + [1]), 8)
    Q, C = max(Q, q_bucket or 0), max(C, c_bucket or 0)
    B = len(dfas)
    nxt = np.zeros((B, Q, C), np.int32)
    cls = np.zeros((B, vocab), np.int32)
    acc = np.zeros((B, Q), bool)
    start = np.zeros((B,), np.int32)
    for b, d in enumerate(dfas):
        if d is None:  # state 1: accepting, every token stays there
            nxt[b, 1, :] = 1
            acc[b, 1] = True
            start[b] = 1
            continue
        q, c = d.next_state.shape
        nxt[b, :q, :c] = d.next_state
        n = min(vocab, len(d.token_class))
        cls[b, :n] = d.token_class[:n]
        acc[b, :q] = d.accepting
        start[b] = d.start
    anyq = np.zeros((B, Q, Q), np.float32)
    for b in range(B):
        used = np.zeros(C, bool)
        used[np.unique(cls[b])] = True
        qs, cs = np.nonzero(np.broadcast_to(used, (Q, C)))
        anyq[b, qs, nxt[b, qs, cs]] = 1.0
    fg = None if slots is None else jnp.zeros((B, slots + 1, Q), jnp.float32)
    return DFATables(next_state=to_device(nxt), token_class=to_device(cls), accepting=to_device(acc),
                     start=to_device(start), any_step=to_device(anyq), fwd=fg, bwd=fg)


# --------------------------------------------------------------------------- the dynamic program
def _slot_kinds(state):
    """Per slot: kind [B, S] (0 = reads nothing, 1 = revealed token, 2 = any token) and class [B, S]."""
    gen = generated_mask(state)
    kind = jnp.where(gen, jnp.where(state.revealed, 1, 2), 0).astype(jnp.int32)
    return kind


def _classes(tab: DFATables, tokens: jax.Array) -> jax.Array:
    return jnp.take_along_axis(tab.token_class, jnp.clip(tokens, 0, tab.token_class.shape[1] - 1), axis=1)


def _fwd(tab: DFATables, f: jax.Array, kind: jax.Array, c: jax.Array) -> jax.Array:
    """One slot forward: f [B, Q] float 0/1 -> states after reading the slot."""
    tgt = jnp.take_along_axis(tab.next_state, c[:, None, None], axis=2)[..., 0]  # [B, Q]
    one = jnp.zeros_like(f).at[jnp.arange(f.shape[0])[:, None], tgt].max(f)  # scatter f to targets
    many = jnp.minimum(jnp.einsum("bq,bqr->br", f, tab.any_step), 1.0)
    return jnp.where((kind == 1)[:, None], one, jnp.where((kind == 2)[:, None], many, f))


def _bwd(tab: DFATables, g: jax.Array, kind: jax.Array, c: jax.Array) -> jax.Array:
    """One slot backward: g [B, Q] (co-reachable after the slot) -> co-reachable before it."""
    tgt = jnp.take_along_axis(tab.next_state, c[:, None, None], axis=2)[..., 0]  # [B, Q]
    one = jnp.take_along_axis(g, tgt, axis=1)
    many = jnp.minimum(jnp.einsum("bqr,br->bq", tab.any_step, g), 1.0)
    return jnp.where((kind == 1)[:, None], one, jnp.where((kind == 2)[:, None], many, g))


def reachable(tab: DFATables, state) -> tuple[jax.Array, jax.Array]:
    """(F [B, S+1, Q], G [B, S+1, Q]) float 0/1: forward-reachable before slot s, co-reachable before s."""
    kind = _slot_kinds(state)
    cls = _classes(tab, state.tokens)
    Q = tab.num_states
    f0 = jax.nn.one_hot(tab.start, Q, dtype=jnp.float32)
    gS = tab.accepting.astype(jnp.float32)
    xs = (kind.T, cls.T)

    def fstep(f, x):
        nf = _fwd(tab, f, *x)
        return nf, nf

    def bstep(g, x):
        ng = _bwd(tab, g, *x)
        return ng, ng

    _, fs = jax.lax.scan(fstep, f0, xs)  # fs[s] = after slot s
    _, gs = jax.lax.scan(bstep, gS, xs, reverse=True)  # gs[s] = before slot s
    F = jnp.concatenate([f0[None], fs], axis=0).transpose(1, 0, 2)
    G = jnp.concatenate([gs, gS[None]], axis=0).transpose(1, 0, 2)
    return F, G


def _rows_window(x: jax.Array, offset, width: int) -> jax.Array:

    return window(x, offset, width)


def allowed_classes(tab: DFATables, state, offset, width: int, FG=None) -> jax.Array:
    """[B, W, C] bool: classes a masked slot of the window may take (True elsewhere)."""
    F, G = reachable(tab, state) if FG is None else FG
    f = _rows_window(F[:, :-1], offset, width)  # [B, W, Q] before each slot
    g = _rows_window(G[:, 1:], offset, width)  # [B, W, Q] after each slot
    g_next = jax.vmap(lambda gb, nb: gb[:, nb])(g, tab.next_state)  # [B, W, Q, C]
    ok = jnp.any((f[..., None] > 0) & (g_next > 0), axis=2)  # [B, W, C]
    masked = _rows_window(_slot_kinds(state) == 2, offset, width)
    return ok | ~masked[..., None]


def _allowed_tokens(tab: DFATables, state, F, G, offset, width: int) -> jax.Array:
    okc = allowed_classes(tab, state, offset, width, (F, G))
    return jax.vmap(lambda o, tc: o[:, tc])(okc, tab.token_class)


def allowed_tokens(tab: DFATables, state, offset, width: int) -> jax.Array:
    """[B, W, V] bool: tokens a masked slot of the window may take (True elsewhere)."""
    return _allowed_tokens(tab, state, *reachable(tab, state), offset, width)


def draft_allowed(tab: DFATables, state, F, G, offset, drafts: jax.Array) -> jax.Array:
    """[B, K+1, V] bool: the tokens slot offset + i may take after drafts[:, :i] (see `draft_mask`).
    Slots from `offset` on are masked (AR order), so G there does not depend on the drafts; only
    the forward states do: f_0 = F before `offset`, f_{i+1} = f_i read through draft i."""
    K = drafts.shape[1]
    f0 = _rows_window(F, offset, 1)[:, 0]  # [B, Q] before slot offset
    cls = _classes(tab, drafts)  # [B, K]

    def step(f, c):
        nf = _fwd(tab, f, jnp.ones_like(c), c)
        return nf, nf

    _, fs = jax.lax.scan(step, f0, cls.T)  # [K, B, Q]
    f = jnp.concatenate([f0[None], fs], axis=0).transpose(1, 0, 2)  # [B, K+1, Q]
    g = _rows_window(G[:, 1:], offset, K + 1)  # [B, K+1, Q] after each slot
    g_next = jax.vmap(lambda gb, nb: gb[:, nb])(g, tab.next_state)  # [B, K+1, Q, C]
    okc = jnp.any((f[..., None] > 0) & (g_next > 0), axis=2)  # [B, K+1, C]
    return jax.vmap(lambda o, tc: o[:, tc])(okc, tab.token_class)


def joint_select(tab: DFATables, state, offset, sel: jax.Array, token: jax.Array, score: jax.Array,
                 FG=None) -> jax.Array:
    """Keep the selected reveals [B, W] (tokens [B, W]) in descending `score` order while the window
    still completes with them; the best one is always individually allowed, so a row with a selection
    keeps at least one."""

    W = sel.shape[1]
    F, G = reachable(tab, state) if FG is None else FG
    f_in = _rows_window(F, offset, 1)[:, 0]  # [B, Q] before the window
    g_out = _rows_window(G, jnp.asarray(offset) + W, 1)[:, 0]  # [B, Q] after it (offset + W <= S)
    kind0 = _rows_window(_slot_kinds(state), offset, W)  # [B, W]
    cls0 = _classes(tab, _rows_window(state.tokens, offset, W))
    cls_new = _classes(tab, token)

    def completes(keep):
        kind = jnp.where(keep, 1, kind0)
        cls = jnp.where(keep, cls_new, cls0)
        f, _ = jax.lax.scan(lambda f, x: (_fwd(tab, f, *x), None), f_in, (kind.T, cls.T))
        return jnp.any((f > 0) & (g_out > 0), axis=-1)  # [B]

    all_ok = completes(sel)
    r = rank(score, sel)  # [B, W]; W where not selected
    n = jnp.where(all_ok, 0, jnp.sum(sel, axis=-1))  # rows that need the one-by-one pass

    def body(carry):
        i, keep = carry
        trial = keep | (sel & (r == i))
        ok = completes(trial)
        return i + 1, jnp.where((ok & (i < n))[:, None], trial, keep)

    _, keep = jax.lax.while_loop(lambda c: c[0] < jnp.max(n), body, (jnp.int32(0), jnp.zeros_like(sel)))
    return jnp.where(all_ok[:, None], sel, keep)


__all__ = ["DFATables", "stack", "reachable", "allowed_classes", "allowed_tokens", "draft_allowed", "joint_select"]
