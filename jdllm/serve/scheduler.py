"""The serving scheduler: which requests run in which rows, decided on the host as plain data.

It holds the waiting queue, the running requests by row, the free rows and the pending aborts,
and turns them into one `SchedulerOutput` per round; the runner (`jdllm.serve.runner`) carries
that out on the device. No JAX here: it is tested with plain objects standing in for requests
(anything with `id`, `status`, `row` and `sampling.max_new_tokens`).

Admission follows the paradigm (`Paradigm.joins_running_batch`):
- True (every bundled paradigm: ar, block_diffusion, ar_spec, masked_diffusion, multi_block):
  rows are independent, so waiting requests take free rows at any round, FIFO, and are merged
  into the running batch (the runner prefills those of one round together).
- False (a paradigm whose rows share one canvas schedule, e.g. a lockstep one of your own): a
  new batch starts only once every row has finished: the waiting requests, FIFO, up to the pool
  size, and (unless the paradigm has `ragged_lengths`) only those asking for the head request's
  max_new_tokens, since such a batch decodes to one length. Request i of the batch runs in row i.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One round's decisions.

    aborted: requests dropped this round (waiting or running; already marked "aborted");
    close_rows: rows whose running request was aborted (finish them as ABORT on the device);
    admit: (request, row) pairs joining the running batch;
    start_batch: requests starting a new batch together, request i in row i (a drained pool);
    run_round: some row is running after the admissions, so the round's steps run.
    """

    aborted: tuple = ()
    close_rows: tuple[int, ...] = ()
    admit: tuple = ()
    start_batch: tuple = ()
    run_round: bool = False


class Scheduler:
    """Host bookkeeping of one pool of `rows` rows serving `paradigm` (not thread-safe: the engine
    holds its lock around every call)."""

    def __init__(self, paradigm, rows: int):
        self.joins_running_batch = bool(paradigm.joins_running_batch)
        self.ragged_lengths = bool(paradigm.ragged_lengths)
        self.rows = rows
        self.waiting: collections.deque = collections.deque()
        self.running: dict = {}  # row -> request
        self.free: list[int] = list(range(rows))
        self.aborts: set = set()  # ids of requests to drop at the next round
        self.requests: dict = {}  # id -> request, waiting or running

    def add(self, req) -> None:
        """Queue a request (status "waiting")."""
        self.requests[req.id] = req
        self.waiting.append(req)

    def abort(self, request_id) -> bool:
        """Drop a tracked request at the next round; False when it is not tracked (finished, unknown)."""
        if request_id not in self.requests:
            return False
        self.aborts.add(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.aborts)

    def queued_beyond_rows(self, extra: int = 0) -> int:
        """How many of the waiting requests (plus `extra` new ones) find no row at the next round:
        free rows take waiting requests at any round (`joins_running_batch`), or all rows once the
        pool has drained."""
        rows = len(self.free) if self.joins_running_batch or not self.running else 0
        return max(0, len(self.waiting) + extra - rows)

    def schedule(self) -> SchedulerOutput:
        """This round's aborts and admissions (the records are updated: status, row)."""
        aborted, close = self._take_aborts()
        admit, start = (), ()
        if self.joins_running_batch:
            admit = self._admit_into_free_rows()
        elif not self.running:
            start = self._start_batch()
        return SchedulerOutput(aborted=aborted, close_rows=close, admit=admit, start_batch=start,
                               run_round=bool(self.running))

    def finish(self, row: int, req) -> None:
        """A request finished in `row`: free the row, stop tracking the request."""
        if self.running.get(row) is req:
            del self.running[row]
            self.free.append(row)
        self.requests.pop(req.id, None)

    def clear(self) -> list:
        """Forget every request (the engine stopped or failed); returns those that were tracked."""
        left = list(self.requests.values())
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self.aborts.clear()
        self.free = list(range(self.rows))
        return left

    def stats(self) -> dict:
        return dict(rows=self.rows, rows_busy=len(self.running), rows_free=len(self.free),
                    waiting=len(self.waiting), tracked=len(self.requests))

    # ----------------------------------------------------------------- the rules
    def _take_aborts(self) -> tuple[tuple, tuple[int, ...]]:
        aborts, self.aborts = self.aborts, set()
        aborted, close = [], []
        for rid in aborts:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == "waiting":
                self.waiting.remove(req)
            elif req.status == "running":
                close.append(req.row)
                del self.running[req.row]
                self.free.append(req.row)
            req.status = "aborted"
            aborted.append(req)
        return tuple(aborted), tuple(close)

    def _admit_into_free_rows(self) -> tuple:
        admit = []
        while self.free and self.waiting:
            req = self.waiting.popleft()
            req.row, req.status = self.free.pop(0), "running"
            self.running[req.row] = req
            admit.append((req, req.row))
        return tuple(admit)

    def _start_batch(self) -> tuple:
        if not self.waiting:
            return ()
        pick = list(self.waiting)
        if not self.ragged_lengths:  # the batch decodes to one length: the head's
            n = pick[0].sampling.max_new_tokens
            pick = [r for r in pick if r.sampling.max_new_tokens == n]
        pick = pick[:self.rows]
        for i, req in enumerate(pick):
            self.waiting.remove(req)
            req.row, req.status = i, "running"
            self.running[i] = req
        self.free = list(range(len(pick), self.rows))
        return tuple(pick)


__all__ = ["Scheduler", "SchedulerOutput"]
