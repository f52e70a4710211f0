"""Continuous batching (`jdllm.serve.Engine`) vs static batching (`jdllm.generate` on fixed batches)
on one Poisson-arrival workload with mixed prompt and answer lengths, greedy.

For each model: the same request list (arrival times, prompts, max_new_tokens, no stop ids, so
every answer has exactly its asked length) runs through
  - continuous: the engine's row pool on its own thread, requests submitted at their arrival
    times, tokens streamed as they become final;
  - static: fixed batches of `max_batch` consecutive requests; a batch starts once its last request
    has arrived and the previous batch is done, as one `jdllm.generate` call (rows may ask for
    different lengths; every answer of the batch arrives when the batch ends). Fixed batches keep
    the shapes of both passes equal, so the timed pass compiles nothing.
Each path runs the workload twice and the second pass is timed (every compile cached by then).
Reported: throughput (generated tokens / (last finish - first arrival)), time to first token
(static: the batch's end), per-token latency ((finish - arrival) / tokens), p50 / p99, and
whether both paths produced the same tokens for every request.

`--paradigms`: the same comparison for each named paradigm on its shipped model (ar: tiny-ar;
ar_spec: tiny-ar with tiny-ar-draft; block_diffusion, multi_block: tiny-sdar; masked_diffusion:
tiny-llada), each with the options `jdllm serve` gives it by default, on task prompts
(`jdllm.tasks`, stop at EOS, one max_new_tokens for every request: `--max-new`). Then, with
`--clients N`, a closed loop: N clients each send a request (a task prompt, max_new_tokens drawn in
3-19 as `benchmarks/serve_load.py` does) and the next one as soon as its answer is done,
`--per-client` times, against an engine built as `jdllm serve` builds it (its default pool:
`--max-batch` rows, max_prompt_tokens / max_new_tokens the model's context); a first pass of other
requests (another seed) warms the engine up, the second is timed: request latency (submit -> done)
p50 / p99, throughput, forwards per request and the compiles the timed pass still needed.
`--admission drain` makes every paradigm start new requests only once the pool has drained
(the admission masked_diffusion and multi_block had before they joined a running batch).

    python benchmarks/serve.py                   # tiny-ar + a larger random-weight qwen3
    python benchmarks/serve.py --models tiny-ar --requests 32 --rate 40
    python benchmarks/serve.py --paradigms ar ar_spec block_diffusion multi_block masked_diffusion --clients 50
Writes benchmarks/out/serve.json (--paradigms: benchmarks/out/serve_paradigms.json).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_model(name: str):
    import jax  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.config import ModelConfig  # noqa: PLC0415
    from jdllm.loading import Model  # noqa: PLC0415
    from jdllm.model import init_params  # noqa: PLC0415

    if name == "tiny-ar":
        return jdllm.load(os.path.join(ROOT, "models", "tiny-ar")), (4, 16), (4, 40)
    # a larger random-weight causal model (no tokenizer: token-id prompts)
    cfg = ModelConfig(model_type="qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=6,
                      num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True, max_position_embeddings=512,
                      eos_token_ids=())
    return Model(cfg, init_params(cfg, jax.random.key(0), std=0.05), attn_impl="xla"), (8, 64), (8, 96)


def workload(n: int, rate: float, prompt_range, new_range, vocab: int, seed: int = 0):
    """(arrival s, prompt ids, max_new_tokens) per request: Poisson arrivals; answers mostly short,
    a quarter long (the mix where a static batch waits for its longest row)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    lo, hi = new_range
    out = []
    for i in range(n):
        plen = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        new = int(rng.integers(hi * 3 // 4, hi + 1)) if rng.random() < 0.25 else int(rng.integers(lo, lo + (hi - lo) // 4 + 1))
        out.append((float(arrivals[i]), rng.integers(3, vocab - 1, plen).tolist(), new))
    return out


class Compiles:
    """Counts jit traces (each precedes a new compile) and backend compile seconds while active."""

    def __enter__(self):
        import jax  # noqa: PLC0415

        self.traces, self.seconds = 0, 0.0

        def listen(event, duration, **kw):
            if event == "/jax/core/compile/jaxpr_trace_duration":
                self.traces += 1
            elif event == "/jax/core/compile/backend_compile_duration":
                self.seconds += duration

        self._listen = listen
        jax.monitoring.register_event_duration_secs_listener(listen)
        return self

    def __exit__(self, *exc):
        import jax  # noqa: PLC0415

        jax.monitoring.unregister_event_duration_listener(self._listen)


# --------------------------------------------------------------------------- the shipped models, per paradigm
SHIPPED = {"ar": "tiny-ar", "ar_spec": "tiny-ar", "block_diffusion": "tiny-sdar", "multi_block": "tiny-sdar",
           "masked_diffusion": "tiny-llada"}


def paradigm_setup(name: str, options=()):
    """(model, paradigm config) for `name` on its shipped model, configured as `jdllm serve --paradigm
    name` configures it (block sizes: the model's; ar_spec: the shipped draft), plus `options`: command
    line flags such as ("--confidence-threshold", "0.9")."""
    import argparse as ap  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.generate_cli import add_paradigm_arguments, decoding_from_args  # noqa: PLC0415

    model = jdllm.load(os.path.join(ROOT, "models", SHIPPED[name]), dtype="float32")
    p = ap.ArgumentParser()
    add_paradigm_arguments(p)
    argv = ["--paradigm", name] + (["--draft", os.path.join(ROOT, "models", "tiny-ar-draft")] if name == "ar_spec" else [])
    return model, decoding_from_args(p.parse_args(argv + list(options)), model.config, command="serve")


def draining(par):
    """The same config, admitted only once the pool has drained (`joins_running_batch = False`)."""
    import dataclasses  # noqa: PLC0415

    cls = type(par)
    sub = type(cls.__name__, (cls,), {"joins_running_batch": False, "__module__": cls.__module__})
    return sub(**{f.name: getattr(par, f.name) for f in dataclasses.fields(cls) if f.init})


def task_workload(model, n: int, rate: float, max_new: int, seed: int = 0):
    """(arrival s, prompt ids, max_new_tokens) per request: task prompts, Poisson arrivals."""
    from jdllm import tasks  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    exs = tasks.test_set(n, seed=seed, tasks=("sort", "add", "rev"))
    return [(float(a), model.tokenizer.encode(e.prompt, add_special_tokens=False), max_new)
            for a, e in zip(arrivals, exs)]


def run_clients(model, par, clients: int, per_client: int, max_batch: int, steps_per_round: int, seed: int = 0):
    """Closed loop: `clients` threads, each sending `per_client` requests one after another to an engine
    built as `jdllm serve` builds it; the second of two passes is timed. Latency per request, seconds."""
    import jdllm  # noqa: PLC0415
    from jdllm import tasks  # noqa: PLC0415
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    def jobs_of(seed):
        rng = np.random.default_rng(seed)
        exs = tasks.test_set(clients * per_client, seed=seed, tasks=("sort", "add", "rev"))
        return [(model.tokenizer.encode(e.prompt, add_special_tokens=False), int(rng.integers(3, 20))) for e in exs]

    eng = Engine(model, par, max_batch=max_batch, max_queue=clients * per_client,
                 steps_per_round=steps_per_round).start()

    def client(c, jobs, lat, toks, nfe):
        for k in range(per_client):
            prompt, new = jobs[c * per_client + k]
            done = threading.Event()
            box = {}

            def on_event(ev, box=box, done=done):
                if ev.kind == "done":
                    box["out"] = ev.output
                    done.set()
                elif ev.kind == "error":
                    box["error"] = ev.message
                    done.set()
            t = time.perf_counter()
            eng.submit(prompt, jdllm.Sampling(max_new_tokens=new), on_event=on_event)
            done.wait()
            if "error" in box:
                raise RuntimeError(box["error"])
            lat.append(time.perf_counter() - t)
            toks.append(len(box["out"].token_ids))
            nfe.append(box["out"].nfe)

    try:
        res = None
        for pass_seed in (seed + 1, seed):  # the first pass (other requests) warms the engine up
            lat, toks, nfe = [], [], []
            jobs = jobs_of(pass_seed)
            threads = [threading.Thread(target=client, args=(c, jobs, lat, toks, nfe)) for c in range(clients)]
            with Compiles() as comp:
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                span = time.perf_counter() - t0
            res = dict(latency=np.asarray(lat), tokens=int(sum(toks)), seconds=span, nfe=float(np.mean(nfe)),
                       traces=comp.traces, compile_s=comp.seconds)
    finally:
        eng.stop()
    lat = res["latency"]
    return dict(clients=clients, requests=len(lat), latency_p50_ms=float(np.percentile(lat, 50) * 1e3),
                latency_p99_ms=float(np.percentile(lat, 99) * 1e3), req_per_s=float(len(lat) / res["seconds"]),
                tok_per_s=float(res["tokens"] / res["seconds"]), nfe_mean=res["nfe"], traces=res["traces"],
                compile_s=res["compile_s"])


def run_continuous(model, reqs, max_batch: int, steps_per_round: int, par=None, stop_ids=None):
    import jdllm  # noqa: PLC0415
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    par = jdllm.AR() if par is None else par
    max_new = max(r[2] for r in reqs)
    max_prompt = max(len(r[1]) for r in reqs)
    stops = () if stop_ids is None else stop_ids
    eng = Engine(model, par, max_batch=max_batch, max_prompt_tokens=max_prompt, max_new_tokens=max_new,
                 max_queue=len(reqs), steps_per_round=steps_per_round).start()
    try:
        result = None
        for _ in range(2):  # the first pass compiles
            first, done, outs = {}, {}, {}
            lock = threading.Event()

            def on_event(i):
                def f(ev):
                    now = time.perf_counter()
                    if ev.kind == "tokens" and i not in first:
                        first[i] = now
                    elif ev.kind == "done":
                        done[i], outs[i] = now, ev.output.token_ids
                        if len(done) == len(reqs):
                            lock.set()
                return f

            with Compiles() as comp:
                t0 = time.perf_counter()
                for i, (at, prompt, new) in enumerate(reqs):
                    wait = t0 + at - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                    eng.submit(prompt, jdllm.Sampling(max_new_tokens=new, stop_token_ids=stops), on_event=on_event(i))
                lock.wait()
            result = dict(t0=t0, first=first, done=done, outs=outs, traces=comp.traces)
    finally:
        eng.stop()
    return result


def run_static(model, reqs, max_batch: int, par=None, stop_ids=None):
    import jdllm  # noqa: PLC0415

    par = jdllm.AR() if par is None else par
    stops = () if stop_ids is None else stop_ids

    result = None
    for _ in range(2):
        first, done, outs = {}, {}, {}
        t0 = time.perf_counter()
        for k in range(0, len(reqs), max_batch):
            batch = list(range(k, min(k + max_batch, len(reqs))))
            wait = t0 + reqs[batch[-1]][0] - time.perf_counter()  # the batch is complete
            if wait > 0:
                time.sleep(wait)
            res = jdllm.generate(model, [reqs[i][1] for i in batch], par,
                                 [jdllm.Sampling(max_new_tokens=reqs[i][2], stop_token_ids=stops) for i in batch])
            end = time.perf_counter()
            for i, o in zip(batch, res):
                first[i] = done[i] = end
                outs[i] = o.token_ids
        result = dict(t0=t0, first=first, done=done, outs=outs)
    return result


def summary(reqs, r) -> dict:
    t0 = r["t0"]
    arr = np.array([t0 + a for a, _, _ in reqs])
    n = np.array([len(r["outs"][i]) for i in range(len(reqs))])
    first = np.array([r["first"][i] for i in range(len(reqs))])
    done = np.array([r["done"][i] for i in range(len(reqs))])
    ttft, per_tok = first - arr, (done - arr) / np.maximum(n, 1)
    span = done.max() - arr.min()
    q = lambda x, p: float(np.percentile(x, p) * 1e3)  # noqa: E731
    return dict(tokens=int(n.sum()), seconds=float(span), tok_per_s=float(n.sum() / span),
                ttft_p50_ms=q(ttft, 50), ttft_p99_ms=q(ttft, 99), per_token_p50_ms=q(per_tok, 50),
                per_token_p99_ms=q(per_tok, 99), traces=r.get("traces"))


def paradigm_rows(args) -> list[dict]:
    """Continuous vs static (and the closed loop, with --clients) for each of `args.paradigms`."""
    rows = []
    for name in args.paradigms:
        model, par = paradigm_setup(name, (args.options or {}).get(name, ()))
        if args.admission == "drain":
            par = draining(par)
        eos = tuple(model.config.eos_token_ids)
        reqs = task_workload(model, args.requests, args.rate or 100.0, args.max_new)
        cont = run_continuous(model, reqs, args.max_batch, args.steps_per_round, par, eos)
        stat = run_static(model, reqs, args.max_batch, par, eos)
        same = all(cont["outs"][i] == stat["outs"][i] for i in range(len(reqs)))
        base = dict(paradigm=name, model=SHIPPED[name], options=" ".join((args.options or {}).get(name, ())),
                    admission=args.admission, requests=len(reqs),
                    rate=args.rate or 100.0, max_batch=args.max_batch, max_new=args.max_new, same_tokens=same)
        for mode, r in (("continuous", cont), ("static", stat)):
            rows.append(dict(base, mode=mode, **summary(reqs, r)))
        if args.clients:
            rows.append(dict(base, mode=f"{args.clients} clients",
                             **run_clients(model, par, args.clients, args.per_client, args.max_batch,
                                           args.steps_per_round)))
        print(json.dumps(rows[-3 if args.clients else -2:]), flush=True)
    hdr = ("paradigm", "model", "mode", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "per-tok p50 ms", "per-tok p99 ms",
           "same tokens", "compiles in the timed pass")
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for r in rows:
        if r["mode"] in ("continuous", "static"):
            print(f"| {_label(r)} | {r['model']} | {r['mode']} | {r['tok_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | "
                  f"{r['ttft_p99_ms']:.0f} | {r['per_token_p50_ms']:.1f} | {r['per_token_p99_ms']:.1f} | "
                  f"{r['same_tokens']} | {'-' if r['traces'] is None else r['traces']} |")
    if args.clients:
        hdr = ("paradigm", "model", "clients", "requests", "latency p50 ms", "latency p99 ms", "req/s", "tok/s",
               "NFE / request", "compiles in the timed pass")
        print("\n| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
        for r in rows:
            if "clients" in r:
                print(f"| {_label(r)} | {r['model']} | {r['clients']} | {r['requests']} | {r['latency_p50_ms']:.0f} | "
                      f"{r['latency_p99_ms']:.0f} | {r['req_per_s']:.1f} | {r['tok_per_s']:.0f} | {r['nfe_mean']:.1f} | "
                      f"{r['traces']} ({r['compile_s']:.1f} s) |")
    return rows


def _label(r: dict) -> str:
    return r["paradigm"] + (f" {r['options']}" if r.get("options") else "") + \
        (" (drain)" if r.get("admission") == "drain" else "")


def _options(text: str) -> dict:
    name, _, flags = text.partition(":")
    return {name: tuple(flags.split())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-ar", "random-qwen3-h256-l6"])
    ap.add_argument("--paradigms", nargs="+", default=None, choices=sorted(SHIPPED),
                    help="compare these paradigms on their shipped models instead of --models")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second (default: per model; 100 with --paradigms)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--steps-per-round", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=12, help="--paradigms: every request's max_new_tokens (stop at EOS)")
    ap.add_argument("--clients", type=int, default=0, help="--paradigms: also a closed loop of this many clients")
    ap.add_argument("--per-client", type=int, default=4, help="requests each client sends in a pass")
    ap.add_argument("--options", type=_options, default=None, metavar="NAME:FLAGS",
                    help="paradigm options as `jdllm serve` flags, e.g. 'masked_diffusion:--confidence-threshold 0.9'")
    ap.add_argument("--admission", choices=("paradigm", "drain"), default="paradigm",
                    help="drain: admit only into a drained pool (the old masked_diffusion / multi_block rule)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.paradigms:
        rows = paradigm_rows(args)
        out = args.out or os.path.join(ROOT, "benchmarks", "out", "serve_paradigms.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
        return
    args.out = args.out or os.path.join(ROOT, "benchmarks", "out", "serve.json")
    rows = []
    for name in args.models:
        model, prange, nrange = load_model(name)
        rate = args.rate or (200.0 if name == "tiny-ar" else 50.0)
        reqs = workload(args.requests, rate, prange, nrange, model.config.vocab_size)
        cont = run_continuous(model, reqs, args.max_batch, args.steps_per_round)
        stat = run_static(model, reqs, args.max_batch)
        same = all(cont["outs"][i] == stat["outs"][i] for i in range(len(reqs)))
        for mode, r in (("continuous", cont), ("static", stat)):
            rows.append(dict(model=name, mode=mode, requests=len(reqs), rate=rate, max_batch=args.max_batch,
                             same_tokens=same, **summary(reqs, r)))
    hdr = ("model", "mode", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "per-tok p50 ms", "per-tok p99 ms", "same tokens")
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['tok_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
              f"{r['per_token_p50_ms']:.1f} | {r['per_token_p99_ms']:.1f} | {r['same_tokens']} |")
    for name in args.models:
        c, s = (next(r for r in rows if r["model"] == name and r["mode"] == m) for m in ("continuous", "static"))
        print(f"{name}: continuous / static throughput = {c['tok_per_s'] / s['tok_per_s']:.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
