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

import httpx
import numpy as np
import pytest

import jdllm
from jdllm.serve.engine import Engine
from jdllm.serve.server import create_app
from tests.decode_fixtures import FAST_COMPILE, fast_compile  # noqa: F401
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
    engine.max_queue = 0  # every submission now finds the queue full
    try:
        _err(post({"model": NAME, "prompt": "a"}), 429, "max_queue=0")
    finally:
        engine.max_queue = 64


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
    k = next(k for k in range(1, 17) if stop in model.tokenizer.decode(want.token_ids[:k], skip_special_tokens=True))
    kw = dict(model=NAME, prompt=prompt, max_tokens=16, stop=[stop, "\x00never"],
              extra_body={"jdllm": {"stop_token_ids": []}})
    res = client.completions.create(**kw, logprobs=0)
    c = res.choices[0]
    assert (c.text, c.finish_reason) == (want.text[:j], "stop")
    assert c.model_extra["jdllm"]["token_ids"] == want.token_ids[:k] and res.usage.completion_tokens == k
    assert k <= c.model_extra["jdllm"]["nfe"] <= want.nfe  # forwards by the round the stop string completed
    np.testing.assert_allclose(c.logprobs.token_logprobs, want.logprobs[:k], atol=1e-5)
    text, finish = "", None
    for ch in client.completions.create(**kw, stream=True):
        text += ch.choices[0].text
        finish = ch.choices[0].finish_reason or finish
    assert (text, finish) == (want.text[:j], "stop")

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
    bad = {"model": NAME, "prompt": "a", "logprobs": 2}
    _err(httpx.post(f"{url}/v1/completions", json=bad, timeout=60), 400, "logprobs=2")
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
         "matches no string")
    _err(post({"jdllm": {"regex": "[a-c]{6}"}, "max_tokens": 4}), 400, "max_tokens")
    _err(post({"jdllm": {"regex": "[a-z]{30}"}}), 400, "at most 16 states")
    _err(post({"jdllm": {"regex": "("}}), 400, "regex")
    _err(post({"jdllm": {"regex": "a", "choice": ["b"]}}), 400, "give one constraint")
