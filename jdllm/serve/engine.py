"""Continuous-batching engine: a fixed pool of rows on the device, requests joining and leaving
while the others decode, newly final tokens streamed out.

A scheduling round (`Engine.step_round`, run by the engine thread or driven by a test) is three
parts, each its own module:

1. the scheduler (`jdllm.serve.scheduler`, host data only) decides it: requests whose client
   went away are dropped, waiting requests are admitted into free rows (at any round, or as a
   new batch once the pool has drained: `Paradigm.joins_running_batch`);
2. the runner (`jdllm.serve.runner`) carries it out on the device: aborted rows closed, joining
   rows prefilled (together when they arrive together) and merged into the pool (or a drained
   batch prepared and prefilled),
   then up to `steps_per_round` compiled steps (`loop.step_n`) for the whole pool;
3. the output processor (`jdllm.serve.output`) turns the host copy of the pool into each
   request's events: the tokens that became final, per-step events on request, and the `Output`
   of a finished row, whose row the scheduler then frees.

Parts 1-2 of a round are dispatched before part 3 of the round before it runs: the device works
on round k+1 while the host copies and streams round k (a round's host view is copied out of the
pool on the device, so donating the pool to the next round leaves it intact). A row that
finishes in round k is freed when round k is streamed, so it takes a new request at round k+2.

No recompiles as requests come and go: the pool's shape (rows, canvas, stop-id width) is fixed at
construction, the row to merge into and the step count are traced values, and a joining row's
prefill compiles once per prompt-length bucket (a drained batch: once per batch shape bucket).

Constraints (`Engine(constraint_states=Q)`, `submit(..., constraint=)`): every row carries an
on-device token-DFA table (the DFA backend, `jdllm.constraints.dfa`) padded to fixed buckets, so
constrained and free requests share one compiled step.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np

from jdllm import compile_cache, constraints as C, errors, inputs
from jdllm.api import Output, resolve_paradigm, to_host
from jdllm.constraints import dfa
from jdllm.decode import common, loop
from jdllm.loading import check_token_ids
from jdllm.sampling import Sampling
from jdllm.serve.output import OutputProcessor
from jdllm.serve.request import Event, Request
from jdllm.serve.runner import STOP_WIDTH, Runner
from jdllm.serve.scheduler import Scheduler


class Engine:
    """A fixed pool of `max_batch` rows decoding with one paradigm; requests join and leave freely.

    model: a loaded `jdllm.Model`. decoding: a paradigm config (any `jdllm.decode.protocol.Paradigm`;
    default: the model's default paradigm). max_prompt_tokens / max_new_tokens: the largest
    prompt / generation a request may ask for (they size the pool's canvas; default: the model's
    context, at most 512 and 256). max_queue: requests waiting for a row (beyond those the free
    rows take at the next round) past which `submit` raises `errors.QueueFullError`; the engine
    holds at most `max_batch + max_queue` requests (`capacity`). steps_per_round: decoding steps
    between two host visits (admissions, aborts and streaming happen between rounds).
    constraint_states / constraint_classes: > 0 lets requests carry a constraint (`submit(...,
    constraint=)`), enforced by the on-device DFA backend (`jdllm.constraints.dfa`): every row
    holds a token-DFA table padded to these buckets (rounded up to powers of two), so constrained
    and free requests share one compiled step; each step then also runs the constraint's
    reachability pass for every row (a cost the default, 0, does not pay).

    mesh / rules: serve on a device mesh (`jdllm.sharding.make_mesh` or any `jax.sharding.Mesh` the
    rules cover, see `jdllm.sharding`): the model's params are placed
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
        decoding = resolve_paradigm(decoding, cfg)
        self.model, self.paradigm, self.cfg = model, decoding, cfg
        self._check_settings(max_batch, max_queue, steps_per_round, constraint_states, constraint_classes)
        ctx_len = cfg.max_position_embeddings
        self.max_prompt_tokens = int(max_prompt_tokens or min(512, ctx_len - 1))
        self.max_new_tokens = int(max_new_tokens or min(256, ctx_len - 1))
        for name, v in (("max_prompt_tokens", self.max_prompt_tokens), ("max_new_tokens", self.max_new_tokens)):
            if not 1 <= v < ctx_len:
                raise errors.DecodingConfigError(
                    f"{name}={v} must be in [1, {ctx_len}) (the model's context max_position_embeddings)")
        self.max_batch, self.max_queue, self.steps_per_round = max_batch, max_queue, steps_per_round
        pool = decoding.pool_layout(cfg, self.max_prompt_tokens, self.max_new_tokens)
        self.slots = int(pool.slots)
        self.constraint_states = common.bucket(constraint_states, 8) if constraint_states else 0
        self.constraint_classes = common.bucket(constraint_classes, 8)
        options = loop.current_options() if compiler_options is None else tuple(compiler_options)
        self.scheduler = Scheduler(decoding, max_batch)
        self.runner = Runner(model, decoding, rows=max_batch, slots=self.slots, prefill_len=int(pool.prefill_len),
                             constraint_states=self.constraint_states, constraint_classes=self.constraint_classes,
                             compiler_options=options)
        self.output_processor = OutputProcessor(decoding, model.tokenizer)
        self._ids = itertools.count()
        self._cv = threading.Condition()  # guards the scheduler, _stopping and _thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending = None  # (host view, rows) of the round dispatched last, not yet streamed
        self.rounds = 0
        self.aborted = 0  # requests aborted (client gone) so far

    def _check_settings(self, max_batch, max_queue, steps_per_round, constraint_states, constraint_classes):
        for name, v, lo in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                            ("steps_per_round", steps_per_round, 1), ("constraint_states", constraint_states, 0),
                            ("constraint_classes", constraint_classes, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise errors.DecodingConfigError(f"{name}={v!r} must be an integer >= {lo}")
        placement = self.model.placement
        if placement is not None and max_batch % placement.batch_multiple():
            raise errors.ShardingError(
                f"max_batch={max_batch} rows do not split over the mesh's batch axis {placement.axis('batch')!r} "
                f"of size {placement.batch_multiple()}; choose a multiple of it")

    # ----------------------------------------------------------------- public API
    def check(self, prompt_ids, sampling: Sampling) -> tuple[list[int], tuple[int, ...]]:
        """Validate one request (raises `jdllm.errors.*` naming the bad value, with the input at
        fault as its `field`: "prompt", "max_new_tokens" or "stop_token_ids"); returns its ids and
        stop ids."""
        inputs.check_sampling(sampling)
        with _field("stop_token_ids"):
            stops = tuple(self.cfg.eos_token_ids if sampling.stop_token_ids is None else sampling.stop_token_ids)
            if len(stops) > STOP_WIDTH:
                raise errors.InputError(f"{len(stops)} stop token ids; a request may carry at most {STOP_WIDTH}")
            inputs.check_stop_ids([sampling], self.cfg)
        with _field("prompt"):
            ids = self._checked_prompt(prompt_ids, sampling)
        with _field("max_new_tokens"):
            self._check_length(ids, sampling)
        return ids, stops

    def _check_length(self, ids: list[int], sampling: Sampling) -> None:
        if sampling.max_new_tokens > self.max_new_tokens:
            raise errors.SequenceTooLongError(
                f"max_new_tokens={sampling.max_new_tokens} is more than this engine's max_new_tokens="
                f"{self.max_new_tokens}; ask for fewer")
        if self.paradigm.joins_running_batch:  # the row's own geometry (e.g. a block that must divide it)
            self.paradigm.row_layout(self.cfg, len(ids), sampling.max_new_tokens, self.slots)

    def _checked_prompt(self, prompt_ids, sampling: Sampling) -> list[int]:
        ids = [int(t) for t in inputs.id_row(prompt_ids, "prompt")]
        if not ids:
            raise errors.InputError("the prompt is empty; give at least one token")
        check_token_ids(np.asarray(ids), self.cfg)
        inputs.check_no_mask_token(ids, self.cfg, "the prompt")
        if len(ids) > self.max_prompt_tokens:
            raise errors.SequenceTooLongError(
                f"the prompt has {len(ids)} tokens, more than this engine's max_prompt_tokens="
                f"{self.max_prompt_tokens}; shorten it")
        total = len(ids) + sampling.max_new_tokens  # the prompt at fault: in a batch the server names which
        if total > self.cfg.max_position_embeddings:
            raise errors.SequenceTooLongError(
                f"the prompt has {len(ids)} tokens and max_new_tokens={sampling.max_new_tokens}: {total} > the "
                f"model's context max_position_embeddings={self.cfg.max_position_embeddings}; shorten the "
                "prompt or lower max_new_tokens")
        return ids

    def compile_constraint(self, constraint, stops: tuple[int, ...], budget: int):
        """A `jdllm.constraints.Constraint` -> its token DFA (the on-device "dfa" backend, whatever
        backend the constraint names), checked against this engine's table buckets and the budget."""
        if constraint is None:
            return None
        if not isinstance(constraint, C.Constraint):
            raise errors.ArgumentTypeError(f"constraint must be a jdllm.constraints.Constraint, got "
                                           f"{type(constraint).__name__}")
        if not self.constraint_states:
            raise errors.ConstraintError("this engine holds no constraint tables; build it with "
                                         "constraint_states=Q (`jdllm serve --constraint-states Q`)")
        if constraint.backend != "dfa":
            constraint = C.Constraint(constraint.kind, constraint.source, "dfa")
        d = dfa.compile(self.model, constraint, stops, max_states=self.constraint_states)
        if d.num_states > self.constraint_states or d.num_classes > self.constraint_classes:
            raise errors.ConstraintError(
                f"the constraint compiles to {d.num_states} DFA states and {d.num_classes} token classes; this "
                f"engine holds at most {self.constraint_states} states and {self.constraint_classes} classes "
                "(constraint_states / constraint_classes); simplify it or raise them")
        dfa.check_budget(d, budget, raise_what="max_tokens")
        return d

    @property
    def capacity(self) -> int:
        """The most requests this engine ever holds at once: one per row, and max_queue waiting."""
        return self.max_batch + self.max_queue

    def submit(self, prompt_ids, sampling: Sampling | None = None, *, return_step_map: bool = False,
               on_event: Callable[[Event], Any] | None = None, constraint=None) -> Request:
        """Queue one request (token ids). Events go to `on_event` (called on the engine's thread), or,
        without one, collect in `request.events`. `constraint`: a `jdllm.constraints` constraint
        (regex / json_schema / choice) enforced on the device (the engine needs `constraint_states`).
        Raises `errors.QueueFullError` when `max_queue` requests already wait for a row,
        `errors.EngineStoppedError` after `stop()`, `errors.ConstraintError` for a constraint that
        does not fit."""
        return self.submit_many(prompt_ids, [sampling], return_step_map=return_step_map, on_events=[on_event],
                                constraint=constraint)[0]

    def submit_many(self, prompt_ids, samplings: list, *, return_step_map: bool = False,
                    on_events: list | None = None, constraint=None) -> list[Request]:
        """Queue one prompt under several settings together (the `n` choices of one API request), or
        a list of prompts, one per setting (an API request's batch of prompts), all or none:
        `errors.InputError` when there are more than `capacity`, `errors.QueueFullError` when they
        would leave more than `max_queue` requests waiting for a row (nothing is queued then, so
        nothing has to be aborted). Otherwise as `submit`, one request per setting. An error that one
        request's check raises carries its place in the group as `request_index`."""
        samplings = [Sampling() if s is None else s for s in samplings]
        per_setting = isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) > 0 and all(
            isinstance(p, (list, tuple, np.ndarray)) for p in prompt_ids)
        if per_setting and len(prompt_ids) != len(samplings):
            raise errors.ArgumentTypeError(f"{len(prompt_ids)} prompts for {len(samplings)} samplings")
        prompts = list(prompt_ids) if per_setting else [prompt_ids] * len(samplings)
        on_events = [None] * len(samplings) if on_events is None else list(on_events)
        if len(on_events) != len(samplings):
            raise errors.ArgumentTypeError(f"{len(on_events)} on_events for {len(samplings)} samplings")
        if not 1 <= len(samplings) <= self.capacity:
            raise errors.InputError(
                f"{len(samplings)} requests at once: this engine holds at most max_batch + max_queue = "
                f"{self.max_batch} + {self.max_queue} = {self.capacity}")
        checked = []
        for i, (p, s) in enumerate(zip(prompts, samplings)):
            try:
                checked.append(self.check(p, s))
            except errors.JdllmError as e:
                e.request_index = i  # which request of the group is at fault (the server names its prompt)
                raise
        dfas: dict = {}
        for (_, stops), s in zip(checked, samplings):
            if stops not in dfas:
                dfas[stops] = self.compile_constraint(constraint, stops, s.max_new_tokens)
            elif dfas[stops] is not None:
                dfa.check_budget(dfas[stops], s.max_new_tokens, raise_what="max_tokens")
        with self._cv:
            if self._stopping:
                raise errors.EngineStoppedError("the engine is shutting down; no new requests are accepted")
            beyond = self.scheduler.queued_beyond_rows(len(samplings))
            if beyond > self.max_queue:
                raise errors.QueueFullError(
                    f"{self.scheduler.queued_beyond_rows()} requests already wait for a row and {len(samplings)} "
                    f"more would make {beyond} wait (max_queue={self.max_queue}); retry later")
            reqs = []
            for (ids, stops), s, on_event in zip(checked, samplings, on_events):
                req = Request(id=next(self._ids), prompt_ids=ids, sampling=s, stop_ids=stops,
                              return_step_map=bool(return_step_map), on_event=on_event,
                              submitted=time.perf_counter(), events=[] if on_event is None else None,
                              dfa=dfas[stops])
                self.scheduler.add(req)
                reqs.append(req)
            self._cv.notify_all()
        return reqs

    def abort(self, request_id: int) -> None:
        """The client went away: the request's row is closed and freed at the next round (no event)."""
        with self._cv:
            if self.scheduler.abort(request_id):
                self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return dict(**self.scheduler.stats(), rounds=self.rounds, aborted=self.aborted)

    def idle(self) -> bool:
        with self._cv:
            return not self.scheduler.has_work()

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
        self._pending = None
        with self._cv:
            left = self.scheduler.clear()
        for req in left:
            req.emit(Event("error", message="the engine stopped before the request finished"))

    # ----------------------------------------------------------------- the loop
    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self.scheduler.has_work():
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step_round()
            except Exception as e:  # noqa: BLE001 (a failed round must not hang every client)
                traceback.print_exc()
                self._fail_all(f"engine error: {type(e).__name__}: {e}")

    def _fail_all(self, message: str) -> None:
        self._pending = None
        with self._cv:
            reqs = self.scheduler.clear()
        self.runner.close_all()
        for r in reqs:
            r.status = "aborted"
            r.emit(Event("error", message=message))

    def step_round(self) -> None:
        """One scheduling round: the scheduler decides, the runner dispatches it (`steps_per_round`
        steps), and while the device runs those the output processor streams what the previous
        round made final; the rows that finished there are freed (the next round admits into them).
        The host's work of a round thus overlaps the device's next round instead of idling it."""
        with self._cv:
            decided = self.scheduler.schedule()
            self.aborted += len(decided.aborted)
        view = self.runner.execute(decided, self.steps_per_round)
        pending, self._pending = self._pending, None
        if view is not None:
            self.rounds += 1
            with self._cv:  # the rows as this round runs them (admissions after it are not in its view)
                self._pending = (view, list(self.scheduler.running.items()))
        if pending is not None:
            self._process(*pending)
        if self._pending is not None and self.idle():  # everything finished in the round just read
            self._pending = None

    def _process(self, view: dict, running: list) -> None:
        """Stream a dispatched round's host view to the requests that ran in it and still do."""
        host = to_host(view)
        running = [(row, req) for row, req in running if req.status == "running"]
        events, finished = self.output_processor.process(host, running)
        for req, ev in events:
            req.emit(ev)
        with self._cv:
            for row, req in finished:
                self.scheduler.finish(row, req)
        for _, req in finished:
            req.emit(Event("done", output=req.output))


@contextlib.contextmanager
def _field(name: str):
    """A `jdllm.errors` error raised inside names `name` as its `field` (the input at fault)."""
    try:
        yield
    except errors.JdllmError as e:
        e.field = name
        raise


__all__ = ["Engine", "Event", "Request", "STOP_WIDTH"]
