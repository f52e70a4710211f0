"""/v1/completions and /v1/chat/completions: one request's choices through the engine, answered
whole or streamed as server-sent events.

A request with `n` choices of each of its prompts (a completion's `prompt` may be a batch)
submits `n` engine requests per prompt together, all or none (choice p * n + j is prompt p's j-th
and samples with `seed + j`); their events come back on the engine's thread and are handed to the event loop
through a queue. `Choice` turns a choice's events into text (detokenized incrementally, cut
before a `stop` string, whose row is then aborted and freed at the next round), keeping its
tokens, log-probs and step map in step with the text; `Completion` runs the request and shapes
the response; a client that goes away has its choices aborted. Tokenizing and submitting (which
compiles a constraint) run on worker threads, never on the event loop.
"""

import asyncio
import dataclasses
import itertools
import json
import math
import time
import uuid

from jdllm.sampling import Sampling
from jdllm.serve.engine import Event
from jdllm.serve.openai_protocol import (MAX_N, ApiError, Server, logprob_settings, number, read_body,
                                         stop_strings, stream_settings)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Choice:
    """One choice's text as it streams: detokenized incrementally, cut before the first stop string
    (a tail that may begin one is held back until it cannot), with its tokens' log-probs.

    Tokens go out with their text: a token whose text is held back is held back too. After a stop
    string the choice keeps the tokens that reach into the text (one may straddle the stop string's
    start; its token string in `logprob_block` is cut there) and drops those wholly inside it, so
    the text, token ids, log-probs, step map and usage agree."""

    def __init__(self, index: int, srv: Server, stops: tuple[str, ...]):
        self.index, self.srv, self.stops = index, srv, stops
        self.ids: list[int] = []
        self.step_map: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""  # the text sent so far
        self.sent_ids = 0  # tokens sent so far
        self.finish: str | None = None
        self.cut = False  # ended by a stop string
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
        cut = self._cut(text) if self.stops else None
        if cut is not None:  # a stop string: the choice ends before it
            final, self.finish, self.cut = text[:cut], "stop", True
            keep = self._covering(final)
            del self.ids[keep:], self.step_map[keep:], self.logprobs[keep:]
        elif ev.kind == "done":
            final, self.finish, keep = text, ev.output.finish_reason, len(self.ids)
        else:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
                final = self.text
            else:
                hold = max((k for x in self.stops for k in range(1, len(x)) if text.endswith(x[:k])), default=0)
                final = text[:len(text) - hold]
            keep = len(self.ids) if final == text else self._within(final)
        delta = final[len(self.text):] if final.startswith(self.text) else ""
        self.text += delta
        keep = max(keep, self.sent_ids)
        new = slice(self.sent_ids, keep)
        self.sent_ids = keep
        return delta, new

    def _covering(self, final: str) -> int:
        """The fewest tokens whose text begins with `final` (those after it lie inside the stop string)."""
        for k in range(self.sent_ids, len(self.ids) + 1):
            if self.srv.text_of(self.ids[:k]).startswith(final):
                return k
        return len(self.ids)

    def _within(self, final: str) -> int:
        """The most tokens whose text lies within `final` (the rest wait with the held-back text)."""
        for k in range(len(self.ids), self.sent_ids, -1):
            if final.startswith(self.srv.text_of(self.ids[:k])):
                return k
        return self.sent_ids

    def logprob_block(self, sl: slice, chat: bool, base: int = 0, scored=None, at: int = 0):
        """The OpenAI `logprobs` object of the tokens `sl` (chat: `content`; completions: `tokens`,
        `token_logprobs`, `top_logprobs` and `text_offset`, each token's offset in the response's text,
        whose choice text begins at `base`: after the prompt's with echo). The log-probs are the
        recorded ones, or with `scored` (a `jdllm.Scores` of the prompt and this choice, whose tokens
        begin at `at`) the scored ones with their alternatives. After a stop string, the last
        token's string is cut where the text ends."""
        ids = self.ids[sl]
        toks = [self.srv.token_text(t) for t in ids]
        if scored is None:
            lps, alts = [float(x) for x in self.logprobs[sl]], None
        else:
            rows = range(at + sl.start, at + sl.start + len(ids))
            lps, alts = [scored.logprobs[i] for i in rows], [(scored.top_ids[i], scored.top_logprobs[i]) for i in rows]
        offsets, pos = [], base + (len(self.srv.text_of(self.ids[:sl.start])) if sl.start else 0)
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        if self.cut and toks and sl.stop >= len(self.ids):  # the last token may straddle the stop string
            toks[-1] = toks[-1][:max(0, base + len(self.text) - offsets[-1])]
        return token_block(self.srv, toks, ids, lps, alts, offsets, chat)


def _finite(x) -> float | None:
    """A log-prob for JSON: None where it is not a finite number (the prompt's first token)."""
    x = float(x)
    return x if math.isfinite(x) else None


def _alternatives(srv, ids, lps, chosen: int, chosen_lp, chat: bool):
    """One token's top alternatives (most likely first, the impossible left out), each named by its
    own string (special tokens too: `Server.token_text(special=True)`): chat a list of {token,
    logprob, bytes}; completions a {token string: log-prob} dict, OpenAI's, which also holds the
    chosen token (up to k + 1 entries)."""
    pairs = [(int(t), float(lp)) for t, lp in zip(ids, lps) if math.isfinite(float(lp))]
    name = lambda t: srv.token_text(t, special=True)  # noqa: E731
    if chat:
        return [{"token": name(t), "logprob": lp, "bytes": list(name(t).encode())} for t, lp in pairs]
    out: dict[str, float] = {}
    for t, lp in pairs:
        out.setdefault(name(t), lp)
    if chosen not in {t for t, _ in pairs} and chosen_lp is not None:
        out.setdefault(name(chosen), chosen_lp)
    return out


def token_block(srv, toks, ids, lps, alts, offsets, chat: bool) -> dict:
    """The `logprobs` object of tokens `ids` (their strings `toks`, log-probs `lps`, alternatives
    `alts`: one (ids, log-probs) per token or None for none, text offsets `offsets`)."""
    lps = [_finite(x) for x in lps]
    tops = [None if a is None else _alternatives(srv, *a, t, lp, chat) for t, lp, a in
            zip(ids, lps, alts)] if alts is not None else None
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [] if tops is None else tops[i]}
                            for i, (t, lp) in enumerate(zip(toks, lps))]}
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_block(srv, ids: list[int], scores, top: int) -> dict:
    """The completions `logprobs` object of an echoed prompt from its `jdllm.Scores`: the first
    token's log-prob and alternatives are null (it has no context), offsets from 0."""
    toks = [srv.token_text(t) for t in ids]
    offsets = [0, *itertools.accumulate(len(t) for t in toks[:-1])]
    alts = [None] + [(scores.top_ids[i], scores.top_logprobs[i]) for i in range(1, len(ids))] if top else None
    return token_block(srv, toks, ids, scores.logprobs[:len(ids)], alts, offsets, chat=False)


def join_blocks(a: dict, b: dict) -> dict:
    """Two completions `logprobs` objects one after the other (the echoed prompt's, the choice's)."""
    top = None if a["top_logprobs"] is None else a["top_logprobs"] + b["top_logprobs"]
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": top, "text_offset": a["text_offset"] + b["text_offset"]}


class Completion:
    """One completion or chat request in flight: its choices, each an engine request, and the queue
    their events arrive on. Parsing errors (n, stop, logprobs, constraint) raise `ApiError` here,
    before anything is submitted."""

    def __init__(self, srv: Server, request, body: dict, sampling: Sampling, step_map: bool, chat: bool):
        self.srv, self.request, self.chat = srv, request, chat
        self.prompts: list[list[int]] = []  # the prompts' ids (a completion's batch; a chat's one), set by `start`
        self.sampling, self.step_map = sampling, step_map
        self.stream, self.include_usage = stream_settings(body)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.n = number(body, "n", 1, int, 1, MAX_N)
        srv.check_n(self.n)
        self.stops, self.constraint = stop_strings(body), srv.constraint(body)
        self.lp = logprob_settings(body, chat, srv.engine.cfg.attention, self.stream)
        self.zero = False  # max_tokens=0 with echo: the prompts scored, nothing generated (`completions`)
        self.echo_texts: list[str] = []  # each prompt's text, with echo
        self.prompt_scores = None  # echo with logprobs=0: each prompt's `jdllm.Scores`
        self.choice_scores = None  # logprobs=k: each choice's prompt and tokens scored, once all are done
        self.choices: list[Choice] = []  # n per prompt, prompt-major (OpenAI's index), made by `start`
        self.settings: list[Sampling] = []
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = 0

    def start(self, prompts: list[list[int]], samplings: list[Sampling]) -> None:
        """The choices of `prompts` (each with its own `Sampling`): choice p * n + j is prompt p's j-th,
        sampling with seed + j, so a batch's choices equal those of one request per prompt (greedy
        choices of one prompt are all the same)."""
        self.srv.check_n(self.n, len(prompts))
        self.prompts = prompts
        self.choices = [Choice(p * self.n + j, self.srv, self.stops)
                        for p in range(len(prompts)) for j in range(self.n)]
        self.settings = [s if j == 0 else dataclasses.replace(s, seed=(s.seed + j) % 2**32)
                         for s in samplings for j in range(self.n)]
        self.echo_texts = [self.srv.text_of(p) for p in prompts] if self.lp.echo else [""] * len(prompts)

    def prompt_of(self, c: Choice) -> list[int]:
        return self.prompts[c.index // self.n]

    async def score_prompts(self) -> None:
        """Echo with logprobs=0: each prompt's log-probs, scored before its choices run (a stream
        sends them first)."""
        if self.lp.scores_prompt and not self.lp.top:
            self.prompt_scores = await asyncio.to_thread(self.srv.score, self.prompts, 0)

    async def score_choices(self) -> None:
        """logprobs=k: every choice (its prompt and its tokens) scored with k alternatives, once all are done."""
        if self.lp.top:
            rows = [self.prompt_of(c) + c.ids for c in self.choices]
            self.choice_scores = await asyncio.to_thread(self.srv.score, rows, self.lp.top)

    def nothing_to_generate(self) -> None:
        """max_tokens=0 (echo): every choice is its prompt alone, done without an engine request."""
        for c in self.choices:
            c.finish, c.nfe = "length", 0
        self.created = int(time.time())

    async def submit(self) -> None:
        """One engine request per choice (`start`), submitted together on a worker thread (compiling a
        constraint takes host time): all are queued, or none (nothing to abort)."""
        ids = [self.prompts[c.index // self.n] for c in self.choices]
        try:
            reqs = await asyncio.to_thread(self.srv.submit, ids, self.settings, self.step_map,
                                           [self._listener(c.index) for c in self.choices], self.constraint)
        except ApiError as e:  # in a batch, name the prompt at fault (request i is choice i: prompt i // n)
            i = getattr(e, "request_index", None)
            if i is None or e.param != "prompt" or len(self.prompts) == 1:
                raise
            p = i // self.n
            raise ApiError(e.status, f"prompt[{p}]: {e.message}", f"prompt[{p}]", e.type, e.code) from None
        for c, r in zip(self.choices, reqs):
            c.request = r
        self.created = int(time.time())

    def _listener(self, i: int):
        return lambda ev: self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))

    def abort_rest(self) -> None:
        for c in self.choices:
            if not c.done and c.request is not None:
                self.srv.engine.abort(c.request.id)

    async def next_event(self, stream: bool):
        """(choice, event, delta text, new token slice) for the next event of a running choice; None
        when the client went away (checked while waiting, unless streaming)."""
        while True:
            if stream:
                i, ev = await self.queue.get()
            else:
                try:
                    i, ev = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await self.request.is_disconnected():
                        return None
                    continue
            c = self.choices[i]
            if c.done:  # events queued before a stop string aborted it
                continue
            if ev.kind == "error":
                raise ApiError(503, ev.message, type_="server_error")
            if ev.kind == "steps":
                return c, ev, "", slice(0, 0)
            delta, new = c.feed(ev)
            if c.done and ev.kind != "done":  # a stop string: its row is freed at the next round
                self.srv.engine.abort(c.request.id)
            return c, ev, delta, new

    # ----------------------------------------------------------------- answered whole
    async def collect(self) -> dict | None:
        """The whole response once every choice is done; None when the client went away."""
        try:
            while not all(c.done for c in self.choices):
                if await self.next_event(stream=False) is None:
                    self.abort_rest()
                    return None
        except (asyncio.CancelledError, ApiError):
            self.abort_rest()
            raise
        await self.score_choices()
        out = [self._choice_body(c) for c in self.choices]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.srv.model_name, "choices": out, "usage": self.usage()}

    def usage(self) -> dict:
        """Each prompt's tokens (once, whatever n) and every choice's generated tokens."""
        n, k = sum(len(p) for p in self.prompts), sum(len(c.ids) for c in self.choices)
        return {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}

    def _echo(self, c: Choice) -> str:
        return self.echo_texts[c.index // self.n]

    def _logprobs(self, c: Choice) -> dict:
        """A whole choice's `logprobs` object: with echo its prompt's, then its tokens'."""
        scored = None if self.choice_scores is None else self.choice_scores[c.index]  # choice i is choices[i]
        own = c.logprob_block(slice(0, len(c.ids)), self.chat, len(self._echo(c)), scored, len(self.prompt_of(c)))
        if not self.lp.echo:
            return own
        return join_blocks(self._prompt_block(c, scored), own)

    def _prompt_block(self, c: Choice, scored=None) -> dict:
        scores = self.prompt_scores[c.index // self.n] if scored is None else scored
        return prompt_block(self.srv, self.prompt_of(c), scores, self.lp.top)

    def _choice_body(self, c: Choice) -> dict:
        d = {"index": c.index, "finish_reason": c.finish,
             "logprobs": self._logprobs(c) if self.lp.on else None,
             "jdllm": {"token_ids": c.ids, "step_map": c.step_map, "nfe": c.nfe}}
        if self.constraint is not None:
            d["jdllm"]["constraint_ok"] = c.constraint_ok
        if self.chat:
            d["message"] = {"role": "assistant", "content": c.text}
        else:
            d["text"] = self._echo(c) + c.text
        return d

    # ----------------------------------------------------------------- streamed
    async def events(self):
        """The server-sent events: `data: {chunk}` per choice delta (and per step event on request),
        with stream_options.include_usage a last chunk with no choices and the usage, then
        `data: [DONE]`; an engine error becomes one `data: {"error": ...}`."""
        try:
            if self.chat:
                for c in self.choices:
                    yield self._sse(self._chunk(c, None, None, {}, first=True))
            if self.lp.echo:  # the prompt first (a prompt alone, max_tokens=0: its choice ends here)
                for c in self.choices:
                    extra = {"token_ids": [], "step_map": [], **({"nfe": c.nfe} if c.done else {})}
                    yield self._sse(self._chunk(c, self._echo(c), c.finish, extra,
                                                self._prompt_block(c) if self.lp.on else None))
            failed = False
            while not all(c.done for c in self.choices):
                try:
                    c, ev, delta, new = await self.next_event(stream=True)
                except ApiError as e:
                    yield "data: " + json.dumps(e.body()) + "\n\n"
                    failed = True
                    break
                d = self._event_chunk(c, ev, delta, new)
                if d is not None:
                    yield self._sse(d)
            if self.include_usage and not failed:
                yield self._sse(None, usage=self.usage())
            yield "data: [DONE]\n\n"
        finally:
            self.abort_rest()

    def _event_chunk(self, c: Choice, ev: Event, delta: str, new: slice) -> dict | None:
        if ev.kind == "steps":
            return self._chunk(c, None, None, {"revealed": [
                {"position": p, "step": st, "token_id": t} for p, st, t in zip(ev.positions, ev.steps, ev.token_ids)]})
        lp = c.logprob_block(new, self.chat, len(self._echo(c))) if self.lp.on else None
        extra = {"token_ids": c.ids[new], "step_map": c.step_map[new]}
        if c.done:
            extra["nfe"] = c.nfe
            if self.constraint is not None:
                extra["constraint_ok"] = c.constraint_ok
        if delta or new.stop > new.start or c.done:
            return self._chunk(c, delta, c.finish, extra, lp)
        return None

    def _chunk(self, c: Choice, text: str | None, finish, extra: dict, lp=None, first: bool = False) -> dict:
        d = {"index": c.index, "finish_reason": finish, "jdllm": extra}
        if self.chat:
            delta = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            d["delta"] = delta
            d["logprobs"] = lp
        else:
            d["text"], d["logprobs"] = text or "", lp
        return d

    def _sse(self, d: dict | None, usage: dict | None = None) -> str:
        """One chunk: choice `d`, or (d None) the usage chunk; with include_usage every chunk has a
        `usage` key, null but in the last."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.srv.model_name,
                 "choices": [] if d is None else [d]}
        if self.include_usage:
            chunk["usage"] = usage
        return "data: " + json.dumps(chunk) + "\n\n"


async def respond(run: Completion, body: dict, prompts: list[list[int]], names):
    """Run one parsed request on its prompts (each its own default max_tokens, `Server.fit`): the
    whole response (a dict), 499 when the client went away, or a stream."""
    from fastapi.responses import JSONResponse, StreamingResponse  # noqa: PLC0415 (the serve extra)

    run.start(prompts, [run.srv.fit(body, run.sampling, ids, names) for ids in prompts])
    await run.score_prompts()
    if run.zero:
        run.nothing_to_generate()
    else:
        await run.submit()
    if not run.stream:
        out = await run.collect()
        return JSONResponse({}, status_code=499) if out is None else out
    return StreamingResponse(run.events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def completions(srv: Server, request):
    """POST /v1/completions: every field checked, then the prompt tokenized off the event loop."""
    body = await read_body(request, srv.max_body_bytes)
    zero = body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    if zero and body.get("echo") is not True:
        raise ApiError(400, "max_tokens=0 generates nothing; it is accepted only with echo: true (the prompt "
                            "alone, with logprobs its log-probs)", "max_tokens")
    sampling, step_map = srv.sampling(dict(body, max_tokens=None) if zero else body, min(16, srv.engine.max_new_tokens))
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", "prompt")
    run = Completion(srv, request, body, sampling, step_map, chat=False)
    if zero and run.constraint is not None:
        raise ApiError(400, "max_tokens=0 generates nothing to constrain", "max_tokens")
    run.zero = zero
    prompts = await asyncio.to_thread(srv.prompt_batch, body["prompt"])
    return await respond(run, body, prompts, ("max_tokens",))


async def chat_completions(srv: Server, request):
    """POST /v1/chat/completions: every field checked, then the chat template and tokenizer run off
    the event loop."""
    body = await read_body(request, srv.max_body_bytes)
    names = ("max_tokens", "max_completion_tokens")
    sampling, step_map = srv.sampling(body, srv.engine.max_new_tokens, names, chat=True)
    srv.check_messages(body.get("messages"))
    run = Completion(srv, request, body, sampling, step_map, chat=True)
    ids = await asyncio.to_thread(srv.chat_ids, body["messages"])
    return await respond(run, body, [ids], names)


__all__ = ["Choice", "Completion", "completions", "chat_completions", "respond", "token_block", "prompt_block",
           "join_blocks"]
