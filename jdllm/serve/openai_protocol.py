"""The OpenAI request side of the server: reading and validating request bodies into engine
arguments, and the errors answered as OpenAI-shaped JSON (`ApiError`).

Every check raises `ApiError(status, message, param)`: 400 for a bad value (named by `param`),
413 for a body over `max_body_bytes`, 429 when the engine's queue is full, 503 while it shuts down.

Strict by design: a field the endpoint does not know, a message role or key it does not know, a
boolean sent as anything but true / false, and an unimplemented OpenAI option set to anything but
its no-op value are 400s naming them. Cheap bounds come before expensive work: the body's size
while it is read, its JSON nesting once parsed, a text prompt's length in characters before it is
tokenized (`Server.max_prompt_chars`).
"""

import asyncio
import dataclasses
import json
import math
import time

from jdllm import constraints as C, errors, inputs
from jdllm.sampling import Sampling
from jdllm.serve.engine import Engine

JDLLM_OPTIONS = ("top_k", "stop_token_ids", "return_step_map", "regex", "choice")  # the `jdllm` object's keys
MAX_N = 16  # choices per request
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI chat's top_logprobs limit; vLLM's default max_logprobs)
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a request body's size (413 beyond)
MAX_JSON_DEPTH = 64  # nesting of a request body (the top-level object is depth 1)
PROMPT_CHARS_PER_TOKEN = 2  # a text prompt may have max_prompt_tokens x (longest token's characters) x this
SCORE_ROWS = 8  # rows per scoring forward (`Server.score`)
THREAD_PARSE_BYTES = 64 << 10  # bodies from this size on are parsed on a worker thread

# The fields each endpoint reads; the OpenAI options it does not implement, accepted only at the value
# that asks for nothing; and the ones it accepts and ignores (they do not change the output).
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
                 "stream_options", "logprobs", "response_format", "jdllm")
COMPLETION_FIELDS = COMMON_FIELDS + ("prompt", "best_of", "echo")
CHAT_FIELDS = COMMON_FIELDS + ("messages", "max_completion_tokens", "top_logprobs")
NO_OP_VALUES = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": "",
                "tools": []}  # no-op values (or null); suffix: completions only, tools: chat only
NO_OP_FIELDS = {False: ("presence_penalty", "frequency_penalty", "logit_bias", "suffix"),
                True: ("presence_penalty", "frequency_penalty", "logit_bias", "tools")}
IGNORED_FIELDS = ("user",)  # OpenAI: an end-user id for abuse monitoring
CHAT_ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name")  # name: accepted and ignored (the chat template sees role and content)


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
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (kind is int and int(v) != v):
        # (Python's JSON reads NaN, Infinity and 1e999 as floats that int() cannot take)
        raise ApiError(400, f"{name}={v!r} must be {'an integer' if kind is int else 'a finite number'}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{name}={v!r} must be {rng}", name)
    return kind(v)


def boolean(obj: dict, name: str, default: bool = False, param: str | None = None) -> bool:
    """obj[name] as a bool (`default` when absent or null); anything but true / false is a 400."""
    v = obj.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{param or name}={v!r} must be true or false", param or name)
    return v


def accepted_fields(chat: bool) -> tuple[str, ...]:
    return tuple(sorted((CHAT_FIELDS if chat else COMPLETION_FIELDS) + NO_OP_FIELDS[chat] + IGNORED_FIELDS))


def _no_op(name: str, v) -> bool:
    want = NO_OP_VALUES[name]
    if isinstance(want, bool) or isinstance(v, bool):
        return v is want
    if isinstance(want, (int, float)):
        return isinstance(v, (int, float)) and v == want
    return type(v) is type(want) and v == want


def check_fields(body: dict, chat: bool) -> None:
    """Refuse unknown fields, unimplemented OpenAI options set to anything but their no-op value, and
    an ignored field of the wrong type."""
    accepted = accepted_fields(chat)
    unknown = sorted(k for k in body if k not in accepted)
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; this endpoint accepts {list(accepted)} (jdllm's own "
                            f"options go in the `jdllm` object: {list(JDLLM_OPTIONS)})", unknown[0])
    for name in NO_OP_FIELDS[chat]:
        v = body.get(name)
        if v is not None and not _no_op(name, v):
            raise ApiError(400, f"{name}={v!r} is not supported by this server (accepted only as "
                                f"{NO_OP_VALUES[name]!r}, which asks for nothing)", name)
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of not in (1, body.get("n") or 1)):
        raise ApiError(400, f"best_of={best_of!r} is not supported; use n", "best_of")
    for name in IGNORED_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(400, f"{name}={body[name]!r} must be a string", name)


def stream_settings(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage): `stream` a boolean; `stream_options` (only with stream: true) an
    object whose one key, include_usage, is a boolean."""
    stream = boolean(body, "stream")
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(so, dict):
        raise ApiError(400, f"stream_options={so!r} must be an object", "stream_options")
    unknown = sorted(set(so) - {"include_usage"})
    if unknown:
        raise ApiError(400, f"unknown stream_options key(s) {unknown}; accepted: ['include_usage']",
                       f"stream_options.{unknown[0]}")
    return stream, boolean(so, "include_usage", param="stream_options.include_usage")


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


@dataclasses.dataclass(frozen=True)
class LogprobSettings:
    """What log-probs a request's choices carry.

    on: the tokens' log-probs (completions `logprobs` given, chat `logprobs: true`); top: the most
    likely alternatives per token (completions `logprobs=k`, chat `top_logprobs=k`); echo
    (completions): each choice's text begins with its prompt, and with `on` so do its log-probs.
    Without `top` a generated token's log-prob is the one recorded when it was drawn (under that
    distribution: temperature / top-k / top-p applied). Prompt tokens and, with `top`, every token
    are scored by one teacher-forced forward (`jdllm.score`: the model's own distribution), which
    only a causal model has."""

    on: bool = False
    top: int = 0
    echo: bool = False

    @property
    def scores_prompt(self) -> bool:
        return self.echo and self.on

    @property
    def scores(self) -> bool:
        return self.top > 0 or self.scores_prompt


def logprob_settings(body: dict, chat: bool, attention: str = "causal", stream: bool = False) -> LogprobSettings:
    """The request's `LogprobSettings`; a 400 naming the field for a bad value, for scoring on a
    diffusion model (`attention` not "causal"), and for top alternatives while streaming (they are
    scored once a choice is complete)."""
    if chat:
        on = boolean(body, "logprobs")
        top, name = number(body, "top_logprobs", 0, int, 0, MAX_TOP_LOGPROBS), "top_logprobs"
        if top and not on:
            raise ApiError(400, f"top_logprobs={top} needs logprobs: true", "top_logprobs")
        lp = LogprobSettings(on, top)
    else:
        name = "logprobs"
        lp = LogprobSettings(body.get("logprobs") is not None,
                             number(body, "logprobs", 0, int, 0, MAX_TOP_LOGPROBS), boolean(body, "echo"))
    if lp.scores and attention != "causal":
        what, use = ((f"{name}={lp.top} (top alternatives)", f"{name}=0 (the sampled tokens' log-probs)") if lp.top else
                     ("echo: true with logprobs (the prompt's log-probs)",
                      "echo without logprobs, or logprobs=0 without echo (the sampled tokens' log-probs)"))
        raise ApiError(400, f"{what} needs each token's log-prob given the tokens before it, which only a causal "
                            f"(autoregressive) model defines; this server's model has {attention} attention (a "
                            f"diffusion model); use {use}", name if lp.top else "echo")
    if lp.top and stream:
        raise ApiError(400, f"{name}={lp.top}: top alternatives are scored once a choice is complete; use stream: "
                            f"false (or {name}=0)", name)
    return lp


class Server:
    """Request parsing around one `Engine`: OpenAI fields -> engine arguments, or an `ApiError`."""

    def __init__(self, engine: Engine, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise errors.InputError(f"max_body_bytes={max_body_bytes!r} must be an integer >= 1")
        self.engine, self.model_name, self.max_body_bytes = engine, model_name, max_body_bytes
        self.tokenizer = engine.model.tokenizer
        self.created = int(time.time())
        self.longest_token = _longest_token(self.tokenizer)
        self.max_prompt_chars = engine.max_prompt_tokens * self.longest_token * PROMPT_CHARS_PER_TOKEN
        self._token_texts: dict[tuple[int, bool], str] = {}

    def _too_many_chars(self, n: int, param: str):
        return ApiError(400, f"the prompt has {n} characters, more than max_prompt_tokens="
                             f"{self.engine.max_prompt_tokens} tokens can hold (at most {self.longest_token} "
                             f"characters a token, x {PROMPT_CHARS_PER_TOKEN}: {self.max_prompt_chars} characters); "
                             "shorten it", param)

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

    def sampling(self, body: dict, max_default: int, max_names=("max_tokens",), chat: bool = False
                 ) -> tuple[Sampling, bool]:
        """The request's `Sampling` and whether it asks for per-step events (return_step_map); checks
        the fields (`check_fields`) and the model name."""
        check_fields(body, chat)
        model = body.get("model")
        if model is None:
            raise ApiError(400, "model is required", "model")
        if model != self.model_name:
            raise ApiError(400, f"model {model!r} is not served here; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "model", code="model_not_found")
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
        temperature = number(body, "temperature", 0.0, float)
        top_p = number(body, "top_p", 1.0, float)
        for name, check, v in (("temperature", inputs.check_temperature, temperature),
                               ("top_p", inputs.check_top_p, top_p)):
            try:  # the one rule of each (jdllm.Sampling, `jdllm generate`), the error naming its field
                check(v)
            except errors.JdllmError as e:
                raise ApiError(400, str(e), name) from None
        try:
            s = Sampling(temperature=temperature,
                         top_p=top_p, top_k=number({"top_k": top_k}, "top_k", 0, int, 0),
                         seed=number(body, "seed", 0, int, 0, 2**32 - 1), max_new_tokens=max_tokens,
                         stop_token_ids=None if stops is None else tuple(stops))
        except errors.JdllmError as e:
            raise ApiError(400, str(e)) from None
        return s, step_map

    def prompt_ids(self, prompt, what: str = "the prompt", param: str = "prompt") -> list[int]:
        """A completion's `prompt` (one text or one list of token ids) as token ids; a text longer than
        `max_prompt_chars` or a list longer than max_prompt_tokens is refused before any work. Can
        take a while (tokenizing): call it off the event loop. A batch: `prompt_batch`."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer; send the prompt as a list of token ids", "prompt")
            if not prompt:
                raise ApiError(400, "the prompt is empty", "prompt")
            if len(prompt) > self.max_prompt_chars:
                raise self._too_many_chars(len(prompt), "prompt")
            try:  # the CLI's check: a character the tokenizer cannot encode is named with its position
                ids = inputs.encode_text(self.tokenizer, prompt, 0,
                                         lambda: self.tokenizer.encode(prompt, add_special_tokens=False), what=what)
            except errors.JdllmError as e:
                raise ApiError(400, str(e), param) from None
            return [int(t) for t in ids]
        if isinstance(prompt, list) and len(prompt) > self.engine.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens, more than this server's max_prompt_tokens="
                                f"{self.engine.max_prompt_tokens}; shorten it", "prompt")
        if _token_list(prompt):
            return list(prompt)
        raise ApiError(400, PROMPT_FORMS, "prompt")

    def prompt_batch(self, prompt) -> list[list[int]]:
        """A completion's `prompt` as OpenAI takes it, one prompt or a batch: a text, a list of token
        ids, or a non-empty list of texts / token-id lists (`prompt_ids` each; an error in one names
        its index, e.g. `prompt[2]`). Call it off the event loop."""
        if isinstance(prompt, str) or _token_list(prompt):
            return [self.prompt_ids(prompt)]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, PROMPT_FORMS, "prompt")
        out = []
        for i, p in enumerate(prompt):
            try:
                out.append(self.prompt_ids(p))
            except ApiError as e:
                raise ApiError(e.status, f"prompt[{i}]: {e.message}", f"prompt[{i}]", e.type, e.code) from None
        return out

    def check_messages(self, messages) -> None:
        """A chat's `messages`: a non-empty list of {role, content[, name]} objects, roles among
        CHAT_ROLES, text content, no more characters in all than `max_prompt_chars`."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects with text content",
                           "messages")
        for i, m in enumerate(messages):
            unknown = sorted(set(m) - set(MESSAGE_KEYS))
            if unknown:
                raise ApiError(400, f"messages[{i}] has unknown key(s) {unknown}; accepted: {list(MESSAGE_KEYS)}",
                               f"messages[{i}].{unknown[0]}")
            if m["role"] not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role={m['role']!r} is not a role this server takes; accepted: "
                                    f"{list(CHAT_ROLES)}", f"messages[{i}].role")
            if m.get("name") is not None and not isinstance(m["name"], str):
                raise ApiError(400, f"messages[{i}].name={m['name']!r} must be a string", f"messages[{i}].name")
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.max_prompt_chars:
            raise self._too_many_chars(chars, "messages")

    def chat_ids(self, messages) -> list[int]:
        """A chat's `messages` as token ids (the chat template, or the contents joined by newlines).
        Can take a while (the template, tokenizing): call it off the event loop."""
        self.check_messages(messages)
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
        if len(messages) > 1:
            try:
                self.tokenizer.encode("\n", add_special_tokens=False)
            except Exception:  # noqa: BLE001 (tokenizers raise bare Exceptions)
                raise ApiError(400, f"this model has no chat template, so the {len(messages)} messages would be "
                                    "joined by newlines, which its tokenizer cannot encode; send one message, or "
                                    "the text as /v1/completions' prompt", "messages") from None
        return self.prompt_ids("\n".join(m["content"] for m in messages), "the messages' text", "messages")

    def fit(self, body: dict, sampling: Sampling, ids: list[int], names) -> Sampling:
        """A default max_tokens (none of `names` given) shrinks to what the model's context leaves
        after the prompt."""
        room = self.engine.cfg.max_position_embeddings - len(ids)
        if all(body.get(n) is None for n in names) and 1 <= room < sampling.max_new_tokens:
            return dataclasses.replace(sampling, max_new_tokens=room)
        return sampling

    def check_n(self, n: int, prompts: int = 1) -> None:
        """n choices of each prompt are n x prompts engine requests: more than the engine ever holds is
        a 400 naming n."""
        if n * prompts > self.engine.capacity:
            what = f"n={n} choices" if prompts == 1 else f"n={n} choices for each of {prompts} prompts"
            raise ApiError(400, f"{what} are more than this server ever holds at once (max_batch="
                                f"{self.engine.max_batch} rows + max_queue={self.engine.max_queue} waiting)", "n")

    def submit(self, ids, samplings: list[Sampling], step_map: bool, on_events, constraint=None):
        """`Engine.submit_many` (one prompt's ids, or one prompt per setting; all choices or none), its
        errors as `ApiError`s (429 queue full, 503 shutting down, else 400). Can take a while
        (compiling a constraint): call it off the event loop."""
        try:
            return self.engine.submit_many(ids, samplings, return_step_map=step_map, on_events=on_events,
                                           constraint=constraint)
        except errors.QueueFullError as e:
            raise ApiError(429, f"server overloaded: {e}", type_="rate_limit_error", code="queue_full") from None
        except errors.EngineStoppedError as e:
            raise ApiError(503, str(e), type_="server_error", code="shutting_down") from None
        except errors.ConstraintError as e:
            raise ApiError(400, str(e), "response_format") from None
        except errors.JdllmError as e:  # `Engine.check` names the input at fault as the error's field
            field = getattr(e, "field", None)
            err = ApiError(400, str(e), {"max_new_tokens": "max_tokens",
                                         "stop_token_ids": "jdllm.stop_token_ids"}.get(field, "prompt"))
            err.request_index = getattr(e, "request_index", None)  # `Engine.submit_many`: the request at fault
            raise err from None

    def text_of(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def token_text(self, t: int, special: bool = False) -> str:
        """One token's text, remembered (log-prob blocks name every token and its alternatives):
        `text_of([t])` (a special token is ""), or with `special` its own string (e.g. "<eos>": how
        alternatives are named, so they stay apart)."""
        s = self._token_texts.get((t, special))
        if s is None:
            tok = self.tokenizer
            s = (tok.decode([t], skip_special_tokens=False) if special else self.text_of([t])) if tok is not None else ""
            self._token_texts[(t, special)] = s
        return s

    def score(self, rows: list[list[int]], top: int):
        """`jdllm.score` of token-id rows under the served model (top alternatives each), SCORE_ROWS
        rows a call (bounded memory, a few compiled programs). Call it off the event loop."""
        from jdllm import scoring  # noqa: PLC0415

        out = []
        try:
            for i in range(0, len(rows), SCORE_ROWS):
                out += scoring.score(self.engine.model, rows[i:i + SCORE_ROWS], top_logprobs=top)
        except errors.JdllmError as e:
            raise ApiError(400, str(e), "prompt") from None
        return out


PROMPT_FORMS = "prompt must be a string, a list of token ids, or a non-empty list of either (a batch)"


def _token_list(prompt) -> bool:
    """Whether `prompt` is one prompt as token ids: a non-empty list of ints (not booleans)."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _longest_token(tokenizer) -> int:
    """The most characters one token stands for: its stored string (a byte-level BPE token's is
    one character a byte, a SentencePiece one's has its space as one character), special tokens
    included; 1 without a tokenizer."""
    if tokenizer is None:
        return 1
    try:
        toks = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    except Exception:  # noqa: BLE001 (a tokenizer without that method: a generous guess)
        return 64
    return max([len(t) for t in toks if isinstance(t, str)] + [1])


def too_deep(obj, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON data nests deeper than `limit` (the top-level value is depth 1); iterative."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        children = o.values() if isinstance(o, dict) else o
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_json(raw: bytes) -> dict:
    """A request body's JSON object (ApiError 400 when it is not one, or nests too deep)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body is JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if too_deep(body):
        raise ApiError(400, f"the request body is JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return body


def _too_large(max_bytes: int, size: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes or more, over this server's max_body_bytes={max_bytes} "
                         "(`jdllm serve --max-body-bytes`)", code="request_too_large")


async def read_body(request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict:
    """The request's JSON object body: 413 as soon as it passes `max_bytes` (by its Content-Length,
    or while it arrives), then parsed (a large one on a worker thread) and its depth checked."""
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes, int(length))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes, size)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) >= THREAD_PARSE_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


__all__ = ["ApiError", "Server", "read_body", "parse_json", "too_deep", "number", "boolean", "check_fields",
           "stream_settings", "stop_strings", "logprob_settings", "LogprobSettings", "MAX_TOP_LOGPROBS", "accepted_fields", "MAX_N", "MAX_STOPS",
           "JDLLM_OPTIONS", "DEFAULT_MAX_BODY_BYTES", "MAX_JSON_DEPTH", "PROMPT_CHARS_PER_TOKEN", "IGNORED_FIELDS",
           "NO_OP_VALUES", "CHAT_ROLES"]
