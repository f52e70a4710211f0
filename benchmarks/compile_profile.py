"""Where a first call's compile time goes: the decode program compiled ahead of time with abstract weights.

`jdllm.generate`'s first call at the 8B shape spent 51 s (AR) to 119-153 s (block diffusion, multi_block)
on an H100 (issue 27), against a target of 30 s cold and 5 s from JAX's persistent cache. This script
compiles the very program `generate` runs (`jdllm.decode.loop.compiled(options)`, i.e. `jax.jit(loop.run)`
with per-jit XLA `compiler_options`, on the state, paradigm and context `jdllm.api.prepare` builds) ahead
of time, with the weights as `jax.ShapeDtypeStruct`s in the per-layer (or stacked) layout derived from
`jdllm.model.param_specs`: no weight memory, nothing built, so an 8B program compiles on any machine
in the time its compile takes. Each row times the three phases separately (trace, lower, XLA compile)
and records what the compile produced.

    python benchmarks/compile_profile.py --budget 150                      # 8B, the priority rows below
    python benchmarks/compile_profile.py --shape tiny --budget 300 --out /tmp/cp.json   # CPU self-check
    python benchmarks/compile_profile.py --shape 8b --paradigms ar --layers 1 2 --groups layers
    python benchmarks/compile_profile.py --with-run      # + a real first `generate` at full depth (GPU)
    python benchmarks/compile_profile.py --markdown      # print the table of --out

Rows, in priority order (the first ~150 s of an 8B run on an H100 should reach the end of (d)):
  (a) `layers`: ar and bd at 1 and 4 layers, default options (the per-layer marginal cost: does XLA
      compile each layer anew, or reuse one layer's code?); each with a cached pass (below);
  (b) `options` at 4 layers (bd): xla_gpu_autotune_level=0, xla_gpu_enable_triton_gemm=False;
  (c) `layout` at 4 layers (bd): stacked weights (the forward's `lax.scan`), and stacked with
      xla_gpu_enable_dynamic_slice_fusion=True + triton gemm off (does the scan then read the weights
      in place? temp bytes ~ the weights' bytes = a copy); both timed on zero weights (below);
  (d) `merge` at 4 layers (bd): `DecodeCtx.merge_tokens` flipped (0 = every window width its own
      forward; on the CPU, where the default is 0, the GPU's 256);
  then ar at full depth; attn=xla (no Pallas kernels) and xla_backend_optimization_level=0 at 4
  layers; the options for ar; Fast-dLLM dual and multi_block approx at 4 layers; bd, dual, mb and
  stacked bd at full depth; more option pairs. `--groups` keeps some of them (layers options layout
  merge attn paradigms); `--layers` sets the depths of (a) (default 1 4 full).
Paradigms (short names): ar = AR greedy; bd = block_diffusion static 32x8; dual = masked_diffusion
Fast-dLLM dual cache 0.9; mb = multi_block approx cache (benchmarks/gpu.py's cases; prompt 128,
generation 256, batch 1, block 32; shapes as in gpu.py: 8b, 4b, tiny).

Each row runs in a process of its own (XLA keeps its GEMM autotuning results and Triton kernels for
the process: a second compile in one process would reuse the first's work) with a fresh, empty
persistent compilation cache (`--cache fresh`; XLA's per-fusion autotune cache lives there too), so
every compile is cold. Columns / JSON fields of a row:
  trace / lower / compile: seconds of `.trace(...)`, `.lower()` and `.compile()`;
  cached: rows of group (a) then `jax.clear_caches()` and trace, lower and compile again, the compile
      now a load from the persistent cache (hit or not is recorded): what a second process pays;
  fwd: whole-model forwards in the program (rsqrt ops in the program's jaxpr over those of one
      `jdllm.model.forward` of the same weights; prefill + each window width of the step); the JSON
      also counts `pallas_call` sites (each a Triton / Mosaic GPU kernel for XLA to compile);
  HLO: the optimized HLO (`compiled.as_text()`): lines, fusions (by kind), custom calls (by target),
      while loops, conditionals;
  temp / args: `compiled.memory_analysis()` bytes; temp close to the weights' bytes = a copy of them;
  XLA timers: with `TF_CPP_VMODULE` on XLA's compiler files (`--xla-vmodule`), its scoped timers
      during the compile: HLO passes (autotuning included) and the backend (LLVM, PTX) separately;
  run: rows marked so (layout rows, bd at 4 layers) run the compiled program on zero weights
      (`--no-time-run` skips): ms per forward, and the device's peak memory over the weights.
The options a backend rejects are reported per row; options named xla_gpu_* are skipped off a GPU
(`--force-options` compiles them anyway: the CPU ignores them).
`--budget S`: no row starts after S seconds; a full-depth row whose cost, extrapolated from the
shallow rows, would end past budget + `--grace` is skipped; a row still compiling at budget + grace
is stopped (the phases it finished are kept). `--with-run` then times a real `jdllm.generate` at
full depth with random weights built per layer on the device (as gpu.py builds them): the first
call cold, the number of XLA programs it compiled and their seconds, and the first call of a new
trace with the persistent cache filled.
Output: one progress line per row, rows merged into `--out` keyed by device, shape and variant
(default benchmarks/results/compile_profile.json), a markdown table, and a summary that fits
seconds = a + b x layers on the shallow rows and extrapolates to full depth.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "compile_profile.json")
GIB = 2 ** 30


def _gpu_bench():
    """benchmarks/gpu.py as a module (its shapes, paradigm configs, prompts and weight builder)."""
    spec = importlib.util.spec_from_file_location("jdllm_bench_gpu", os.path.join(ROOT, "benchmarks", "gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


G = _gpu_bench()
PARADIGMS = {"ar": "ar", "bd": "bd_static", "dual": "fastdllm_dual", "mb": "mb_approx"}  # -> gpu.py case
OPTIONS = {
    "none": {},
    "autotune0": {"xla_gpu_autotune_level": 0},
    "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},
    "dsf_no_triton": {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False},
    "backend_O0": {"xla_backend_optimization_level": 0},
    "autotune0_no_triton": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False},
}
GROUPS = ("layers", "options", "layout", "merge", "attn", "paradigms")
DEFAULT_VMODULE = "gpu_compiler=1,nvptx_compiler=1,cpu_compiler=1"
TIMER_RE = re.compile(r"\] (.+?) time: ([\d.]+) (us|ms|s|min|h)\b")
LOG_RE = re.compile(r"^[IW]\d{4} ")  # XLA INFO / WARNING lines: kept for the timers, not echoed
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
BEGIN, END = "@@compile_profile xla-compile begin", "@@compile_profile xla-compile end"


def case_of(paradigm: str):
    """gpu.py's batch-1 case of a paradigm (short name)."""
    return {c.id: c for c in G.all_cases()}[f"{PARADIGMS[paradigm]}_b1"]


@dataclasses.dataclass(frozen=True)
class Spec:
    group: str
    paradigm: str  # a PARADIGMS key
    layers: int
    layout: str = "per_layer"  # jdllm's default (`default_layout()`: fused) | "per_layer_unfused" | "stacked"
    attn: str = "auto"
    merge: str = "default"  # "default" | "flip" | a token count
    options: str = "none"
    cached: bool = False  # trace, lower and compile again from the persistent cache
    time_run: bool = False  # run the compiled program on zero weights

    def label(self) -> str:
        return (f"{self.paradigm} L{self.layers} {self.layout} attn={self.attn} merge={self.merge} "
                f"opts={self.options}")

    def variant(self) -> tuple:
        """Everything but the depth: the rows a fit over layers groups together."""
        return (self.paradigm, self.layout, self.attn, self.merge, self.options)


def plan_rows(paradigms, layers, full: int, probe: int, groups) -> list[Spec]:
    """The rows in priority order (see the module docstring)."""
    pair = [p for p in ("ar", "bd") if p in paradigms] or list(paradigms[:1])
    focus = "bd" if "bd" in paradigms else paradigms[0]
    others = [p for p in pair if p != focus]
    small = sorted({L for L in layers if L <= probe})
    deep = sorted({L for L in layers if L > probe})
    rows: list[Spec] = []
    add = rows.append
    for L in small:  # (a)
        for p in pair:
            add(Spec("layers", p, L, cached=True, time_run=(p == focus and L == probe)))
    # the Pallas kernels without Mosaic GPU: does the persistent cache then hit (H200, 2026-11-26: bd, whose
    # prefill runs the Mosaic kernel, missed it; ar, Triton kernels only, hit)
    add(Spec("attn", focus, probe, attn="triton", cached=True))
    add(Spec("options", focus, probe, options="autotune0"))  # (b)
    add(Spec("options", focus, probe, options="no_triton_gemm"))
    add(Spec("layout", focus, probe, layout="stacked", time_run=True))  # (c)
    add(Spec("layout", focus, probe, layout="stacked", options="dsf_no_triton", time_run=True))
    add(Spec("merge", focus, probe, merge="flip"))  # (d)
    for L in deep:  # (a) at depth, the pair's cheaper member first
        for p in pair[:1]:
            add(Spec("layers", p, L, cached=True))
        # one scanned layer body that reads the stacked weights in place (no copy at 4 layers on the H200):
        # its compile and run at full depth against the per-layer program's
        add(Spec("layout", focus, L, layout="stacked", options="dsf_no_triton", cached=True, time_run=True))
    add(Spec("attn", focus, probe, attn="xla"))
    add(Spec("options", focus, probe, options="backend_O0"))
    for p in others:
        add(Spec("options", p, probe, options="autotune0"))
        add(Spec("options", p, probe, options="no_triton_gemm"))
    for p in ("dual", "mb"):
        if p in paradigms:
            add(Spec("paradigms", p, probe, cached=True))
    for L in deep:
        for p in pair[1:]:
            add(Spec("layers", p, L, cached=True))
        for p in ("dual", "mb"):
            if p in paradigms:
                add(Spec("paradigms", p, L, cached=True))
        add(Spec("layout", focus, L, layout="stacked"))
    add(Spec("options", focus, probe, options="autotune0_no_triton"))
    add(Spec("layout", focus, probe, layout="per_layer_unfused"))
    for p in others:
        add(Spec("merge", p, probe, merge="flip"))
        add(Spec("layout", p, probe, layout="stacked"))
    seen, out = set(), []
    for s in rows:
        if s.group in groups and s.paradigm in paradigms and s not in seen:
            seen.add(s)
            out.append(s)
    return out


# --------------------------------------------------------------------------- the child: one row
def count_eqns(jaxpr, names: tuple[str, ...]) -> collections.Counter:
    """Equations whose primitive is in `names`, in a jaxpr and every jaxpr nested in it (while /
    cond / scan bodies, pjit, custom rules), not inside a kernel's own jaxpr (pallas_call)."""
    c: collections.Counter = collections.Counter()

    def subs(v):
        if hasattr(v, "eqns"):
            yield v
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
            yield v.jaxpr
        elif isinstance(v, (tuple, list)):
            for x in v:
                yield from subs(x)

    def walk(j):
        for e in j.eqns:
            name = e.primitive.name
            if name in names:
                c[name] += 1
            if name == "pallas_call":
                continue
            for v in e.params.values():
                for s in subs(v):
                    walk(s)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr)
    return c


def hlo_stats(text: str) -> dict:
    """Counts in an optimized HLO module's text."""
    kinds = collections.Counter(re.findall(r"\bfusion\(.*?kind=(k\w+)", text))
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    lines = text.splitlines()
    return dict(lines=len(lines), chars=len(text), fusions=sum(kinds.values()), fusion_kinds=dict(kinds),
                custom_calls=sum(targets.values()), custom_call_targets=dict(targets.most_common(12)),
                whiles=len(re.findall(r"\bwhile\(", text)), conditionals=len(re.findall(r"\bconditional\(", text)),
                computations=sum(1 for ln in lines if ln and not ln[0].isspace() and ln.rstrip().endswith("{")))


def memory_stats(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    names = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
             "generated_code_size_in_bytes", "host_temp_size_in_bytes")
    return {n.replace("_size_in_bytes", "_bytes"): int(getattr(m, n)) for n in names if hasattr(m, n)}


def cost_stats(compiled) -> dict:
    try:
        c = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 (not every backend has it)
        return {}
    if isinstance(c, (list, tuple)):
        c = c[0] if c else {}
    return {k.replace(" ", "_"): float(c[k]) for k in ("flops", "bytes accessed") if c and k in c}


class Events:
    """JAX's monitoring events (persistent-cache hits / misses, compile durations) while recording."""

    def __init__(self):
        import jax  # noqa: PLC0415

        self.counts: collections.Counter = collections.Counter()
        self.durations: dict[str, list[float]] = collections.defaultdict(list)
        self.traced: set = set()
        self.on = False
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event, **kw):
        if self.on:
            self.counts[event.rsplit("/", 1)[-1]] += 1

    def _duration(self, event, duration, **kw):
        if self.on:
            self.durations[event.rsplit("/", 1)[-1]].append(float(duration))
            if event.endswith("jaxpr_trace_duration"):
                self.traced.add(kw.get("fun_name"))  # the decode loop traces as "run"

    def start(self):
        self.counts.clear()
        self.durations.clear()
        self.traced: set = set()
        self.on = True

    def stop(self) -> dict:
        self.on = False
        out = {k: v for k, v in self.counts.items() if "cache" in k}
        for k, v in self.durations.items():
            out[k] = dict(n=len(v), total_s=round(sum(v), 3), max_s=round(max(v), 3))
        return out


class CacheLog:
    """What JAX's compiler says about the persistent cache while a row compiles (an entry not written:
    host callbacks, an executable that does not serialize, a compile under the minimum time; its
    DEBUG lines, which `jax_explain_cache_misses` would raise to warnings along with every tracing-cache
    miss), and Python warnings (a failed cache write is one), as strings."""

    NAMES = ("jax._src.compiler", "jax._src.compilation_cache")

    def __init__(self):
        import logging  # noqa: PLC0415
        import warnings  # noqa: PLC0415

        self.lines: list[str] = []
        outer = self

        class Handler(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                low = msg.lower()
                if "cache" in low and ("jit_run" in msg or "not writing" in low or "error" in low
                                       or record.levelno >= logging.WARNING):
                    outer.lines.append(f"{record.levelname} {record.name}: {msg}"[:600])
                if record.levelno >= logging.WARNING:
                    print(f"{record.levelname} {record.name}: {msg}", file=sys.stderr, flush=True)

        h = Handler(logging.DEBUG)
        for name in self.NAMES:
            lg = logging.getLogger(name)
            lg.setLevel(logging.DEBUG)
            lg.propagate = False  # its DEBUG lines go to this list, not to the console
            lg.addHandler(h)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            outer.lines.append(f"{category.__name__}: {message}"[:600])
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show

    def take(self) -> list[str]:
        out, self.lines = self.lines[:16], []
        return out


def cache_entries(path: str | None) -> list:
    """(name, bytes) of the persistent cache's files: an entry the cold compile did not write is missing."""
    if not path or not os.path.isdir(path):
        return []
    return sorted((n, os.path.getsize(os.path.join(path, n))) for n in os.listdir(path)
                  if os.path.isfile(os.path.join(path, n)))


def configure_cache(task) -> dict:
    """The persistent cache this child compiles with (before anything compiles)."""
    import jax  # noqa: PLC0415

    mode = task["cache"]
    info = dict(mode=mode)
    if mode == "fresh":
        for name, v in (("jax_compilation_cache_dir", task["cache_dir"]),
                        ("jax_persistent_cache_min_compile_time_secs", 0.0),
                        ("jax_persistent_cache_min_entry_size_bytes", -1)):
            try:
                jax.config.update(name, v)
            except Exception as e:  # noqa: BLE001 (a jax without the option)
                info.setdefault("config_errors", []).append(f"{name}: {e}")
        info["dir"] = task["cache_dir"]
    elif mode == "env":
        try:
            from jdllm import compile_cache  # noqa: PLC0415 (jdllm's own, where this checkout has it)

            st = compile_cache.enable()
            info.update(dir=st.path, source=st.source)
        except ImportError:
            info.update(dir=os.environ.get("JAX_COMPILATION_CACHE_DIR"), source="JAX_COMPILATION_CACHE_DIR")
    return info


def device_info() -> dict:
    import importlib.metadata as md  # noqa: PLC0415

    import jax  # noqa: PLC0415

    dev = jax.devices()[0]
    info = dict(backend=jax.default_backend(), device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__)
    for pkg in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return info


def device_peak():
    import jax  # noqa: PLC0415

    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        st = {}
    return st.get("peak_bytes_in_use")


def child_row(task: dict) -> int:
    """Compile one row's decode program ahead of time; the result JSON is rewritten after each phase."""
    out = task["result"]
    spec = Spec(**task["spec"])
    row = dict(task["row"])
    G.write_json(out, row)
    import jax  # noqa: PLC0415

    row["cache"] = configure_cache(task)
    row.update(device_info())
    opts = OPTIONS[spec.options]
    if row["backend"] != "gpu" and any(k.startswith("xla_gpu_") for k in opts) and not task["force_options"]:
        row["skipped"] = f"GPU-only options on {row['backend']}"
        G.write_json(out, row)
        return 0
    import jax.numpy as jnp  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.api import params_for, prepare  # noqa: PLC0415
    from jdllm.decode import common, loop  # noqa: PLC0415
    from jdllm.model import (default_layout, default_positions, forward, is_param_spec,  # noqa: PLC0415
                             param_bytes, param_specs)
    from pallas_kernels import resolve_impl  # noqa: PLC0415

    ev = Events()
    base = G.base_config(task["shape"]).replace(num_layers=spec.layers)
    case = case_of(spec.paradigm)
    cfg = G.model_config(base, case.attention, task["block"])
    layout = {"per_layer": default_layout(), "per_layer_unfused": "per_layer", "stacked": "stacked"}[spec.layout]
    if spec.layout == "stacked" and row["backend"] in loop.UNROLL_LAYERS_ON:  # the scan a GPU runs, not a split
        loop.UNROLL_LAYERS_ON = ()
        row["note"] = "stacked weights through lax.scan (loop.UNROLL_LAYERS_ON cleared for this row)"
    dtype = jnp.bfloat16
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(cfg, layout),
                          is_leaf=is_param_spec)
    attn = spec.attn
    if attn == "triton":  # the Pallas kernels, Triton only: no Mosaic GPU prefill kernel on Hopper
        from pallas_kernels.common import BACKEND_ENV  # noqa: PLC0415

        os.environ[BACKEND_ENV] = "triton"
        attn = "pallas" if row["backend"] == "gpu" else "auto"
    row["pallas_backend"] = os.environ.get("JDLLM_PALLAS_BACKEND") or "default"
    model = jdllm.Model(config=cfg, params=params, attn_impl=attn)
    dec = G.decoding_for(case, task["gen"], task["block"])
    prompts = G.prompts_for(case, task["prompt"], cfg.vocab_size, task["seed"])
    prep = prepare(model, prompts, dec, jdllm.Sampling(max_new_tokens=task["gen"], stop_token_ids=()))
    ctx = prep.ctx
    if spec.merge != "default":
        dflt = common.weight_bound_tokens(ctx)
        n = (0 if dflt else common.GPU_WEIGHT_BOUND_TOKENS) if spec.merge == "flip" else int(spec.merge)
        ctx = dataclasses.replace(ctx, merge_tokens=n)
    run_params = params_for(model, dec)
    row.update(param_layout=layout, layers_run="scan" if layout == "stacked" else "straight-line",
               attn_resolved=resolve_impl(attn), merge_tokens=common.weight_bound_tokens(ctx),
               options_set=opts, weight_bytes=param_bytes(cfg, dtype), canvas=int(prep.state.slots),
               prefill_len=ctx.prefill_len, batch=int(prep.state.batch))
    fn = loop.compiled(tuple(sorted(opts.items())))

    def phases(tag: str) -> tuple:
        ev.start()
        t = time.perf_counter()
        traced = fn.trace(run_params, prep.state, paradigm=prep.paradigm, ctx=ctx)
        row[f"{tag}trace_s"] = time.perf_counter() - t
        G.write_json(out, row)
        t = time.perf_counter()
        lowered = traced.lower()
        row[f"{tag}lower_s"] = time.perf_counter() - t
        G.write_json(out, row)
        if not tag:
            row["compile_started"] = time.time()
            G.write_json(out, row)
        print(BEGIN, flush=True)
        t = time.perf_counter()
        try:
            compiled = lowered.compile()
        finally:
            print(END, flush=True)
            row[f"{tag}compile_s"] = time.perf_counter() - t
            row[f"{tag}events"] = ev.stop()
        row[f"{tag}total_s"] = row[f"{tag}trace_s"] + row[f"{tag}lower_s"] + row[f"{tag}compile_s"]
        return traced, lowered, compiled

    log = CacheLog()
    try:
        traced, lowered, compiled = phases("")
    except Exception as e:  # noqa: BLE001 (a rejected option, a failed compile: reported in the row)
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        row["error"] = msg[-1500:]
        if "compile_s" in row and (any(k in msg for k in opts) or "option" in msg.lower()):
            row["rejected"] = True
        G.write_json(out, row)
        traceback.print_exc()
        return 0
    if task["cache"] == "fresh":
        row["cache_entries_after_cold"] = cache_entries(task["cache_dir"])
    row["cache_log"] = log.take()
    G.write_json(out, row)
    # what the program holds
    names = ("rsqrt", "pallas_call", "while", "cond", "scan")
    prog = count_eqns(traced.jaxpr, names)
    tok = jnp.zeros((1, 8), jnp.int32)  # one forward's norms (the XLA attention: no kernel shape limits)
    one = jax.make_jaxpr(lambda p: forward(p, ctx.model, tok, default_positions(jnp.zeros((1,), jnp.int32), 0, 8),
                                           start=jnp.zeros((1,), jnp.int32), attn_impl="xla")[0])(run_params)
    per = count_eqns(one, names)
    row.update(jaxpr_counts=dict(prog), forward_counts=dict(per),
               forwards_in_program=round(prog["rsqrt"] / per["rsqrt"], 2) if per["rsqrt"] else None,
               stablehlo_chars=len(lowered.as_text()), memory=memory_stats(compiled), cost=cost_stats(compiled),
               hlo=hlo_stats(compiled.as_text()))
    G.write_json(out, row)
    if spec.time_run and task["time_run"]:
        try:
            row["run"] = time_run(compiled, run_params, prep, row["weight_bytes"])
        except Exception as e:  # noqa: BLE001 (out of memory, ...: the compile figures stand)
            row["run"] = dict(error="".join(traceback.format_exception_only(type(e), e)).strip()[-800:])
        G.write_json(out, row)
    if spec.cached and task["cache"] == "fresh":
        del compiled, lowered, traced
        jax.clear_caches()
        try:
            phases("cached_")
        except Exception as e:  # noqa: BLE001
            row["cached_error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-800:]
        row["cached_cache_log"] = log.take()
        G.write_json(out, row)
    return 0


def time_run(compiled, abstract, prep, wbytes: int) -> dict:
    """The compiled program on zero weights of the same layout: seconds per forward (median of two
    runs after one warm-up), forwards, and the device's peak memory over the weights' bytes."""
    import statistics  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    jax.block_until_ready(params)
    final = jax.block_until_ready(compiled(params, prep.state))
    ts = []
    for _ in range(2):
        t = time.perf_counter()
        final = jax.block_until_ready(compiled(params, prep.state))
        ts.append(time.perf_counter() - t)
    sec = statistics.median(ts)
    fwd = int(jax.device_get(final.forwards))
    peak = device_peak()
    return dict(seconds=sec, forwards=fwd, ms_per_forward=1e3 * sec / max(fwd, 1), peak_bytes=peak,
                peak_over_weights_bytes=None if peak is None else peak - wbytes)


def child_generate(task: dict) -> int:
    """A real `jdllm.generate` at full depth: random bf16 weights built per layer on the device (gpu.py's
    builder), the first call cold (fresh persistent cache), a second call (compiled), then the first
    call of a new trace after `jax.clear_caches()` (the persistent cache filled: a new process's cost
    but for its imports)."""
    out = task["result"]
    rows = []
    G.write_json(out, dict(rows=rows))
    import jax  # noqa: PLC0415

    cache = configure_cache(task)
    info = device_info()
    import jdllm  # noqa: PLC0415

    ev = Events()
    base = G.base_config(task["shape"])
    t = time.perf_counter()
    params = G.build_params(base, "per_layer", task["seed"], 0.02, 0.1)
    build_s = time.perf_counter() - t
    print(f"# {task['shape']} weights built per layer in {build_s:.1f}s", flush=True)
    for p in task["paradigms"]:
        case = case_of(p)
        model = jdllm.Model(config=G.model_config(base, case.attention, task["block"]), params=params)
        dec = G.decoding_for(case, task["gen"], task["block"])
        prompts = G.prompts_for(case, task["prompt"], base.vocab_size, task["seed"])
        sampling = jdllm.Sampling(max_new_tokens=task["gen"], stop_token_ids=())
        row = dict(task["row"], paradigm=p, layers=base.num_layers, kind="generate", cache=cache, build_s=build_s,
                   **info)
        try:
            for tag in ("first", "second", "cached_first"):
                if tag == "cached_first":
                    jax.clear_caches()
                ev.start()
                t = time.perf_counter()
                outs = jdllm.generate(model, prompts, dec, sampling)
                row[f"{tag}_s"] = time.perf_counter() - t
                row[f"{tag}_retraced"] = "run" in ev.traced
                row[f"{tag}_events"] = ev.stop()
            row["nfe"] = outs[0].nfe
        except Exception as e:  # noqa: BLE001
            row["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-1500:]
            traceback.print_exc()
        rows.append(row)
        G.write_json(out, dict(rows=rows))
        print(generate_line(row), flush=True)
    return 0


def child_main(path: str) -> int:
    with open(path) as f:
        task = json.load(f)
    sys.path.insert(0, ROOT)
    return child_generate(task) if task["kind"] == "generate" else child_row(task)


# --------------------------------------------------------------------------- the parent
def fmt_s(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def fmt_gib(b) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def row_key(r: dict) -> str:
    return (f"{r.get('device', '?')} | {r['shape']} {r['paradigm']} L{r['layers']} {r['layout']} attn={r['attn']} "
            f"merge={r.get('merge_tokens', r['merge'])} opts={r['options']} P{r['prompt']} G{r['gen']}")


def xla_timers(lines: list[str]) -> dict:
    """XLA's scoped-timer log lines logged during the compile: label -> [seconds, times]."""
    agg: dict[str, list] = {}
    on = False
    for ln in lines:
        if ln.startswith(BEGIN):
            on = True
        elif ln.startswith(END):
            on = False
        elif on:
            m = TIMER_RE.search(ln)
            if m:
                label = re.sub(r"\s+", " ", m.group(1).strip())
                a = agg.setdefault(label, [0.0, 0])
                a[0] += float(m.group(2)) * UNITS[m.group(3)]
                a[1] += 1
    return {k: [round(v[0], 3), v[1]] for k, v in sorted(agg.items(), key=lambda kv: -kv[1][0])}


def timer_split(timers: dict) -> tuple:
    """(HLO passes s, backend s) from XLA's top-level compiler timers (GPU: GpuCompiler::RunHloPasses /
    RunBackend; CPU: 'Running HLO passes' / 'Compiling ... using JIT')."""
    def pick(pat):
        v = [s for k, (s, _) in timers.items() if re.search(pat, k)]
        return sum(v) if v else None
    return pick(r"RunHloPasses for|Running HLO passes on"), pick(r"RunBackend for|for CPU using JIT")


def miss_reason(r: dict) -> str:
    """Why the cached pass missed: the decode program's entry was not written by the cold compile (JAX's
    reason, where it gave one), or it was written under another key than the cached pass looked up
    (the lowered program or its options differ between two traces)."""
    key_re = re.compile(r"'(jit_run-[0-9a-f]+)'")
    written = [n for n, _ in r.get("cache_entries_after_cold", []) if n.startswith("jit_run-")]
    looked = [m.group(1) for ln in r.get("cached_cache_log") or [] if "MISS" in ln for m in [key_re.search(ln)] if m]
    said = [ln for ln in (r.get("cache_log") or []) + (r.get("cached_cache_log") or [])
            if "not writing" in ln.lower() or "error" in ln.lower() or ln.startswith(("WARNING", "ERROR"))]
    if not written:
        return "the cold compile wrote no jit_run entry" + (f": {said[0][:240]}" if said else "")
    if looked and not any(w.startswith(looked[0]) for w in written):
        return f"written as {written[0][:24]}..., looked up as {looked[0][:24]}...: the key changed between traces"
    return f"{len(written)} jit_run entr{'y' if len(written) == 1 else 'ies'} written" + (f"; {said[0][:200]}" if said else "")


def progress_line(r: dict, elapsed: float) -> str:
    head = (f"[{elapsed:5.0f}s] {r['shape']} {r['paradigm']:<4} L{r['layers']:<2} {r['layout']:<9} "
            f"attn={r['attn']:<4} merge={r.get('merge_tokens', r['merge'])!s:<7} {r['options']:<14}")
    if r.get("skipped"):
        return f"{head} | skipped: {r['skipped']}"
    if r.get("error") and "compile_s" not in r:
        return f"{head} | FAILED{' (option rejected)' if r.get('rejected') else ''}: {r['error'].splitlines()[-1][:240]}"
    s = f"{head} | trace {fmt_s(r.get('trace_s'))} lower {fmt_s(r.get('lower_s'))} compile {fmt_s(r.get('compile_s'))}"
    if r.get("error"):
        return f"{s} | FAILED: {r['error'].splitlines()[-1][:200]}"
    if r.get("killed"):
        xla = f" (xla passes {fmt_s(r.get('xla_hlo_passes_s'))} backend {fmt_s(r.get('xla_backend_s'))})"
        return f"{s} | {r['killed']}{xla if 'xla_timers' in r else ''}"
    s += f" = {fmt_s(r.get('total_s'))} s"
    if "cached_total_s" in r:
        hit = r.get("cached_events", {}).get("cache_hits", 0)
        s += f" | cached {fmt_s(r['cached_total_s'])} s ({'hit' if hit else 'MISS'})"
        if not hit:  # why: did the cold compile write the program's entry, under which key, and what JAX said
            s += f" [{miss_reason(r)}]"
    h, m = r.get("hlo", {}), r.get("memory", {})
    kernels = r.get("jaxpr_counts", {}).get("pallas_call", 0)
    s += (f" | {r.get('forwards_in_program')} fwd, {kernels} pallas_call | HLO {h.get('lines', '-')} lines "
          f"{h.get('fusions', '-')} fusions {h.get('custom_calls', '-')} cc | temp {fmt_gib(m.get('temp_bytes'))} GiB")
    if r.get("xla_hlo_passes_s") is not None or r.get("xla_backend_s") is not None:
        s += f" | xla passes {fmt_s(r.get('xla_hlo_passes_s'))} backend {fmt_s(r.get('xla_backend_s'))}"
    run = r.get("run")
    if run and "ms_per_forward" in run:
        s += f" | run {run['ms_per_forward']:.2f} ms/fwd"
    elif run:
        s += f" | run failed: {run.get('error', '')[-120:]}"
    return s


def generate_line(r: dict) -> str:
    head = f"generate {r['shape']} {r['paradigm']} L{r['layers']}"
    if r.get("error"):
        return f"{head} | FAILED: {r['error'].splitlines()[-1][:240]}"
    fe = r.get("first_events", {})
    bc = fe.get("backend_compile_duration", {})
    ce = r.get("cached_first_events", {})
    return (f"{head} | first call {fmt_s(r.get('first_s'))} s ({bc.get('n', 0)} XLA programs, "
            f"{fmt_s(bc.get('total_s'))} s compiling, largest {fmt_s(bc.get('max_s'))} s) | second "
            f"{fmt_s(r.get('second_s'))} s | new trace, cache filled {fmt_s(r.get('cached_first_s'))} s "
            f"({ce.get('cache_hits', 0)} hits, {ce.get('cache_misses', 0)} misses)")


def run_child(task: dict, tmp: str, deadline: float | None, vmodule: str):
    """One child process; its log lines streamed (XLA's INFO lines kept for the timers, not echoed).
    Killed at `deadline` (epoch seconds). Returns (result or None, rc, log lines)."""
    tid = uuid.uuid4().hex[:8]
    task = dict(task, result=os.path.join(tmp, f"result_{tid}.json"))
    path = os.path.join(tmp, f"task_{tid}.json")
    G.write_json(path, task)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if task["cache"] != "env":
        for k in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
            env.pop(k, None)
        env["JDLLM_CACHE_DIR"] = task["cache_dir"] if task["cache"] == "fresh" else "off"
    if vmodule:
        env["TF_CPP_VMODULE"] = ",".join(x for x in (env.get("TF_CPP_VMODULE"), vmodule) if x)
        env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    lines: list[str] = []
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_child", path], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    timer = None
    if deadline is not None:
        timer = threading.Timer(max(0.0, deadline - time.time()), proc.kill)
        timer.start()
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if not (LOG_RE.match(line) or line.startswith("@@compile_profile")):
                print(f"    {line}", flush=True)
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if timer is not None:
            timer.cancel()
    res = None
    if os.path.exists(task["result"]):
        try:
            with open(task["result"]) as f:
                res = json.load(f)
        except (OSError, json.JSONDecodeError):
            pass
    return res, rc, lines


def fit(points: list[tuple[int, float]]):
    """Least-squares (a, b) of y = a + b x over >= 2 distinct x; None otherwise."""
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def predicted_total(spec: Spec, done: list[tuple[Spec, dict]], probe: int):
    """Seconds a deeper row is expected to take, from the shallow rows of its variant."""
    pts = [(s.layers, r["total_s"] + r.get("cached_total_s", 0.0)) for s, r in done
           if s.variant() == spec.variant() and s.layers <= probe and "total_s" in r]
    f = fit(pts)
    return None if f is None else f[0] + f[1] * spec.layers


def load_db(path: str) -> dict:
    if path and os.path.exists(path):
        with open(path) as f:
            db = json.load(f)
        db.setdefault("rows", {})
        db.setdefault("runs", [])
        return db
    return dict(rows={}, runs=[])


def merge_row(db: dict, r: dict) -> str:
    """A row into db['rows'] by key; a failed or skipped row keeps an earlier good one (noted beside it)."""
    key = row_key(r)
    old = db["rows"].get(key)
    bad = r.get("skipped") or (r.get("error") and "compile_s" not in r)
    if old is not None and bad and "compile_s" in old:
        old["last_failure"] = dict(session=r.get("session"), why=r.get("skipped") or r.get("error"))
    else:
        db["rows"][key] = r
    return key


def table(rows: list[dict]) -> str:
    cols = ("device", "row", "trace s", "lower s", "compile s", "total s", "cached s", "fwd", "HLO lines", "fusions",
            "custom calls", "temp GiB", "args GiB", "XLA passes / backend s", "run ms/fwd", "note")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        m, h, run = r.get("memory", {}), r.get("hlo", {}), r.get("run") or {}
        cached = "-"
        if "cached_total_s" in r:
            cached = f"{r['cached_total_s']:.1f} ({'hit' if r.get('cached_events', {}).get('cache_hits') else 'miss'})"
        note = r.get("skipped") or ""
        if r.get("error"):
            note = ("option rejected: " if r.get("rejected") else "failed: ") + r["error"].splitlines()[-1][:90]
        if r.get("killed"):
            note = f"{note} {r['killed']}".strip()
        xla = "-"
        if r.get("xla_hlo_passes_s") is not None or r.get("xla_backend_s") is not None:
            xla = f"{fmt_s(r.get('xla_hlo_passes_s'))} / {fmt_s(r.get('xla_backend_s'))}"
        ms = run.get("ms_per_forward")
        cells = ("cpu" if r.get("backend") == "cpu" else str(r.get("device", "?")),
                 f"{r['shape']} {r['paradigm']} L{r['layers']} {r['layout']} attn={r['attn']} "
                 f"merge={r.get('merge_tokens', r['merge'])} {r['options']}",
                 fmt_s(r.get("trace_s")), fmt_s(r.get("lower_s")),
                 f">{r['compile_s_at_least']:.0f}" if "compile_s_at_least" in r else fmt_s(r.get("compile_s")),
                 fmt_s(r.get("total_s")),
                 cached, r.get("forwards_in_program", "-"), h.get("lines", "-"), h.get("fusions", "-"),
                 h.get("custom_calls", "-"), fmt_gib(m.get("temp_bytes")), fmt_gib(m.get("argument_bytes")), xla,
                 "-" if ms is None else f"{ms:.2f}", note)
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out)


def summary(rows: list[dict], probe: int) -> list[str]:
    """Fits over depth per variant, then the contrasts the option / layout / merge rows answer."""
    ok = [r for r in rows if "compile_s" in r and not r.get("error") and not r.get("skipped")]
    lines = []
    by: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in ok:
        by[(r.get("device"), r["shape"], r["paradigm"], r["layout"], r["attn"], r.get("merge_tokens"),
            r["options"])].append(r)
    for (dev, shape, p, layout, attn, merge, opts), rs in by.items():
        full = G.SHAPES[shape]["num_layers"]
        shallow = [r for r in rs if r["layers"] <= probe]
        base = shallow if len({r["layers"] for r in shallow}) >= 2 else rs
        fits = {ph: fit([(r["layers"], r[f"{ph}_s"]) for r in base]) for ph in ("trace", "lower", "compile", "total")}
        if fits["total"] is None:
            continue
        a, b = fits["total"]
        pred = a + b * full
        at = [r for r in rs if r["layers"] == full]
        meas = f", measured {at[0]['total_s']:.1f} s" if at else ""
        per = ", ".join(f"{ph} {fits[ph][0]:.2f} + {fits[ph][1]:.3f}/layer" for ph in ("trace", "lower", "compile"))
        share = f"; the per-layer part is {max(0.0, b * full) / pred:.0%} of it" if pred > 0 else ""
        s = (f"- {shape} {p} {layout} attn={attn} merge={merge} {opts} (on {'cpu' if dev == 'cpu' else dev}, from "
             f"{sorted({r['layers'] for r in base})} layers): {per} s -> at {full} layers {pred:.1f} s{meas}{share}")
        cf = fit([(r["layers"], r["cached_total_s"]) for r in base if "cached_total_s" in r])
        if cf is not None:
            cpred = cf[0] + cf[1] * full
            s += f"; from the persistent cache (trace + lower + load) {cpred:.1f} s"
        if dev != "cpu":
            s += f" [targets: cold {pred:.0f} s {'<=' if pred <= 30 else '>'} 30 s"
            s += f", cached {cpred:.1f} s {'<=' if cpred <= 5 else '>'} 5 s]" if cf is not None else "]"
        lines.append(s)
    fw = {}
    for r in ok:
        if r.get("forwards_in_program") is not None:
            fw.setdefault((r["paradigm"], r.get("merge_tokens")), r["forwards_in_program"])
    if fw:
        lines.append("- whole-model forwards per program: " + ", ".join(
            f"{p} {n:g} (merge_tokens={m})" for (p, m), n in sorted(fw.items(), key=str)))

    def ref_of(r):
        for q in ok:
            if (q.get("device"), q["shape"], q["paradigm"], q["layers"]) == (r.get("device"), r["shape"], r["paradigm"],
                                                                           r["layers"]) and \
                    (q["layout"], q["attn"], q["options"]) == ("per_layer", "auto", "none") and \
                    q.get("merge_tokens") == (r.get("merge_tokens") if r["merge"] == "default" else q.get("merge_tokens")) \
                    and q is not r and q["merge"] == "default":
                return q
        return None

    for r in ok:
        if (r["layout"], r["attn"], r["options"], r["merge"]) == ("per_layer", "auto", "none", "default"):
            continue
        q = ref_of(r)
        if q is None:
            continue
        what = " ".join(x for x in (r["layout"] if r["layout"] != "per_layer" else "",
                                    f"attn={r['attn']}" if r["attn"] != "auto" else "",
                                    r["options"] if r["options"] != "none" else "",
                                    f"merge_tokens={r.get('merge_tokens')}" if r["merge"] != "default" else "") if x)
        d = r["compile_s"] / q["compile_s"] - 1 if q["compile_s"] else 0.0
        s = (f"- {r['shape']} {r['paradigm']} L{r['layers']} {what}: compile {r['compile_s']:.1f} s vs "
             f"{q['compile_s']:.1f} s ({d:+.0%}), total {r['total_s']:.1f} vs {q['total_s']:.1f} s")
        if r.get("forwards_in_program") != q.get("forwards_in_program"):
            s += f", forwards {r.get('forwards_in_program')} vs {q.get('forwards_in_program')}"
        tm, tq, w = r.get("memory", {}).get("temp_bytes"), q.get("memory", {}).get("temp_bytes"), r.get("weight_bytes")
        if tm is not None and tq is not None and w:
            s += f", temp {tm / GIB:.2f} vs {tq / GIB:.2f} GiB (weights {w / GIB:.2f} GiB)"
        rm, qm = (r.get("run") or {}).get("ms_per_forward"), (q.get("run") or {}).get("ms_per_forward")
        if rm is not None and qm is not None:
            s += f", run {rm:.2f} vs {qm:.2f} ms/forward"
        lines.append(s)
    return lines


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or os.environ.get("GIT_COMMIT", "unknown")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("GIT_COMMIT", "unknown")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", choices=sorted(G.SHAPES), default="8b", help="model shape (default 8b)")
    ap.add_argument("--paradigms", nargs="+", choices=sorted(PARADIGMS), default=["ar", "bd", "dual", "mb"])
    ap.add_argument("--layers", nargs="+", default=["1", "4", "full"],
                    help="depths of the layer rows: numbers and/or 'full' (default 1 4 full)")
    ap.add_argument("--probe-layers", type=int, default=4, help="depth of the option / layout / merge rows (4)")
    ap.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS), help="row groups to run")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=None, help="start no row after this many seconds")
    ap.add_argument("--grace", type=float, default=45.0,
                    help="a row still running at budget + grace is stopped (default 45)")
    ap.add_argument("--cache", choices=("fresh", "env", "off"), default="fresh",
                    help="fresh: an empty persistent cache per row (default); env: whatever JAX_COMPILATION_CACHE_DIR "
                         "/ jdllm's own cache say (hits recorded); off: none")
    ap.add_argument("--xla-vmodule", default=DEFAULT_VMODULE,
                    help=f"TF_CPP_VMODULE for XLA's compile timers ('' turns them off; default {DEFAULT_VMODULE})")
    ap.add_argument("--no-time-run", action="store_true", help="do not run the compiled programs of the marked rows")
    ap.add_argument("--force-options", action="store_true", help="compile xla_gpu_* options off a GPU too")
    ap.add_argument("--with-run", action="store_true",
                    help="then a real first jdllm.generate at full depth (random weights on the device)")
    ap.add_argument("--run-paradigms", nargs="+", choices=sorted(PARADIGMS), default=["ar", "bd"])
    ap.add_argument("--list", action="store_true", help="print the rows in order and exit")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON the rows merge into (default "
                                                       "benchmarks/results/compile_profile.json)")
    ap.add_argument("--markdown", action="store_true", help="print the table and summary of --out (runs nothing)")
    return ap.parse_args(argv)


def parent_main(args) -> int:
    full = G.SHAPES[args.shape]["num_layers"]
    layers = [full if x == "full" else int(x) for x in args.layers]
    probe = args.probe_layers
    specs = plan_rows(args.paradigms, layers, full, probe, args.groups)
    if args.list:
        for i, s in enumerate(specs):
            print(f"{i + 1:3d}. ({s.group}) {s.label()}{' +cached' if s.cached else ''}{' +run' if s.time_run else ''}")
        return 0
    db = load_db(args.out)
    session = dict(id=datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6],
                   argv=sys.argv[1:], git=git_commit(), shape=args.shape, budget=args.budget, cache=args.cache)
    print(f"# compile_profile {args.shape}: {len(specs)} rows, budget {args.budget or '-'} s (+{args.grace:.0f} s "
          f"grace), cache {args.cache}, git {session['git'][:12]}", flush=True)
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="compile_profile_")
    backend = device = None
    done: list[tuple[Spec, dict]] = []
    this: list[dict] = []
    deadline = None if args.budget is None else t0 + args.budget + args.grace

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            G.write_json(args.out, db)

    try:
        for spec in specs:
            el = time.time() - t0
            base = dict(session=session["id"], group=spec.group, shape=args.shape, paradigm=spec.paradigm,
                        case=PARADIGMS[spec.paradigm], layers=spec.layers, layout=spec.layout, attn=spec.attn,
                        merge=spec.merge, options=spec.options, prompt=args.prompt, gen=args.gen, block=args.block,
                        batch=1, git=session["git"])
            skip = None
            if args.budget is not None and el >= args.budget:
                skip = "budget spent"
            elif backend and backend != "gpu" and not args.force_options and \
                    any(k.startswith("xla_gpu_") for k in OPTIONS[spec.options]):
                skip = f"GPU-only options on {backend}"
            elif backend and backend != "gpu" and spec.attn in ("xla", "triton"):
                skip = f"attn=auto is xla on {backend}: the default row's program"
            elif args.budget is not None and spec.layers > probe:
                pred = predicted_total(spec, done, probe)
                if pred is not None and el + pred > args.budget + args.grace:
                    skip = f"predicted {pred:.0f} s from the shallow rows: would end past budget + grace"
            if skip:
                r = dict(base, skipped=skip, backend=backend, device=device)
                print(progress_line(r, el), flush=True)
                this.append(r)
                continue
            cache_dir = tempfile.mkdtemp(prefix="cache_", dir=tmp) if args.cache == "fresh" else None
            task = dict(kind="row", spec=dataclasses.asdict(spec), row=base, shape=args.shape, prompt=args.prompt,
                        gen=args.gen, block=args.block, seed=args.seed, cache=args.cache, cache_dir=cache_dir,
                        time_run=not args.no_time_run, force_options=args.force_options)
            t_row = time.time()
            res, rc, lines = run_child(task, tmp, deadline, args.xla_vmodule)
            r = res or dict(base)
            r["child_wall_s"] = time.time() - t_row
            if rc != 0:
                if deadline is not None and time.time() >= deadline - 0.5:
                    phase = "trace" if "trace_s" not in r else "lower" if "lower_s" not in r else \
                        "compile" if "compile_s" not in r else "after the compile"
                    r["killed"] = f"stopped at budget + grace, during {phase}"
                    if phase == "compile" and r.get("compile_started"):
                        r["compile_s_at_least"] = time.time() - r["compile_started"]
                        r["killed"] += f" (compiling for >= {r['compile_s_at_least']:.0f} s)"
                elif not r.get("error"):
                    tail = [ln for ln in lines if ln.strip() and not LOG_RE.match(ln)][-6:]
                    r["error"] = f"the child exited with {rc}: " + "\n".join(tail)[-1200:]
            timers = xla_timers(lines)
            if timers:
                r["xla_timers"] = dict(list(timers.items())[:25])
                r["xla_hlo_passes_s"], r["xla_backend_s"] = timer_split(timers)
            backend, device = r.get("backend") or backend, r.get("device") or device
            if cache_dir:
                shutil.rmtree(cache_dir, ignore_errors=True)
            print(progress_line(r, time.time() - t0), flush=True)
            if not r.get("skipped"):
                merge_row(db, r)
                save()
            done.append((spec, r))
            this.append(r)
        gen_rows = []
        if args.with_run:
            el = time.time() - t0
            if args.budget is not None and el >= args.budget:
                print(f"[{el:5.0f}s] generate at full depth: skipped, budget spent", flush=True)
            else:
                cache_dir = tempfile.mkdtemp(prefix="cache_", dir=tmp) if args.cache == "fresh" else None
                task = dict(kind="generate", paradigms=args.run_paradigms, shape=args.shape, prompt=args.prompt,
                            gen=args.gen, block=args.block, seed=args.seed, cache=args.cache, cache_dir=cache_dir,
                            row=dict(session=session["id"], shape=args.shape, prompt=args.prompt, gen=args.gen,
                                     block=args.block, batch=1, layout="per_layer", git=session["git"]))
                res, rc, _ = run_child(task, tmp, deadline, "")
                gen_rows = (res or {}).get("rows", [])
                if rc != 0:
                    print(f"# generate child exited with {rc}", flush=True)
                db.setdefault("generate", {})
                for g in gen_rows:
                    db["generate"][f"{g.get('device', '?')} | {g['shape']} {g['paradigm']} L{g['layers']} "
                                   f"P{g['prompt']} G{g['gen']}"] = g
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        session["seconds"] = time.time() - t0
        session["rows"] = [row_key(r) if not r.get("skipped") else f"skipped: {r['paradigm']} L{r['layers']} "
                           f"{r['layout']} {r['options']} ({r['skipped']})" for r in this]
        db["runs"].append(session)
        save()
    print()
    print(table(this))
    for g in gen_rows:
        print(generate_line(g))
    print()
    print("Summary (fits seconds = a + b x layers over the shallow rows):")
    for ln in summary(this, probe) or ["- no two depths of one variant compiled: nothing to extrapolate"]:
        print(ln)
    print(f"# done in {time.time() - t0:.0f} s; rows in {args.out}", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        return child_main(argv[1])
    args = parse(argv)
    if args.markdown:
        db = load_db(args.out)
        rows = list(db["rows"].values())
        print(table(rows))
        for g in db.get("generate", {}).values():
            print(generate_line(g))
        print()
        for ln in summary(rows, args.probe_layers):
            print(ln)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
