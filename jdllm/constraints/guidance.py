"""The "llguidance" constraint backend: host-side grammar matchers driving the decode steps.

Each constrained row owns an llguidance `LLMatcher` (regex, JSON schema, Lark or choice,
compiled against an `LLTokenizer` built from the model's Hugging Face tokenizer). Every
step the `Controller` answers, per row, what a grammar controller answers with a branch:

    sample_mask  packed int32 bitmask [N, ceil(V/32)] over the slots the step samples
                 (llguidance layout; `jdllm.sampling.apply_token_bitmask` applies it)
    ff_tokens    tokens the grammar forces next (llguidance fast-forward): written
                 into the canvas without sampling
    backtrack    revealed tokens the grammar rejects: re-masked (the row rewinds to them)

Masks of a batch are filled in parallel (`fill_next_token_bitmask_par` on an `LLExecutor`
thread pool), not row by row.

Mechanism: a host loop over the engine's own pieces
===================================================
Constrained calls are driven from the host with `loop.compiled_steps()`:
`plan` -> `forward` (dispatched asynchronously) -> masks filled on the host while the
forward runs -> `reveal(bitmask)` -> read the revealed tokens back -> the matchers consume
them -> one jitted `apply_edits` writes fast-forwarded tokens / re-masks rejected ones.
Why not `io_callback` inside the `lax.while_loop`: the matchers are stateful host objects
that must see every revealed token before the next mask exists, so each step syncs with
the host either way (an io_callback blocks the device stream just the same); fast-forward
and backtrack move a row by a data-dependent number of slots, which the host does with
one small jitted edit instead of a second code path inside the loop body; and the
unconstrained call keeps compiling exactly the one-jit loop it compiled before (no
callback, no extra operand): constrained calls never build the one-jit loop (`loop.compiled()`). The cost is
one dispatch of plan / forward / reveal plus one device->host read of the canvas per
step (`benchmarks/constrained.py` measures it against the on-device step).

Fast-forward in AR costs one forward for all forced tokens: they are written into the
canvas without a forward, and the next step's forward (`catch_up`) covers every slot
from the row's committed cache length up to the slot it samples in one window (width
bucketed to a power of two). Forced tokens get log-prob 0 (probability 1 under the
constraint) and the step number of the step that revealed the token forcing them.

Out-of-order paradigms (block_diffusion, multi_block, masked_diffusion): the rule
================================================================================
A left-to-right matcher can judge a slot only when every slot before it is known. The
matcher of a row has consumed exactly the row's contiguous revealed prefix; its first
unrevealed slot is the *frontier*. Each step:
  * the frontier slot is sampled under the matcher's exact mask (so whenever the
    frontier is revealed it is valid);
  * any other planned slot may be revealed *provisionally*, from any token, stop tokens
    included (the paradigm's own choice, unchanged);
  * after the reveal the matcher consumes the contiguous revealed run from the frontier
    left to right (like draft tokens; a stop token is its EOS, accepted only where the
    grammar accepts); the first token it rejects is re-masked (its step_map and log-prob
    cleared; a row the device had ended "stop" or "length" on the strength of provisional
    tokens is reopened in the same host step) and becomes the new frontier; tokens after
    it stay provisional until judged.
Every returned token has therefore been consumed by the matcher, so a finished "stop" row
is accepted; other endings ("length") carry constraint_ok False unless the grammar accepts.
step_map stays truthful (a re-masked slot gets the step that finally reveals it) and NFE
counts every forward, so the TPF cost of the rule is measurable (benchmarks/RESULTS.md).
(An earlier rule kept stop tokens off provisional slots; with static top-k it made the
model reveal its second choice where it wanted EOS, e.g. "iowe" for "iow": exact match on
tiny-sdar static top-2 fell from 97.9 % to 75 %. With stop tokens provisional it is 97.9 %,
the same as the free run and as the DFA backend.)
masked_diffusion: a re-masked slot lies in the batch's current block (a block is left only
once it is full, i.e. once every slot before its end has been judged), so the block stays
current until the slot is revealed again; once its `steps` schedule is spent, the block's
remaining masked slots are revealed together on the next step (the paradigm's own rule).
multi_block: the same rule over its blocks in flight (the frontier lies in the row's first
non-Completed block, which every step plans). Its own state is rewound by its `rewind` hook,
which `apply_edits` calls after the host's edits: a re-masked stop token takes back the EOS
early-stop fill it caused, a Completed block that has masks again reopens in the state it
had reached (Fully-Activated / Activated, or Inactive when only the EOS fill completed it),
blocks the forced tokens filled become Completed, and no row keeps KV-cache entries from its
first edited block on. The cache never holds a re-masked slot in practice: exact and
approximate caches commit only blocks without masks before the first open block, i.e. slots
the matcher has already judged; the hook's cache rule is the guard.

Dead ends: when the frontier's mask allows nothing (the grammar needs a token this
vocabulary lacks), the row ends "length" at the frontier with constraint_ok False.

ar_spec: verification with draft-token masks
============================================
After the forward proposes drafts (and the target scores them), the host fills the masks
of all k + 1 verification slots in one parallel call (`Controller.verify_masks`, llguidance's
`fill_next_token_bitmask_par_with_draft_tokens`: mask i = after drafts[:i]), and `reveal`
applies them to the target's logits before the acceptance rule: a draft the grammar rejects
is rejected there, the correction is drawn from the masked target. The matchers advance
only by the tokens `reveal` emitted. A dead end after accepted drafts (the grammar allows no
token there) gets an all-zero mask: `reveal` emits the drafts before it and no correction, and
`advance` ends the row "length" at it, as AR does. No fast-forward in ar_spec (its cache must cover every
slot before the frontier); greedy constrained ar_spec equals greedy constrained AR.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import api
from jdllm.constraints import Constraint, lark_language
from jdllm.decode import common, loop
from jdllm.errors import ConstraintError
from jdllm.inputs import to_device
from jdllm.sharding import auto_axes
from jdllm.state import LENGTH, RUNNING, STOP, slot_index



def _llg():
    try:
        import llguidance  # noqa: PLC0415 (optional: the constraints extra)
        import llguidance.numpy  # noqa: F401, PLC0415
    except ImportError:  # pragma: no cover - the extra is part of [test]
        raise ConstraintError("the 'llguidance' backend needs the llguidance package: "
                              "pip install 'jdllm[constraints]'") from None
    return llguidance


# --------------------------------------------------------------------------- tokenizer
class _Vocab:
    """A tokenizer seen as llguidance's TokenizerWrapper: each id's bytes, its encoder.

    Used when `llguidance.hf.from_tokenizer` cannot read the tokenizer (e.g. the shipped
    character-level tokenizers, whose `Fuse` decoder it does not know)."""

    def __init__(self, tok, vocab_size: int, eos: int):
        special = set(int(i) for i in getattr(tok, "all_special_ids", []) or [])
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = sorted(i for i in special if i < vocab_size)
        self.tokens = [(tok.convert_ids_to_tokens(i) if i in special else tok.decode([i])).encode("utf-8")
                       if i < len(tok) else b"" for i in range(vocab_size)]
        self._tok = tok

    def __call__(self, s):
        s = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return [int(t) for t in self._tok.encode(s, add_special_tokens=False)]


_TOKENIZERS: dict = {}


def ll_tokenizer(model):
    """The model's llguidance LLTokenizer (cached per tokenizer object; building one costs ~1 s)."""
    llg = _llg()
    tok = model.tokenizer
    if tok is None:
        raise ConstraintError(
            "a constraint needs the model's tokenizer (model.tokenizer is None): load the model from a "
            "directory with tokenizer.json, or set Model(tokenizer=...)")
    V = int(model.config.vocab_size)
    eos = [int(e) for e in model.config.eos_token_ids] or (
        [int(tok.eos_token_id)] if getattr(tok, "eos_token_id", None) is not None else [])
    if not eos:
        raise ConstraintError("a constraint needs an end-of-sequence token to end accepted outputs; the model "
                              "config and its tokenizer name none (eos_token_id)")
    key = (id(tok), V, tuple(eos))
    hit = _TOKENIZERS.get(key)
    if hit is not None and hit[0] is tok:
        return hit[1]
    if len(tok) > V:
        raise ConstraintError(f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {V}")
    try:
        import llguidance.hf  # noqa: PLC0415 (optional: the constraints extra)

        lt = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=eos)
    except (ValueError, TypeError, AttributeError):
        lt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok, V, eos[0])), n_vocab=V, eos_token=eos)
    _TOKENIZERS[key] = (tok, lt)
    return lt


# --------------------------------------------------------------------------- grammars
def grammar(c: Constraint) -> str:
    """The llguidance grammar text of a constraint (not yet checked)."""
    M = _llg().LLMatcher
    if c.kind == "regex":
        return M.grammar_from_regex(c.source)
    if c.kind == "json_schema":
        try:
            return M.grammar_from_json_schema(c.source)
        except ValueError as e:
            raise ConstraintError(f"JSON schema {c.source[:80]!r}: {e}") from None
    if c.kind == "lark":
        return M.grammar_from_lark(c.source)
    options = json.loads(c.source)
    return M.grammar_from_lark("start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))


def matcher(c: Constraint, lltok):
    """A fresh LLMatcher for `c`; a ConstraintError naming the problem when the grammar is
    invalid or no output over this vocabulary can satisfy it (nothing compiles before)."""
    llg = _llg()
    g = grammar(c)
    what = f"{c.kind} constraint {c.source[:80]!r}"
    err, msgs = llg.LLMatcher.validate_grammar_with_warnings(g, lltok)
    if err:
        msg = msgs[0] if msgs else "unknown error"
        if "Unsatisfiable schema" in msg:  # llguidance's word for a schema no document satisfies
            raise ConstraintError(f"{what} is not valid: it has an empty language, no JSON document satisfies "
                                  f"it ({msg.strip()}); fix the schema")
        raise ConstraintError(f"{what} is not valid: {msg}")
    if c.kind == "lark":  # llguidance compiles a grammar none of whose derivations ends: find it here
        dead = lark_language.unproductive_rules(c.source)
        if dead:
            names = ", ".join(repr(r) for r in dead)
            raise ConstraintError(
                f"{what} has an empty language: no string derives from rule 'start' (rules that can never "
                f"finish: {names}; every alternative of each needs one of them again): give a recursive rule "
                "an alternative that ends, e.g. x: \"q\" x | \"q\"")
    m = llg.LLMatcher(lltok, g, log_level=0)
    if m.is_error():
        raise ConstraintError(f"{what} is not valid: {m.get_error()}")
    if not m.is_accepting():
        mask = np.zeros((1, (lltok.vocab_size + 31) // 32), np.int32)
        llg.numpy.fill_next_token_bitmask(m, mask)
        allowed = _unpack(mask[0], lltok.vocab_size)
        allowed[list(lltok.eos_tokens)] = False
        if not allowed.any():
            raise ConstraintError(f"{what} has an empty language over this model's vocabulary: no token can "
                                  "start an accepted output (check the characters the tokenizer knows)")
    return m


def _unpack(words: np.ndarray, V: int) -> np.ndarray:
    bits = (words[:, None].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:V].astype(bool)


def _pack(ids, W32: int) -> np.ndarray:
    """int32 [W32] with the bits of `ids` set."""
    out = np.zeros((W32,), np.uint32)
    for i in ids:
        out[i // 32] |= np.uint32(1) << np.uint32(i % 32)
    return out.view(np.int32)


# --------------------------------------------------------------------------- the controller
CLOSE_STOP, CLOSE_LENGTH = 1, 2


class Edits(NamedTuple):
    """What the host changes on the canvas after a step, as padded [B, E] arrays."""

    slots: np.ndarray  # [B, E] int32, -1 = unused
    tokens: np.ndarray  # [B, E] int32
    kind: np.ndarray  # [B, E] int32: 1 = write a forced token, 2 = re-mask (backtrack)
    reopen: np.ndarray  # [B] bool: a row that ended "length" gets a hole back
    close: np.ndarray  # [B] int32: CLOSE_STOP (the grammar is complete, the row has no stop token),
    #                    CLOSE_LENGTH (dead end: no token can continue), 0 = leave the row alone
    close_end: np.ndarray  # [B] int32: the closed row's end


@dataclasses.dataclass
class Stats:
    steps: int = 0
    mask_s: float = 0.0  # host time filling masks
    advance_s: float = 0.0  # host time consuming tokens / fast-forward / backtrack
    total_s: float = 0.0
    ff_tokens: int = 0
    backtracked: int = 0


class Controller:
    """One llguidance matcher per constrained row (None = free) and the per-step branch.

    gen_start / limit: each row's generation slots; stop_ids: each row's stop tokens
    (a sampled stop token is consumed as the grammar's EOS).
    """

    def __init__(self, lltok, matchers: list, vocab_size: int, gen_start, limit, stop_ids, *,
                 fast_forward: bool = True, block: int | None = None, threads: int | None = None):
        llg = _llg()
        self.m = list(matchers)
        self.V, self.W32 = vocab_size, (vocab_size + 31) // 32
        self.pos = np.asarray(gen_start, np.int64).copy()  # next slot to judge = the frontier
        self.limit = np.asarray(limit, np.int64)
        self.eos = int(lltok.eos_token)
        self.stops = [tuple(int(t) for t in s if t >= 0) for s in stop_ids]
        self.stop_bits = np.stack([_pack(s, self.W32) for s in self.stops])  # [B, W32]
        self.fast_forward = fast_forward
        self.block = block  # forced tokens stop at the end of the frontier's block (its next forward commits it)
        self.eos_bit = _pack([self.eos], self.W32)
        self.executor = llg.LLExecutor(threads)
        self.stats = Stats()
        self.final = np.zeros(len(self.m), bool)  # the matcher consumed the row's end (stop / close / dead)
        self.dead = np.zeros(len(self.m), bool)  # the grammar allows no token of this vocabulary at the frontier
        self.dead_at = np.full(len(self.m), -1, np.int64)  # ar_spec: a dead end after the row's drafts

    @property
    def batch(self) -> int:
        return len(self.m)

    def _eos_as_stops(self, b: int, mask: np.ndarray, accepting: bool = True) -> np.ndarray:
        """A matcher's packed mask with its EOS bit standing for row b's stop tokens: they are allowed
        exactly where the grammar allows EOS (and, with `accepting` False, nowhere)."""
        eos_ok = accepting and bool((mask[self.eos // 32] >> (self.eos % 32)) & 1)
        mask = mask & ~self.stop_bits[b] & ~self.eos_bit
        return mask | self.stop_bits[b] if eos_ok else mask

    def sample_mask(self, offset: np.ndarray, width: int, done: np.ndarray) -> np.ndarray:
        """[B, N, W32] int32: the mask of row b's planned slots [offset[b], offset[b] + N).

        The frontier slot gets the matcher's exact mask (its EOS bit stands for the row's stop
        tokens); every other slot is provisional and gets all tokens, stop tokens included
        (judged once the matcher reaches them). A frontier whose mask allows nothing (the
        grammar needs a token this vocabulary lacks) marks the row dead: `advance` ends it
        "length" at the frontier (constraint_ok False)."""
        t0 = time.perf_counter()
        B = self.batch
        out = np.full((B, width, self.W32), -1, np.int32)
        rows = [b for b in range(B) if self.m[b] is not None and not done[b] and not self.final[b]]
        front = [b for b in rows if offset[b] <= self.pos[b] < offset[b] + width]
        scratch = np.zeros((max(1, len(front)), self.W32), np.int32)
        if front:
            _llg().numpy.fill_next_token_bitmask_par(self.executor, [(self.m[b], i) for i, b in enumerate(front)],
                                                     scratch)
        for i, b in enumerate(front):
            mask = self._eos_as_stops(b, scratch[i], self.m[b].is_accepting())
            if not mask.any():
                self.dead[b] = True
            out[b, int(self.pos[b] - offset[b])] = mask
        self.stats.mask_s += time.perf_counter() - t0
        return out

    def advance(self, tokens: np.ndarray, revealed: np.ndarray, done: np.ndarray, finish: np.ndarray) -> Edits | None:
        """Consume what the step revealed; return the forced writes and re-masks (None: nothing to change)."""
        t0 = time.perf_counter()
        B = self.batch
        edits: list[list[tuple[int, int, int]]] = [[] for _ in range(B)]
        reopen, close = np.zeros(B, bool), np.zeros(B, np.int32)
        close_end = np.zeros(B, np.int32)
        for b in range(B):
            m = self.m[b]
            # rows the device ended "stop" / "length" may still hold provisional tokens to judge
            if m is None or self.final[b]:
                continue
            p, lim = int(self.pos[b]), int(self.limit[b])
            if self.dead[b]:  # no token can continue the output: end it here, "length", not accepted
                close[b], close_end[b], self.final[b] = CLOSE_LENGTH, p, True  # (over the INVALID it got)
                continue
            if done[b] and finish[b] not in (LENGTH, STOP):
                continue
            toks, rev = tokens[b].copy(), revealed[b].copy()
            stopped = back = False
            while True:
                while p < lim and rev[p]:
                    t = int(toks[p])
                    is_stop = t in self.stops[b]
                    # a stop token is the grammar's EOS: allowed where the matcher accepts
                    ok = m.is_accepting() and m.consume_token(self.eos) if is_stop else m.try_consume_tokens([t]) == 1
                    if not ok:
                        edits[b].append((p, 0, 2))
                        self.stats.backtracked += 1
                        reopen[b] = bool(done[b])
                        back = True
                        break
                    p += 1
                    if is_stop:
                        stopped = self.final[b] = True
                        break
                if stopped or back or p >= lim:
                    break
                if p == self.dead_at[b]:  # ar_spec: the drafts reached a dead end: the row ends here
                    close[b], close_end[b], self.final[b] = CLOSE_LENGTH, p, True
                    break
                if m.is_stopped() and (self.fast_forward or not self.stops[b]):
                    if self.stops[b]:
                        ff = [self.stops[b][0]]
                    else:
                        close[b], close_end[b], self.final[b] = CLOSE_STOP, p, True
                        break
                elif self.fast_forward:
                    ff = m.compute_ff_tokens()
                else:
                    ff = []
                if not ff:
                    break
                cap = lim if self.block is None else min(lim, (p // self.block + 1) * self.block)
                for i, t in enumerate(ff[:cap - p]):
                    if not rev[p + i] or int(toks[p + i]) != t:
                        edits[b].append((p + i, int(t), 1))
                        toks[p + i], rev[p + i] = t, True
                        self.stats.ff_tokens += 1
            self.pos[b] = p
        self.stats.advance_s += time.perf_counter() - t0
        E = max(len(e) for e in edits)
        if E == 0 and not close.any():
            return None
        E = common.bucket(E, 8)
        slots = np.full((B, E), -1, np.int32)
        toks = np.zeros((B, E), np.int32)
        kind = np.zeros((B, E), np.int32)
        for b, e in enumerate(edits):
            for j, (s, t, k) in enumerate(e):
                slots[b, j], toks[b, j], kind[b, j] = s, t, k
        return Edits(slots, toks, kind, reopen, close, close_end)

    def draft_masks(self, drafts: list) -> np.ndarray:
        """Verification masks for speculative drafts: [B, K + 1, W32], row b's mask i is the
        mask after its matcher consumed drafts[b][:i] (filled in parallel for every row and
        position by `fill_next_token_bitmask_par_with_draft_tokens`; the matchers are left
        unchanged: llguidance fills them from copies, since filling a mask that allows nothing
        puts a matcher in its error state). A draft token the grammar rejects leaves the masks
        after it all-zero, so verification cuts the draft there. Free rows get all-ones masks."""
        t0 = time.perf_counter()
        K = max((len(d) for d in drafts), default=0)
        out = np.full((self.batch, K + 1, self.W32), -1, np.int32)
        rows = [b for b in range(self.batch) if self.m[b] is not None]
        ms = {b: self.m[b].deep_copy() for b in rows}
        flat = np.zeros((max(1, len(rows)) * (K + 1), self.W32), np.int32)
        llnp = _llg().numpy
        with_drafts = [(ms[b], i * (K + 1), [int(t) for t in drafts[b]])
                       for i, b in enumerate(rows) if len(drafts[b])]
        if with_drafts:
            llnp.fill_next_token_bitmask_par_with_draft_tokens(self.executor, with_drafts, flat)
        without = [(ms[b], i * (K + 1)) for i, b in enumerate(rows) if not len(drafts[b])]
        if without:  # llguidance refuses an empty draft list: these rows need their current mask only
            llnp.fill_next_token_bitmask_par(self.executor, without, flat)
        for i, b in enumerate(rows):
            out[b] = flat[i * (K + 1):(i + 1) * (K + 1)]
        self.stats.mask_s += time.perf_counter() - t0
        return out

    def verify_masks(self, drafts: np.ndarray, n_draft: np.ndarray, done: np.ndarray) -> np.ndarray:
        """ar_spec's verification masks [B, K + 1, W32] for the slots [frontier, frontier + K]:
        `draft_masks` of each row's first n_draft[b] drafts (cut after a stop token, which the
        matcher sees as its EOS), EOS bits turned into the row's stop tokens as in `sample_mask`.
        Stop tokens are allowed at position i only where the grammar accepts after drafts[:i]
        (the matcher consumes the drafts, notes `is_accepting`, and rolls back). An all-zero
        position is left all-zero: at 0 the row is dead (see `sample_mask`); after drafts the
        grammar accepted it is a dead end there (`dead_at`: verification emits the drafts before
        it and no correction, `advance` ends the row "length" at it); after a draft the grammar
        rejects, verification never gets there (that draft has probability 0)."""
        B, K = drafts.shape
        cut, accepting = [], []
        self.dead_at[:] = -1
        for b in range(B):
            d = [int(t) for t in drafts[b, :int(n_draft[b])]]
            if self.m[b] is None or done[b] or self.final[b]:
                d = []
            for i, t in enumerate(d):
                if t in self.stops[b]:
                    d = d[:i] + [self.eos]
                    break
            cut.append(d)
            acc = []
            if self.m[b] is not None:
                m = self.m[b].deep_copy()  # (~1 us)
                acc.append(m.is_accepting())
                for t in d:
                    if m.try_consume_tokens([t]) != 1:
                        break
                    acc.append(m.is_accepting())
            accepting.append(acc)
        raw = self.draft_masks(cut)
        out = np.full((B, K + 1, self.W32), -1, np.int32)
        for b in range(B):
            if self.m[b] is None or done[b] or self.final[b]:
                continue
            acc = accepting[b]
            for i in range(raw.shape[1]):
                mask = self._eos_as_stops(b, raw[b, i], i < len(acc) and acc[i])
                if not mask.any():
                    if i == 0:
                        self.dead[b] = True
                    elif i < len(acc) and self.dead_at[b] < 0:
                        self.dead_at[b] = self.pos[b] + i
                out[b, i] = mask
        return out

    def accepted(self) -> list[bool | None]:
        return [None if m is None else bool(m.is_accepting() and not m.is_error()) for m in self.m]


# --------------------------------------------------------------------------- device edits
def apply_edits(state, slots, tokens, kind, reopen, close, close_end, *, fill: int, paradigm=None, ctx=None):
    """Write forced tokens (kind 1) and re-mask rejected ones (kind 2) at slots [B, E]; reopen /
    close rows; lower a row's committed cache length below its first edited slot; then the
    usual stop rule (a forced stop token or the last slot ends the row). close [B]: CLOSE_STOP
    ends a running row "stop" at close_end, CLOSE_LENGTH ends a row "length" there (dead end).
    A paradigm with more bookkeeping than the canvas (multi_block's block states and EOS fill)
    updates it in its `rewind(ctx, state, before, remasked, written)` hook."""
    S = state.slots
    before = state
    hit = slot_index(state)[:, None, :] == slots[:, :, None]  # [B, E, S]
    wr = jnp.any(hit & (kind == 1)[:, :, None], axis=1)
    rm = jnp.any(hit & (kind == 2)[:, :, None], axis=1)
    tok = jnp.sum(jnp.where(hit & (kind == 1)[:, :, None], tokens[:, :, None], 0), axis=1)
    stamp = jnp.maximum(state.steps, 1)[:, None]
    first = jnp.min(jnp.where(slots >= 0, slots, S), axis=1)
    state = state.replace(
        tokens=jnp.where(wr, tok, jnp.where(rm, fill, state.tokens)).astype(jnp.int32),
        revealed=(state.revealed | wr) & ~rm,
        step_map=jnp.where(wr, stamp, jnp.where(rm, 0, state.step_map)),
        logprobs=jnp.where(wr | rm, 0.0, state.logprobs),
        done=state.done & ~reopen,
        finish=jnp.where(reopen, RUNNING, state.finish),
        end=jnp.where(reopen, 0, state.end),
    )
    if state.cache is not None:
        state = state.replace(cache=state.cache.commit(jnp.minimum(state.cache.length, first)))
    state = paradigm.rewind(ctx, state, before, rm, wr)
    state = common.close_rows(state, (close == CLOSE_STOP) & ~state.done, STOP, close_end)
    dead = close == CLOSE_LENGTH  # overrides the INVALID an all-zero frontier mask may have left
    state = state.replace(done=state.done | dead, finish=jnp.where(dead, LENGTH, state.finish),
                          end=jnp.where(dead, close_end, state.end))
    return common.finish_rows(state)


@functools.lru_cache(maxsize=None)
def _compiled(options: tuple) -> dict:
    opts = dict(options) or None
    def catch_up(params, state, plan, *, width, paradigm, ctx):
        return paradigm.catch_up_forward(params, ctx, state, plan, width)

    return dict(apply_edits=jax.jit(auto_axes(apply_edits), static_argnames=("fill", "paradigm", "ctx"),
                                    donate_argnames=("state",),
                                    compiler_options=opts),
                catch_up=jax.jit(auto_axes(catch_up), static_argnames=("width", "paradigm", "ctx"),
                                 donate_argnames=("state",),
                                 compiler_options=opts))


# --------------------------------------------------------------------------- generate
def _edit(state, ctl: Controller, fill: int, paradigm, ctx):
    host = jax.device_get({"tokens": state.tokens, "revealed": state.revealed, "done": state.done,
                           "finish": state.finish})
    e = ctl.advance(host["tokens"], host["revealed"], host["done"], host["finish"])
    if e is not None:
        state = _compiled(loop.current_options())["apply_edits"](state, *(to_device(a) for a in e), fill=fill,
                                                           paradigm=paradigm, ctx=ctx)
        host["done"] = np.asarray(jax.device_get(state.done))
    return state, host["done"]


def generate_constrained(model, prompts, decoding, sampling, constraints, *, apply_chat_template=False,
             fast_forward: bool = True, stats: Stats | None = None):
    """Constrained generation (one Constraint | None per prompt): see the module docstring.

    fast_forward=False samples forced tokens one step each (same tokens under greedy
    decoding, more forwards). stats: a `Stats` to fill with host timings.
    """
    from jdllm.compile_progress import watch  # noqa: PLC0415 (lines for the CLI; silent otherwise)

    cfg = model.config
    lltok = ll_tokenizer(model)
    matchers = [None if c is None else matcher(c, lltok) for c in constraints]
    prep = api.prepare(model, prompts, decoding, sampling, apply_chat_template=apply_chat_template)
    state = prep.state
    B = state.batch
    matchers += [None] * (B - len(matchers))
    host0 = jax.device_get({"gen_start": state.gen_start, "limit": state.limit, "stop_ids": state.stop_ids})
    paradigm = prep.paradigm
    ctl = Controller(lltok, matchers, cfg.vocab_size, host0["gen_start"], host0["limit"], host0["stop_ids"],
                     fast_forward=fast_forward and paradigm.fast_forward, block=paradigm.constraint_block())
    if stats is not None:
        ctl.stats = stats
    fill = common.fill_token(cfg)
    steps = loop.compiled_steps()
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)
    params = api.params_for(model, prep.paradigm)
    t_start = time.perf_counter()

    if paradigm.first_step_in_prefill:  # the prefill also samples the first slots: mask them
        state, p = steps["plan"](state, **kw)
        done = np.asarray(jax.device_get(state.done))
        mask = paradigm.constraint_masks(ctl, state, p, done)
        with watch(steps["prefill"], f"{paradigm.name} prefill", state, (prep.paradigm, prep.ctx)):
            state = steps["prefill"](params, state, to_device(mask), **kw)
        state, done = _edit(state, ctl, fill, prep.paradigm, prep.ctx)
    else:
        with watch(steps["prefill"], f"{paradigm.name} prefill", state, (prep.paradigm, prep.ctx)):
            state = steps["prefill"](params, state, None, **kw)
        done = np.asarray(jax.device_get(state.done))
    bound = 4 * prep.paradigm.max_iterations(state)
    it = 0
    while not done.all() and it < bound:
        state, p = steps["plan"](state, **kw)
        width = paradigm.pending_width(state, np.asarray(jax.device_get(p.offset)), done)
        if width > 1:  # forced tokens enter the cache in the forward that predicts the next slot
            state, logits = _compiled(loop.current_options())["catch_up"](params, state, p, width=common.bucket(width, 8),
                                                                   **kw)
        else:
            with watch(steps["forward"], f"{paradigm.name} forward", state, (prep.paradigm, prep.ctx)):
                state, logits = steps["forward"](params, state, p, **kw)
        mask = paradigm.constraint_masks(ctl, state, p, done)  # on the host while the forward runs
        state = steps["reveal"](state, p, logits, to_device(mask), **kw)
        state, done = _edit(state, ctl, fill, prep.paradigm, prep.ctx)
        ctl.stats.steps += 1
        it += 1
    state = steps["finalize"](state)
    jax.block_until_ready(state.tokens)
    ctl.stats.total_s += time.perf_counter() - t_start
    ok = ctl.accepted()
    return [dataclasses.replace(o, constraint_ok=ok[b]) for b, o in enumerate(api.outputs(prep, state))]


__all__ = ["generate_constrained", "Controller", "Edits", "Stats", "ll_tokenizer", "matcher", "grammar", "apply_edits"]
