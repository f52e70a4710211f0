"""OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (`stream: true` -> server-sent
events, `data: {...}` chunks then `data: [DONE]`; `jdllm.serve.completions`), `GET /v1/models`,
`GET /health`. Request parsing lives in `jdllm.serve.openai_protocol`.

Request fields: `model` (must name the served model), `prompt` (text or token ids; completions)
or `messages` (chat: the tokenizer's chat template when it has one, else the contents joined by
newlines), `max_tokens` (chat also `max_completion_tokens`), `temperature`, `top_p`, `seed`,
`stream`, `stop` (up to 4 strings: a choice ends before the first one in its final text, its row
is freed at the next round; while streaming, a tail that may begin a stop string is held back),
`n` (up to 16 choices, each its own engine row and stream, choice i sampling with `seed + i`),
`logprobs` (completions: `logprobs=0`; chat: `logprobs=true`: the sampled tokens' log-probs,
under the distribution each was drawn from, temperature / top-k / top-p applied; completions
`logprobs=k`, chat `top_logprobs=k`, k <= 20: each token's k likeliest alternatives too),
`echo` (completions: each choice begins with its prompt, with `logprobs` its log-probs; then
`max_tokens=0` scores the prompt alone). Prompt log-probs and alternatives are scored by
`jdllm.score` (one teacher-forced forward, the model's own distribution; causal models only,
a 400 on a diffusion model; alternatives not while streaming).
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

Requests are strict (`openai_protocol`): unknown fields, roles and message keys, non-boolean
booleans and unimplemented options set to anything but their no-op value are 400s naming them;
`user` is accepted and ignored. `stream_options.include_usage` adds a last chunk with the usage.

Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(malformed or too deeply nested JSON, unknown model or field, bad value, prompt over the context or
the cheap length bound, n over what the engine holds), 413 for a body over `max_body_bytes`, 429
when the engine's bounded queue is full, 503 while it shuts down. A client that disconnects has its
request aborted: its row is freed at the next scheduling round. Nothing slow runs on the event
loop: large bodies are parsed, prompts tokenized and constraints compiled on worker threads.
"""


import contextlib
import socket

from jdllm import compile_progress, errors
from jdllm.serve import completions as handlers
from jdllm.serve.engine import Engine
from jdllm.serve.openai_protocol import DEFAULT_MAX_BODY_BYTES, ApiError, Server

ROUTES = "GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health"
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def create_app(engine: Engine, model_name: str = "jdllm", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The FastAPI app serving `engine` under `model_name`; its lifespan starts and stops the engine.
    max_body_bytes: a request body past this size is refused with 413 as soon as it is seen."""
    from fastapi import FastAPI, Request  # noqa: PLC0415 (the serve extra)
    from fastapi.responses import JSONResponse  # noqa: PLC0415
    from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: PLC0415

    srv = Server(engine, model_name, max_body_bytes)

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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):  # an unknown route or method, OpenAI-shaped
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"{where}: no such route; this server serves {ROUTES}"
        elif exc.status_code == 405:
            allow = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow", "other methods")
            message = f"{where}: method not allowed; {request.url.path} takes {allow}"
        else:
            message = f"{where}: {exc.detail}"
        return JSONResponse(ApiError(exc.status_code, message, code=_HTTP_CODES.get(exc.status_code)).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok", "paradigm": engine.paradigm.name, **engine.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": srv.created,
                                            "owned_by": "jdllm"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handlers.completions(srv, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handlers.chat_completions(srv, request)

    return app


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for the server (as uvicorn binds one), or an `errors.InputError`
    naming the address when it cannot be (in use, not this machine's, no permission). `jdllm serve`
    binds it before loading the model, so a bad port fails at once."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise errors.InputError(f"port={port!r} is not a port: give 1-65535 (0: any free port)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        why = getattr(e, "strerror", None) or str(e)
        raise errors.InputError(f"cannot listen on {host}:{port} ({why}); choose another --port (or --host), or "
                                "stop what listens there") from None
    sock.set_inheritable(True)
    return sock


def serve(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          sock: socket.socket | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """Run the server until interrupted (blocking), on `sock` when given (from `bind`), else on a
    socket bound to host:port here."""
    import uvicorn  # noqa: PLC0415 (the serve extra)

    sock = bind(host, port) if sock is None else sock
    config = uvicorn.Config(create_app(engine, model_name, max_body_bytes), host=host,
                            port=sock.getsockname()[1], log_level=log_level)
    server = uvicorn.Server(config)
    with compile_progress.show("jdllm serve"):  # a request's first compile prints progress lines to stderr
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass
        finally:
            sock.close()
    if not server.started:
        raise errors.EngineStoppedError("the server did not start (see the lines above)")


__all__ = ["create_app", "serve", "bind", "Server", "ApiError"]
