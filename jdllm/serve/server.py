"""OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true` -> server-sent
events, `data: {...}` chunks then `data: [DONE]`), `GET /v1/models`, `GET /health`.

Request fields: `model` (must name the served model), `prompt` (text or token ids; completions)
or `messages` (chat: the tokenizer's chat template when it has one, else the contents joined by
newlines), `max_tokens` (chat also `max_completion_tokens`), `temperature`, `top_p`, `seed`,
`stream`, `stop` (up to 4 strings: a choice ends before the first one in its final text, its row
is freed at the next round; while streaming, a tail that may begin a stop string is held back),
`n` (up to 16 choices, each its own engine row and stream, choice i sampling with `seed + i`),
`logprobs` (completions: `logprobs=0`; chat: `logprobs=true`, `top_logprobs=0`: the sampled
tokens' log-probs, under the distribution each was drawn from, temperature / top-k / top-p
applied; top alternatives are not recorded, so asking for them is a 400).
jdllm's own options go in a `jdllm` object (the `openai` client's
`extra_body={"jdllm": {...}}`): `top_k`, `stop_token_ids`, `return_step_map` (stream a per-step
event with the positions each step revealed and their step_map, for animating the denoising),
`regex` / `choice` (a constraint). Constraints (`response_format: {"type": "json_schema",
"json_schema": {"schema": {...}}}`, or `jdllm.regex` / `jdllm.choice`) are enforced on the device
by the DFA backend (`jdllm.constraints.dfa`: regular languages, non-recursive schemas) when the
server was started with `--constraint-states Q`; choices then carry `jdllm.constraint_ok`.
The paradigm is fixed when the server starts (it is compiled into the engine); an unknown option
is refused. Every response choice carries `jdllm: {token_ids, step_map, nfe}` (streamed chunks:
`token_ids`, `step_map` of the tokens they carry; a choice cut by a `stop` string reports the
forwards its row had run by the round that completed the stop string).

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

JDLLM_OPTIONS = ("top_k", "stop_token_ids", "return_step_map", "regex", "choice")


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


MAX_N = 16  # choices per request
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)


def _unsupported(body: dict) -> None:
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ApiError(400, "best_of is not supported; use n", "best_of")
    for name in ("tools", "logit_bias"):
        if body.get(name):
            raise ApiError(400, f"{name} is not supported by this server", name)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop={stop!r} must be a non-empty string or a list of at most {MAX_STOPS} "
                            "non-empty strings", "stop")
    return tuple(stops)


def _logprobs(body: dict, chat: bool) -> bool:
    """Whether choices carry the sampled tokens' log-probs (jdllm records only the sampled token's,
    under the distribution it was drawn from: temperature / top-k / top-p applied)."""
    if chat:
        on = body.get("logprobs")
        if on not in (None, True, False):
            raise ApiError(400, f"logprobs={on!r} must be true or false", "logprobs")
        top = body.get("top_logprobs")
        if top not in (None, 0):
            raise ApiError(400, f"top_logprobs={top!r}: only the sampled token's log-prob is recorded; "
                                "use top_logprobs=0 (or leave it out)", "top_logprobs")
        return bool(on)
    n = body.get("logprobs")
    if n is None:
        return False
    if isinstance(n, bool) or not isinstance(n, int) or n != 0:
        raise ApiError(400, f"logprobs={n!r}: only the sampled token's log-prob is recorded; use logprobs=0 "
                            "(top alternatives are not returned)", "logprobs")
    return True


class Choice:
    """One choice's text as it streams: detokenized incrementally, cut before the first stop string
    (a tail that may begin one is held back until it cannot), with its tokens' log-probs."""

    def __init__(self, index: int, srv: "Server", stops: tuple[str, ...]):
        self.index, self.srv, self.stops = index, srv, stops
        self.ids: list[int] = []
        self.step_map: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""  # the text sent so far
        self.sent_ids = 0  # tokens sent so far
        self.finish: str | None = None
        self.nfe: int | None = None
        self.constraint_ok: bool | None = None  # constrained: the whole output matches
        self.request = None  # the engine Request

    @property
    def done(self) -> bool:
        return self.finish is not None

    def _cut(self, text: str) -> int | None:
        hits = [text.find(x) for x in self.stops if x in text]
        return min(hits) if hits else None

    def feed(self, ev: Event) -> tuple[str, slice]:
        """The delta text and the new tokens (a slice of self.ids) this event lets out."""
        if ev.kind == "done":
            self.nfe, self.constraint_ok = ev.output.nfe, ev.output.constraint_ok
            if not self.ids and ev.output.token_ids:  # a "done" with nothing streamed before it
                self.ids, self.step_map = list(ev.output.token_ids), list(ev.output.step_map)
                self.logprobs = list(ev.output.logprobs)
        else:
            self.nfe = ev.nfe if ev.nfe is not None else self.nfe  # a stop string may end the choice here
            self.ids += ev.token_ids
            self.step_map += ev.step_map
            self.logprobs += ev.logprobs
        text = self.srv.text_of(self.ids)
        end_ids = len(self.ids)
        cut = self._cut(text) if self.stops else None
        if cut is not None:  # a stop string: the choice ends before it, at the token that completed it
            final, self.finish = text[:cut], "stop"
            end_ids = next(k for k in range(1, len(self.ids) + 1)
                           if self._cut(self.srv.text_of(self.ids[:k])) is not None)
            del self.ids[end_ids:], self.step_map[end_ids:], self.logprobs[end_ids:]
        elif ev.kind == "done":
            final, self.finish = text, ev.output.finish_reason
        elif text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            final = self.text
        else:
            hold = max((k for x in self.stops for k in range(1, len(x)) if text.endswith(x[:k])), default=0)
            final = text[:len(text) - hold]
        delta = final[len(self.text):] if final.startswith(self.text) else ""
        self.text += delta
        new = slice(self.sent_ids, end_ids)
        self.sent_ids = end_ids
        return delta, new

    def logprob_block(self, sl: slice, chat: bool, offset0: int = 0):
        toks = [self.srv.text_of([t]) for t in self.ids[sl]]
        lps = [float(x) for x in self.logprobs[sl]]
        if chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(toks, lps)]}
        offsets, at = [], offset0
        for t in toks:
            offsets.append(at)
            at += len(t)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}


class Server:
    """Request parsing and response shaping around one `Engine` (the FastAPI app calls it)."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.model.tokenizer
        self.created = int(time.time())

    # ----------------------------------------------------------------- parsing
    def constraint(self, body: dict):
        """The request's constraint (`response_format` json_schema, or jdllm.regex / jdllm.choice) as a
        `jdllm.constraints.Constraint` for the on-device DFA backend, or None."""
        extra = body.get("jdllm") or {}
        rf = body.get("response_format")
        rf = None if rf in (None, {"type": "text"}) else rf
        given = [n for n, v in (("response_format", rf), ("jdllm.regex", extra.get("regex")),
                                ("jdllm.choice", extra.get("choice"))) if v is not None]
        if not given:
            return None
        if len(given) > 1:
            raise ApiError(400, f"give one constraint, got {given}", given[1])
        if not self.engine.constraint_states:
            raise ApiError(400, "this server enforces no constraints (start it with --constraint-states Q)",
                           given[0])
        from jdllm import constraints as C  # noqa: PLC0415

        try:
            if rf is not None:
                kind = rf.get("type") if isinstance(rf, dict) else None
                if kind == "json_object":
                    raise ApiError(400, "response_format json_object (any JSON object) is not a regular "
                                        "language; give {\"type\": \"json_schema\", \"json_schema\": "
                                        "{\"schema\": {...}}}", "response_format")
                js = rf.get("json_schema") if kind == "json_schema" else None
                if not isinstance(js, dict) or "schema" not in js:
                    raise ApiError(400, f"response_format={rf!r}: expected {{\"type\": \"text\"}} or "
                                        "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}",
                                   "response_format")
                return C.json_schema(js["schema"], backend="dfa")
            if extra.get("regex") is not None:
                return C.regex(extra["regex"], backend="dfa")
            return C.choice(extra["choice"], backend="dfa")
        except errors.JdllmError as e:
            raise ApiError(400, str(e), given[0]) from None

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

    def submit(self, ids: list[int], sampling: Sampling, step_map: bool, on_event, constraint=None):
        try:
            return self.engine.submit(ids, sampling, return_step_map=step_map, on_event=on_event,
                                      constraint=constraint)
        except errors.QueueFullError as e:
            raise ApiError(429, f"server overloaded: {e}", type_="rate_limit_error", code="queue_full") from None
        except errors.EngineStoppedError as e:
            raise ApiError(503, str(e), type_="server_error", code="shutting_down") from None
        except errors.ConstraintError as e:
            raise ApiError(400, str(e), "response_format") from None
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
        queue: asyncio.Queue = asyncio.Queue()
        n = _number(body, "n", 1, int, 1, MAX_N)
        stops, want_lp, constraint = _stops(body), _logprobs(body, chat), srv.constraint(body)
        choices = [Choice(i, srv, stops) for i in range(n)]
        try:  # choice i samples with seed + i (greedy choices are all the same)
            for c in choices:
                s = sampling if c.index == 0 else dataclasses.replace(sampling, seed=(sampling.seed + c.index) % 2**32)
                args = (ids, s, step_map, lambda ev, i=c.index: loop.call_soon_threadsafe(queue.put_nowait, (i, ev)),
                        constraint)
                # compiling a constraint's DFA takes host time: off the event loop
                c.request = await asyncio.to_thread(srv.submit, *args) if constraint else srv.submit(*args)
        except ApiError:
            for c in choices:
                if c.request is not None:
                    engine.abort(c.request.id)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def abort_rest():
            for c in choices:
                if not c.done:
                    engine.abort(c.request.id)

        async def next_event(stream: bool):
            """(choice, event, delta text, new token slice) for the next event of a running choice."""
            while True:
                if stream:
                    i, ev = await queue.get()
                else:
                    try:
                        i, ev = await asyncio.wait_for(queue.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return None
                        continue
                c = choices[i]
                if c.done:  # events queued before a stop string aborted it
                    continue
                if ev.kind == "error":
                    raise ApiError(503, ev.message, type_="server_error")
                if ev.kind == "steps":
                    return c, ev, "", slice(0, 0)
                delta, new = c.feed(ev)
                if c.done and ev.kind != "done":  # a stop string: its row is freed at the next round
                    engine.abort(c.request.id)
                return c, ev, delta, new

        if not body.get("stream"):
            try:
                while not all(c.done for c in choices):
                    got = await next_event(stream=False)
                    if got is None:
                        abort_rest()
                        return JSONResponse({}, status_code=499)
            except (asyncio.CancelledError, ApiError):
                abort_rest()
                raise
            out = []
            for c in choices:
                d = {"index": c.index, "finish_reason": c.finish,
                     "logprobs": c.logprob_block(slice(0, len(c.ids)), chat) if want_lp else None,
                     "jdllm": {"token_ids": c.ids, "step_map": c.step_map, "nfe": c.nfe}}
                if constraint is not None:
                    d["jdllm"]["constraint_ok"] = c.constraint_ok
                if chat:
                    d["message"] = {"role": "assistant", "content": c.text}
                else:
                    d["text"] = c.text
                out.append(d)
            k = sum(len(c.ids) for c in choices)
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": out,
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": k, "total_tokens": len(ids) + k}}

        def chunk(c: Choice, text: str | None, finish, extra: dict, lp=None, first: bool = False) -> dict:
            d = {"index": c.index, "finish_reason": finish, "jdllm": extra}
            if chat:
                delta = {"role": "assistant"} if first else {}
                if text:
                    delta["content"] = text
                d["delta"] = delta
                d["logprobs"] = lp
            else:
                d["text"], d["logprobs"] = text or "", lp
            return d

        async def events():
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            def sse(d: dict) -> str:
                return "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                              "model": model_name, "choices": [d]}) + "\n\n"
            try:
                if chat:
                    for c in choices:
                        yield sse(chunk(c, None, None, {}, first=True))
                while not all(c.done for c in choices):
                    try:
                        c, ev, delta, new = await next_event(stream=True)
                    except ApiError as e:
                        yield "data: " + json.dumps(e.body()) + "\n\n"
                        break
                    if ev.kind == "steps":
                        yield sse(chunk(c, None, None, {"revealed": [
                            {"position": p, "step": st, "token_id": t}
                            for p, st, t in zip(ev.positions, ev.steps, ev.token_ids)]}))
                        continue
                    lp = c.logprob_block(new, chat, len(c.text) - len(delta)) if want_lp else None
                    extra = {"token_ids": c.ids[new], "step_map": c.step_map[new]}
                    if c.done:
                        extra["nfe"] = c.nfe
                        if constraint is not None:
                            extra["constraint_ok"] = c.constraint_ok
                    if delta or new.stop > new.start or c.done:
                        yield sse(chunk(c, delta, c.finish, extra, lp))
                yield "data: [DONE]\n\n"
            finally:
                abort_rest()

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

    from jdllm import compile_progress  # noqa: PLC0415

    with compile_progress.show("jdllm serve"):  # a request's first compile prints progress lines to stderr
        uvicorn.run(create_app(engine, model_name), host=host, port=port, log_level=log_level)


__all__ = ["create_app", "serve", "Server", "ApiError"]
