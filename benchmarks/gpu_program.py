"""What XLA builds for each decode step on an NVIDIA GPU, compiled on a machine without one.

The GPU is lent to a session only some of the time; the programs XLA compiles for it are not. This
script compiles the very program `jdllm.generate` runs (`jdllm.decode.loop.compiled()` on the state,
paradigm and context `jdllm.api.prepare` builds, weights as abstract arrays in jdllm's per-layer
layout) for an H100 or H200 *deviceless*: a `jax.experimental.topologies` description of the GPU
(its compute capability, SM count, memory) stands in for the device, and XLA runs its whole GPU
pipeline (fusion, buffer assignment, copy insertion, Triton and Mosaic GPU kernel compiles) to the
executable. It reads the optimized HLO:

  kernels / step: kernels the decode loop's body launches per step: its own, plus those of the
      branch a conditional takes (`branches`: each conditional branch's count; a decode step takes
      one branch per conditional; the worst step adds each conditional's costliest branch, so a
      chain of window widths run in turn, `jdllm.decode.common.in_turn`, counts every width's
      forward where a step runs one of them);
  copies / step: bytes moved per step by copy, slice and pad kernels of at least 1 MiB in the
      loop's body (`body`) and in each branch: copies of the KV cache (the whole cache, or one
      layer of it, re-materialised every step) show up here;
  temp / args / out: `compiled.memory_analysis()` bytes;
  compile s: the deviceless compile (no GEMM autotuning: no device to time candidates on).

What it cannot say: times (nothing runs), and GEMM tilings (XLA's defaults, not the autotuner's
picks). Kernel counts and copies are what this jaxlib's XLA makes of the program for that target;
the GPU machine's jax may differ (each row records the versions).

Needs the CUDA plugin of the installed jax (about 3 GB of wheels; it installs on a CPU-only
machine and needs no driver for this):

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    python benchmarks/gpu_program.py                 # 8B, the priority cases + multi_block exact, P128/G256
    python benchmarks/gpu_program.py --long          # prompt 32768, gen 1024: AR, block_diffusion, mb exact
    python benchmarks/gpu_program.py --cases mb_approx_b4   # a gpu.py case at another batch (NAME_bN)
    PYTHONPATH=../old python benchmarks/gpu_program.py --label before  # another checkout's jdllm, rows apart
    python benchmarks/gpu_program.py --markdown      # the table of --out
    python benchmarks/gpu_program.py --conditionals  # when XLA keeps a buffer in place under a conditional

Each case compiles in a process of its own. Rows merge into `--out`
(default benchmarks/results/gpu_program.json), keyed by target, shape, case, prompt, gen and label.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "gpu_program.json")
MIB = 2 ** 20

# gpu_device_info of each target (`xla.GpuTargetConfigProto`, text format): what XLA's GPU compiler
# reads from a device; the numbers are the public specifications of the two cards
TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", cores=132, clock=1.98, memory=84929347584, bandwidth=3352320000000),
    "h200": dict(name="NVIDIA H200", cores=132, clock=1.98, memory=150754820096, bandwidth=4800000000000),
}
TARGET_CONFIG = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: {clock}
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{name}"
"""
DEFAULT_CASES = ("ar_b1", "bd_static_b1", "fastdllm_dual_b1", "mb_approx_b1", "mb_exact_b1")
LONG_CASES = ("ar_b1", "bd_static_b1", "mb_exact_b1")
COPY_NAMES = re.compile(r"^(copy|wrapped_slice|loop_pad_fusion|loop_slice_fusion|loop_dynamic_slice_fusion)")
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1,
         "s4": 0.5}


def _compile_profile():
    """benchmarks/compile_profile.py as a module: gpu.py's cases (its `G`), hlo_stats, memory_stats."""
    spec = importlib.util.spec_from_file_location("jdllm_bench_compile_profile",
                                                  os.path.join(ROOT, "benchmarks", "compile_profile.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- reading the optimized HLO
def computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from `compiled.as_text()`; ENTRY's name is kept."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                comps["__entry__"] = comps[cur]
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line)
    return comps


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO result shape (a tuple's elements summed)."""
    total = 0.0
    for dt, dims in re.findall(r"\b(bf16|f16|f32|s32|u32|pred|s8|u8|f8e4m3fn|s4)\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * BYTES[dt]
    return int(total)


INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*?) (fusion|custom-call|copy|while|conditional|sort|gather|scatter)\(")


def launches(comps: dict, name: str) -> dict:
    """What one pass of computation `name` launches: kernels by kind, the copies (copy / slice / pad
    kernels of >= 1 MiB: name, MiB), its while loops' bodies and its conditionals' branches."""
    kinds: collections.Counter = collections.Counter()
    copies, whiles, conds = [], [], []
    for line in comps.get(name, []):
        m = INSTR.match(line)
        if not m:
            continue
        instr, shape, op = m.groups()
        if op == "while":
            whiles.append(re.search(r"body=%([\w.\-]+)", line).group(1))
            continue
        if op == "conditional":
            br = re.search(r"branch_computations=\{([^}]*)\}", line)
            names = [b.strip().lstrip("%") for b in br.group(1).split(",")] if br else \
                [x for k in ("true_computation", "false_computation")
                 for x in re.findall(k + r"=%([\w.\-]+)", line)]
            conds.append(names)
            continue
        if op == "fusion":
            kind = "fusion " + re.search(r"kind=(\w+)", line).group(1)
        elif op == "custom-call":
            kind = "custom-call " + re.search(r'custom_call_target="([^"]+)"', line).group(1)
        else:
            kind = op
        kinds[kind] += 1
        if COPY_NAMES.match(instr) and shape_bytes(shape) >= MIB:
            copies.append((instr, round(shape_bytes(shape) / MIB, 1)))
    return dict(kernels=sum(kinds.values()), kinds=dict(kinds), copies=copies, whiles=whiles, conditionals=conds)


def decode_step(text: str) -> dict:
    """The decode loop (the entry's widest while body) and what a step launches: the body's own
    kernels and copies, and each conditional branch's (recursively: a branch's own conditionals are
    counted into it, each at its most expensive branch)."""
    comps = computations(text)
    entry = launches(comps, "__entry__")
    if not entry["whiles"]:
        return dict(error="no while loop in the entry computation")
    body_name = max(entry["whiles"], key=lambda b: launches(comps, b)["kernels"])

    def total(name: str, seen=()) -> tuple[int, float]:  # kernels and copy MiB of one pass, worst branch
        got = launches(comps, name)
        k, mib = got["kernels"], sum(c[1] for c in got["copies"])
        for branches in got["conditionals"]:
            worst = [total(b, seen + (name,)) for b in branches if b not in seen]
            if worst:
                bk, bm = max(worst)
                k, mib = k + bk, mib + bm
        return k, mib

    body = launches(comps, body_name)
    branches = [[dict(name=b, kernels=total(b)[0], copy_mib=round(total(b)[1], 1)) for b in names]
                for names in body["conditionals"]]
    worst_k, worst_mib = total(body_name)
    return dict(body_kernels=body["kernels"], body_kinds=body["kinds"],
                body_copy_mib=round(sum(c[1] for c in body["copies"]), 1),
                body_copies=collections.Counter(re.sub(r"\.\d+$", "", c[0]) for c in body["copies"]).most_common(),
                largest_body_copies=sorted(body["copies"], key=lambda c: -c[1])[:4], branches=branches,
                step_kernels_max=worst_k, step_copy_mib_max=round(worst_mib, 1),
                entry_kernels=entry["kernels"], entry_copy_mib=round(sum(c[1] for c in entry["copies"]), 1))


def target_sharding(target: str):
    """A single-device sharding on a deviceless `target` GPU (`jax.experimental.topologies`): arrays
    given it make `jit(...).lower(...).compile()` compile for that GPU."""
    import jax  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415

    topo = topologies.get_topology_desc(platform="cuda", topology_name=target,
                                        target_config=TARGET_CONFIG.format(**TARGETS[target]), topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


# --------------------------------------------------------------------------- when a conditional copies
def conditional_rules(target: str) -> list[dict]:
    """The rule behind the cache copies of RESULTS.md: a while loop carries a [4, 1024, 512] bf16
    buffer (a stand-in for a KV cache) through a conditional, in each variant below; copies of the
    buffer inside the loop (its body and branches) are counted in the program compiled for `target`.
    Each branch writes rows of one "layer" per layer (dynamic_update_slice) and reads them back as
    an attention would; variants differ in what the branches do and how they return."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax import lax  # noqa: PLC0415

    sharding = target_sharding(target)
    L, S, D = 4, 1024, 512
    ob = lax.optimization_barrier

    def writer(w, barrier=True, read_first=False):
        def branch(c, i):
            s = jnp.sum(c[0, :8].astype(jnp.float32)) if read_first else jnp.float32(0)
            for layer in range(L):
                c = lax.dynamic_update_slice(c, jnp.ones((1, w, D), c.dtype) * (s > 0).astype(c.dtype), (layer, i, 0))
                s = s + jnp.sum(lax.dynamic_slice(c, (layer, 0, 0), (1, 64, D)).astype(jnp.float32))
            return ob((c, s)) if barrier else (c, s)
        return branch

    def passing(barrier=True):
        def branch(c, i):
            s = jnp.sum(lax.dynamic_slice(c, (1, i, 0), (1, 8, D)).astype(jnp.float32))
            return ob((c, s)) if barrier else (c, s)
        return branch

    def outside(c, i):  # the branches compute the rows; one write after the conditional
        rows, s = lax.cond(i % 3 == 0, lambda c: (jnp.ones((1, 8, D), c.dtype), jnp.sum(c[0, :8].astype(jnp.float32))),
                           lambda c: (jnp.zeros((1, 8, D), c.dtype), jnp.sum(c[1, :8].astype(jnp.float32))), c)
        return lax.dynamic_update_slice(c, rows, (0, i, 0)), s

    def switch(*branches):
        return lambda c, i: lax.switch(i % len(branches), [functools.partial(b, i=i) for b in branches], c)

    def one_row(c, i, dropped=False):  # a writer of one row, of zeros (dropped: a scatter past the end)
        if dropped:
            c = c.at[0, jnp.maximum(i, S)].set(jnp.zeros((D,), c.dtype), mode="drop")
        else:
            c = lax.dynamic_update_slice(c, jnp.zeros((1, 1, D), c.dtype) + (i > S).astype(c.dtype), (0, S - 1, 0))
        return ob((c, jnp.float32(0)))

    def in_turn(*branches, dropped=False):  # one two-way conditional per writer, in turn
        def step(c, i):
            total = jnp.float32(0)
            for j, b in enumerate(branches):
                c, s = lax.cond(i % len(branches) == j, functools.partial(b, i=i),
                                functools.partial(one_row, i=i, dropped=dropped), c)
                total = total + s
            return c, total
        return step

    variants = [
        ("two writers, no barrier", switch(writer(8, barrier=False), writer(16, barrier=False))),
        ("two writers behind a barrier", switch(writer(8), writer(16))),
        ("a writer and a pass-through, barrier", switch(writer(8), passing())),
        ("two writers, one reads before writing, barrier", switch(writer(8, read_first=True), writer(16))),
        ("three writers behind a barrier", switch(writer(8), writer(16), writer(32))),
        ("two writers, the second a nested two-way switch", switch(
            writer(8), lambda c, i: ob(lax.cond(i % 2 == 0, functools.partial(writer(16), i=i),
                                                functools.partial(writer(32), i=i), c)))),
        ("rows from the branches, written after", outside),
        ("three writers in turn, each beside a one-row writer", in_turn(writer(8), writer(16), writer(32))),
        ("three writers in turn, each beside a dropped write", in_turn(writer(8), writer(16), writer(32),
                                                                      dropped=True)),
    ]
    out = []
    for name, step in variants:
        def body(carry, step=step):
            c, i = carry
            c, s = step(c, i)
            return c, i + 1 + (s > 1e9).astype(jnp.int32)

        fn = jax.jit(lambda c, body=body: lax.while_loop(lambda cr: cr[1] < 100, body, (c, jnp.int32(0)))[0])
        text = fn.lower(jax.ShapeDtypeStruct((L, S, D), jnp.bfloat16, sharding=sharding)).compile().as_text()
        comps = computations(text)
        body_name = max(launches(comps, "__entry__")["whiles"], key=lambda b: launches(comps, b)["kernels"])
        names = [body_name] + [b for branches in launches(comps, body_name)["conditionals"] for b in branches]
        big = f"[{L},{S},{D}]"
        copies = sum(1 for n in names for line in comps[n] if " copy(" in line and big in line)
        out.append(dict(variant=name, copies_in_loop=copies))
        print(f"  {name:<52} {copies} copies of the buffer in the loop", flush=True)
    return out


# --------------------------------------------------------------------------- a child: one case
def case_of(G, case_id: str):
    """gpu.py's case of that id, or one of its b1 cases at another batch (`mb_approx_b8`)."""
    cases = {c.id: c for c in G.all_cases()}
    if case_id in cases:
        return cases[case_id]
    m = re.fullmatch(r"(\w+)_b(\d+)", case_id)
    if not m or f"{m.group(1)}_b1" not in cases:
        raise ValueError(f"unknown case {case_id!r}: gpu.py's cases are {sorted(cases)}, or NAME_bN for another batch")
    return dataclasses.replace(cases[f"{m.group(1)}_b1"], batch=int(m.group(2)))


def child(task: dict) -> int:
    """Compile one case deviceless for `task["target"]` and write its row to task["result"]."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # the topology below is the GPU; nothing runs anywhere
    os.environ.setdefault("JDLLM_PALLAS_BACKEND", "mosaic")  # what a Hopper GPU picks (no device to ask)
    os.environ["JDLLM_CACHE_DIR"] = "off"
    row = dict(task["row"])
    try:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415

        sharding = target_sharding(task["target"])
        jax.default_backend = lambda: "gpu"  # jdllm's GPU choices (Pallas kernels, window merging)
        cp = _compile_profile()
        G = cp.G
        import jdllm  # noqa: PLC0415
        from jdllm.api import params_for, prepare  # noqa: PLC0415
        from jdllm.decode import loop  # noqa: PLC0415
        from jdllm.model import default_layout, is_param_spec, param_specs  # noqa: PLC0415

        case = case_of(G, task["case"])
        P, Gn, block = task["prompt"], task["gen"], task["block"]
        base = G.base_config(task["shape"], 1 << (P + Gn + 8 * block).bit_length())
        cfg = G.model_config(base, case.attention, block).replace(kv_cache_dtype=task.get("kv_cache"))
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=sharding),
                              param_specs(cfg, default_layout()), is_leaf=is_param_spec)
        model = jdllm.Model(config=cfg, params=params, attn_impl="auto")
        dec = G.decoding_for(case, Gn, block)
        prep = prepare(model, G.prompts_for(case, P, cfg.vocab_size, 0), dec,
                       jdllm.Sampling(max_new_tokens=Gn, stop_token_ids=()))
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), prep.state)
        t0 = time.perf_counter()
        lowered = loop.compiled().trace(params_for(model, dec), state, paradigm=prep.paradigm, ctx=prep.ctx).lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        text = compiled.as_text()
        if task.get("dump"):
            os.makedirs(os.path.dirname(task["dump"]), exist_ok=True)
            with open(task["dump"], "w") as f:
                f.write(text)
        row.update(lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2), canvas=int(prep.state.slots),
                   memory=cp.memory_stats(compiled), hlo=cp.hlo_stats(text), step=decode_step(text),
                   jax=jax.__version__, jdllm_from=os.path.dirname(os.path.dirname(jdllm.__file__)))
        row["commit"] = git_commit(row["jdllm_from"])  # the tree compiled (PYTHONPATH may name another)
    except Exception as e:  # noqa: BLE001 (a failed case is recorded; the others still run)
        row["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-1500:]
        traceback.print_exc()
    with open(task["result"], "w") as f:
        json.dump(row, f)
    return 0


# --------------------------------------------------------------------------- the parent
def row_key(r: dict) -> str:
    key = "|".join(str(r.get(k)) for k in ("target", "shape", "case", "prompt", "gen", "label"))
    return key + (f"|kv-{r['kv_cache']}" if r.get("kv_cache") else "")


def case_name(r: dict) -> str:
    """The row's case, with its KV cache's dtype when not the activations' (`--kv-cache int8`)."""
    return r["case"] + (f" ({r['kv_cache']} KV)" if r.get("kv_cache") else "")


def load_db(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return dict(rows={})


def git_commit(where: str = ROOT) -> str:
    """The commit of the checkout at `where` (+ " (dirty)" with uncommitted changes to the code compiled)."""
    try:
        out = subprocess.run(["git", "-C", where, "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no", "--",
                                "jdllm", "pallas_kernels"], capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (dirty)" if dirty else "")
    except OSError:
        return "?"


def line(r: dict) -> str:
    head = f"{r['target']} {r['shape']} {case_name(r):<17} P{r['prompt']}/G{r['gen']} [{r['label']}]"
    if r.get("error"):
        return f"{head} | FAILED: {r['error'].splitlines()[-1][:200]}"
    s, m = r["step"], r["memory"]
    return (f"{head} | {s['body_kernels']} kernels in the loop body (worst step {s['step_kernels_max']}) | copies "
            f"{s['body_copy_mib']:.0f} MiB body, {s['step_copy_mib_max']:.0f} MiB worst step | temp "
            f"{m.get('temp_bytes', 0) / 2**30:.2f} GiB | compile {r['compile_s']:.1f}s")


def table(rows: list[dict]) -> str:
    out = ["| target | shape | case | P/G | label | kernels / step: body (worst step) | copies / step, MiB: body "
           "(worst step) | largest copies in the body | temp GiB | out GiB | compile s | jax | tree |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["target"], r["shape"], r["prompt"], r["case"], r.get("date", ""))):
        head = f"| {r['target']} | {r['shape']} | {case_name(r)} | {r['prompt']}/{r['gen']} | {r['label']} |"
        if r.get("error"):
            out.append(f"{head} FAILED: {r['error'].splitlines()[-1][:100]} | | | | | | | |")
            continue
        s, m = r["step"], r["memory"]
        big = ", ".join(f"{n} x{c}" for n, c in s["body_copies"][:3]) or "-"
        out.append(f"{head} {s['body_kernels']} ({s['step_kernels_max']}) | {s['body_copy_mib']:.0f} "
                   f"({s['step_copy_mib_max']:.0f}) | {big} | {m.get('temp_bytes', 0) / 2**30:.2f} | "
                   f"{m.get('output_bytes', 0) / 2**30:.2f} | {r['compile_s']:.1f} | {r.get('jax')} | {r.get('commit')} |")
    return "\n".join(out)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), default="h100")
    ap.add_argument("--shape", default="8b", help="a benchmarks/gpu.py shape (default 8b)")
    ap.add_argument("--cases", nargs="+", default=None, help="gpu.py case ids, or NAME_bN for one at another "
                    "batch (default: "
                    + " ".join(DEFAULT_CASES) + "; with --long: " + " ".join(LONG_CASES) + ")")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--long", action="store_true", help="prompt 32768, generation 1024 (gpu.py --long's cases)")
    ap.add_argument("--label", default="", help="a tag for the rows (kept apart from other labels)")
    ap.add_argument("--kv-cache", default=None, choices=("int8",),
                    help="an int8 KV cache (kv_cache_dtype; issue 29): rows keyed apart from the bf16 cache's")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--dump", metavar="DIR", help="also write each case's compiled program (HLO text) into DIR")
    ap.add_argument("--markdown", action="store_true", help="print the table of --out and exit")
    ap.add_argument("--conditionals", action="store_true",
                    help="compile small loops that carry a buffer through a conditional, count its copies per "
                         "variant (when XLA updates a cache in place under lax.cond / lax.switch) and exit")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def cuda_plugin_missing() -> str | None:
    """Why no deviceless GPU compile can run here (None when the jax CUDA plugin is installed)."""
    if importlib.util.find_spec("jax_plugins") and any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}")
                                                         for v in (12, 13)):
        return None
    return ("the jax CUDA plugin is not installed, so XLA cannot compile for a GPU here; install the one "
            "matching your jax (it needs no GPU or driver): pip install \"jax[cuda12]==$(python -c "
            "'import jax; print(jax.__version__)')\"")


def main(argv=None) -> int:
    args = parse(argv)
    if args._child:
        with open(args._child) as f:
            return child(json.load(f))
    db = load_db(args.out)
    if args.markdown:
        print(table(list(db["rows"].values())))
        return 0
    missing = cuda_plugin_missing()
    if missing:
        print(f"gpu_program.py: {missing}", file=sys.stderr)
        return 2
    if args.conditionals:
        os.environ["JAX_PLATFORMS"] = "cpu"
        print(f"# deviceless {args.target}: a [4, 1024, 512] bf16 buffer carried through a conditional", flush=True)
        db["conditionals"] = dict(target=args.target, rows=conditional_rules(args.target))
        with open(args.out, "w") as f:
            json.dump(db, f, indent=1, sort_keys=True)
        return 0
    if args.long:
        args.prompt, args.gen = 32768, 1024
    cases = args.cases or (LONG_CASES if args.long else DEFAULT_CASES)
    commit, t_start = git_commit(), time.time()
    print(f"# deviceless {args.target} compiles of {args.shape}, P{args.prompt}/G{args.gen}, tree {commit}", flush=True)
    import tempfile  # noqa: PLC0415

    for case in cases:
        row = dict(target=args.target, shape=args.shape, case=case, prompt=args.prompt, gen=args.gen,
                   block=args.block, label=args.label, commit=commit, kv_cache=args.kv_cache,
                   date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        with tempfile.TemporaryDirectory() as tmp:
            task = dict(row=row, target=args.target, shape=args.shape, case=case, prompt=args.prompt, gen=args.gen,
                        block=args.block, kv_cache=args.kv_cache, result=os.path.join(tmp, "row.json"),
                        dump=args.dump and os.path.abspath(os.path.join(args.dump, f"{args.target}_{case}_P{args.prompt}"
                                                                                   f"_G{args.gen}" + ("_kv" + args.kv_cache if args.kv_cache else "")
                                                                                   + ".hlo.txt")))
            with open(os.path.join(tmp, "task.json"), "w") as f:
                json.dump(task, f)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", os.path.join(tmp, "task.json")],
                           check=False)
            try:
                with open(task["result"]) as f:
                    row = json.load(f)
            except (OSError, ValueError):
                row = dict(row, error="the child process wrote no row (crashed or killed)")
        db["rows"][row_key(row)] = row
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(db, f, indent=1, sort_keys=True)
        print(f"[{time.time() - t_start:5.0f}s] " + line(row), flush=True)
    print(table([r for r in db["rows"].values() if r.get("label") == args.label and r.get("prompt") == args.prompt]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
