"""A request's host-side record (`Request`) and what it hears from the engine (`Event`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jdllm.api import Output
from jdllm.sampling import Sampling


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


__all__ = ["Event", "Request"]
