"""Bounded load test of `jdllm serve` on localhost (not CI): many concurrent official `openai`
clients, every request answered exactly once, greedy outputs equal to offline `jdllm.generate`.

The server (uvicorn on 127.0.0.1, a free port, in this process) serves a shipped model. Phase 1:
`--requests` requests (completions and chat, streamed and not, some with `stop` strings and
`n=2`, mixed prompts and max_tokens) from `--clients` threads, each with its own `openai.OpenAI`
client. Every answer is checked: its request index seen once, its response id unique, and its
text / token ids / finish reason equal to `jdllm.generate` on that prompt alone (a stop string:
the offline text cut before it). Phase 2 (`--aborts`): streams dropped after their first chunk;
the row pool must be idle again (no row busy, nothing waiting or tracked) and the process RSS
must not keep growing. Writes benchmarks/out/serve_load.json.

    python benchmarks/serve_load.py                          # 200 requests, 32 clients, tiny-ar
    python benchmarks/serve_load.py --clients 64 --requests 200 --aborts 200
    python benchmarks/serve_load.py --model models/tiny-sdar --paradigm block_diffusion
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import resource
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def start_server(engine, name):
    import uvicorn  # noqa: PLC0415

    from jdllm.serve.server import create_app  # noqa: PLC0415

    srv = uvicorn.Server(uvicorn.Config(create_app(engine, name), host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        if not t.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return srv, t, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


def jobs(n: int, seed: int = 0):
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b, c = (int(x) for x in rng.integers(0, 10, 3))
        prompt = [f"add:{a}{b}+{c}=", f"sort:{a} {b} {c} {(a + b) % 10}=", f"rev:{'abcdefgh'[a % 8]}{'xyz'[b % 3]}q="][i % 3]
        out.append(dict(i=i, prompt=prompt, max_tokens=int(rng.integers(3, 20)), stream=bool(rng.random() < 0.5),
                        chat=bool(rng.random() < 0.3), n=2 if rng.random() < 0.1 else 1,
                        stop=" " if (i % 3 == 1 and rng.random() < 0.3) else None))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-ar"))
    ap.add_argument("--paradigm", default=None, help="ar | block_diffusion | ... (default: the model's)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--aborts", type=int, default=100)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "serve_load.json"))
    args = ap.parse_args()

    import httpx  # noqa: PLC0415
    import openai  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.decode.loop import paradigm_class  # noqa: PLC0415
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    model = jdllm.load(args.model)
    par = paradigm_class(args.paradigm)() if args.paradigm else None
    engine = Engine(model, par, max_batch=args.max_batch, max_prompt_tokens=32, max_new_tokens=24, max_queue=1024)
    name = os.path.basename(os.path.normpath(args.model))
    srv, thread, url = start_server(engine, name)
    print(f"serving {name} ({engine.paradigm.name}) at {url}; {args.requests} requests from {args.clients} clients",
          flush=True)
    local = threading.local()

    def client():
        if not hasattr(local, "c"):
            local.c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        return local.c

    def call(job):
        kw = dict(model=name, max_tokens=job["max_tokens"], stream=job["stream"], n=job["n"],
                  extra_body={"jdllm": {"stop_token_ids": []}})
        if job["stop"]:
            kw["stop"] = job["stop"]
        c = client()
        t0 = time.perf_counter()
        if job["chat"]:
            res = c.chat.completions.create(messages=[{"role": "user", "content": job["prompt"]}], **kw)
        else:
            res = c.completions.create(prompt=job["prompt"], **kw)
        texts, finish, ids = collections.defaultdict(str), {}, set()
        if not job["stream"]:
            ids.add(res.id)
            for ch in res.choices:
                texts[ch.index] = ch.message.content if job["chat"] else ch.text
                finish[ch.index] = ch.finish_reason
        else:
            for chunk in res:
                ids.add(chunk.id)
                for ch in chunk.choices:
                    texts[ch.index] += (ch.delta.content or "") if job["chat"] else ch.text
                    if ch.finish_reason:
                        finish[ch.index] = ch.finish_reason
        return dict(i=job["i"], ids=sorted(ids), texts=dict(texts), finish=finish, s=time.perf_counter() - t0)

    work = jobs(args.requests)
    rss0 = rss_mib()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(call, work))
    wall = time.perf_counter() - t0
    seen = collections.Counter(r["i"] for r in results)
    resp_ids = collections.Counter(x for r in results for x in r["ids"])
    once = sorted(seen) == list(range(args.requests)) and set(seen.values()) == {1}
    unique = all(len(r["ids"]) == 1 for r in results) and set(resp_ids.values()) == {1}

    # offline references: generate() on each prompt alone (greedy: every choice of n is the same)
    offline = {}
    mismatches = []
    for job, r in zip(work, results):
        key = (job["prompt"], job["max_tokens"])
        if key not in offline:
            offline[key] = jdllm.generate(model, [job["prompt"]], par,
                                          jdllm.Sampling(max_new_tokens=job["max_tokens"], stop_token_ids=()))[0]
        w = offline[key]
        text, fin = w.text, w.finish_reason
        if job["stop"] and job["stop"] in text:
            text, fin = text[:text.index(job["stop"])], "stop"
        for k in range(job["n"]):
            if (r["texts"].get(k), r["finish"].get(k)) != (text, fin):
                mismatches.append(dict(i=job["i"], got=r["texts"].get(k), want=text, finish=r["finish"].get(k)))
    health = httpx.get(f"{url}/health").json()
    print(f"phase 1: {args.requests} requests in {wall:.1f} s; answered once: {once}; unique ids: {unique}; "
          f"equal offline: {args.requests - len({m['i'] for m in mismatches})}/{args.requests}; health {health}",
          flush=True)

    # phase 2: clients that drop their stream after the first chunk
    rss1 = rss_mib()

    def drop(i):
        body = {"model": name, "prompt": "sort:1 2 3 4=", "max_tokens": 24, "stream": True,
                "jdllm": {"stop_token_ids": []}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    return True
        return False

    t1 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        dropped = sum(pool.map(drop, range(args.aborts)))
    deadline = time.time() + 60
    while (h := httpx.get(f"{url}/health").json())["rows_busy"] or h["tracked"] or h["waiting"]:
        if time.time() > deadline:
            break
        time.sleep(0.1)
    idle_s = time.perf_counter() - t1
    rss2 = rss_mib()
    print(f"phase 2: {dropped} streams dropped mid-way; pool after: {h} ({idle_s:.1f} s); "
          f"RSS {rss0:.0f} -> {rss1:.0f} -> {rss2:.0f} MiB", flush=True)
    srv.should_exit = True
    thread.join(timeout=30)
    lat = sorted(r["s"] for r in results)
    rec = dict(model=name, paradigm=engine.paradigm.name, requests=args.requests, clients=args.clients,
               wall_s=wall, answered_once=once, unique_ids=unique, mismatches=mismatches[:20],
               equal_offline=args.requests - len({m["i"] for m in mismatches}),
               latency_p50_s=lat[len(lat) // 2], latency_p99_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))],
               aborts=args.aborts, dropped=dropped, pool_after=h, rss_mib=[rss0, rss1, rss2],
               load_avg=os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(json.dumps({k: v for k, v in rec.items() if k != "mismatches"}))


if __name__ == "__main__":
    main()
