"""benchmarks/gpu.py's results file: rows of different GPUs and weight formats stay apart.

The GPU benchmark merges every session's rows into one JSON. Its key once left the device out, so an
H100 session replaced the H200's rows of the same configuration; int8 rows were keyed apart but
rendered as if they were bf16's; quantized rows through XLA's dot and through the Pallas kernel
(`JDLLM_QUANT_MATMUL`) are two configurations. These tests run no GPU: they build rows by hand and check the merge
and the markdown.
"""

from __future__ import annotations

import json
import os

from scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

gpu = load_script("benchmarks/gpu.py")


def _row(device, ms, quantize=None, session="s1"):
    r = dict(shape="8b", case="ar_b1", label="AR greedy", paradigm="ar", batch=1, layout="per_layer", impl="auto",
             flags="", prompt=128, gen=256, kind="decode", window="token", device=device, session=session,
             ms_per_forward=ms, ms_per_token=ms, floor_ms=ms / 1.3, x_floor=1.3, tok_s=1e3 / ms, nfe=256.0,
             tpf=1.0, weight_bytes=(8 if quantize else 16) << 30, peak_bytes=18 << 30, peak_exact=True)
    if quantize:
        r["quantize"] = quantize
    return r


def test_rows_of_two_devices_and_of_int8_are_kept_apart(tmp_path):
    path = tmp_path / "gpu.json"
    old = _row("NVIDIA H200", 4.91, session="s0")
    # a file written before the device joined the key: its rows come back under today's keys on load
    legacy_key = "|".join(str(old[k]) for k in ("shape", "case", "batch", "layout", "impl", "flags", "prompt", "gen"))
    path.write_text(json.dumps(dict(sessions=[dict(session="s0")], rows={legacy_key: old})))
    db = gpu.load_db(str(path))
    db["sessions"].append(dict(session="s1"))
    h100 = "NVIDIA H100 80GB HBM3"
    gpu.merge_rows(db, [_row(h100, 6.45), dict(_row(h100, 6.47, "int8"), quant_matmul="xla"),
                        dict(_row(h100, 3.9, "int8"), quant_matmul="auto")])
    assert len(db["rows"]) == 4
    again = _row(h100, 6.40, session="s2")  # a later session of the same device replaces
    gpu.merge_rows(db, [again])
    assert len(db["rows"]) == 4
    by_dev = sorted((r["device"], gpu.weights_label(r), r["ms_per_token"]) for r in db["rows"].values())
    assert by_dev == [(h100, "bf16", 6.40), (h100, "int8", 3.9), (h100, "int8 (xla dot)", 6.47),
                      ("NVIDIA H200", "bf16", 4.91)]

    md = gpu.render(db)
    assert "### 8b on NVIDIA H200" in md and "### 8b on NVIDIA H100 80GB HBM3" in md
    assert "| AR greedy | 1 | int8 | per_layer |" in md and "| AR greedy | 1 | bf16 | per_layer |" in md
    assert "Weights 8.00 GiB int8" in md
    assert "| AR greedy | 1 | int8 (xla dot) | per_layer |" in md
    assert "Targets, weights int8," in md and "Targets, weights bf16," in md and "Targets, weights int8 (xla dot)," in md
    # an int8 KV cache (`--kv-cache int8`): its own row, labelled
    gpu.merge_rows(db, [dict(_row(h100, 6.2, session="s3"), kv_cache="int8")])
    assert len(db["rows"]) == 5 and "| AR greedy | 1 | bf16 + int8 KV | per_layer |" in gpu.render(db)


def test_an_int8_kv_cache_counts_its_bytes_and_scales():
    """`gpu.kv_cache_bytes`: two bytes per element for a bf16 cache; one and a float32 scale per token
    and KV head for an int8 one (what the KV floors of its rows divide)."""
    from jdllm.config import ModelConfig  # noqa: PLC0415

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    assert gpu.kv_cache_bytes(cfg, 2, 10, 2) == 2 * 3 * 2 * 10 * 2 * 16 * 2
    assert gpu.kv_cache_bytes(cfg.replace(kv_cache_dtype="int8"), 2, 10, 2) == 2 * 3 * 2 * 10 * 2 * (16 + 4)
    # the long-context table names each row's weights and cache, so bf16 and int8-KV rows stand apart
    long = dict(_row("NVIDIA H100 80GB HBM3", 9.48), kind="long", prompt=32768, gen=1024, canvas=33792)
    md = gpu.render_long([long, dict(long, kv_cache="int8", ms_per_forward=6.1)])
    assert "| AR greedy | 1 | bf16 | per_layer |" in md and "| AR greedy | 1 | bf16 + int8 KV | per_layer |" in md


def test_device_profile_splits_a_traces_device_time_by_kernel_kind():
    """`--profile`'s summary of a trace: only the device's stream lines count (not the host, not the
    profiler's derived "XLA Modules" line), overlapping kernels (two streams) count once as busy,
    the rest of the span is waiting, and kernels fall into kinds by name. The trace is built by hand in the layout of JAX's GPU profiler (a process per device)."""
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
            dict(ph="M", name="thread_name", pid=1, tid=7, args=dict(name="Stream #13(Compute)")),
            dict(ph="M", name="thread_name", pid=1, tid=8, args=dict(name="Stream #14(Compute)")),
            dict(ph="M", name="thread_name", pid=1, tid=9, args=dict(name="XLA Modules"))]

    def k(name, ts, dur, pid=1, tid=7):
        return dict(ph="X", name=name, pid=pid, tid=tid, ts=ts, dur=dur)

    events = meta + [k("gemv2T_kernel_val", 0, 40), k("jdllm_flash_window", 50, 10),
                     k("loop_add_fusion", 55, 10, tid=8),  # overlaps the attention kernel on another stream
                     k("jdllm_qmatmul", 100, 20), k("Memcpy DtoD", 130, 10),
                     k("PjitFunction(run)", 0, 500, pid=2),  # host: not device time
                     k("jit_run", 0, 140, tid=9)]  # a derived line over the kernels: not counted again
    p = gpu.device_profile(dict(traceEvents=events), forwards=2)
    assert p["device_events"] == 5
    assert p["wall_ms"] == 140 / 1e3 and p["busy_ms"] == (40 + 15 + 20 + 10) / 1e3
    assert abs(p["gap_ms"] - 55 / 1e3) < 1e-12 and p["per_forward_ms"]["busy"] == 85 / 2e3
    kinds = p["kinds_ms_per_forward"]
    assert kinds == {"matmul (cuBLAS / XLA GEMM)": 0.02, "qmatmul (Pallas)": 0.01, "attention (Pallas)": 0.005,
                     "other XLA fusions": 0.005, "copies / memset": 0.005}
    assert gpu.device_profile(dict(traceEvents=meta[1:2] + events[-2:-1]), forwards=2) == dict(device_events=0)
    # cuBLAS 13 on Hopper names its GEMMs nvjet_* (an H200 run counted them as "other" before)
    assert gpu.kernel_kind("nvjet_sm90_tst_192x64_64x6_2x1_v_bz_NNT") == "matmul (cuBLAS / XLA GEMM)"


def test_a_cached_processs_peak_is_reported_beside_the_cold_one():
    """A cold first call's peak holds what compiling kept on the device (the GEMM autotuner's copies of
    its operands among it); the process that compiles from the cache shows the running peak alone. Both
    come from first-call rows merged into the decode row, and the peak target reports both."""
    h100 = "NVIDIA H100 80GB HBM3"
    db = dict(sessions=[dict(session="s1")], rows={})
    first = {k: v for k, v in _row(h100, 6.45).items() if k not in ("peak_bytes", "peak_exact")}
    gpu.merge_rows(db, [dict(_row(h100, 6.45), peak_bytes=19 << 30),
                        dict(first, kind="first_call", compile=dict(session="s1", cold_s=21.0,
                                                                    cold_peak_bytes=19 << 30, cold_peak_exact=True)),
                        dict(first, kind="first_call", compile=dict(session="s1", cached_s=3.0,
                                                                    cached_peak_bytes=15 << 30,
                                                                    cached_peak_exact=True))])
    (row,) = db["rows"].values()
    assert row["compile"]["cold_peak_bytes"] == 19 << 30 and row["compile"]["cached_peak_bytes"] == 15 << 30
    md = gpu.render(db)
    assert "peak of a process compiling from the cache: 15.0 GiB" in md
    lim = (16 << 30) + 2 * gpu.GIB
    assert (f"AR greedy b1: peak <= weights + KV + 2 GiB = {lim / gpu.GIB:.1f} GiB: MISSED (19.0 GiB); a process "
            "compiling from the cache: met (15.0 GiB)") in md


def test_a_later_timing_keeps_an_earlier_sessions_first_call_figures_and_names_that_session():
    """A lease short of time re-times a case without its first calls (`--cold-cases` with none). The
    row it writes replaces the earlier one, but the earlier session's cached first call and peak stay,
    marked with that session, instead of vanishing from the tables; the new row's own cold first call
    is the one reported. A later first-call row of another session replaces them."""
    h100 = "NVIDIA H100 80GB HBM3"
    db = dict(sessions=[dict(session="s1"), dict(session="s2")], rows={})
    first = {k: v for k, v in _row(h100, 6.45).items() if k not in ("peak_bytes", "peak_exact")}
    gpu.merge_rows(db, [dict(_row(h100, 6.45), first_call_s=19.0),
                        dict(first, kind="first_call", compile=dict(session="s1", cached_s=6.1,
                                                                    cached_peak_bytes=15 << 30,
                                                                    cached_peak_exact=True))])
    gpu.merge_rows(db, [dict(_row(h100, 5.98, session="s2"), first_call_s=14.7)])
    (row,) = db["rows"].values()
    assert row["ms_per_forward"] == 5.98 and row["compile"]["session"] == "s1"
    md = gpu.render(db)
    assert "| 14.7 / 6.1 |" in md and "cached first call from session s1" in md
    assert "AR greedy: first call <= 30 s cold: met (14.7 s); <= 5 s cached: MISSED (6.1 s, from session s1)" in md
    assert "a process compiling from the cache: met (15.0 GiB, from session s1)" in md
    gpu.merge_rows(db, [dict(first, session="s2", kind="first_call", compile=dict(session="s2", cached_s=2.9))])
    (row,) = db["rows"].values()
    assert row["compile"] == dict(session="s2", cached_s=2.9)
    md = gpu.render(db)
    assert "from session" not in md and "| 14.7 / 2.9 |" in md


def test_a_variant_sets_environment_words_apart_from_xla_flags(monkeypatch):
    """`--xla-flags-variants` words of the form NAME=VALUE (a jdllm knob such as JDLLM_WINDOW_SPLITS)
    go into the variant's process environment, the other words into XLA_FLAGS after the caller's."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    assert gpu.split_variant("") == ({}, "")
    assert gpu.split_variant("JDLLM_WINDOW_SPLITS=1 --xla_gpu_enable_pdl=true") == (
        {"JDLLM_WINDOW_SPLITS": "1"}, "--xla_gpu_enable_pdl=true")
    env = gpu.child_env("JDLLM_WINDOW_SPLITS=1 --xla_gpu_enable_pdl=true", None)
    assert env["JDLLM_WINDOW_SPLITS"] == "1"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_gpu_enable_pdl=true"
    env = gpu.child_env("JDLLM_WINDOW_SPLITS=1", None)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    # an XLA flag's own '=' stays a flag: it starts with '--'
    assert gpu.split_variant("--xla_gpu_enable_command_buffer=FUSION,WHILE") == (
        {}, "--xla_gpu_enable_command_buffer=FUSION,WHILE")


def test_attention_benchmark_chains_window_calls_in_one_loop_and_says_which_timing_a_table_used():
    """benchmarks/attention.py times windows (tens of microseconds on a GPU) as calls chained inside one
    compiled loop: `loop_seconds` runs fn once per pass, each pass on the previous output, so it
    measures calls rather than one dispatch. Its tables say which timing the JSON used: the first GPU
    run (2026-11-26) timed one dispatch per call."""
    import jax
    import jax.numpy as jnp

    limits = load_script("benchmarks/device_limits.py")
    attention = load_script("benchmarks/attention.py")
    calls = []

    def fn(q, k):
        jax.debug.callback(lambda: calls.append(1))
        return q * k
    q, k = jnp.ones((4,), jnp.float32), jnp.full((4,), 2.0, jnp.float32)
    sec = limits.loop_seconds(fn, q, k, iters=2, passes=3)
    assert sec > 0 and len(calls) == 3 * (2 + 2)  # 2 warm-ups + 2 timed runs, 3 chained calls each
    res = dict(device="NVIDIA H200", platform="gpu", pallas_backend="mosaic", jax="0.11.2", mode="full",
               dtype="bfloat16", shape={}, matmul_tflops=700.0, copy_gbps=4000.0, prefill=[],
               window=[dict(mask="block_causal(B=32)", T=32, S=4096, impl="pallas", ms=0.01, gbps=1600.0,
                            frac_of_copy=0.4)])
    assert "one dispatch per call" in attention.markdown(res)
    assert "compiled loop" in attention.markdown(dict(res, window_timing="loop"))
    # the backward rows' Tiles: the earlier default (Triton backward) stays timed beside the new one
    assert attention.GRAD_TILES["pallas-triton-bwd"] == dict(mosaic_warp_specialized=False, mosaic_backward=False)


def test_attention_window_only_run_keeps_the_prefill_rows_and_sweeps_window_tiles(tmp_path, capsys):
    """`attention.py --window-only` (a lease's call for the window kernel alone) keeps the prefill rows
    that a full run of the same device wrote to --out, and says when they were taken; `--window-sweep`
    adds a row per Tiles variant of the window kernel."""
    attention = load_script("benchmarks/attention.py")
    out = str(tmp_path / "attention.json")
    tiny = ["--quick", "--iters", "1", "--seq", "64", "--window", "16", "--out", out]
    assert attention.main(tiny + ["--impls", "xla"]) == 0
    with open(out) as f:
        full = json.load(f)
    assert full["prefill"] and full["window"]
    attention.WINDOW_SWEEP = attention.WINDOW_SWEEP[:2]  # two variants keep the interpreter's time short
    assert attention.main(tiny + ["--impls", "pallas", "--window-only", "--window-sweep"]) == 0
    with open(out) as f:
        res = json.load(f)
    assert res["prefill"] == full["prefill"] and res["prefill_when"] == full["when"]
    assert [r["impl"] for r in res["window"]] == (["pallas"] + [f"pallas {n}" for n, _ in attention.WINDOW_SWEEP]
                                                  + ["pallas (defaults again)"])  # the noise of one kernel's timing
    assert "the prefill rows: " in attention.markdown(res)
    capsys.readouterr()


def test_an_xla_flag_alone_is_a_flags_variant():
    """`gpu.py --xla-flags-variants "" --xla_gpu_enable_command_buffer=...`: a lone XLA flag is a variant
    (argparse would take it for an option of the script), kept as typed."""
    flag = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
    args = gpu.parse(["--only", "ar_b1", "--xla-flags-variants", "", flag, "--no-hf"])
    assert args.xla_flags_variants == ["", flag] and args.no_hf and args.only == ["ar_b1"]


def test_a_child_stopped_during_the_profile_keeps_its_timed_row_and_one_stopped_before_gets_an_error_row(capsys):
    """On an H100 the profiled decode of Fast-dLLM prefix ran for minutes (the plain runs took 2 s) and the
    step's time limit stopped the child: the timings it had were lost with it. The child now records
    the timed row before profiling; the parent keeps that row when the child dies afterwards."""
    timed = dict(_row("NVIDIA H100 80GB HBM3", 8.4), case="fastdllm_prefix_b1",
                 profile=dict(error="the profiled decode did not finish"))
    done = _row("NVIDIA H100 80GB HBM3", 6.1)
    kw = dict(shape="8b", prompt=128, gen=256, session="s1", device="NVIDIA H100 80GB HBM3")
    task = dict(kind="run", layout="per_layer", mode="run")
    started = dict(case="fastdllm_prefix_b1", impl="auto", at=0.0)

    rows = gpu.child_rows(dict(rows=[done], started=dict(started, row=timed)), -15, [], task, **kw)
    assert rows == [done, timed]
    assert "timed row is kept" in capsys.readouterr().out

    rows = gpu.child_rows(dict(rows=[done], started=started), -15, ["[  1s] x"], task, **kw)
    assert rows[0] == done and len(rows) == 2
    assert rows[1]["case"] == "fastdllm_prefix_b1" and "killed by signal 15" in rows[1]["error"]
    assert "ms_per_forward" not in rows[1]

    # a child that finished (or never started a case) adds nothing
    assert gpu.child_rows(dict(rows=[done], started=None), 0, [], task, **kw) == [done]
    assert gpu.child_rows(None, 1, [], task, **kw) == []


def test_a_first_calls_phases_come_from_jaxs_compile_events():
    """`compile_phases` splits a first call into tracing, lowering and the backend's compile (or a
    cache hit's load), with the programs counted: what a cached first call spends (AR's 6.1 s on an
    H100 against a 5 s target) read off the next GPU run instead of guessed."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def f(x):
        return jnp.sin(x) * 2 + 1

    x = jnp.arange(7.0).block_until_ready()
    with gpu.compile_phases() as ph:
        f(x).block_until_ready()
    assert ph["programs"] == 1 and ph["trace_s"] > 0 and ph["lower_s"] > 0 and ph["compile_s"] > 0
    with gpu.compile_phases() as again:  # compiled already: nothing
        f(x).block_until_ready()
    assert again["programs"] == 0 and again["trace_s"] == 0
    row = dict(shape="8b", case="ar_b1", layout="per_layer", impl="auto", kind="first_call",
               compile=dict(cached_s=6.1, cache_files=951, cached_phases=dict(ph, rest_s=1.6, cache_hits=1)))
    line = gpu.progress_line(row, 10.0)
    assert "cached_s 6.1s" in line and "cached: 1 programs (1 from the cache)" in line and "the rest 1.6s" in line


def test_the_kv_floor_counts_the_live_cache_and_shows_on_batched_token_rows():
    """At b64 on the 8B shape the live KV cache is over half the weights' bytes: the table's note gives
    the weights + KV floor (the live part at prompt + gen / 2 of the canvas) for batched AR rows only;
    the long-context rows take their floor from the same function."""
    r = dict(_row("NVIDIA H100 80GB HBM3", 11.24), batch=64, read_bytes=16e9, kv_bytes=12e9, canvas=384,
             read_gbs=3000.0)
    want = 1e3 * (16e9 + 12e9 * 256 / 384) / 3000e9
    assert abs(gpu.kv_floor_ms(r) - want) < 1e-9
    assert gpu.kv_floor_ms(dict(r, kind="long")) == gpu.kv_floor_ms(r)  # the long-context rows' floor too
    assert gpu.kv_floor_ms(dict(r, kind="serve")) is None and gpu.kv_floor_ms(dict(r, kv_bytes=0)) is None
    db = dict(sessions=[dict(session="s1")], rows={})
    gpu.merge_rows(db, [r, dict(r, case="bd_static_b32", label="block_diffusion", window="window", batch=32)])
    md = gpu.render(db)
    assert md.count(f"weights + KV read floor {want:.2f} ms: {11.24 / want:.2f}x") == 1


def test_attention_sweep_takes_a_subset_by_label_and_rejects_unknown_ones(capsys):
    """`attention.py --window-sweep --sweep-only LABELS` times only those WINDOW_SWEEP variants (a lease
    has minutes: the whole sweep did not finish in 80 s); an unknown label, or --sweep-only without
    --window-sweep, is an argument error naming the labels, before any device work."""
    import pytest

    attention = load_script("benchmarks/attention.py")
    first = attention.WINDOW_SWEEP[0][0]
    with pytest.raises(SystemExit):
        attention.main(["--window-sweep", "--sweep-only", f"{first},bk99"])
    assert "['bk99'] are not WINDOW_SWEEP / INT8_SWEEP labels" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        attention.main(["--sweep-only", first])
    assert "add --window-sweep" in capsys.readouterr().err


def test_attention_times_the_window_over_an_int8_cache_and_its_tiles(tmp_path, capsys):
    """`attention.py --kv-cache int8`: the window kernel over the same K / V quantized, a row beside
    bf16's, counting one byte per element and a float32 scale per key and KV head; with
    --window-sweep, INT8_SWEEP's variants (`--sweep-only` picks among them too: "dot" is the one-row
    window through the tensor-core dot, `Tiles(one_row=False)`)."""
    attention = load_script("benchmarks/attention.py")
    out = str(tmp_path / "attention.json")
    S, KV, D = 64, 2, 32
    assert attention.main(["--quick", "--iters", "1", "--seq", str(S), "--window", "1", "--heads", "2", "--kv-heads",
                           str(KV), "--head-dim", str(D), "--impls", "pallas", "--window-only", "--window-sweep",
                           "--sweep-only", "dot", "--kv-cache", "int8", "--out", out]) == 0
    with open(out) as f:
        rows = json.load(f)["window"]
    assert [r["impl"] for r in rows] == ["pallas", "pallas int8", "pallas int8 dot", "pallas (defaults again)"]
    by = {r["impl"]: r for r in rows}
    int8_bytes, bf16_bytes = 2 * KV * S * D + 2 * KV * S * 4, 2 * KV * S * D * 2
    assert abs(by["pallas int8"]["gbps"] * by["pallas int8"]["ms"] * 1e6 - int8_bytes) <= 1e-6 * int8_bytes
    assert abs(by["pallas"]["gbps"] * by["pallas"]["ms"] * 1e6 - bf16_bytes) <= 1e-6 * bf16_bytes
    capsys.readouterr()


def test_a_long_context_row_takes_a_profile_of_its_decode_steps(tmp_path):
    """`gpu.py --long --profile` (here the tiny shape on the CPU, an int8 KV cache): the long row is
    timed and its tokens agree across runs, then LONG_PROFILE_STEPS decode steps after the prompt run
    under the profiler (the CPU has no device events: the row says so, and its log line too)."""
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--long", "--shape", "tiny", "--long-prompt", "64",
                           "--long-gen", "16", "--long-cases", "ar_b1", "--kv-cache", "int8", "--profile",
                           "--xla-flags-variants", "", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(out.read_text())["rows"].values() if r.get("kind") == "long"]
    assert len(rows) == 1 and rows[0]["kv_cache"] == "int8" and rows[0]["same_tokens"] and rows[0]["gen"] == 16
    assert rows[0]["profile"] == dict(device_events=0)
    assert "profile: no device events" in proc.stdout


def test_qmatmul_benchmark_times_weights_stored_either_way(tmp_path, capsys):
    """`qmatmul.py`'s "[N, K]" variants run the kernel on the same quantized weights stored [N, K]
    (contraction last, `transpose=True`), checked against the float32 product like every variant;
    a matrix already stored [N, K] (a tied head) has no such row."""
    qmm = load_script("benchmarks/qmatmul.py")
    out = str(tmp_path / "qmatmul.json")
    assert qmm.main(["--shape", "tiny", "--rows", "1", "--iters", "1", "--out", out, "--only",
                     "default (dot, k128 n128, auto splits, w4 s3)", "[N, K] storage"]) == 0
    with open(out) as f:
        rows = list(json.load(f)["rows"].values())
    by = {(r["matrix"], r["impl"]): r for r in rows}
    assert by[("o", "int8, qmatmul [N, K] storage")]["ok"] and by[("o", "int8, qmatmul [N, K] storage")]["rel_err"] > 0
    assert ("head (tied)", "int8, qmatmul [N, K] storage") not in by
    assert by[("head (tied)", "int8, qmatmul default (dot, k128 n128, auto splits, w4 s3)")]["ok"]
    capsys.readouterr()


def test_next_lease_commands_parse():
    """Every benchmark command of `benchmarks/next_lease.sh` (run on a lent GPU, where a typo costs a
    device call) passes its script's own argument checks here: gpu.py's cases and options,
    attention.py's sweep labels, qmatmul.py's variant labels."""
    import re  # noqa: PLC0415
    import shlex  # noqa: PLC0415

    with open(os.path.join(ROOT, "benchmarks", "next_lease.sh")) as f:
        text = f.read().replace("\\\n", " ")
    parsers = {"gpu": load_script("benchmarks/gpu.py").parse, "attention": load_script("benchmarks/attention.py").parse,
               "qmatmul": load_script("benchmarks/qmatmul.py").parse}
    seen = []
    for line in text.splitlines():
        m = re.search(r"python3 benchmarks/(\w+)\.py (.*)", line)
        if not m:
            continue
        argv = shlex.split(m.group(2).replace("$out", "/tmp/out").replace('"$v"', '"JDLLM_INT8_V_WORDS=1"'))
        parsers[m.group(1)](argv)  # argparse's errors exit: SystemExit fails the test
        seen.append(m.group(1))
    assert sorted(set(seen)) == ["attention", "gpu", "qmatmul"] and len(seen) >= 9


def test_next_lease_refuses_an_unknown_call_before_it_writes(tmp_path):
    """`CALL=4` exits 2 before it records the machine or makes its log folder (on a lent GPU that
    record costs seconds of device time); every real call starts by writing `logs/device.txt`."""
    import subprocess  # noqa: PLC0415

    script = os.path.join(ROOT, "benchmarks", "next_lease.sh")
    bad = subprocess.run(["bash", script], env={**os.environ, "CALL": "4", "OUT": str(tmp_path / "out")},
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "CALL must be 1, 2 or 3" in bad.stderr
    assert not (tmp_path / "out").exists()
    with open(script) as f:
        text = f.read()
    assert text.index('> "$L/device.txt"') < text.index("case ${CALL:-1} in\n1)")
