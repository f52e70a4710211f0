"""OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true` -> server-sent
events, `data: {...}` chunks then `data: [DONE]`), `GET /v1/models`, `GET /health`.

Request fields: `model` (must name the served model), `prompt` (text or token ids; completions)
or `messages` (chat: the tokenizer's chat template when it has one, else the contents joined by
newlines), `max_tokens` (chat also `max_completion_tokens`), `temperature`, `top_p`, `seed`,
`stream`. jdllm's own options go in a `jdllm` object (the `openai` client's
`extra_body={"jdllm": {...}}`): `top_k`, `stop_token_ids`, `return_step_map` (stream a per-step
event with the positions each step revealed and their step_map, for animating the denoising).
The paradigm is fixed when the server starts (it is compiled into the engine); an unknown option
is refused. Every response choice carries `jdllm: {token_ids, step_map, nfe}` (streamed chunks:
`token_ids`, `step_map` of the tokens they carry).

Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(malformed JSON, unknown model, bad value, prompt over the context), 429 when the engine's bounded
queue is full, 503 while it shuts down. A client that disconnects has its request aborted: its row
is freed at the next scheduling round.
"""


import asyncio
import contextlib
import dataclasses
import json
import time
import uuid

from jdllm import errors
from jdllm.sampling import Sampling
from jdllm.serve.engine import Engine, Event

JDLLM_OPTIONS = ("top_k", "stop_token_ids", "return_step_map")
IGNORED = ("user", "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "suffix", "echo",
           "best_of", "logprobs", "top_logprobs", "n", "stop", "response_format", "tools", "tool_choice",
           "parallel_tool_calls", "service_tier", "store", "metadata")


class ApiError(Exception):
    """An error answered as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and int(v) != v):
        raise ApiError(400, f"{name}={v!r} must be {'an integer' if kind is int else 'a number'}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{name}={v!r} must be {rng}", name)
    return kind(v)


def _unsupported(body: dict) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, f"n={n!r}: this server returns one choice per request; send n requests", "n")
    if body.get("stop"):
        raise ApiError(400, "stop strings are not supported; pass token ids as jdllm.stop_token_ids", "stop")
    if body.get("logprobs") not in (None, False, 0) or body.get("echo"):
        raise ApiError(400, "logprobs / echo are not supported; per-token log-probs are not returned yet",
                       "logprobs")
    for name in ("response_format", "tools"):
        if body.get(name) not in (None, {"type": "text"}):
            raise ApiError(400, f"{name} is not supported by this server", name)


class Server:
    """Request parsing and response shaping around one `Engine` (the FastAPI app calls it)."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.model.tokenizer
        self.created = int(time.time())

    # ----------------------------------------------------------------- parsing
    def sampling(self, body: dict, max_default: int, max_names=("max_tokens",)) -> tuple[Sampling, bool]:
        model = body.get("model")
        if model is None:
            raise ApiError(400, "model is required", "model")
        if model != self.model_name:
            raise ApiError(400, f"model {model!r} is not served here; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "model", code="model_not_found")
        _unsupported(body)
        extra = body.get("jdllm") or {}
        if not isinstance(extra, dict):
            raise ApiError(400, f"jdllm={extra!r} must be an object", "jdllm")
        unknown = sorted(set(extra) - set(JDLLM_OPTIONS))
        if unknown:
            raise ApiError(400, f"unknown jdllm option(s) {unknown}; accepted: {list(JDLLM_OPTIONS)} (the "
                                f"paradigm, {self.engine.paradigm.name}, is fixed when the server starts)",
                           f"jdllm.{unknown[0]}")
        max_tokens = max_default
        for name in max_names:
            if body.get(name) is not None:
                max_tokens = _number(body, name, max_default, int, 1, self.engine.max_new_tokens)
        stops = extra.get("stop_token_ids")
        if stops is not None and (not isinstance(stops, list) or
                                  any(isinstance(t, bool) or not isinstance(t, int) for t in stops)):
            raise ApiError(400, f"jdllm.stop_token_ids={stops!r} must be a list of integer token ids",
                           "jdllm.stop_token_ids")
        step_map = extra.get("return_step_map", False)
        if not isinstance(step_map, bool):
            raise ApiError(400, f"jdllm.return_step_map={step_map!r} must be true or false", "jdllm.return_step_map")
        top_k = extra.get("top_k", body.get("top_k", 0))
        try:
            s = Sampling(temperature=_number(body, "temperature", 0.0, float, 0.0, 2.0),
                         top_p=_number(body, "top_p", 1.0, float), top_k=_number({"top_k": top_k}, "top_k", 0, int, 0),
                         seed=_number(body, "seed", 0, int, 0, 2**32 - 1), max_new_tokens=max_tokens,
                         stop_token_ids=None if stops is None else tuple(stops))
        except errors.JdllmError as e:
            raise ApiError(400, str(e)) from None
        return s, step_map

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer; send the prompt as a list of token ids", "prompt")
            if not prompt:
                raise ApiError(400, "the prompt is empty", "prompt")
            try:
                return [int(t) for t in self.tokenizer.encode(prompt, add_special_tokens=False)]
            except Exception as e:  # noqa: BLE001 (tokenizers raise bare Exceptions)
                raise ApiError(400, f"the prompt cannot be tokenized: {e}", "prompt") from None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ApiError(400, "prompt must be one string or one list of token ids (batches: send one request "
                            "per prompt)", "prompt")

    def chat_ids(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects with text content",
                           "messages")
        tok = self.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer; use /v1/completions with token ids", "messages")
        if getattr(tok, "chat_template", None):
            try:
                ids = tok.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                              add_generation_prompt=True, tokenize=True)
            except Exception as e:  # noqa: BLE001
                raise ApiError(400, f"the chat template failed on these messages: {e}", "messages") from None
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return self.prompt_ids("\n".join(m["content"] for m in messages))

    def submit(self, ids: list[int], sampling: Sampling, step_map: bool, on_event):
        try:
            return self.engine.submit(ids, sampling, return_step_map=step_map, on_event=on_event)
        except errors.QueueFullError as e:
            raise ApiError(429, f"server overloaded: {e}", type_="rate_limit_error", code="queue_full") from None
        except errors.EngineStoppedError as e:
            raise ApiError(503, str(e), type_="server_error", code="shutting_down") from None
        except errors.JdllmError as e:
            raise ApiError(400, str(e), "prompt") from None

    # ----------------------------------------------------------------- shaping
    def text_of(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def create_app(engine: Engine, model_name: str = "jdllm"):
    """The FastAPI app serving `engine` under `model_name`; its lifespan starts and stops the engine."""
    from fastapi import FastAPI, Request  # noqa: PLC0415 (the serve extra)
    from fastapi.responses import JSONResponse, StreamingResponse  # noqa: PLC0415

    srv = Server(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="jdllm", lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "paradigm": engine.paradigm.name, **engine.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": srv.created,
                                            "owned_by": "jdllm"}]}

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def run(request: Request, body: dict, ids: list[int], sampling: Sampling, step_map: bool, chat: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        req = srv.submit(ids, sampling, step_map, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish, extra: dict, first: bool = False) -> dict:
            c = {"index": 0, "finish_reason": finish, "jdllm": extra}
            if chat:
                delta = {"role": "assistant"} if first else {}
                if text:
                    delta["content"] = text
                c["delta"] = delta
            else:
                c["text"], c["logprobs"] = text or "", None
            return c

        if not body.get("stream"):
            out = None
            try:
                while out is None:
                    try:
                        ev = await asyncio.wait_for(queue.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            engine.abort(req.id)
                            return JSONResponse({}, status_code=499)
                        continue
                    if ev.kind == "error":
                        raise ApiError(503, ev.message, type_="server_error")
                    if ev.kind == "done":
                        out = ev.output
            except asyncio.CancelledError:
                engine.abort(req.id)
                raise
            c = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None,
                 "jdllm": {"token_ids": out.token_ids, "step_map": out.step_map, "nfe": out.nfe}}
            if chat:
                c["message"] = {"role": "assistant", "content": out.text or ""}
            else:
                c["text"] = out.text or ""
            n = len(out.token_ids)
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [c],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}}

        async def events():
            finished = False
            ids_sent: list[int] = []
            text_sent = ""
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            def sse(c: dict) -> str:
                return "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                              "model": model_name, "choices": [c]}) + "\n\n"
            try:
                if chat:
                    yield sse(choice(None, None, {}, first=True))
                while True:
                    ev = await queue.get()
                    if ev.kind == "error":
                        yield "data: " + json.dumps(ApiError(503, ev.message, type_="server_error").body()) + "\n\n"
                        break
                    if ev.kind == "steps":
                        yield sse(choice(None, None, {"revealed": [{"position": p, "step": s, "token_id": t} for p, s, t
                                                                   in zip(ev.positions, ev.steps, ev.token_ids)]}))
                    elif ev.kind == "tokens":
                        ids_sent += ev.token_ids
                        text = srv.text_of(ids_sent)
                        delta = text[len(text_sent):] if not text.endswith("\ufffd") else ""
                        text_sent += delta
                        yield sse(choice(delta, None, {"token_ids": ev.token_ids, "step_map": ev.step_map}))
                    elif ev.kind == "done":
                        finished = True
                        text = srv.text_of(ids_sent)
                        yield sse(choice(text[len(text_sent):], ev.output.finish_reason, {"nfe": ev.output.nfe}))
                        break
                yield "data: [DONE]\n\n"
            finally:
                if not finished:
                    engine.abort(req.id)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def fit(body: dict, sampling: Sampling, ids: list[int], names) -> Sampling:
        """A default max_tokens (none given) shrinks to what the model's context leaves after the prompt."""
        room = engine.cfg.max_position_embeddings - len(ids)
        if all(body.get(n) is None for n in names) and 1 <= room < sampling.max_new_tokens:
            return dataclasses.replace(sampling, max_new_tokens=room)
        return sampling

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        sampling, step_map = srv.sampling(body, min(16, engine.max_new_tokens))
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", "prompt")
        ids = srv.prompt_ids(body["prompt"])
        return await run(request, body, ids, fit(body, sampling, ids, ("max_tokens",)), step_map, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await body_of(request)
        names = ("max_tokens", "max_completion_tokens")
        sampling, step_map = srv.sampling(body, engine.max_new_tokens, names)
        ids = srv.chat_ids(body.get("messages"))
        return await run(request, body, ids, fit(body, sampling, ids, names), step_map, chat=True)

    return app


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """Run the server until interrupted (blocking)."""
    import uvicorn  # noqa: PLC0415

    uvicorn.run(create_app(engine, model_name), host=host, port=port, log_level=log_level)


__all__ = ["create_app", "serve", "Server", "ApiError"]
