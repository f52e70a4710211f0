"""The serving output processor: the host copy of the pool after a round -> each running request's
events, and the rows that finished.

What a request hears: the tokens that became final since its last event (AR every new token;
diffusion paradigms the left-contiguous revealed prefix, cut after a revealed stop token), on
request a "steps" event naming every slot revealed since the last one with its `step_map`, and
when its row is done, its whole `Output` (the paradigm's `output_trace`, and `constraint_ok` for
a constrained request).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jdllm.api import row_output
from jdllm.constraints.dfa import output_ok
from jdllm.serve.request import Event


class OutputProcessor:
    """Streams rounds of one paradigm's pool (`tokenizer` detokenizes the final `Output`s)."""

    def __init__(self, paradigm, tokenizer=None):
        self.paradigm, self.tokenizer = paradigm, tokenizer

    def process(self, host: dict, running: list, now: float | None = None) -> tuple[list, list]:
        """(events, finished) for the (row, request) pairs `running`, from the runner's host arrays:
        events: (request, Event) pairs to emit now, in order; finished: (row, request) pairs whose
        request is done (its `output` and status set; its "done" event is the engine's to send
        once the row is freed). Updates each request's streaming cursor (`sent`, `seen`)."""
        now = time.perf_counter() if now is None else now
        events, finished = [], []
        for r, req in running:
            done = bool(host["done"][r])
            end = self._final_end(host, r, req, done)
            if req.return_step_map:
                ev = self._steps(host, r, req, end, done)
                if ev is not None:
                    events.append((req, ev))
            ev = self._tokens(host, r, req, end, now)
            if ev is not None:
                events.append((req, ev))
            if done:
                self._finish(host, r, req, now)
                finished.append((r, req))
        return events, finished

    @staticmethod
    def _final_end(host: dict, r: int, req, done: bool) -> int:
        """The slot after the last final token of row r: its end when done, else the end of the
        revealed prefix (cut after the first stop id in it)."""
        g0, lim = int(host["gen_start"][r]), int(host["limit"][r])
        if done:
            return max(int(host["end"][r]), g0)
        rev = host["revealed"][r, g0:lim]
        hole = int(np.argmin(rev)) if not rev.all() else lim - g0
        prefix = host["tokens"][r, g0:g0 + hole]
        stop = np.flatnonzero(np.isin(prefix, req.stop_ids)) if req.stop_ids else np.empty(0)
        return g0 + (int(stop[0]) + 1 if stop.size else hole)

    @staticmethod
    def _steps(host: dict, r: int, req, end: int, done: bool) -> Event | None:
        """The generation slots revealed since the last "steps" event, or None."""
        g0, lim = int(host["gen_start"][r]), int(host["limit"][r])
        seen = host["revealed"][r, g0:lim] & (np.arange(lim - g0) < (end - g0 if done else lim - g0))
        prev = np.zeros_like(seen) if req.seen is None else req.seen
        new = np.flatnonzero(seen & ~prev)
        req.seen = seen
        if not new.size:
            return None
        return Event("steps", positions=new.tolist(), steps=host["step_map"][r, g0 + new].tolist(),
                     token_ids=host["tokens"][r, g0 + new].tolist())

    @staticmethod
    def _tokens(host: dict, r: int, req, end: int, now: float) -> Event | None:
        """The tokens that became final since the last "tokens" event, or None."""
        g0 = int(host["gen_start"][r])
        if end - g0 <= req.sent:
            return None
        sl = slice(g0 + req.sent, end)
        if req.first_token is None:
            req.first_token = now
        req.sent = end - g0
        return Event("tokens", token_ids=host["tokens"][r, sl].tolist(), step_map=host["step_map"][r, sl].tolist(),
                     logprobs=host["logprobs"][r, sl].tolist(), nfe=int(host["nfe"][r]))

    def _finish(self, host: dict, r: int, req, now: float) -> None:
        trace = None if host["extra"] is None else self.paradigm.output_trace(host["extra"], r)
        req.output = row_output(host, r, req.prompt_ids, self.tokenizer, trace)
        if req.dfa is not None:
            req.output = dataclasses.replace(req.output, constraint_ok=output_ok(req.dfa, req.output))
        req.finished, req.status = now, "done"


__all__ = ["OutputProcessor"]
