"""`jdllm serve` over real HTTP on 127.0.0.1 (a random free port): OpenAI-style errors, the official
`openai` client under concurrency (every request answered once, greedy outputs equal to offline
generate()), SSE streaming, a disconnecting client freeing its row, a full queue answering 429."""

from __future__ import annotations

import concurrent.futures
import json
import re
import os
import threading
import time
import types

import httpx
import numpy as np
import pytest

import jdllm
from jdllm.serve.engine import Engine
from jdllm.serve.server import create_app
from tests.decode_fixtures import FAST_COMPILE
from tests.quick import slow

uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny-ar"


@pytest.fixture(scope="module")
def server():
    """(base url, engine, model): tiny-ar served by uvicorn on a thread; always shut down. float32: the
    tests compare served log-probs with offline `generate` to 1e-5, which bfloat16 cannot promise
    between a pool of rows and one row (XLA:CPU rounds a matmul per batch shape)."""
    model = jdllm.load(os.path.join(ROOT, "models", "tiny-ar"), dtype="float32")
    engine = Engine(model, max_batch=4, max_prompt_tokens=48, max_new_tokens=24, max_queue=64, steps_per_round=2,
                    compiler_options=FAST_COMPILE, constraint_states=16, constraint_classes=16)
    config = uvicorn.Config(create_app(engine, NAME), host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        deadline = time.time() + 60
        while not srv.started:
            assert time.time() < deadline and t.is_alive(), "the server did not start"
            time.sleep(0.05)
        port = srv.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", engine, model
    finally:
        srv.should_exit = True
        t.join(timeout=30)
    assert not t.is_alive()


def _err(r: httpx.Response, status: int, needle: str):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert needle in e["message"] and e["type"]
    return e


@slow
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    url, engine, _ = server
    post = lambda body, **kw: httpx.post(f"{url}/v1/completions", timeout=60, **kw,  # noqa: E731
                                         **({"json": body} if body is not None else {}))
    _err(post(None, content=b"{not json", headers={"content-type": "application/json"}), 400, "not valid JSON")
    _err(post({"model": "gpt-9", "prompt": "a"}), 400, "'gpt-9' is not served")
    assert _err(post({"model": NAME, "prompt": "a", "max_tokens": -1}), 400, "max_tokens=-1")["param"] == "max_tokens"
    _err(post({"model": NAME, "prompt": "1" * 49}), 400, "max_prompt_tokens=48")
    _err(post({"model": NAME, "prompt": "1" * 45, "max_tokens": 24}), 400, "max_position_embeddings=64")
    _err(post({"model": NAME, "prompt": "a", "jdllm": {"block_length": 8}}), 400, "unknown jdllm option")
    _err(post({"model": NAME, "prompt": "a", "temperature": "hot"}), 400, "temperature")
    _err(httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": "hi"}, timeout=60), 400, "messages")
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,  # default max_tokens: what the context leaves
                   json={"model": NAME, "messages": [{"role": "user", "content": "1" * 44}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 64 - 44
    r = post({"model": NAME, "prompt": "sort:3 1 2=", "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == NAME
    h = httpx.get(f"{url}/health").json()
    assert h["status"] == "ok" and h["rows"] == 4
    gate, real = threading.Event(), engine.step_round
    engine.step_round = lambda: (gate.wait(60), real())  # rounds wait: what is submitted stays queued
    engine.max_queue = 0  # the four rows take four requests, none may wait beyond them
    try:
        held = [engine.submit([5, 6], jdllm.Sampling(max_new_tokens=2)) for _ in range(4)]
        _err(post({"model": NAME, "prompt": "a"}), 429, "max_queue=0")
    finally:
        engine.max_queue = 64
        gate.set()
        engine.step_round = real
    deadline = time.time() + 60
    while not all(r.status == "done" for r in held):
        assert time.time() < deadline
        time.sleep(0.05)


@slow
@pytest.mark.usefixtures("fast_compile")
def test_openai_client_concurrent_load_equals_offline(server):
    """32 requests from 12 concurrent `openai` clients, completions and chat, streamed and not:
    each answered exactly once, each greedy output equal to generate() on its prompt alone."""
    url, engine, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    jobs = []
    for i in range(32):
        a, b = i % 10, (i * 7) % 10
        prompt = [f"add:{a}+{b}=", f"sort:{a} {b} {(a + 3) % 10}=", f"rev:{a}{b}{i % 4}="][i % 3]
        jobs.append((i, prompt, 4 + (i * 5) % 13, i % 2 == 0, i % 4 == 3))

    def call(job):
        i, prompt, n, stream, chat = job
        kw = dict(model=NAME, max_tokens=n, stream=stream, extra_body={"jdllm": {"stop_token_ids": []}})
        if chat:
            res = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
        else:
            res = client.completions.create(prompt=prompt, **kw)
        if not stream:
            c = res.choices[0]
            return i, (c.message.content if chat else c.text), c.model_extra["jdllm"]["token_ids"], c.finish_reason
        text, ids, finish, ids_seen = "", [], None, set()
        for chunk in res:
            c = chunk.choices[0]
            text += (c.delta.content or "") if chat else c.text
            ids += (c.model_extra.get("jdllm") or {}).get("token_ids", [])
            finish = c.finish_reason or finish
            ids_seen.add(chunk.id)
        assert len(ids_seen) == 1
        return i, text, ids, finish

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(call, jobs))
    assert sorted(r[0] for r in results) == list(range(32))
    for (i, prompt, n, _, _), (_, text, ids, finish) in zip(jobs, results):
        want = jdllm.generate(model, [prompt], sampling=jdllm.Sampling(max_new_tokens=n, stop_token_ids=()))[0]
        assert (ids, text, finish) == (want.token_ids, want.text, want.finish_reason), (i, prompt)
    h = httpx.get(f"{url}/health").json()
    assert (h["rows_busy"], h["waiting"], h["tracked"]) == (0, 0, 0)


@slow
def test_disconnect_mid_stream_frees_the_row(server):
    url, engine, _ = server
    slow = threading.Event()
    real = engine.step_round

    def step_round():  # a slow pool, so the client leaves while its request still decodes
        real()
        if slow.is_set():
            time.sleep(0.5)

    engine.step_round, steps = step_round, engine.steps_per_round
    engine.steps_per_round = 1  # 24 rounds of 0.5 s if it were left to finish
    slow.set()
    try:
        body = {"model": NAME, "prompt": "add:1+2=", "max_tokens": 24, "stream": True,
                "jdllm": {"stop_token_ids": []}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    break
            h = engine.stats()
            assert h["rows_busy"] == 1, h
            aborted = h["aborted"]
        deadline = time.time() + 5
        while (h := httpx.get(f"{url}/health").json())["rows_busy"] or h["tracked"]:
            assert time.time() < deadline, h
            time.sleep(0.05)
        assert h["aborted"] == aborted + 1  # freed by the disconnect, not by finishing
        rounds = h["rounds"]
        time.sleep(0.3)
        assert httpx.get(f"{url}/health").json()["rounds"] == rounds  # nothing left decoding
    finally:
        slow.clear()
        engine.step_round, engine.steps_per_round = real, steps


def test_cli_serve_refuses_a_paradigm_the_model_cannot_run(capsys):
    from jdllm.cli import main

    assert main(["serve", os.path.join(ROOT, "models", "tiny-sdar"), "--paradigm", "ar"]) == 2
    assert "needs a causal model" in capsys.readouterr().err


@slow
@pytest.mark.usefixtures("fast_compile")
def test_stop_strings_n_choices_and_logprobs_equal_offline(server):
    """`stop` cuts a choice before its first stop string (streamed or not, the row freed early);
    n=3 sampled choices each equal generate() alone with seed + i; logprobs are the recorded ones."""
    url, engine, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    prompt, free = "sort:7 3 9 1 5=", jdllm.Sampling(max_new_tokens=16, stop_token_ids=())
    want = jdllm.generate(model, [prompt], sampling=free)[0]
    j = next(j for j in range(2, len(want.text) - 1) if want.text.find(want.text[j:j + 2]) == j)
    stop = want.text[j:j + 2]
    decode = lambda ids: model.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    k = next(k for k in range(1, 17) if stop in decode(want.token_ids[:k]))  # the token completing the stop
    m = next(m for m in range(17) if decode(want.token_ids[:m]).startswith(want.text[:j]))  # those before it
    kw = dict(model=NAME, prompt=prompt, max_tokens=16, stop=[stop, "\x00never"],
              extra_body={"jdllm": {"stop_token_ids": []}})
    res = client.completions.create(**kw, logprobs=0)
    c = res.choices[0]
    assert (c.text, c.finish_reason) == (want.text[:j], "stop")
    # text, tokens, log-probs, offsets and usage agree: cut at the stop string (issue 32: the tokens
    # kept the stop string's tokens)
    assert c.model_extra["jdllm"]["token_ids"] == want.token_ids[:m] and res.usage.completion_tokens == m
    assert "".join(c.logprobs.tokens) == c.text and max(c.logprobs.text_offset) < len(c.text)
    assert k <= c.model_extra["jdllm"]["nfe"] <= want.nfe  # forwards by the round the stop string completed
    np.testing.assert_allclose(c.logprobs.token_logprobs, want.logprobs[:m], atol=1e-5)
    text, finish, ids = "", None, []
    for ch in client.completions.create(**kw, stream=True):
        text += ch.choices[0].text
        ids += ch.choices[0].model_extra["jdllm"]["token_ids"]
        finish = ch.choices[0].finish_reason or finish
    assert (text, finish, ids) == (want.text[:j], "stop", want.token_ids[:m])

    hot = dict(temperature=0.9, top_k=0, stop_token_ids=(), max_new_tokens=10)
    res = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello"}], n=3,
                                         max_tokens=10, temperature=0.9, seed=11, logprobs=True,
                                         extra_body={"jdllm": {"stop_token_ids": []}})
    chat_ids = engine.model.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                                          add_generation_prompt=True, tokenize=True) \
        if getattr(engine.model.tokenizer, "chat_template", None) else None
    assert [c.index for c in res.choices] == [0, 1, 2]
    for c in res.choices:
        s = jdllm.Sampling(seed=11 + c.index, **hot)
        w = jdllm.generate(model, [chat_ids if chat_ids else "hello"], sampling=s)[0]
        assert (c.message.content, c.model_extra["jdllm"]["token_ids"]) == (w.text, w.token_ids)
        np.testing.assert_allclose([t.logprob for t in c.logprobs.content], w.logprobs, atol=1e-5)
    assert len({tuple(c.model_extra["jdllm"]["token_ids"]) for c in res.choices}) > 1  # really sampled apart
    streamed = {}
    for ch in client.completions.create(model=NAME, prompt="hello", n=2, max_tokens=10, temperature=0.9,
                                        seed=11, stream=True, extra_body={"jdllm": {"stop_token_ids": []}}):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    for i in (0, 1):
        assert streamed[i] == jdllm.generate(model, ["hello"], sampling=jdllm.Sampling(seed=11 + i, **hot))[0].text
    bad = {"model": NAME, "prompt": "a", "logprobs": 21}
    _err(httpx.post(f"{url}/v1/completions", json=bad, timeout=60), 400, "logprobs=21")
    _err(httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "a", "n": 99}, timeout=60), 400, "n=99")
    _err(httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "a", "stop": [""]}, timeout=60), 400,
         "stop=")
    h = httpx.get(f"{url}/health").json()
    assert (h["rows_busy"], h["waiting"], h["tracked"]) == (0, 0, 0)


@slow
@pytest.mark.usefixtures("fast_compile")
def test_constraints_through_response_format_equal_offline(server):
    """response_format json_schema and jdllm.regex / choice run on the device beside free requests
    (the pool holds every row's DFA table) and equal generate(constraint=...) on the DFA backend."""
    url, engine, model = server
    from jdllm import constraints as C

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    schema = {"type": "integer", "minimum": 0}
    cases = [("hello", dict(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}),
              C.json_schema(schema, backend="dfa")),
             ("sort:3 1 2=", dict(extra_body={"jdllm": {"regex": "[a-c]+"}}), C.regex("[a-c]+", backend="dfa")),
             ("rev:abc=", dict(extra_body={"jdllm": {"choice": ["ab", "ba c"]}}), C.choice(["ab", "ba c"], backend="dfa")),
             ("add:4+5=", {}, None)]

    def call(case):
        prompt, kw, _ = case
        return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=12, **kw).choices[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(call, cases))
    for (prompt, _, c), g in zip(cases, got):
        w = jdllm.generate(model, [prompt], sampling=jdllm.Sampling(max_new_tokens=12), constraint=c)[0]
        assert (g.message.content, g.model_extra["jdllm"]["token_ids"]) == (w.text, w.token_ids), prompt
        assert g.model_extra["jdllm"].get("constraint_ok") == w.constraint_ok
    assert got[0].message.content.isdigit() and re.fullmatch("[a-c]+", got[1].message.content)  # free: "1 2 3"
    assert got[2].message.content in ("ab", "ba c")
    post = lambda body: httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "a", **body},  # noqa: E731
                                   timeout=60)
    _err(post({"response_format": {"type": "json_object"}}), 400, "json_object")
    _err(post({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}), 400,
         "passes 64 states while being built")  # any JSON object: refused as its automaton grows past 4 x 16
    _err(post({"jdllm": {"regex": "[a-c]{6}"}, "max_tokens": 4}), 400, "max_tokens")
    _err(post({"jdllm": {"regex": "[a-z]{30}"}}), 400, "at most 16 states")
    _err(post({"jdllm": {"regex": "("}}), 400, "regex")
    _err(post({"jdllm": {"regex": "a", "choice": ["b"]}}), 400, "give one constraint")


# --------------------------------------------------------------------------- issue 32: no request stalls another
def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _raw_post(url: str, path: str, body: bytes, **kw) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=300, **kw)


@slow
def test_no_request_stalls_another(server):
    """While a pathological request is handled (a 10 MB body, a 3 MB prompt or chat message, JSON
    nested 50,000 deep, a regex whose DFA blows up), /health and a small completion answer in under a
    second, and the pathological request gets its 4xx within seconds (issue 32: /health took 22 s behind
    a 10 MB prompt, the nested JSON was a 500, the regex took 112 s)."""
    url, engine, _ = server
    small = {"model": NAME, "prompt": "add:1+2=", "max_tokens": 4}
    assert httpx.post(f"{url}/v1/completions", json=small, timeout=120).status_code == 200  # compiled
    chat = {"model": NAME, "messages": [{"role": "user", "content": "1" * (3 << 20)}]}
    cases = [
        ("10 MB body", "/v1/completions", json.dumps({"model": NAME, "prompt": "1" * (10 << 20)}), 413,
         "max_body_bytes"),
        ("3 MB prompt", "/v1/completions", json.dumps({"model": NAME, "prompt": "1 " * (3 << 19)}), 400,
         "characters"),
        ("3 MB chat message", "/v1/chat/completions", json.dumps(chat), 400, "characters"),
        ("JSON nested 50,000 deep", "/v1/completions",
         f'{{"model": "{NAME}", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", 400, "nested"),
        ("a DFA that blows up", "/v1/completions",
         json.dumps({"model": NAME, "prompt": "a", "jdllm": {"regex": "[ab]*a[ab]{14}"}}), 400,
         "while being built"),
    ]
    for name, path, body, status, needle in cases:
        got: dict = {}

        def send():
            got["response"], got["seconds"] = _timed(lambda: _raw_post(url, path, body.encode()))

        worker = threading.Thread(target=send)
        worker.start()
        health, answered = [], None
        while worker.is_alive() or not health:
            r, dt = _timed(lambda: httpx.get(f"{url}/health", timeout=300))
            assert r.status_code == 200
            health.append(dt)
            if answered is None:
                r, answered = _timed(lambda: httpx.post(f"{url}/v1/completions", json=small, timeout=300))
                assert r.status_code == 200, r.text
        worker.join()
        assert max(health) < 1.0 and answered < 1.0, (name, max(health), answered)
        _err(got["response"], status, needle)
        assert got["seconds"] < 10, (name, got["seconds"])
    h = httpx.get(f"{url}/health").json()
    assert (h["rows_busy"], h["waiting"], h["tracked"]) == (0, 0, 0)


@slow
def test_body_size_json_depth_and_prompt_length_bounds(server):
    """413 beyond max_body_bytes (default 4 MiB; announced by Content-Length or not), 400 for JSON nested
    deeper than 64 or a prompt past the cheap length bound, each an OpenAI-shaped error; at the
    bounds, requests are served."""
    url, engine, _ = server
    from jdllm.serve import openai_protocol as P

    assert create_app(engine, NAME).state.server.max_body_bytes == P.DEFAULT_MAX_BODY_BYTES == 4 << 20
    big = json.dumps({"model": NAME, "prompt": "1" * (5 << 20)}).encode()
    e = _err(_raw_post(url, "/v1/completions", big), 413, "max_body_bytes=4194304")
    assert e["type"] == "invalid_request_error" and e["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + 1 << 16]

    _err(_raw_post(url, "/v1/completions", chunks()), 413, "max_body_bytes")
    deep = lambda d: f'{{"model": "{NAME}", "prompt": "a", "stop": ' + "[" * d + "]" * d + "}"  # noqa: E731
    _err(_raw_post(url, "/v1/completions", deep(P.MAX_JSON_DEPTH).encode()), 400, f"deeper than {P.MAX_JSON_DEPTH}")
    _err(_raw_post(url, "/v1/completions", deep(P.MAX_JSON_DEPTH - 1).encode()), 400, "stop=")  # parsed, then checked
    limit = create_app(engine, NAME).state.server.max_prompt_chars
    assert limit == 48 * 6 * P.PROMPT_CHARS_PER_TOKEN  # max_prompt_tokens x the longest token ('<mask>') x 2
    e = _err(httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "1" * (limit + 1)}, timeout=60), 400,
             f"{limit + 1} characters")
    assert e["param"] == "prompt" and "max_prompt_tokens=48" in e["message"]
    _err(httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "1" * limit}, timeout=60), 400,
         "the prompt has")  # tokenized: the engine's own count
    e = _err(httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": [5] * 49}, timeout=60), 400,
             "49 tokens")
    assert "max_prompt_tokens=48" in e["message"]
    ok = {"model": NAME, "prompt": "add:1+2=", "max_tokens": 2, "stop": "x"}
    assert httpx.post(f"{url}/v1/completions", json=ok, timeout=60).status_code == 200


# --------------------------------------------------------------------------- issue 32: strict OpenAI handling
@slow
def test_non_finite_numbers_untokenizable_text_field_names_and_unknown_routes(server):
    """What a client can send that used to answer badly: NaN / Infinity / 1e999 in an integer field
    (a 500: int() of them raised), text the tokenizer cannot encode (the tokenizer's own message),
    messages joined by a newline the tokenizer lacks, ids past int64, stop ids and top_p named as
    the param at fault (it was "prompt" / null), and an unknown route or method (FastAPI's
    {"detail"} body): each a 4xx in OpenAI's error shape naming the field."""
    url, _, _ = server
    raw = lambda text, path="/v1/completions": httpx.post(  # noqa: E731
        f"{url}{path}", content=text.encode(), headers={"content-type": "application/json"}, timeout=60)
    for field, v in (("max_tokens", "NaN"), ("max_tokens", "1e999"), ("n", "Infinity"), ("seed", "NaN"),
                     ("max_tokens", "-Infinity")):
        e = _err(raw(f'{{"model": "{NAME}", "prompt": "a", "{field}": {v}}}'), 400, f"{field}=")
        assert e["param"] == field and "must be an integer" in e["message"], e
    for v in ("NaN", "2", "0"):
        assert _err(raw(f'{{"model": "{NAME}", "prompt": "a", "top_p": {v}}}'), 400, "top_p=")["param"] == "top_p"
    post = lambda body, path="/v1/completions": httpx.post(f"{url}{path}", json={"model": NAME, **body},  # noqa: E731
                                                            timeout=60)
    e = _err(post({"prompt": "sort:Hello"}), 400, "the prompt has 'H' (U+0048) at position 5, which the tokenizer "
                                                  "cannot encode")
    assert e["param"] == "prompt"
    assert _err(post({"prompt": ["a", "bX"]}), 400, "prompt[1]: the prompt has 'X'")["param"] == "prompt[1]"
    e = _err(post({"messages": [{"role": "system", "content": "sort"}, {"role": "user", "content": "3 1="}]},
                  "/v1/chat/completions"), 400, "joined by newlines, which its tokenizer cannot encode")
    assert e["param"] == "messages"
    assert _err(post({"messages": [{"role": "user", "content": "a?"}]}, "/v1/chat/completions"), 400,
                "the messages' text has '?'")["param"] == "messages"
    _err(post({"prompt": [5, 2**63]}), 400, f"token id {2**63} in prompt is outside the vocabulary")
    for stops, needle in (([999], "stop token id 999 is outside the vocabulary"),
                          (list(range(1, 21)), "20 stop token ids; a request may carry at most")):
        e = _err(post({"prompt": "a", "jdllm": {"stop_token_ids": stops}}), 400, needle)
        assert e["param"] == "jdllm.stop_token_ids", e
    assert _err(post({"prompt": "1" * 45, "max_tokens": 24}), 400, "max_position_embeddings")["param"] == "prompt"
    e = _err(httpx.get(f"{url}/v1/completions", timeout=60), 405, "GET /v1/completions: method not allowed")
    assert "POST" in e["message"] and e["code"] == "method_not_allowed"
    e = _err(httpx.get(f"{url}/v1/nothing", timeout=60), 404, "GET /v1/nothing: no such route")
    assert "POST /v1/chat/completions" in e["message"] and e["code"] == "not_found"
    assert post({"prompt": "sort:3 1 2=", "max_tokens": 4}).status_code == 200  # still serving


@slow
def test_strict_fields_booleans_and_roles(server):
    """Booleans are booleans; unknown top-level fields, message roles and message keys are 400s naming
    them; the documented no-op values of unimplemented fields and the ignored `user` are accepted."""
    url, _, _ = server
    post = lambda path, body: httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=60)  # noqa: E731
    cmpl = lambda body: post("/v1/completions", {"prompt": "a", "max_tokens": 2, **body})  # noqa: E731
    chat = lambda body, **m: post("/v1/chat/completions",  # noqa: E731
                                  {"messages": [{"role": "user", "content": "a", **m}], "max_tokens": 2, **body})
    for v in ("false", "yes", 1, 0):
        assert _err(cmpl({"stream": v}), 400, f"stream={v!r} must be true or false")["param"] == "stream"
        assert _err(chat({"stream": v}), 400, "must be true or false")["param"] == "stream"
    for field, v in (("foo", 1), ("suffix", "x"), ("presence_penalty", 0.5), ("frequency_penalty", -1),
                     ("logit_bias", {"5": 1})):
        e = _err(cmpl({field: v}), 400, field)
        assert e["param"] == field, e
    e = _err(cmpl({"foo": 1, "bar": 2}), 400, "unknown field(s) ['bar', 'foo']")
    assert "user" in e["message"]  # the accepted fields are listed
    _err(chat({"best_of": 2}), 400, "best_of")  # a completions field
    assert _err(chat({}, role="wizard"), 400, "'wizard'")["param"] == "messages[0].role"
    assert _err(chat({}, tool_call_id="x"), 400, "tool_call_id")["param"] == "messages[0].tool_call_id"
    r = cmpl({"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "echo": False, "suffix": None,
              "user": "someone", "best_of": 1, "stream": False})
    assert r.status_code == 200, r.text
    assert chat({"user": "someone", "presence_penalty": 0, "stream": False}, name="alice").status_code == 200
    so = {"stream_options": {"include_usage": True}}
    _err(cmpl(so), 400, "stream_options")  # only with stream: true
    assert _err(cmpl({"stream": True, "stream_options": {"include_usage": "true"}}), 400,
                "include_usage")["param"] == "stream_options.include_usage"
    assert _err(cmpl({"stream": True, "stream_options": {"x": 1}}), 400, "'x'")["param"] == "stream_options.x"


@slow
@pytest.mark.usefixtures("fast_compile")
def test_stream_options_include_usage(server):
    """stream_options.include_usage: every chunk carries "usage": null, and a last chunk before [DONE]
    has no choices and the usage the same request reports unstreamed (n choices counted together)."""
    url, _, _ = server
    for path, body in (("/v1/completions", {"prompt": "sort:3 1 2=", "n": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "rev:abc="}]})):
        body = {"model": NAME, "max_tokens": 6, "temperature": 0.7, "seed": 3, **body}
        whole = httpx.post(url + path, json=body, timeout=120).json()["usage"]
        with httpx.stream("POST", url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                          timeout=120) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole, (chunks[-1], whole)
        assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
            plain = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert all("usage" not in c and c["choices"] for c in plain)


@slow
def test_n_is_checked_against_what_the_server_can_hold(server):
    """n choices beyond max_batch + max_queue can never be held: 400 naming n (not a 429 that also
    counts aborts); up to it, on an idle server, every choice is answered (issue 32: n=5 with
    --max-batch 4 --max-queue 4 was a 429 '4 requests are already waiting')."""
    url, engine, _ = server
    engine.max_queue = 1  # 4 rows + 1 waiting
    try:
        before = httpx.get(f"{url}/health").json()
        e = _err(httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "a", "n": 6}, timeout=60), 400,
                 "n=6")
        assert e["param"] == "n" and "max_batch=4" in e["message"] and "max_queue=1" in e["message"]
        h = httpx.get(f"{url}/health").json()
        assert (h["waiting"], h["aborted"], h["tracked"]) == (0, before["aborted"], 0)
        r = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "a", "n": 5, "max_tokens": 3,
                                                      "temperature": 1.0}, timeout=120)
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3, 4]
    finally:
        engine.max_queue = 64


@slow
@pytest.mark.usefixtures("fast_compile")
def test_a_batch_of_prompts_equals_one_request_per_prompt(server):
    """`prompt` as a list (texts and token-id lists; the `openai` client's batch, what lm-eval-harness
    sends): choice p * n + j is prompt p's j-th, equal to generate() on that prompt alone with seed +
    j, streamed or not; usage counts each prompt once; one bad prompt is a 400 naming its index and
    queues nothing; n x prompts beyond what the server holds is a 400 naming n."""
    url, engine, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    ids = model.tokenizer.encode("rev:abc=", add_special_tokens=False)
    prompts, hot = ["sort:3 1 2=", "hello", list(ids)], dict(temperature=0.9, top_k=0, stop_token_ids=(),
                                                                  max_new_tokens=8)
    want = [[jdllm.generate(model, [p], sampling=jdllm.Sampling(seed=5 + j, **hot))[0] for j in range(2)]
            for p in prompts]
    kw = dict(model=NAME, prompt=prompts, n=2, max_tokens=8, temperature=0.9, seed=5,
              extra_body={"jdllm": {"stop_token_ids": []}})
    res = client.completions.create(**kw)
    assert [c.index for c in res.choices] == list(range(6))
    for c in res.choices:
        w = want[c.index // 2][c.index % 2]
        assert (c.text, c.model_extra["jdllm"]["token_ids"], c.finish_reason) == (w.text, w.token_ids, "length")
    assert len({tuple(c.model_extra["jdllm"]["token_ids"]) for c in res.choices[2:4]}) > 1  # "hello": sampled apart
    lengths = [len(model.tokenizer.encode(p, add_special_tokens=False)) if isinstance(p, str) else len(p)
               for p in prompts]
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (sum(lengths), 6 * 8)
    streamed = {}
    for ch in client.completions.create(**kw, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: want[i // 2][i % 2].text for i in range(6)}

    post = lambda prompt, **kw: httpx.post(f"{url}/v1/completions", timeout=60,  # noqa: E731
                                           json={"model": NAME, "prompt": prompt, "max_tokens": 4, **kw})
    before = httpx.get(f"{url}/health").json()
    assert _err(post([]), 400, "non-empty list")["param"] == "prompt"
    assert _err(post(["a", ""]), 400, "prompt[1]: the prompt is empty")["param"] == "prompt[1]"
    assert _err(post([[5], [[6]]]), 400, "prompt[1]: prompt must be")["param"] == "prompt[1]"
    assert _err(post(["a", [10**6]]), 400, "prompt[1]: token id 1000000")["param"] == "prompt[1]"
    assert _err(post(["a", "1" * 45], max_tokens=24), 400, "prompt[1]: ")["param"] == "prompt[1]"
    for n in (2, 3):  # the engine refuses the prompt's choices 2..5 (or 3..5): the prompt is still prompt[1]
        e = _err(post(["a", "1" * 45, "b"], max_tokens=24, n=n), 400, "max_position_embeddings")
        assert e["param"] == "prompt[1]" and e["message"].startswith("prompt[1]: "), e
    e = _err(post(["a"] * 5, n=16), 400, "n=16 choices for each of 5 prompts")
    assert e["param"] == "n" and "max_batch=4" in e["message"]
    h = httpx.get(f"{url}/health").json()
    assert (h["waiting"], h["tracked"], h["aborted"]) == (0, 0, before["aborted"])


def test_stop_string_cuts_text_tokens_logprobs_and_offsets_together():
    """After a stop string, a choice's text, token ids, log-probs, token strings and text offsets agree:
    tokens wholly inside the stop string are dropped, a token that straddles its start is kept with its
    token string cut there; while streaming, a token whose text is held back (it may begin a stop
    string) is held back too (issue 32: the tokens kept the stop token while the text was cut)."""
    from jdllm.serve.completions import Choice
    from jdllm.serve.request import Event

    vocab = ["1 ", "2 3", " 4", "x", "a", "b", "c"]
    text_of = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    srv = types.SimpleNamespace(text_of=text_of, token_text=lambda t: text_of([t]))

    def tokens(ids):
        return Event("tokens", token_ids=ids, step_map=[1] * len(ids), logprobs=[-0.5] * len(ids), nfe=1)

    c = Choice(0, srv, ("3",))  # "2 3" straddles the stop string's start
    assert c.feed(tokens([0])) == ("1 ", slice(0, 1))
    assert c.feed(tokens([1, 2])) == ("2 ", slice(1, 2))
    assert (c.text, c.ids, c.finish, len(c.logprobs), len(c.step_map)) == ("1 2 ", [0, 1], "stop", 2, 2)
    lp = c.logprob_block(slice(0, 2), chat=False)
    assert lp["tokens"] == ["1 ", "2 "] and "".join(lp["tokens"]) == c.text and lp["text_offset"] == [0, 2]
    assert [t["token"] for t in c.logprob_block(slice(0, 2), chat=True)["content"]] == ["1 ", "2 "]

    c = Choice(0, srv, ("ab",))  # "a" may begin "ab": held back, text and token alike
    assert c.feed(tokens([3, 4])) == ("x", slice(0, 1))
    assert c.feed(tokens([6])) == ("ac", slice(1, 3))  # it did not: both go out
    assert c.feed(tokens([4])) == ("", slice(3, 3))
    assert c.feed(tokens([5, 6])) == ("", slice(3, 3))  # "ab": the stop string, wholly its own tokens
    assert (c.text, c.ids, c.finish) == ("xac", [3, 4, 6], "stop")
    lp = c.logprob_block(slice(0, 3), chat=False)
    assert lp["tokens"] == ["x", "a", "c"] and lp["text_offset"] == [0, 1, 2]


def test_cli_serve_checks_its_port_before_loading_the_model(capsys, monkeypatch):
    """`jdllm serve --port 99999` is an argparse error (exit 2); a port in use is a `jdllm serve: error:`
    (exit 2) before the model loads and before the banner (issue 32: 99999 listened on a random port,
    a port in use exited 3 after the banner); --max-body-bytes reaches the app, the banner names the
    port really bound."""
    import socket

    import jdllm.serve.server as server_module
    from jdllm.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(jdllm, "load", no_load)
    for port in ("99999", "-1", "http"):
        with pytest.raises(SystemExit) as e:
            main(["serve", os.path.join(ROOT, "models", "tiny-ar"), "--port", port])
        assert e.value.code == 2 and "jdllm serve: error: argument --port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", os.path.join(ROOT, "models", "tiny-ar"), "--max-body-bytes", "0"])
    assert "argument --max-body-bytes" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", os.path.join(ROOT, "models", "tiny-ar"), "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"jdllm serve: error: InputError: cannot listen on 127.0.0.1:{port}" in err, err
        assert "on http://" not in err  # no banner
    monkeypatch.undo()
    seen = {}
    monkeypatch.setattr(server_module, "serve", lambda engine, name, **kw: seen.update(kw, name=name))
    assert main(["serve", os.path.join(ROOT, "models", "tiny-ar"), "--port", "0", "--max-body-bytes", "1000"]) == 0
    bound = seen["sock"].getsockname()[1]
    seen["sock"].close()
    assert seen["max_body_bytes"] == 1000 and seen["name"] == "tiny-ar" and bound != 0
    assert f"on http://127.0.0.1:{bound}/v1" in capsys.readouterr().err


def test_one_temperature_rule_for_the_cli_and_the_server(capsys):
    """`jdllm generate --temperature 1e30` is refused before the model loads, with the rule the server
    applies to `temperature` (jdllm.inputs.check_temperature; issue 32: the CLI took 1e30, the server
    capped at 2.0 with its own check)."""
    from jdllm.cli import main
    from jdllm.serve.openai_protocol import ApiError, Server

    assert main(["generate", "/no/such/model", "--prompt", "a", "--temperature", "1e30"]) == 2
    assert "temperature=1e+30 must be finite and in [0, 2.0]" in capsys.readouterr().err
    assert main(["generate", "/no/such/model", "--prompt", "a", "--temperature", "2.5"]) == 2
    cli = capsys.readouterr().err
    engine = types.SimpleNamespace(model=types.SimpleNamespace(tokenizer=None), max_prompt_tokens=8,
                                   max_new_tokens=8)
    with pytest.raises(ApiError) as e:
        Server(engine, NAME).sampling({"model": NAME, "temperature": 2.5}, 8)
    assert e.value.param == "temperature" and e.value.message in cli
    assert Server(engine, NAME).sampling({"model": NAME, "temperature": 2.0}, 8)[0].temperature == 2.0


# --------------------------------------------------------------------------- echo and prompt log-probs
def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@slow
@pytest.mark.usefixtures("fast_compile")
def test_echo_scores_prompts_as_lm_evaluation_harness_reads_them(server):
    """lm-evaluation-harness' loglikelihood request (token-id prompts = context + continuation,
    max_tokens 1, logprobs 1, echo, temperature 0) through the `openai` client: each choice's prompt
    log-probs equal the log-softmax of `jdllm.logits` (a separate forward), its top alternative is
    the argmax there, and the harness' own reading (the sum over [ctxlen:-1], greedy when each
    token's log-prob is the top one) gives the reference's figures. Then max_tokens=0, logprobs=k
    on generated tokens (= the recorded ones, greedy), a streamed echo, chat top_logprobs, and
    the refusals."""
    url, _, model = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    tok = model.tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    pairs = [("sort:3 1 2=", "1 2 3"), ("sort:3 1 2=", "3 2 1"), ("add:1+2=", "3")]
    prompts = [enc(a) + enc(b) for a, b in pairs]
    ctxlens = [len(enc(a)) for a, _ in pairs]
    res = client.completions.create(model=NAME, prompt=prompts, max_tokens=1, logprobs=1, echo=True,
                                    temperature=0, seed=1234)
    assert [c.index for c in res.choices] == [0, 1, 2]
    greedy = []
    for c, p, ctxlen in zip(res.choices, prompts, ctxlens):
        lp = c.logprobs
        first = jdllm.generate(model, [p], sampling=jdllm.Sampling(max_new_tokens=1, stop_token_ids=()))[0]
        assert c.text == tok.decode(p, skip_special_tokens=True) + first.text
        assert c.model_extra["jdllm"]["token_ids"] == first.token_ids
        assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(p) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = _log_softmax(np.asarray(jdllm.logits(model, [p]))[0])  # ref[t - 1] predicts token t
        want = [ref[t - 1, p[t]] for t in range(1, len(p))]
        np.testing.assert_allclose(lp.token_logprobs[1:len(p)], want, atol=1e-4)
        for t in range(1, len(p)):  # the top alternative: the argmax and its log-prob (+ the token itself)
            best = int(np.argmax(ref[t - 1]))
            assert tok.decode([best]) in lp.top_logprobs[t]
            assert abs(max(lp.top_logprobs[t].values()) - ref[t - 1, best]) < 1e-4
            assert len(lp.top_logprobs[t]) == (1 if best == p[t] else 2)
        assert lp.text_offset == [len(tok.decode(p[:i])) for i in range(len(p))] + [len(tok.decode(p))]
        # lm-evaluation-harness' reading of the choice
        total = sum(lp.token_logprobs[ctxlen:-1])
        is_greedy = all(x == max(top.values()) for x, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]))
        assert abs(total - sum(want[ctxlen - 1:])) < 1e-3
        assert is_greedy == all(int(np.argmax(ref[t - 1])) == p[t] for t in range(ctxlen, len(p)))
        greedy.append(is_greedy)
    assert len(set(greedy)) == 2, greedy  # the cases tell greedy and not greedy apart

    # max_tokens=0: the prompt alone, scored, nothing generated (n copies of it)
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": NAME, "prompt": prompts[0], "max_tokens": 0,
                                                              "echo": True, "logprobs": 0, "n": 2}).json()
    assert [c["finish_reason"] for c in r["choices"]] == ["length", "length"] and r["usage"]["completion_tokens"] == 0
    for c in r["choices"]:
        assert c["text"] == tok.decode(prompts[0]) and c["jdllm"]["token_ids"] == []
        assert c["logprobs"]["top_logprobs"] is None and len(c["logprobs"]["token_logprobs"]) == len(prompts[0])
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:], res.choices[0].logprobs.token_logprobs[1:-1],
                                   atol=1e-5)

    # logprobs=k on generated tokens, greedy: the recorded log-probs, each the top of its k + 1 alternatives
    kw = dict(model=NAME, prompt="sort:5 2 8=", max_tokens=8, extra_body={"jdllm": {"stop_token_ids": []}})
    rec = client.completions.create(**kw, logprobs=0).choices[0]
    top = client.completions.create(**kw, logprobs=3).choices[0]
    assert top.text == rec.text and top.logprobs.tokens == rec.logprobs.tokens
    assert top.logprobs.text_offset == rec.logprobs.text_offset
    np.testing.assert_allclose(top.logprobs.token_logprobs, rec.logprobs.token_logprobs, atol=1e-4)
    for x, alts in zip(top.logprobs.token_logprobs, top.logprobs.top_logprobs):
        assert len(alts) in (3, 4) and x == max(alts.values())

    # a streamed echo: the prompt (and its log-probs) first, then the generated text, offsets running on
    body = {"model": NAME, "prompt": "sort:5 2 8=", "max_tokens": 8, "echo": True, "logprobs": 0, "stream": True,
            "jdllm": {"stop_token_ids": []}}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    whole = httpx.post(f"{url}/v1/completions", timeout=60, json=dict(body, stream=False)).json()["choices"][0]
    assert chunks[0]["text"] == "sort:5 2 8=" and chunks[0]["jdllm"]["token_ids"] == []
    assert "".join(c["text"] for c in chunks) == whole["text"] == "sort:5 2 8=" + rec.text
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert sum((c["logprobs"][key] for c in chunks), []) == whole["logprobs"][key], key

    # chat: top_logprobs alternatives of each generated token
    msgs = [{"role": "user", "content": "hello"}]
    ch = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=2)
    for t in ch.choices[0].logprobs.content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6  # greedy: the chosen token is the likeliest

    post = lambda path, b: httpx.post(f"{url}{path}", json={"model": NAME, **b}, timeout=60)  # noqa: E731
    assert _err(post("/v1/completions", {"prompt": "a", "max_tokens": 0}), 400, "echo: true")["param"] == "max_tokens"
    assert _err(post("/v1/completions", {"prompt": "a", "logprobs": 2, "stream": True}), 400,
                "stream: false")["param"] == "logprobs"
    assert _err(post("/v1/completions", {"prompt": "a", "echo": "yes"}), 400, "true or false")["param"] == "echo"
    assert _err(post("/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}), 400,
                "logprobs: true")["param"] == "top_logprobs"
    assert _err(post("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 21}), 400,
                "top_logprobs=21")["param"] == "top_logprobs"
    h = httpx.get(f"{url}/health").json()
    assert (h["rows_busy"], h["waiting"], h["tracked"]) == (0, 0, 0)


def test_scoring_a_diffusion_model_is_refused_naming_the_field():
    """A block-causal or bidirectional model has no left-to-right likelihood: echo with logprobs and
    top alternatives are 400s naming the field; echo alone and logprobs=0 stay accepted."""
    from jdllm.serve.openai_protocol import ApiError, logprob_settings

    for attention in ("block_causal", "bidirectional"):
        for body, param in (({"echo": True, "logprobs": 0}, "echo"), ({"logprobs": 1}, "logprobs")):
            with pytest.raises(ApiError, match="causal") as e:
                logprob_settings(body, chat=False, attention=attention)
            assert e.value.param == param and attention in e.value.message
        with pytest.raises(ApiError, match="causal") as e:
            logprob_settings({"logprobs": True, "top_logprobs": 1}, chat=True, attention=attention)
        assert e.value.param == "top_logprobs"
        assert logprob_settings({"echo": True}, chat=False, attention=attention).scores is False
        assert logprob_settings({"logprobs": 0}, chat=False, attention=attention).on
    assert logprob_settings({"echo": True, "logprobs": 2}, chat=False).scores
