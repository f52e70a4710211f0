"""Serving: a continuous-batching engine (`Engine`) and an OpenAI-compatible HTTP server
(`jdllm.serve.server.create_app`, the `jdllm serve` command).

The engine needs only JAX; the server needs the `serve` extra (`pip install "jdllm[serve]"`).
"""

from jdllm.serve.engine import Engine, Event, Request

__all__ = ["Engine", "Event", "Request"]
