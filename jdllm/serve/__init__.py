"""Serving: a continuous-batching engine (`Engine`) and an OpenAI-compatible HTTP server
(`jdllm.serve.server.create_app`, the `jdllm serve` command).

engine.py     the loop: lock -> scheduler -> runner -> output processor -> events
scheduler.py  host data only: waiting queue, rows, aborts -> a `SchedulerOutput` per round
runner.py     the device side: the pool `DecodeState`, admission / round / close programs
output.py     host arrays -> each request's events and finished `Output`s
request.py    `Request` (a request's host record) and `Event`
server.py     the FastAPI app: routes, health, models, lifespan; `serve`
openai_protocol.py  request parsing and validation (OpenAI fields -> engine arguments, `ApiError`)
completions.py      /v1/completions and /v1/chat/completions, streamed or whole

How a request joins a running batch is the paradigm's (`Paradigm.joins_running_batch`,
`pool_layout`, `row_layout`); serving never asks a paradigm's name. The engine needs only JAX;
the server needs the `serve` extra (`pip install "jdllm[serve]"`).
"""

from jdllm.serve.engine import Engine, Event, Request

__all__ = ["Engine", "Event", "Request"]
