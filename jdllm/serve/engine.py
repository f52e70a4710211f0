"""Continuous-batching engine: a fixed pool of rows on the device, requests joining and leaving
while the others decode, newly final tokens streamed out.

One scheduling round (`Engine.step_round`, run by the engine thread or driven by a test):

1. rows whose client went away are closed (ABORT) and freed;
2. waiting requests are admitted into free rows (FIFO): the paradigm's lifecycle
   (`jdllm.serve.lifecycle`) builds the row as `jdllm.generate` would for that prompt alone,
   prefills it alone and merges it into the running batch (one jitted call, the pool donated);
3. the compiled `loop.step_n` runs up to `steps_per_round` steps for the whole pool;
4. the host reads the canvas back and sends each request the tokens that became final:
   for AR every new token, for diffusion paradigms the left-contiguous revealed prefix
   (cut at a revealed stop token), plus, on request, a per-step event naming every slot
   revealed and its `step_map`; finished rows send their `Output` and are freed.

No recompiles as requests come and go (ar, block_diffusion, ar_spec: join at any round; ar_spec's
draft KV cache and counters ride in the row's `extra`): the pool's shape
(rows, canvas, stop-id width) is fixed at construction, the row to merge into and the step count
are traced values, and a joining row's prefill compiles once per prompt-length bucket (`TRACES`
counts every trace). masked_diffusion / multi_block join only when the batch drains (see
`jdllm.serve.lifecycle.DrainJoin`): one compile per batch shape bucket.

Constraints (`Engine(constraint_states=Q)`, `submit(..., constraint=)`): every row of the pool
carries an on-device token-DFA table (`DecodeState.constraint`, the DFA backend) padded to fixed
buckets; a free row's table allows everything, so constrained and free requests share one
compiled step. A finished row still takes part in the batched forward until an admission
reuses it (it reveals nothing).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import compile_cache, compile_progress, errors, inputs
from jdllm.api import Output, default_paradigm, params_for, row_output, trace_arrays
from jdllm.decode import common, loop
from jdllm.loading import check_token_ids
from jdllm.sampling import Sampling
from jdllm.serve.lifecycle import DrainJoin, lifecycle_for, merge_row
from jdllm.state import ABORT, DecodeState

# traces per jitted piece ("admit", "round", "close"): a test checks requests coming and going
# with the same prompt buckets add none
TRACES: collections.Counter = collections.Counter()

STOP_WIDTH = 8  # stop ids a request may carry (the pool's stop_ids width)


# --------------------------------------------------------------------------- jitted pieces
def _admit(params, pool: DecodeState, fresh: DecodeState, row, *, paradigm, ctx):
    """Prefill `fresh` (one row, the pool's canvas) with the row's own context and merge it into `row`.
    On a mesh the lone row is left to XLA (one row does not split over `data`); the merged pool is
    pinned to its shardings."""
    TRACES["admit"] += 1
    new = loop.prefill(params, fresh, paradigm=paradigm, ctx=dataclasses.replace(ctx, placement=None))
    return common.constrain(ctx, merge_row(pool, new, row))


def _round(params, pool: DecodeState, n, *, paradigm, ctx):
    """Up to n steps for the whole pool (the iteration guard counts per round: the pool lives on)."""
    TRACES["round"] += 1
    pool = pool.replace(iteration=jnp.zeros((), jnp.int32))
    return loop.step_n(params, pool, n, paradigm=paradigm, ctx=ctx)


def _close(pool: DecodeState, rows):
    """Rows [B] (bool) still running finish as ABORT (client gone)."""
    TRACES["close"] += 1
    return common.close_rows(pool, rows & ~pool.done, ABORT)


def _idle_extra(params, pool: DecodeState, paradigm, ctx) -> dict:
    """Zeros shaped like the `extra` the paradigm's prefill sets (ar_spec: counters, draft cache),
    so a row's merge finds the same structure in the pool (traced only, nothing runs)."""
    ctx1 = dataclasses.replace(ctx, prefill_len=1)
    shapes = jax.eval_shape(lambda p, s: paradigm.prefill(p, ctx1, s).extra, params, pool)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


@functools.lru_cache(maxsize=None)
def _compiled(compiler_options: tuple = ()):
    opts = dict(compiler_options) or None
    static = ("paradigm", "ctx")
    return dict(admit=jax.jit(_admit, static_argnames=static, donate_argnames=("pool",), compiler_options=opts),
                round=jax.jit(_round, static_argnames=static, donate_argnames=("pool",), compiler_options=opts),
                close=jax.jit(_close, donate_argnames=("pool",), compiler_options=opts),
                buffers=jax.jit(common.with_buffers, static_argnums=(1,), compiler_options=opts),
                prefill=loop.compiled_steps(compiler_options)["prefill"])


# --------------------------------------------------------------------------- requests and events
@dataclasses.dataclass
class Event:
    """What a request hears from the engine.

    kind "tokens": `token_ids` became final (with their `step_map` and `logprobs`; `nfe`: the row's
    forwards so far, prefill included, as of the round that made them final);
    kind "steps" (only with return_step_map): `positions` (0-based in the generation) revealed
    since the last event and their `steps` (step_map values) and `token_ids`, in any order;
    kind "done": the request finished, `output` holds the whole `jdllm.Output`;
    kind "error": the engine failed (`message`).
    """

    kind: str
    token_ids: list[int] = dataclasses.field(default_factory=list)
    step_map: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    steps: list[int] = dataclasses.field(default_factory=list)
    nfe: int | None = None
    output: Output | None = None
    message: str = ""


@dataclasses.dataclass
class Request:
    """One request's host-side record (the engine's; read `status`, `output`)."""

    id: int
    prompt_ids: list[int]
    sampling: Sampling
    stop_ids: tuple[int, ...]
    return_step_map: bool = False
    on_event: Callable[[Event], Any] | None = None
    status: str = "waiting"  # waiting -> running -> done | aborted
    row: int | None = None
    sent: int = 0  # generated tokens already streamed
    seen: np.ndarray | None = None  # revealed flags of the generation slots at the last event
    output: Output | None = None
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    events: list[Event] | None = None  # kept when on_event is None (offline use, tests)
    dfa: Any = None  # the constraint's token DFA (host tables), None = free

    def emit(self, ev: Event) -> None:
        if self.on_event is not None:
            self.on_event(ev)
        else:
            self.events.append(ev)


class Engine:
    """A fixed pool of `max_batch` rows decoding with one paradigm; requests join and leave freely.

    model: a loaded `jdllm.Model`. decoding: a paradigm config (default: the model's default
    paradigm); served paradigms: see `jdllm.serve.lifecycle.LIFECYCLES`. max_prompt_tokens /
    max_new_tokens: the largest prompt / generation a request may ask for (they size the pool's
    canvas; default: the model's context, at most 512 and 256). max_queue: waiting requests
    beyond which `submit` raises `errors.QueueFullError`. steps_per_round: decoding steps between
    two host visits (admissions, aborts and streaming happen between rounds).
    constraint_states / constraint_classes: > 0 lets requests carry a constraint (`submit(...,
    constraint=)`), enforced by the on-device DFA backend (`jdllm.constraints.dfa`): every row
    holds a token-DFA table padded to these buckets (rounded up to powers of two), so constrained
    and free requests share one compiled step; each step then also runs the constraint's
    reachability pass for every row (a cost the default, 0, does not pay).

    mesh / rules: serve on a device mesh (`jdllm.sharding.make_mesh`): the model's params are placed
    on it under `rules` (as `jdllm.load(path, mesh=, rules=)` does; a model loaded that way needs
    neither), the pool's rows split over `data` (max_batch must be a multiple of its size), heads /
    MLP over `model`, and every round runs under those shardings.

    Drive it with `start()` (a background thread) or call `step_round()` yourself.
    """

    def __init__(self, model, decoding=None, *, max_batch: int = 8, max_prompt_tokens: int | None = None,
                 max_new_tokens: int | None = None, max_queue: int = 256, steps_per_round: int = 4,
                 compiler_options: tuple | None = None, constraint_states: int = 0, constraint_classes: int = 64,
                 mesh=None, rules=None):
        compile_cache.enable()
        if mesh is not None:
            model = model.shard(mesh, rules)
        elif rules is not None:
            raise errors.ShardingError("rules= needs a mesh=: pass Engine(model, mesh=mesh, rules=rules)")
        cfg = model.config
        decoding = default_paradigm(cfg) if decoding is None else decoding
        if not hasattr(decoding, "layout"):
            raise errors.DecodingConfigError(f"decoding={decoding!r} is not a paradigm config")
        inputs.validate_paradigm(decoding, cfg)
        self.lifecycle = lifecycle_for(decoding)
        for name, v, lo in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                            ("steps_per_round", steps_per_round, 1), ("constraint_states", constraint_states, 0),
                            ("constraint_classes", constraint_classes, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise errors.DecodingConfigError(f"{name}={v!r} must be an integer >= {lo}")
        placement = model.placement
        if placement is not None and max_batch % placement.batch_multiple():
            raise errors.ShardingError(
                f"max_batch={max_batch} rows do not split over the mesh's batch axis {placement.axis('batch')!r} "
                f"of size {placement.batch_multiple()}; choose a multiple of it")
        ctx_len = cfg.max_position_embeddings
        self.max_prompt_tokens = int(max_prompt_tokens or min(512, ctx_len - 1))
        self.max_new_tokens = int(max_new_tokens or min(256, ctx_len - 1))
        for name, v in (("max_prompt_tokens", self.max_prompt_tokens), ("max_new_tokens", self.max_new_tokens)):
            if not 1 <= v < ctx_len:
                raise errors.DecodingConfigError(
                    f"{name}={v} must be in [1, {ctx_len}) (the model's context max_position_embeddings)")
        self.model, self.paradigm, self.cfg = model, decoding, cfg
        self.max_batch, self.max_queue, self.steps_per_round = max_batch, max_queue, steps_per_round
        self.fwd_cfg = decoding.attention_config(cfg) if hasattr(decoding, "attention_config") else cfg
        self.ctx = common.DecodeCtx(model=self.fwd_cfg, attn_impl=model.forward_impl, prefill_len=0,
                                    placement=placement)
        self._ctx = self.ctx  # the context rounds run with (a drained batch brings its own)
        self.drain = isinstance(self.lifecycle, DrainJoin)
        self.slots = self.lifecycle.pool_slots(decoding, cfg, self.max_prompt_tokens, self.max_new_tokens)
        # None: those of an enclosing `jdllm.compiler_options` block
        self._fns = _compiled(loop.current_options() if compiler_options is None else tuple(compiler_options))
        R = max_batch
        lay = common.Layout(start=np.zeros(R, np.int32), gen_start=np.ones(R, np.int32), slots=self.slots,
                            prefill_len=0)
        idle = common.new_state(cfg, [np.zeros(1, np.int32)] * R, lay, 1, stop_ids=[(-1,) * STOP_WIDTH] * R,
                                active=np.zeros(R, bool))
        # on-device DFA constraints (jdllm.constraints.dfa): every row carries a table padded to
        # fixed buckets, so a constrained request joins without a recompile; free rows allow all
        self.constraint_states = common.bucket(constraint_states, 8) if constraint_states else 0
        self.constraint_classes = common.bucket(constraint_classes, 8)
        if self.constraint_states:
            idle = idle.replace(constraint=self._tables([None] * R, self.slots))
        self.params = params_for(model, decoding)  # ar_spec: the draft's parameters ride along
        pool = self._fns["buffers"](self.params, cfg, idle)
        pool = pool.replace(extra=_idle_extra(self.params, pool, decoding, self.ctx))
        self._pool = pool if placement is None else placement.place_state(pool)
        self._free = list(range(R))
        self._rows: dict[int, Request] = {}  # row -> running request
        self._waiting: collections.deque[Request] = collections.deque()
        self._aborts: set[int] = set()
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.rounds = 0
        self.aborted = 0  # requests aborted (client gone) so far

    # ----------------------------------------------------------------- public API
    def check(self, prompt_ids, sampling: Sampling) -> tuple[list[int], tuple[int, ...]]:
        """Validate one request (raises `jdllm.errors.*` naming the bad value); returns its ids and stop ids."""
        inputs.check_sampling(sampling)
        ids = [int(t) for t in inputs.id_row(prompt_ids, "prompt")]
        if not ids:
            raise errors.InputError("the prompt is empty; give at least one token")
        check_token_ids(np.asarray(ids), self.cfg)
        inputs.check_prompts([ids], self.cfg, [sampling])
        if len(ids) > self.max_prompt_tokens:
            raise errors.SequenceTooLongError(
                f"the prompt has {len(ids)} tokens, more than this engine's max_prompt_tokens="
                f"{self.max_prompt_tokens}; shorten it")
        if sampling.max_new_tokens > self.max_new_tokens:
            raise errors.SequenceTooLongError(
                f"max_new_tokens={sampling.max_new_tokens} is more than this engine's max_new_tokens="
                f"{self.max_new_tokens}; ask for fewer")
        total = len(ids) + sampling.max_new_tokens
        if total > self.cfg.max_position_embeddings:
            raise errors.SequenceTooLongError(
                f"the prompt has {len(ids)} tokens and max_new_tokens={sampling.max_new_tokens}: {total} > the "
                f"model's context max_position_embeddings={self.cfg.max_position_embeddings}; shorten the "
                "prompt or lower max_new_tokens")
        stops = tuple(self.cfg.eos_token_ids if sampling.stop_token_ids is None else sampling.stop_token_ids)
        if len(stops) > STOP_WIDTH:
            raise errors.InputError(f"{len(stops)} stop token ids; a request may carry at most {STOP_WIDTH}")
        return ids, stops

    def _tables(self, dfas: list, slots: int):
        from jdllm.constraints.dfa_device import stack  # noqa: PLC0415

        return stack(dfas, self.cfg.vocab_size, self.constraint_states, self.constraint_classes, slots=slots)

    def compile_constraint(self, constraint, stops: tuple[int, ...], budget: int):
        """A `jdllm.constraints.Constraint` -> its token DFA (the on-device "dfa" backend, whatever
        backend the constraint names), checked against this engine's table buckets and the budget."""
        if constraint is None:
            return None
        from jdllm import constraints as C  # noqa: PLC0415
        from jdllm.constraints import dfa  # noqa: PLC0415

        if not isinstance(constraint, C.Constraint):
            raise errors.ArgumentTypeError(f"constraint must be a jdllm.constraints.Constraint, got "
                                           f"{type(constraint).__name__}")
        if not self.constraint_states:
            raise errors.ConstraintError("this engine holds no constraint tables; build it with "
                                         "constraint_states=Q (`jdllm serve --constraint-states Q`)")
        if constraint.backend != "dfa":
            constraint = C.Constraint(constraint.kind, constraint.source, "dfa")
        d = dfa.compile(self.model, constraint, stops)
        if d.num_states > self.constraint_states or d.num_classes > self.constraint_classes:
            raise errors.ConstraintError(
                f"the constraint compiles to {d.num_states} DFA states and {d.num_classes} token classes; this "
                f"engine holds at most {self.constraint_states} states and {self.constraint_classes} classes "
                "(constraint_states / constraint_classes); simplify it or raise them")
        dfa.check_budget(d, budget, raise_what="max_tokens")
        return d

    def submit(self, prompt_ids, sampling: Sampling | None = None, *, return_step_map: bool = False,
               on_event: Callable[[Event], Any] | None = None, constraint=None) -> Request:
        """Queue one request (token ids). Events go to `on_event` (called on the engine's thread), or,
        without one, collect in `request.events`. `constraint`: a `jdllm.constraints` constraint
        (regex / json_schema / choice) enforced on the device (the engine needs `constraint_states`).
        Raises `errors.QueueFullError` when `max_queue` requests are already waiting,
        `errors.EngineStoppedError` after `stop()`, `errors.ConstraintError` for a constraint that
        does not fit."""
        sampling = Sampling() if sampling is None else sampling
        ids, stops = self.check(prompt_ids, sampling)
        dfa = self.compile_constraint(constraint, stops, sampling.max_new_tokens)
        with self._cv:
            if self._stopping:
                raise errors.EngineStoppedError("the engine is shutting down; no new requests are accepted")
            if len(self._waiting) >= self.max_queue:
                raise errors.QueueFullError(
                    f"{len(self._waiting)} requests are already waiting (max_queue={self.max_queue}); "
                    "retry later")
            req = Request(id=next(self._ids), prompt_ids=ids, sampling=sampling, stop_ids=stops,
                          return_step_map=bool(return_step_map), on_event=on_event, submitted=time.perf_counter(),
                          events=[] if on_event is None else None, dfa=dfa)
            self._requests[req.id] = req
            self._waiting.append(req)
            self._cv.notify_all()
        return req

    def abort(self, request_id: int) -> None:
        """The client went away: the request's row is closed and freed at the next round (no event)."""
        with self._cv:
            if request_id in self._requests:
                self._aborts.add(request_id)
                self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return dict(rows=self.max_batch, rows_busy=len(self._rows), rows_free=len(self._free),
                        waiting=len(self._waiting), tracked=len(self._requests), rounds=self.rounds,
                        aborted=self.aborted)

    def idle(self) -> bool:
        with self._cv:
            return not self._rows and not self._waiting and not self._aborts

    def run_until_idle(self) -> None:
        """Run rounds on this thread until nothing is waiting or running (offline use, tests)."""
        while not self.idle():
            self.step_round()

    def generate(self, prompts, sampling: Sampling | list[Sampling] | None = None) -> list[Output]:
        """Offline: submit token-id prompts together and return one Output each (this thread)."""
        settings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        reqs = [self.submit(p, s) for p, s in zip(prompts, settings)]
        self.run_until_idle()
        return [r.output for r in reqs]

    def start(self) -> "Engine":
        """Run scheduling rounds on a background thread until `stop()`."""
        with self._cv:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._serve, name="jdllm-engine", daemon=True)
                self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread; requests still waiting or running get an "error" event."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            t, self._thread = self._thread, None
        if t is not None:
            t.join()
        with self._cv:
            left = list(self._requests.values())
            self._requests.clear()
            self._waiting.clear()
        for req in left:
            req.emit(Event("error", message="the engine stopped before the request finished"))

    # ----------------------------------------------------------------- the scheduler
    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._rows and not self._waiting and not self._aborts:
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step_round()
            except Exception as e:  # noqa: BLE001 (a failed round must not hang every client)
                traceback.print_exc()
                self._fail_all(f"engine error: {type(e).__name__}: {e}")

    def _fail_all(self, message: str) -> None:
        with self._cv:
            reqs = list(self._requests.values())
            self._requests.clear()
            self._waiting.clear()
            self._rows.clear()
            self._free = list(range(self.max_batch))
        kill = jnp.ones((self._pool.batch,), bool)
        self._pool = self._fns["close"](self._pool, kill)
        for r in reqs:
            r.status = "aborted"
            r.emit(Event("error", message=message))

    def step_round(self) -> None:
        """One scheduling round: aborts, admissions, `steps_per_round` steps, streaming."""
        with self._cv:
            aborts, self._aborts = self._aborts, set()
            kill = []
            for rid in aborts:
                req = self._requests.pop(rid, None)
                if req is None:
                    continue
                if req.status == "waiting":
                    self._waiting.remove(req)
                elif req.status == "running":
                    kill.append(req.row)
                    del self._rows[req.row]
                    self._free.append(req.row)
                req.status = "aborted"
                self.aborted += 1
            admit = []
            if self.drain:  # a new batch only once the previous one has drained
                if not self._rows:
                    admit = self.lifecycle.take(list(self._waiting), self.max_batch)
                    for i, req in enumerate(admit):
                        self._waiting.remove(req)
                        req.row, req.status = i, "running"
                        self._rows[i] = req
                    self._free = list(range(len(admit), self.max_batch)) if admit else self._free
            else:
                while self._free and self._waiting:
                    req = self._waiting.popleft()
                    req.row, req.status = self._free.pop(0), "running"
                    self._rows[req.row] = req
                    admit.append(req)
        if kill:
            mask = np.zeros(self._pool.batch, bool)
            mask[kill] = True
            self._pool = self._fns["close"](self._pool, jnp.asarray(mask))
        if self.drain and admit:
            state, self._ctx = self.lifecycle.batch(self.model, self.paradigm, admit, max_rows=self.max_batch)
            if self.constraint_states:
                dfas = [r.dfa for r in admit] + [None] * (state.batch - len(admit))
                state = state.replace(constraint=self._tables(dfas, state.slots))
            with compile_progress.watch(self._fns["prefill"], f"{self.paradigm.name} prefill", state,
                                        (self.paradigm, self._ctx)):
                self._pool = self._fns["prefill"](self.params, state, paradigm=self.paradigm, ctx=self._ctx)
        for req in admit if not self.drain else ():
            self._admit_one(req)
        if not self._rows:
            return
        with compile_progress.watch(self._fns["round"], f"{self.paradigm.name} step", self._pool,
                                    (self.paradigm, self._ctx)):
            self._pool = self._fns["round"](self.params, self._pool, jnp.int32(self.steps_per_round),
                                            paradigm=self.paradigm, ctx=self._ctx)
        self.rounds += 1
        self._stream()

    def _admit_one(self, req: Request) -> None:
        s = req.sampling
        lay = self.lifecycle.row_layout(self.paradigm, self.cfg, len(req.prompt_ids), s.max_new_tokens, self.slots)
        stops = req.stop_ids + (-1,) * (STOP_WIDTH - len(req.stop_ids))
        fresh = common.new_state(self.cfg, [np.asarray(req.prompt_ids, np.int32)], lay, s.max_new_tokens,
                                 settings=[s], stop_ids=[stops], seed=s.seed, stream=0)
        if self.constraint_states:
            fresh = fresh.replace(constraint=self._tables([req.dfa], self.slots))
        ctx = dataclasses.replace(self.ctx, prefill_len=int(lay.prefill_len))
        key = (self.paradigm, ctx, self._pool.tokens.shape)
        with compile_progress.watch(self._fns["admit"], f"{self.paradigm.name} prefill", fresh, key):
            self._pool = self._fns["admit"](self.params, self._pool, fresh, jnp.int32(req.row),
                                            paradigm=self.paradigm, ctx=ctx)

    def _stream(self) -> None:
        """Send every running request what became final this round; finish and free done rows."""
        fields = {k: getattr(self._pool, k) for k in ("tokens", "revealed", "step_map", "logprobs", "gen_start",
                                                      "limit", "end", "done", "finish", "nfe")}
        fields["extra"] = trace_arrays(self.paradigm, self._pool.extra)  # what Output.trace reads, or None
        host = jax.device_get(fields)
        now = time.perf_counter()
        finished = []
        with self._cv:
            running = list(self._rows.items())
        for r, req in running:
            g0, lim = int(host["gen_start"][r]), int(host["limit"][r])
            done = bool(host["done"][r])
            if done:
                end = max(int(host["end"][r]), g0)
            else:
                rev = host["revealed"][r, g0:lim]
                hole = int(np.argmin(rev)) if not rev.all() else lim - g0
                prefix = host["tokens"][r, g0:g0 + hole]
                stop = np.flatnonzero(np.isin(prefix, req.stop_ids)) if req.stop_ids else np.empty(0)
                end = g0 + (int(stop[0]) + 1 if stop.size else hole)
            if req.return_step_map:
                seen = host["revealed"][r, g0:lim] & (np.arange(lim - g0) < (end - g0 if done else lim - g0))
                prev = np.zeros_like(seen) if req.seen is None else req.seen
                new = np.flatnonzero(seen & ~prev)
                req.seen = seen
                if new.size:
                    req.emit(Event("steps", positions=new.tolist(),
                                   steps=host["step_map"][r, g0 + new].tolist(),
                                   token_ids=host["tokens"][r, g0 + new].tolist()))
            if end - g0 > req.sent:
                sl = slice(g0 + req.sent, end)
                if req.first_token is None:
                    req.first_token = now
                req.emit(Event("tokens", token_ids=host["tokens"][r, sl].tolist(),
                               step_map=host["step_map"][r, sl].tolist(),
                               logprobs=host["logprobs"][r, sl].tolist(), nfe=int(host["nfe"][r])))
                req.sent = end - g0
            if done:
                trace = None if host["extra"] is None else self.paradigm.output_trace(host["extra"], r)
                req.output = row_output(host, r, req.prompt_ids, self.model.tokenizer, trace)
                if req.dfa is not None:
                    from jdllm.constraints.dfa import output_ok  # noqa: PLC0415

                    req.output = dataclasses.replace(req.output, constraint_ok=output_ok(req.dfa, req.output))
                req.finished, req.status = now, "done"
                finished.append((r, req))
        with self._cv:
            for r, req in finished:
                if self._rows.get(r) is req:
                    del self._rows[r]
                    self._free.append(r)
                self._requests.pop(req.id, None)
        for _, req in finished:
            req.emit(Event("done", output=req.output))


__all__ = ["Engine", "Event", "Request", "TRACES"]
