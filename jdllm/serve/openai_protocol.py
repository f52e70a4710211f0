"""The OpenAI request side of the server: parsing and validating request bodies into engine
arguments, and the errors answered as OpenAI-shaped JSON (`ApiError`).

Every check raises `ApiError(status, message, param)`: 400 for a bad value (named by `param`),
429 when the engine's queue is full, 503 while it shuts down.
"""

import dataclasses
import json
import time

from jdllm import constraints as C, errors
from jdllm.sampling import Sampling
from jdllm.serve.engine import Engine

JDLLM_OPTIONS = ("top_k", "stop_token_ids", "return_step_map", "regex", "choice")  # the `jdllm` object's keys
MAX_N = 16  # choices per request
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)


class ApiError(Exception):
    """An error answered as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def number(body: dict, name: str, default, kind=float, lo=None, hi=None):
    """body[name] as a `kind` (int or float) in [lo, hi], or `default` when absent or null."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and int(v) != v):
        raise ApiError(400, f"{name}={v!r} must be {'an integer' if kind is int else 'a number'}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{name}={v!r} must be {rng}", name)
    return kind(v)


def unsupported(body: dict) -> None:
    """Refuse the OpenAI fields this server does not implement."""
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ApiError(400, "best_of is not supported; use n", "best_of")
    for name in ("tools", "logit_bias"):
        if body.get(name):
            raise ApiError(400, f"{name} is not supported by this server", name)


def stop_strings(body: dict) -> tuple[str, ...]:
    """The request's `stop` strings (a string or a list of at most MAX_STOPS)."""
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop={stop!r} must be a non-empty string or a list of at most {MAX_STOPS} "
                            "non-empty strings", "stop")
    return tuple(stops)


def wants_logprobs(body: dict, chat: bool) -> bool:
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


class Server:
    """Request parsing around one `Engine`: OpenAI fields -> engine arguments, or an `ApiError`."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.model.tokenizer
        self.created = int(time.time())

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

    def options(self, body: dict) -> dict:
        """The request's `jdllm` object (jdllm's own options), checked for unknown keys."""
        extra = body.get("jdllm") or {}
        if not isinstance(extra, dict):
            raise ApiError(400, f"jdllm={extra!r} must be an object", "jdllm")
        unknown = sorted(set(extra) - set(JDLLM_OPTIONS))
        if unknown:
            raise ApiError(400, f"unknown jdllm option(s) {unknown}; accepted: {list(JDLLM_OPTIONS)} (the "
                                f"paradigm, {self.engine.paradigm.name}, is fixed when the server starts)",
                           f"jdllm.{unknown[0]}")
        return extra

    def sampling(self, body: dict, max_default: int, max_names=("max_tokens",)) -> tuple[Sampling, bool]:
        """The request's `Sampling` and whether it asks for per-step events (return_step_map); checks
        the model name and refuses unsupported fields."""
        model = body.get("model")
        if model is None:
            raise ApiError(400, "model is required", "model")
        if model != self.model_name:
            raise ApiError(400, f"model {model!r} is not served here; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "model", code="model_not_found")
        unsupported(body)
        extra = self.options(body)
        max_tokens = max_default
        for name in max_names:
            if body.get(name) is not None:
                max_tokens = number(body, name, max_default, int, 1, self.engine.max_new_tokens)
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
            s = Sampling(temperature=number(body, "temperature", 0.0, float, 0.0, 2.0),
                         top_p=number(body, "top_p", 1.0, float), top_k=number({"top_k": top_k}, "top_k", 0, int, 0),
                         seed=number(body, "seed", 0, int, 0, 2**32 - 1), max_new_tokens=max_tokens,
                         stop_token_ids=None if stops is None else tuple(stops))
        except errors.JdllmError as e:
            raise ApiError(400, str(e)) from None
        return s, step_map

    def prompt_ids(self, prompt) -> list[int]:
        """A completion's `prompt` (one text or one list of token ids) as token ids."""
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
        """A chat's `messages` as token ids (the chat template, or the contents joined by newlines)."""
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

    def fit(self, body: dict, sampling: Sampling, ids: list[int], names) -> Sampling:
        """A default max_tokens (none of `names` given) shrinks to what the model's context leaves
        after the prompt."""
        room = self.engine.cfg.max_position_embeddings - len(ids)
        if all(body.get(n) is None for n in names) and 1 <= room < sampling.max_new_tokens:
            return dataclasses.replace(sampling, max_new_tokens=room)
        return sampling

    def submit(self, ids: list[int], sampling: Sampling, step_map: bool, on_event, constraint=None):
        """`Engine.submit`, its errors as `ApiError`s (429 queue full, 503 shutting down, else 400)."""
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

    def text_of(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


async def read_body(request) -> dict:
    """The request's JSON object body."""
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


__all__ = ["ApiError", "Server", "read_body", "number", "stop_strings", "wants_logprobs", "unsupported", "MAX_N",
           "MAX_STOPS", "JDLLM_OPTIONS"]
