"""End-to-end decode on a GPU: every paradigm at a real model's shape, against the weight-read floor.

Random bf16 weights at the LLaDA-8B / LLaMA-3-8B shape (`--shape 8b`: hidden 4096, 32 layers,
32 heads MHA, MLP 12288, vocab 126464) or a Qwen3 / SDAR-4B-like one (`4b`: hidden 2560, 36
layers, 32 heads, 8 KV heads, MLP 9728, vocab 151936, q/k norm, tied embeddings); `tiny` is a
two-layer model for self-checks on the CPU. One set of weights serves every attention kind
(`jdllm.Model(cfg.replace(attention=...), params)`): causal for ar / ar_spec, block-causal
(block 32) for block_diffusion and multi_block exact, bidirectional for LLaDA, Fast-dLLM and
multi_block approx; the mask token is the last id. Prompt 128, generation 256, greedy, stop
tokens off. The LM head is drawn with a larger std (`--head-std 0.1`) so that the logits are
peaked and the thresholded paradigms reveal several tokens per forward, as a trained model
does (with std 0.02 a random 126k-way head never reaches a 0.9 confidence).

    python benchmarks/gpu.py                        # every case, 8B shape, per-layer weights
    python benchmarks/gpu.py --quick --budget 240   # the ~5-minute subset (see --quick)
    python benchmarks/gpu.py --layouts per_layer stacked --only ar_b1 bd_static_b1
    python benchmarks/gpu.py --xla-flags-variants '' \\
        '--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false'
    python benchmarks/gpu.py --markdown             # print the table of benchmarks/results/gpu.json
    python benchmarks/gpu.py --markdown --write-results-md   # ... and put it into RESULTS.md
    python benchmarks/gpu.py --shape tiny --gen 16 --prompt 8 --repeats 1 --out /tmp/gpu_tiny.json
    python benchmarks/gpu.py --long                 # AR, block_diffusion, multi_block exact at prompt 32k, gen 1k
    python benchmarks/gpu.py --shape tiny --long --long-prompt 512 --long-gen 32 --block 8 --out /tmp/gpu_tiny.json

Long contexts (`--long`, issue 28 item 3): only the `--long-cases` (default ar_b1, bd_static_b1,
mb_exact_b1) at `--long-prompt` (32768) and `--long-gen` (1024), in one child. Before anything
compiles, the KV cache (layers x 2 x canvas x KV heads x head_dim, the weights' dtype) plus a
generous estimate of a prompt-sized forward's activations is checked against the device's free
memory; the prefill and step programs are then compiled ahead of time (`loop.compiled_steps()`,
`lower().compile()`) and their own temp bytes (`memory_analysis`) plus the cache checked again;
either too big -> a row saying why (`skipped`), and nothing runs. The decode then runs as
`generate` does, through the loop's pieces so that the prompt and the generation are timed apart:
phase A = `prefill` + the first step (multi_block's prefill runs no forward; its first step is the
prompt's), phase B = the remaining steps + `finalize`. Columns: prefill s (phase A), decode
ms/forward (phase B; AR also per token), tok/s (all generated tokens / A + B), the KV floor =
(the weights a forward reads + the KV cache up to the average live length P + G/2) / the read
bandwidth, its ratio, first call (the ahead-of-time compile + the first run; the compile apart),
peak (the running peak), the KV cache and the programs' temp bytes. The rows (kind "long") merge
into the same JSON, keyed by prompt and gen like the others, and print as a table of their own.
`--merge-tokens N` sets the long decodes' window-merge bound (`DecodeCtx.merge_tokens`: on a GPU,
window shapes of <= 256 tokens run as the widest of them, a rule that ignores the cache length;
0 compiles each width) in rows keyed apart, to A/B it at 32k.

How it runs. The parent process never touches the device: it starts one child process per
piece of work (this script again, `--_child TASK`), so that each XLA_FLAGS variant gets its own
process, each group of cases its own peak-memory counter, and a first call can be timed against
an empty and then a filled persistent compilation cache:
  1. a probe child: device, versions, the device-to-device copy bandwidth (bytes read + written),
     the read bandwidth (the floor's) and a bf16 matmul rate, each timed as 10 passes in one
     compiled loop, once;
  2. per (XLA flags variant, weight layout): a child that builds the weights on the device
     (each weight generated in place, one layer at a time: never two copies) and runs the
     priority cases (AR b1, block_diffusion static b1, Fast-dLLM dual, multi_block approx),
     with a fresh, empty persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`, min
     compile time 0); each case's first call there is its cold first call;
  3. per variant and layout: a child that re-runs the first call of the `--cold-cases` with
     the cache the step-2 child filled (the "cached" first call; `--cold-separate` instead
     times cold in a child of its own with an empty cache, then cached from it);
  4. the PyTorch Hugging Face baseline (transformers, eager, bf16, sdpa) of the same shape,
     where torch with CUDA imports (on the tiny shape it runs on the CPU; otherwise skipped);
  5. the remaining cases, the same way, big batches last (their KV caches set the peak);
     the serving engine (64 concurrent requests) against offline `generate` of the same
     prompts comes last.
`--budget S`: no case or child starts after S seconds (what is done is written).

Timing: the first call is a full `jdllm.generate` (prepare, trace,
compile, run, outputs) and is the warm-up; then `--repeats` runs of the compiled decode on a
prepared state (`loop.compiled()`, `jax.block_until_ready`), median kept; the tokens of every
repeat must equal the first call's (greedy).

Columns. tok/s: generated tokens of the whole batch / median seconds. NFE: model forwards per
row (prefill and KV-commit passes included). TPF: tokens per row / NFE. ms/fwd: seconds /
forwards of the batch. x floor: ms/fwd over the floor, the time to read the weights a forward
reads (every parameter except an untied input embedding, of which a forward gathers only its
window's rows) at the read bandwidth measured in the same run (a max-reduction over 4 GiB,
timed in a compiled loop; rows of the first GPU session, which measured only a copy timed one pass
per call, use that copy figure, which read low). first call: seconds of the
first `generate` in a process whose persistent cache is empty (cold) / filled by an earlier
process (cached); the first-call child's progress line and row (`compile.cached_phases`) split it
by JAX's compile events: programs (from the cache), tracing, lowering, the backend's compile or
cache load, and the rest (running, host work). peak: `peak_bytes_in_use` of the device when the case ended; JAX cannot reset
it, so it is the process's running peak: exact for the case when the case raised it (the row
says so), otherwise an upper bound (the cases of a child run smallest-first for that reason).

Targets (issue 27, H100, 8B shape, batch 1), each printed as met / missed with the figure:
AR <= 1.1x floor per token; every diffusion window forward (T <= 128) <= 1.2x floor;
multi_block ms/forward <= 0.4 x d3LLM-in-SGLang's 18.2 ms; each paradigm >= 3x faster per
forward than the HF eager baseline (AR: generate b1 per token; 32-token windows: one forward of
32 tokens; whole-canvas forwards: one forward of prompt + gen tokens); AR b64 tok/s >= 2x HF
generate b64; first call <= 30 s cold and <= 5 s cached; peak <= weights + KV cache + 2 GiB.

Results are merged into `--out` (default benchmarks/results/gpu.json): rows keyed by shape,
case, batch, layout, attention impl, XLA flags, prompt and gen length, quantization and device
kind; a later session adds rows or replaces those of the same kind of device (a failed case does not erase an earlier figure; it is noted beside it).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import gc
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "gpu.json")
RESULTS_MD = os.path.join(ROOT, "benchmarks", "RESULTS.md")
MD_BEGIN = "<!-- benchmarks/gpu.py:begin (generated by `python benchmarks/gpu.py --markdown --write-results-md`) -->"
MD_END = "<!-- benchmarks/gpu.py:end -->"
GIB = 2 ** 30

SHAPES = {
    # LLaDA-8B / LLaMA-3-8B
    "8b": dict(model_type="llama", vocab_size=126464, hidden_size=4096, intermediate_size=12288, num_layers=32,
               num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=500000.0, hf="llama"),
    # Qwen3-4B / SDAR-4B-like (Qwen3-4B ties its embeddings)
    "4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
               num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True,
               rope_theta=1000000.0, hf="qwen3"),
    # the CPU self-check: GQA and q/k norm like 4b, two layers
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, rope_theta=10000.0, hf="qwen3"),
}
LAYOUTS = ("per_layer", "stacked")
D3LLM_SGLANG_MS = 18.2  # d3LLM-LLaDA in SGLang, H100: 545 tok/s at 9.91 tokens per forward


# --------------------------------------------------------------------------- the cases
@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # paradigm setting, e.g. "bd_static"
    batch: int
    paradigm: str  # jdllm paradigm name
    attention: str  # the model's attention kind for it
    label: str  # what the row says in words
    window: str  # "token" (AR), "window" (<= 128-token windows), "canvas" (forwards up to the whole canvas), "serve"

    @property
    def id(self) -> str:
        return f"{self.name}_b{self.batch}"


def all_cases() -> list[Case]:
    C = Case
    return [
        C("ar", 1, "ar", "causal", "AR greedy", "token"),
        C("bd_static", 1, "block_diffusion", "block_causal", "block_diffusion static 32x8", "window"),
        C("fastdllm_dual", 1, "masked_diffusion", "bidirectional", "Fast-dLLM dual cache 0.9", "window"),
        C("mb_approx", 1, "multi_block", "bidirectional", "multi_block approx cache", "canvas"),
        C("bd_dynamic", 1, "block_diffusion", "block_causal", "block_diffusion dynamic 0.9", "window"),
        C("mb_exact", 1, "multi_block", "block_causal", "multi_block exact cache", "window"),
        C("fastdllm_prefix", 1, "masked_diffusion", "bidirectional", "Fast-dLLM prefix cache 0.9", "canvas"),
        C("llada", 1, "masked_diffusion", "bidirectional", "LLaDA no cache, steps gen/4", "canvas"),
        C("ar_spec_pld", 1, "ar_spec", "causal", "ar_spec prompt lookup, copying prompt", "token"),
        C("ar", 16, "ar", "causal", "AR greedy", "token"),
        C("bd_static", 32, "block_diffusion", "block_causal", "block_diffusion static 32x8", "window"),
        C("bd_dynamic", 32, "block_diffusion", "block_causal", "block_diffusion dynamic 0.9", "window"),
        C("ar", 64, "ar", "causal", "AR greedy", "token"),
        C("serve_ar", 64, "ar", "causal", "serving engine, 64 concurrent requests", "serve"),
    ]


PRIORITY = ("ar_b1", "bd_static_b1", "fastdllm_dual_b1", "mb_approx_b1")
# --long (issue 28 item 3): the long-context cases, prompt 32k and generation 1k by default. multi_block
# runs its exact cache (block-causal windows from the cache's end); approx (bidirectional) refreshes the
# whole 33k canvas with a prefill-sized forward whenever a block stabilises: add it with --long-cases
LONG_CASES = ("ar_b1", "bd_static_b1", "mb_exact_b1")
LONG_PROMPT, LONG_GEN = 32768, 1024
LONG_PROFILE_STEPS = 64  # --long --profile: the decode steps after the prompt run under the profiler
QUICK_CASES = PRIORITY + ("hf",)
DEFAULT_COLD = PRIORITY


def decoding_for(case: Case, gen: int, block: int):
    """The paradigm config of a case (block: the block length, at most gen)."""
    import jdllm  # noqa: PLC0415

    n = case.name
    if n in ("ar", "serve_ar"):
        return jdllm.AR()
    if n == "ar_spec_pld":
        return jdllm.Speculative(proposer="prompt_lookup", num_draft_tokens=4, max_ngram=3)
    if n == "bd_static":
        return jdllm.BlockDiffusion(block_length=block, denoising_steps=min(8, block),
                                    strategy="low_confidence_static")
    if n == "bd_dynamic":
        return jdllm.BlockDiffusion(block_length=block, denoising_steps=block, strategy="low_confidence_dynamic",
                                    confidence_threshold=0.9)
    if n == "llada":
        return jdllm.MaskedDiffusion(gen_length=gen, steps=max(gen // 4, gen // block), block_length=block)
    if n == "fastdllm_prefix":
        return jdllm.MaskedDiffusion(gen_length=gen, block_length=block, confidence_threshold=0.9, cache_mode="prefix")
    if n == "fastdllm_dual":
        return jdllm.MaskedDiffusion(gen_length=gen, block_length=block, confidence_threshold=0.9, cache_mode="dual")
    if n == "mb_exact":
        return jdllm.MultiBlock(block_size=block, cache_mode="exact")
    if n == "mb_approx":
        return jdllm.MultiBlock(block_size=block, cache_mode="approx", cache_delay_iter=2)
    raise ValueError(n)


def select_cases(only, gen: int) -> list[Case]:
    cases = all_cases()
    if only:
        cases = [c for c in cases if c.id in only or c.name in only]
    return cases


def prompts_for(case: Case, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed + case.batch)
    if case.name == "ar_spec_pld":  # a copying prompt: one pattern repeated, so n-gram lookup finds matches
        pat = rng.integers(0, vocab - 2, size=max(2, min(16, prompt_len // 2)))
        return [np.resize(pat, prompt_len).tolist() for _ in range(case.batch)]
    return rng.integers(0, vocab - 2, size=(case.batch, prompt_len)).tolist()


# --------------------------------------------------------------------------- weights
def base_config(shape: str, context: int = 4096):
    """The shape's config; `context`: max_position_embeddings (at least 4096; --long raises it to
    hold the long prompt and generation; RoPE needs no table, so it changes nothing else)."""
    from jdllm.config import ModelConfig  # noqa: PLC0415

    kw = {k: v for k, v in SHAPES[shape].items() if k != "hf"}
    return ModelConfig(max_position_embeddings=max(4096, int(context)), eos_token_ids=(), **kw)


def model_config(base, attention: str, block: int):
    """The same weights as a causal, block-causal or bidirectional model (mask token: the last id)."""
    if attention == "causal":
        return base
    return base.replace(model_type="llada" if attention == "bidirectional" else "sdar", attention=attention,
                        block_size=block if attention == "block_causal" else 1, mask_token_id=base.vocab_size - 1)


def build_params(cfg, layout: str, seed: int, std: float, head_std: float, quantize=None):
    """Random bf16 weights built on the device, each array generated where it lives.

    Every (weight, layer) pair draws from its own key, so both layouts hold the same numbers.
    per_layer: one jitted call per layer builds that layer's dict, passed through
    `jdllm.model.unstack_layers` inside the call (the library's own per-layer form: fused qkv /
    gate_up); stacked: one jitted call per weight builds its [layers, ...] array. No step holds
    more than one layer's weights twice. quantize ("int8" / "fp8"): each top-level weight, layer
    (per_layer) or stacked weight is quantized as soon as it is built (`jdllm.quant`), so the bf16
    model never exists whole and the device's peak is the quantized model's."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jdllm.model import param_specs, unstack_layers  # noqa: PLC0415
    from jdllm.quant import as_quantization, quantize_weight  # noqa: PLC0415

    qc = as_quantization(quantize)

    def q(name, x, lead=0):  # one weight as `quantize` stores it (plain where it leaves it), x freed
        return x if qc is None else quantize_weight(name, x, qc, lead, consume=True)

    dtype = jnp.bfloat16
    specs = param_specs(cfg)
    root = jax.random.key(seed)
    names = sorted(specs["layers"])
    L = cfg.num_layers

    def draw(spec, shape, key, s):  # spec, shape, s: Python values closed over (bound by partial)
        if spec.init == "ones":
            return jnp.ones(shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(shape, dtype)
        return jax.random.normal(key, shape, dtype) * jnp.asarray(s, dtype)

    def layer_key(j, i):
        return jax.random.fold_in(jax.random.fold_in(root, 100 + j), i)

    def put_layer(spec, j, buf, i):
        return jax.lax.dynamic_update_index_in_dim(buf, draw(spec, spec.shape[1:], layer_key(j, i), std), i, 0)

    head_is_embed = cfg.tie_word_embeddings
    top = {}
    for j, name in enumerate(sorted(k for k in specs if k != "layers")):
        spec = specs[name]
        s = head_std if (name == "lm_head" or (name == "embed" and head_is_embed)) else std
        top[name] = q(name, jax.jit(functools.partial(draw, spec, spec.shape, s=s))(jax.random.fold_in(root, j)))

    if layout == "per_layer":
        # small stand-ins for the top-level weights, so unstack_layers sees a whole params dict
        stubs = {n: jnp.zeros((1,) * len(specs[n].shape), dtype) for n in specs if n != "layers"}

        @jax.jit
        def one_layer(i):
            lp = {n: draw(specs["layers"][n], specs["layers"][n].shape[1:], layer_key(j, i), std)[None]
                  for j, n in enumerate(names)}
            return unstack_layers(dict(stubs, layers=lp))["layers"][0]

        layers = []
        for i in range(L):
            layers.append({k: q(k, v) for k, v in one_layer(i).items()})
            jax.block_until_ready(layers[-1])  # one layer's temporaries at a time
        params = dict(top, layers=tuple(layers))
    elif layout == "stacked":
        layers = {}
        for j, n in enumerate(names):
            spec = specs["layers"][n]
            # layer by layer into the donated [layers, ...] buffer: a transient of one layer, not of the stack
            put = jax.jit(functools.partial(put_layer, spec, j), donate_argnums=0)
            buf = jax.jit(functools.partial(jnp.zeros, spec.shape, dtype))()
            for i in range(L):
                buf = put(buf, i)
            layers[n] = jax.block_until_ready(q(n, buf, lead=1))
        params = dict(top, layers=layers)
    else:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    return jax.block_until_ready(params)


def weight_bytes(params, cfg) -> tuple[int, int]:
    """(all parameter bytes, bytes a forward reads: all but an untied input embedding)."""
    import jax  # noqa: PLC0415

    total = sum(x.nbytes for x in jax.tree.leaves(params))
    read = total if cfg.tie_word_embeddings else total - params["embed"].nbytes
    return int(total), int(read)


# --------------------------------------------------------------------------- device facts
def first_device_stats() -> dict:
    """The first device's `memory_stats()` ({} where the backend keeps none: the CPU)."""
    import jax  # noqa: PLC0415

    from jdllm.device_memory import device_stats  # noqa: PLC0415

    return device_stats(jax.devices()[0]) or {}


def device_peak():
    st = first_device_stats()
    return st.get("peak_bytes_in_use"), st.get("bytes_in_use")


def probe(task) -> dict:
    """Device, versions, copy bandwidth (read + write bytes) and a bf16 matmul rate."""
    import importlib.metadata as md  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    dev = jax.devices()[0]
    gpu = jax.default_backend() == "gpu"
    info = dict(backend=jax.default_backend(), device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__,
                python=sys.version.split()[0])
    for pkg in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt", "jax-cuda12-pjrt"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        info["platform_version"] = dev.client.platform_version
    except Exception:  # noqa: BLE001
        pass
    try:
        from jax._src.lib import cuda_versions  # noqa: PLC0415 (private: versions of the CUDA libraries jaxlib loaded)

        if cuda_versions is not None:
            for k in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version",
                      "cublas_get_version"):
                if hasattr(cuda_versions, k):
                    info[k.replace("_get_version", "")] = getattr(cuda_versions, k)()
    except Exception:  # noqa: BLE001
        pass
    info.update(nvidia_smi())
    # the device's limits (benchmarks/device_limits.py): copy (bytes read + written), read (the floor's
    # basis: what a decode step does to the weights) and a bf16 matmul rate
    sys.path.insert(0, ROOT)
    from benchmarks import device_limits as lim  # noqa: PLC0415

    iters = 5 if gpu else 2
    info["copy_gbs"] = lim.copy_gbps((2 << 30) if gpu else (16 << 20), iters)
    info["read_gbs"] = lim.read_gbps((4 << 30) if gpu else (8 << 20), iters)
    info["matmul_tflops_bf16"] = lim.matmul_tflops(8192 if gpu else 256, jnp.bfloat16, iters)
    print(f"# device {info['device']} ({info['backend']}), jax {info['jax']}, jaxlib {info.get('jaxlib')}, "
          f"CUDA {info.get('cuda_version_smi') or info.get('cuda_runtime') or '-'}; copy {info['copy_gbs']:.0f} GB/s "
          f"(read + write), read {info['read_gbs']:.0f} GB/s, bf16 matmul {info['matmul_tflops_bf16']:.1f} TFLOP/s", flush=True)
    return info


def nvidia_smi() -> dict:
    out = {}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        if q.returncode == 0 and q.stdout.strip():
            out["nvidia_smi"] = q.stdout.strip().splitlines()[0]
        h = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        m = re.search(r"CUDA Version:\s*([\d.]+)", h.stdout or "")
        if m:
            out["cuda_version_smi"] = m.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    return out


# --------------------------------------------------------------------------- one decode case
def tokens_digest(outs) -> str:
    h = hashlib.sha1()
    for o in outs:
        h.update(json.dumps(o.token_ids).encode())
    return h.hexdigest()[:12]


def run_decode_case(case: Case, model, task, base_row: dict, timed=None) -> dict:
    """First call (a full `generate`), then `repeats` timed runs of the compiled decode; with
    `--profile`, one more under the profiler, after `timed(row)` has recorded the timed row (a
    profile that never ends, as Fast-dLLM prefix's did on an H100, then costs the profile, not the row)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.api import outputs, params_for, prepare  # noqa: PLC0415
    from jdllm.decode import loop  # noqa: PLC0415

    P, G = task["prompt"], task["gen"]
    dec = decoding_for(case, G, task["block"])
    prompts = prompts_for(case, P, model.config.vocab_size, task["seed"])
    sampling = jdllm.Sampling(max_new_tokens=G, stop_token_ids=())
    peak0, _ = device_peak()
    t0 = time.perf_counter()
    outs0 = jdllm.generate(model, prompts, dec, sampling)
    first = time.perf_counter() - t0
    prep = prepare(model, prompts, dec, sampling)
    params = params_for(model, dec)
    times, same, final = [], True, None
    ref = [o.token_ids for o in outs0]
    for _ in range(task["repeats"]):
        final = None
        gc.collect()
        t0 = time.perf_counter()
        final = jax.block_until_ready(loop.compiled()(params, prep.state, paradigm=prep.paradigm, ctx=prep.ctx))
        times.append(time.perf_counter() - t0)
        same &= [o.token_ids for o in outputs(prep, final)] == ref
    sec = statistics.median(times)
    forwards = int(jax.device_get(final.forwards))
    kv = 0 if final.cache is None else sum(int(x.nbytes) for x in (final.cache.k, final.cache.v, final.cache.k_scale,
                                                                   final.cache.v_scale) if x is not None)
    peak, in_use = device_peak()
    per_row = float(np.mean([len(o.token_ids) for o in outs0]))
    nfe = float(np.mean([o.nfe for o in outs0]))
    toks = int(sum(len(o.token_ids) for o in outs0))
    row = dict(base_row, kind="decode", tokens=toks, tokens_per_row=per_row, seconds=sec,
               seconds_all=times, tok_s=toks / sec, nfe=nfe, forwards=forwards, tpf=per_row / nfe if nfe else None,
               ms_per_forward=1e3 * sec / forwards, ms_per_token=1e3 * sec / per_row, first_call_s=first,
               same_tokens=bool(same), tokens_digest=tokens_digest(outs0), kv_bytes=kv, canvas=int(prep.state.slots),
               finish=dict(collections.Counter(o.finish_reason for o in outs0)),
               peak_bytes=peak, peak_exact=None if peak is None else bool(peak0 is None or peak > peak0),
               bytes_in_use_after=in_use)
    if base_row.get("floor_ms"):
        row["x_floor"] = row["ms_per_forward"] / base_row["floor_ms"]
    if case.paradigm == "ar_spec":
        tr = [o.trace for o in outs0]
        prop = sum(t.get("drafts_proposed", 0) for t in tr)
        acc = sum(t.get("drafts_accepted", 0) for t in tr)
        row.update(drafts_proposed=prop, drafts_accepted=acc, acceptance_rate=acc / prop if prop else 0.0,
                   acceptance_rate_row0=tr[0].get("acceptance_rate"))
    if task.get("profile"):
        if timed is not None:
            timed(row)
        state, paradigm, ctx = prep.state, prep.paradigm, prep.ctx
        row["profile"] = profile_decode(lambda: jax.block_until_ready(
            loop.compiled()(params, state, paradigm=paradigm, ctx=ctx)), forwards)
    del final, prep, outs0
    return row


# --------------------------------------------------------------------------- device profile (--profile)
# kernel-name patterns -> kind, first match wins (XLA names its fusions after their root op; cuBLAS /
# CUTLASS GEMMs carry gemm / gemv / xmma / cutlass in their names, cuBLAS 13's Hopper GEMMs are
# nvjet_sm90_*; Pallas kernels their pallas_call name)
KERNEL_KINDS = (("qmatmul (Pallas)", ("jdllm_qmatmul",)),
                ("attention (Pallas)", ("jdllm_flash", "mosaic")),
                ("matmul (cuBLAS / XLA GEMM)", ("gemm", "gemv", "xmma", "cutlass", "cublas", "nvjet", "triton_gemm",
                                                "__triton_gemm", "dot")),
                ("copies / memset", ("memcpy", "memset", "copy")),
                ("other XLA fusions", ("",)))


DERIVED_LINES = {"XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Framework Ops", "Framework Name Scope",
                 "TensorFlow Ops", "TensorFlow Name Scope", "Source code", "Launch Stats"}


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next(kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys))


def device_profile(trace: dict, forwards: int) -> dict:
    """A Chrome / Perfetto trace (`traceEvents`) of one decode -> the device's time by kernel kind.

    Device events are the complete ("X") events of processes whose name holds "/device:" (JAX's GPU
    profiler: one process per device, one thread per stream). busy = the union of their intervals;
    wall = first start to last end; the gap (wall - busy) is time the device waited: launches, host
    round trips, the while loop's predicate. Per-forward figures divide by `forwards`."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    names = {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", "")) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    dev = [e for e in events if e.get("ph") == "X" and "/device:" in names.get(e.get("pid"), "")
           and "dur" in e]
    # a device's kernels are on its stream lines ("Stream #N(...)"); the profiler also draws derived
    # lines over them ("XLA Modules": one event per program run, "XLA Ops": one per HLO op, "Steps"),
    # which would count the same time again and cover the waiting
    streams = {k for k, n in threads.items() if n.startswith("Stream")}
    if streams:
        dev = [e for e in dev if (e.get("pid"), e.get("tid")) in streams]
    else:
        dev = [e for e in dev if threads.get((e.get("pid"), e.get("tid")), "") not in DERIVED_LINES]
    if not dev:
        return dict(device_events=0)
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in dev)
    busy, end = 0.0, -float("inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    wall = max(b for _, b in spans) - spans[0][0]
    by_kind = collections.Counter()
    by_name = collections.Counter()
    count = collections.Counter()
    for e in dev:
        by_kind[kernel_kind(e.get("name", ""))] += float(e["dur"])
        by_name[e.get("name", "")] += float(e["dur"])
        count[e.get("name", "")] += 1
    f = max(1, forwards)
    return dict(device_events=len(dev), forwards=forwards, wall_ms=wall / 1e3, busy_ms=busy / 1e3,
                gap_ms=(wall - busy) / 1e3, per_forward_ms=dict(wall=wall / 1e3 / f, busy=busy / 1e3 / f,
                                                               gap=(wall - busy) / 1e3 / f),
                kernels_per_forward=len(dev) / f,
                kinds_ms_per_forward={k: v / 1e3 / f for k, v in by_kind.most_common()},
                top=[dict(name=n[:120], ms_per_forward=v / 1e3 / f, calls_per_forward=count[n] / f)
                     for n, v in by_name.most_common(12)])


def profile_decode(run, forwards: int) -> dict:
    """Run `run()` (one compiled decode) under `jax.profiler.trace` and summarise the device's time
    (`device_profile`); {"error": ...} when the profiler or its trace file is not there."""
    import glob  # noqa: PLC0415
    import gzip  # noqa: PLC0415

    import jax  # noqa: PLC0415

    d = tempfile.mkdtemp(prefix="jdllm_profile_")
    try:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
        files = (sorted(glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True))
                 or sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)))
        if not files:
            return dict(error=f"no perfetto_trace.json.gz or *.trace.json.gz under {d}")
        with gzip.open(files[-1], "rt") as f:
            return device_profile(json.load(f), forwards)
    except Exception as e:  # noqa: BLE001 (a profile is extra: the row's timings stand without it)
        return dict(error=f"{type(e).__name__}: {e}"[:300])
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- long contexts (--long)
def kv_cache_bytes(cfg, batch: int, slots: int, itemsize: int) -> int:
    """Bytes of the K and V caches of every layer for `batch` rows of `slots` slots (an int8 cache,
    cfg.kv_cache_dtype "int8": one byte per element and a float32 scale per token and KV head)."""
    per_head = cfg.head_dim + 4 if cfg.kv_cache_dtype == "int8" else cfg.head_dim * itemsize
    return 2 * cfg.num_layers * batch * slots * cfg.num_kv_heads * per_head


def prefill_activation_bytes(cfg, tokens: int, itemsize: int) -> int:
    """A generous estimate of one forward's live activations over `tokens` tokens (q/k/v and their
    rotated copies, the MLP's gate/up and product, a few hidden-state copies); the compiled programs'
    own figure (`memory_analysis`) is checked after compiling, before anything runs."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return tokens * (2 * qkv + 3 * 2 * F + 6 * D) * itemsize


def free_device_bytes():
    """(free bytes, limit) of the first device, or (None, None) where it keeps no statistics (the CPU)."""
    st = first_device_stats()
    if "bytes_limit" not in st:
        return None, None
    return int(st["bytes_limit"]) - int(st.get("bytes_in_use", 0)), int(st["bytes_limit"])


def program_bytes(compiled) -> dict:
    """The compiled program's own memory figures (`memory_analysis`), where the backend gives them."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return {}
    if ma is None:
        return {}
    return {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output", "generated_code")
            if hasattr(ma, f"{k}_size_in_bytes")}


def run_long_case(case: Case, model, task, base_row: dict) -> dict:
    """One long-context decode (prompt `task["prompt"]`, generation `task["gen"]`) through the loop's
    host-driven pieces, so that the prompt and the generation are timed apart: phase A = `prefill` +
    the first step (multi_block's prefill runs no forward: its first step is the prompt's forward),
    phase B = the remaining steps + `finalize`. Before anything compiles: the KV cache + a
    generous activation estimate against the device's free memory; after compiling (ahead of time,
    `lower().compile()`): the programs' own temp bytes + the cache against it; either too big -> a
    row with `skipped` saying why, and nothing runs. ms/forward is phase B's, against the floor of
    reading the weights plus the KV cache up to the average live length, P + G/2, once per forward."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.api import outputs, params_for, prepare  # noqa: PLC0415
    from jdllm.decode import loop  # noqa: PLC0415

    P, G = task["prompt"], task["gen"]
    cfg = model.config
    dec = decoding_for(case, G, task["block"])
    prompts = prompts_for(case, P, cfg.vocab_size, task["seed"])
    prep = prepare(model, prompts, dec, jdllm.Sampling(max_new_tokens=G, stop_token_ids=()))
    S = int(prep.state.slots)
    itemsize = model.dtype.itemsize
    kv = kv_cache_bytes(cfg, prep.state.batch, S, itemsize)
    act = prefill_activation_bytes(cfg, prep.state.batch * S, itemsize)
    avg_live = P + G / 2
    kv_read = kv_cache_bytes(cfg, prep.state.batch, 1, itemsize) * avg_live
    row = dict(base_row, kind="long", canvas=S, kv_bytes=kv, activation_estimate_bytes=act, avg_live_kv=avg_live,
               kv_read_bytes=kv_read)
    row["kv_floor_ms"] = kv_floor = kv_floor_ms(row)
    free, limit = free_device_bytes()
    if task.get("assume_free_gib") is not None:  # --long-assume-free: exercise the check where nothing is counted
        free = limit = int(task["assume_free_gib"] * GIB)
    row.update(free_bytes_before=free, device_limit_bytes=limit)
    key = f"{task['shape']} {case.id} {base_row['layout']} {base_row['impl']} P{P}/G{G}"
    fits = "the device keeps no memory statistics: not checked" if free is None else \
        f"{fmt_gib(kv + act)} of {fmt_gib(free)} free"
    print(f"[{time.time() - task['t_start']:6.0f}s] {key}: canvas {S} slots, KV cache {fmt_gib(kv)} + activations "
          f"<= {fmt_gib(act)} ({fits})", flush=True)
    if free is not None and kv + act > free:
        return dict(row, skipped=f"does not fit: KV cache {fmt_gib(kv)} + activations (estimate) {fmt_gib(act)} > "
                                 f"{fmt_gib(free)} free of {fmt_gib(limit)} next to "
                                 f"{fmt_gib(base_row['weight_bytes'])} of weights; lower --long-prompt / --long-gen")
    print(f"[{time.time() - task['t_start']:6.0f}s] {key}: compiling prefill and steps ahead of time", flush=True)
    params = params_for(model, dec)
    ctx = prep.ctx
    if task.get("merge_tokens") is not None:  # --merge-tokens: the window-merge rule's token bound
        ctx = dataclasses.replace(ctx, merge_tokens=int(task["merge_tokens"]))
    kw = dict(paradigm=prep.paradigm, ctx=ctx)
    steps = loop.compiled_steps()
    one, rest = np.int32(1), np.int32(2 ** 30)
    t0 = time.perf_counter()
    prefill = steps["prefill"].lower(params, prep.state, **kw).compile()
    with_cache = jax.eval_shape(lambda p, s: loop.prefill(p, s, **kw), params, prep.state)
    step_n = steps["step_n"].lower(params, with_cache, one, **kw).compile()
    finalize = steps["finalize"].lower(with_cache).compile()
    compile_s = time.perf_counter() - t0
    mem = dict(prefill=program_bytes(prefill), steps=program_bytes(step_n))
    temp = max(m.get("temp", 0) for m in mem.values())
    row.update(compile_s=compile_s, program_bytes=mem, program_temp_bytes=temp)
    if free is not None and kv + temp > free:
        return dict(row, skipped=f"does not fit: KV cache {fmt_gib(kv)} + the compiled programs' temp "
                                 f"{fmt_gib(temp)} > {fmt_gib(free)} free; lower --long-prompt / --long-gen")

    def run_once():
        t = time.perf_counter()
        st = step_n(params, prefill(params, prep.state), one)
        jax.block_until_ready(st)
        ta = time.perf_counter() - t
        host = jax.device_get(dict(f=st.forwards, r=st.revealed, g=st.gen_start, l=st.limit))
        cols = np.arange(host["r"].shape[1])[None]
        revealed_a = int(np.sum(host["r"] & (cols >= host["g"][:, None]) & (cols < host["l"][:, None])))
        t = time.perf_counter()
        st = jax.block_until_ready(finalize(step_n(params, st, rest)))
        return st, ta, time.perf_counter() - t, int(host["f"]), revealed_a

    peak0, _ = device_peak()
    t = time.perf_counter()
    final, ta, tb, fa, ra = run_once()
    first = compile_s + time.perf_counter() - t
    outs0 = outputs(prep, final)
    ref = [o.token_ids for o in outs0]
    runs, same = [], True
    for _ in range(task["repeats"]):
        del final
        gc.collect()
        final, ta, tb, fa, ra = run_once()
        runs.append((ta, tb, fa, ra))
        same &= [o.token_ids for o in outputs(prep, final)] == ref
    if not runs:  # --repeats 0: the first run's figures (compile excluded from them)
        runs.append((ta, tb, fa, ra))
    ta = statistics.median(r[0] for r in runs)
    tb = statistics.median(r[1] for r in runs)
    fa, ra = runs[0][2], runs[0][3]
    forwards = int(jax.device_get(final.forwards))
    peak, in_use = device_peak()
    toks = int(sum(len(o) for o in ref))
    per_row = toks / len(ref)
    nfe = float(np.mean([o.nfe for o in outs0]))
    fb, tok_b = forwards - fa, toks - ra
    row.update(tokens=toks, tokens_per_row=per_row, nfe=nfe, tpf=per_row / nfe if nfe else None, forwards=forwards,
               prefill_s=ta, prefill_forwards=fa, prefill_tokens=ra, decode_s=tb, decode_forwards=fb,
               seconds=ta + tb, seconds_all=[r[0] + r[1] for r in runs], tok_s=toks / (ta + tb),
               decode_tok_s=tok_b / tb if tb else None,
               ms_per_forward=1e3 * tb / fb if fb else None,
               ms_per_token=1e3 * tb / (tok_b / len(ref)) if tok_b else None,
               first_call_s=first, same_tokens=bool(same), tokens_digest=tokens_digest(outs0),
               finish=dict(collections.Counter(o.finish_reason for o in outs0)), peak_bytes=peak,
               peak_exact=None if peak is None else bool(peak0 is None or peak > peak0), bytes_in_use_after=in_use)
    per = row["ms_per_token"] if case.window == "token" else row["ms_per_forward"]
    if kv_floor and per:
        row["x_kv_floor"] = per / kv_floor
    if task.get("profile"):  # --profile: LONG_PROFILE_STEPS decode steps after the prompt, under the profiler
        del final
        gc.collect()
        def after_prompt():  # (step_n donates its state: a fresh one per run)
            return jax.block_until_ready(step_n(params, prefill(params, prep.state), one))

        n = np.int32(LONG_PROFILE_STEPS)
        st = after_prompt()
        f0 = int(jax.device_get(st.forwards))
        steps_f = int(jax.device_get(jax.block_until_ready(step_n(params, st, n)).forwards)) - f0
        st = after_prompt()
        row["profile"] = profile_decode(lambda: jax.block_until_ready(step_n(params, st, n)), steps_f)
        del st
    return row  # the cache, the states and the executables go with this frame


def kv_floor_ms(r: dict) -> float | None:
    """A decode or long-context row's floor with the KV cache's reads: the weights a forward reads
    plus the cache's live part at the average length (prompt + gen / 2 of its `canvas` slots, every
    row), over the bandwidth its plain floor uses. At batch 1 and a short context the cache is
    noise; at b64 on the 8B shape (32 KV heads) the live cache is ~8.6 GB a step (of a 12.9 GB
    cache), beside the 15.0 GB of weights."""
    need = ("kv_bytes", "canvas", "prompt", "gen", "read_bytes")
    bw = r.get("read_gbs") if r.get("floor_basis", "read") == "read" else r.get("copy_gbs")
    if not bw or any(not r.get(k) for k in need) or r.get("kind") not in ("decode", "long"):
        return None
    live = min(1.0, (r["prompt"] + r["gen"] / 2) / r["canvas"])
    return 1e3 * (r["read_bytes"] + r["kv_bytes"] * live) / (bw * 1e9)


def first_difference(a, b) -> int | None:
    """The first position where token lists a and b differ (the shorter one's length if one is a prefix
    of the other), None if they are equal."""
    a, b = list(a), list(b)
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def diverge(r: dict) -> str:
    """' (the others first differ at token ...)' for a serving row whose outputs differ from offline."""
    pos = sorted(p for p in r.get("first_difference") or () if p is not None)
    if not pos:
        return ""
    return (f" (the others first differ at token {pos[0]}-{pos[-1]}, median {statistics.median(pos):.0f}, "
            f"of {r['tokens'] // max(1, r['requests'])})")


def run_serve_case(case: Case, model, task, base_row: dict) -> dict:
    """The serving engine with `batch` requests submitted together (a pool of `batch` rows, its own
    thread) against one offline `generate` call of the same prompts; the second pass of each is
    timed (the first compiles). Latency: submit -> done per request."""
    import numpy as np  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    P, G, n = task["prompt"], task["gen"], case.batch
    prompts = prompts_for(case, P, model.config.vocab_size, task["seed"])
    sampling = jdllm.Sampling(max_new_tokens=G, stop_token_ids=())
    peak0, _ = device_peak()
    eng = Engine(model, jdllm.AR(), max_batch=n, max_prompt_tokens=P, max_new_tokens=G, max_queue=n,
                 steps_per_round=task["steps_per_round"]).start()
    passes = []
    try:
        for _ in range(2):
            done = threading.Event()
            left = [n]
            lock = threading.Lock()

            def on_event(ev):
                if ev.kind in ("done", "error"):
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()

            t0 = time.perf_counter()
            reqs = [eng.submit(p, sampling, on_event=on_event) for p in prompts]
            if not done.wait(timeout=task.get("serve_timeout", 900)):
                raise TimeoutError(f"the engine did not finish {n} requests in time")
            bad = [r for r in reqs if r.output is None]
            if bad:
                raise RuntimeError(f"{len(bad)} requests ended without an output (engine error)")
            t1 = max(r.finished for r in reqs)
            passes.append(dict(t0=t0, span=t1 - t0, lat=[r.finished - r.submitted for r in reqs],
                               ttft=[(r.first_token or r.finished) - r.submitted for r in reqs],
                               outs=[r.output.token_ids for r in reqs]))
    finally:
        eng.stop()
    e = passes[-1]
    t0 = time.perf_counter()
    offline = jdllm.generate(model, prompts, jdllm.AR(), sampling)
    off_first = time.perf_counter() - t0
    off_times = []
    for _ in range(max(1, task["repeats"])):
        t0 = time.perf_counter()
        offline = jdllm.generate(model, prompts, jdllm.AR(), sampling)
        off_times.append(time.perf_counter() - t0)
    off = statistics.median(off_times)
    toks = sum(len(t) for t in e["outs"])
    off_toks = sum(len(o.token_ids) for o in offline)
    peak, _ = device_peak()
    q = lambda x, p: float(np.percentile(x, p) * 1e3)  # noqa: E731
    return dict(base_row, kind="serve", requests=n, tokens=toks, seconds=e["span"], tok_s=toks / e["span"],
                latency_p50_ms=q(e["lat"], 50), latency_p99_ms=q(e["lat"], 99), ttft_p50_ms=q(e["ttft"], 50),
                ttft_p99_ms=q(e["ttft"], 99), first_pass_s=passes[0]["span"], steps_per_round=task["steps_per_round"],
                offline_seconds=off, offline_tok_s=off_toks / off, offline_first_call_s=off_first,
                offline_latency_ms=1e3 * off, same_tokens=e["outs"] == [o.token_ids for o in offline],
                same_requests=sum(a == o.token_ids for a, o in zip(e["outs"], offline)),
                # where an engine output first differs from the offline one (None: equal): in bf16 the two
                # batch their rows differently, so a near-tie of two logits can flip and the rest follows
                first_difference=[first_difference(a, o.token_ids) for a, o in zip(e["outs"], offline)],
                same_tokens_passes=passes[0]["outs"] == e["outs"], peak_bytes=peak,
                peak_exact=None if peak is None else bool(peak0 is None or peak > peak0))


# --------------------------------------------------------------------------- children
def configure_cache(task) -> None:
    import jax  # noqa: PLC0415

    d = task.get("cache_dir")
    if d:  # the environment (JAX_COMPILATION_CACHE_DIR, ...) says the same; an option a jax lacks is skipped
        for name, v in (("jax_compilation_cache_dir", d), ("jax_persistent_cache_min_compile_time_secs", 0.0),
                        ("jax_persistent_cache_min_entry_size_bytes", -1)):
            try:
                jax.config.update(name, v)
            except Exception as e:  # noqa: BLE001
                print(f"# jax.config.update({name!r}) failed: {e}", flush=True)


def write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def child_main(task_path: str) -> int:
    with open(task_path) as f:
        task = json.load(f)
    sys.path.insert(0, ROOT)
    out = task["result"]
    kind = task["kind"]
    if kind == "hf":
        write_json(out, dict(rows=hf_baseline(task)))
        return 0
    configure_cache(task)
    if kind == "probe":
        write_json(out, dict(info=probe(task)))
        return 0
    import jax  # noqa: PLC0415

    from jdllm.loading import Model  # noqa: PLC0415
    from pallas_kernels import resolve_impl  # noqa: PLC0415

    rows: list[dict] = []
    state = dict(rows=rows, started=None)
    write_json(out, state)
    # a long prompt needs the positions: the canvas is at most the prompt and generation plus a few blocks
    base = base_config(task["shape"], 1 << (task["prompt"] + task["gen"] + 8 * task["block"]).bit_length())
    t0 = time.perf_counter()
    params = build_params(base, task["layout"], task["seed"], task["std"], task["head_std"], task.get("quantize"))
    build_s = time.perf_counter() - t0
    total, read = weight_bytes(params, base)
    bw = task.get("read_gbs") or task.get("copy_gbs")  # sessions before 2026-11-26 measured only a copy
    floor_basis = "read" if task.get("read_gbs") else "copy"
    floor_ms = 1e3 * read / (bw * 1e9) if bw else None
    peak, _ = device_peak()
    print(f"# {task['shape']} {task['layout']} weights: {total / GIB:.2f} GiB ({total / 2 / 1e9:.2f}B params) built "
          f"in {build_s:.1f}s; floor {floor_ms and round(floor_ms, 3)} ms; peak so far "
          f"{'-' if peak is None else f'{peak / GIB:.2f} GiB'}" + (f"; flags {task['flags']!r}" if task["flags"] else ""),
          flush=True)
    models = {}
    cases = {c.id: c for c in all_cases()}
    for cid in task["cases"]:
        case = cases[cid]
        for impl in task["impls"]:
            key = f"{task['shape']} {cid} {task['layout']} {impl}"
            if time.time() > task["deadline"]:
                print(f"[{time.time() - task['t_start']:6.0f}s] {key}: skipped, budget spent", flush=True)
                continue
            state["started"] = dict(case=cid, impl=impl, at=time.time())
            write_json(out, state)
            mk = (case.attention, impl)
            if mk not in models:
                cfg = model_config(base, case.attention, task["block"]).replace(kv_cache_dtype=task.get("kv_cache"))
                models[mk] = Model(config=cfg, params=params, attn_impl=impl)
            row = dict(shape=task["shape"], case=cid, name=case.name, label=case.label, paradigm=case.paradigm,
                       attention=case.attention, batch=case.batch, layout=task["layout"], impl=impl,
                       impl_resolved=resolve_impl(impl), flags=task["flags"], prompt=task["prompt"], gen=task["gen"],
                       block=task["block"], session=task["session"], device=task.get("device"),
                       backend=jax.default_backend(), weight_bytes=total, read_bytes=read,
                       copy_gbs=task.get("copy_gbs"), read_gbs=task.get("read_gbs"), floor_basis=floor_basis,
                       floor_ms=floor_ms, window=case.window, repeats=task["repeats"],
                       quantize=task.get("quantize"), quant_matmul=quant_matmul_mode(task.get("quantize")),
                       merge_tokens=task.get("merge_tokens"), kv_cache=task.get("kv_cache"))
            try:
                if task["mode"] == "first_call":
                    row = first_call_row(case, models[mk], task, row)
                elif task["mode"] == "long":
                    row = run_long_case(case, models[mk], task, row)
                elif case.window == "serve":
                    row = run_serve_case(case, models[mk], task, row)
                else:
                    def timed(r, started=state["started"]):
                        started["row"] = dict(r, profile=dict(error="the profiled decode did not finish "
                                                              "(the child was stopped during it)"))
                        write_json(out, state)

                    row = run_decode_case(case, models[mk], task, row, timed=timed)
            except Exception as e:  # noqa: BLE001 (one failing case is recorded, the others still run)
                msg = "".join(traceback.format_exception_only(type(e), e)).strip()[-1500:]
                traceback.print_exc()
                row = dict(row, kind=MODE_KIND.get(task["mode"], "decode"), error=msg)
            rows.append(row)
            state["started"] = None
            write_json(out, state)
            print(progress_line(row, time.time() - task["t_start"]), flush=True)
            gc.collect()
    return 0


MODE_KIND = {"first_call": "first_call", "long": "long"}  # a child's mode -> its rows' kind ("run": decode)


def first_call_row(case: Case, model, task, row: dict) -> dict:
    """Only the first `generate` of a case (cold: empty persistent cache; cached: filled by an earlier process)."""
    import jdllm  # noqa: PLC0415

    P, G = task["prompt"], task["gen"]
    dec = decoding_for(case, G, task["block"])
    prompts = prompts_for(case, P, model.config.vocab_size, task["seed"])
    peak0, _ = device_peak()
    with compile_phases() as phases:
        t0 = time.perf_counter()
        jdllm.generate(model, prompts, dec, jdllm.Sampling(max_new_tokens=G, stop_token_ids=()))
        sec = time.perf_counter() - t0
    phases["rest_s"] = sec - phases["trace_s"] - phases["lower_s"] - phases["compile_s"]
    peak, _ = device_peak()
    entries = sum(len(fs) for _, _, fs in os.walk(task["cache_dir"])) if task.get("cache_dir") else None
    which = task["which"]  # "cold" | "cached"
    # the peak of a first call: cold, it includes what compiling holds on the device (the GEMM
    # autotuner's operand copies among it); cached, the compiled programs come from the cache and
    # only running them counts: the peak a user's later processes see
    return dict(row, kind="first_call", compile={f"{which}_s": sec, f"{which}_source": task["source"],
                                                 "cache_files": entries, "session": task["session"],
                                                 f"{which}_peak_bytes": peak,
                                                 f"{which}_peak_exact": None if peak is None else
                                                 bool(peak0 is None or peak > peak0),
                                                 f"{which}_phases": phases})


LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_phases: list = []  # the open `compile_phases` accumulators


@contextlib.contextmanager
def compile_phases():
    """Where a first call's seconds went, from `jax.monitoring`'s compile events: tracing, lowering,
    the backend (an XLA compile, or a persistent-cache hit's retrieval and load), the number of
    programs and how many came from the cache; the caller adds the rest (running, host work)."""
    import jax  # noqa: PLC0415

    from jdllm.compile_progress import CACHE_HIT_EVENT, COMPILE_EVENT, TRACE_EVENT  # noqa: PLC0415

    if not getattr(compile_phases, "listening", False):
        phase_of = {TRACE_EVENT: "trace_s", LOWER_EVENT: "lower_s", COMPILE_EVENT: "compile_s"}

        def duration(event, secs, **kw):
            key = phase_of.get(event)
            for acc in _phases if key else ():
                acc[key] += secs
                acc["programs"] += event == COMPILE_EVENT

        def count(event, **kw):
            for acc in _phases if event == CACHE_HIT_EVENT else ():
                acc["cache_hits"] += 1

        jax.monitoring.register_event_duration_secs_listener(duration)
        jax.monitoring.register_event_listener(count)
        compile_phases.listening = True
    acc = dict(trace_s=0.0, lower_s=0.0, compile_s=0.0, programs=0, cache_hits=0)
    _phases.append(acc)
    try:
        yield acc
    finally:
        _phases.remove(acc)


def progress_line(r: dict, elapsed: float) -> str:
    head = f"[{elapsed:6.0f}s] {r['shape']} {r['case']:<18} {r['layout']:<9} {r['impl']:<6}" + \
           (f" flags={r['flags']!r}" if r.get("flags") else "")
    if r.get("error"):
        return f"{head} | FAILED: {r['error'].splitlines()[-1][:300]}"
    if r["kind"] == "first_call":
        c = r["compile"]
        ph = "".join(f"; {w}: {p['programs']} programs ({p['cache_hits']} from the cache), trace {p['trace_s']:.1f}s, "
                     f"lower {p['lower_s']:.1f}s, compile / load {p['compile_s']:.1f}s, the rest {p['rest_s']:.1f}s"
                     for w in ("cold", "cached") if (p := c.get(f"{w}_phases")))
        return f"{head} | first call {' '.join(f'{k} {v:.1f}s' for k, v in c.items() if k.endswith('_s'))}" \
               f" ({c.get('cache_files')} cache files{ph})"
    if r["kind"] == "long":
        head += f" P{r['prompt']}/G{r['gen']}"
        if r.get("skipped"):
            return f"{head} | SKIPPED: {r['skipped']}"
        per = "ms/token" if r.get("window") == "token" else "ms/fwd"
        val = r["ms_per_token"] if r.get("window") == "token" else r["ms_per_forward"]
        return (f"{head} | {r['tok_s']:8.1f} tok/s | prefill {r['prefill_s']:6.2f}s | {f1(val, '{:.2f}')} {per} | "
                f"floor {f1(r.get('kv_floor_ms'), '{:.2f}')} ms = {f1(r.get('x_kv_floor'), '{:.2f}')}x | nfe "
                f"{r['nfe']:.0f} | first {r['first_call_s']:.1f}s (compile {r['compile_s']:.1f}s) | peak "
                f"{fmt_gib(r.get('peak_bytes'))}{'' if r.get('peak_exact') in (True, None) else ' (running)'} | "
                f"KV {fmt_gib(r['kv_bytes'])} | same {r['same_tokens']}{profile_text(r)}")
    if r["kind"] == "serve":
        return (f"{head} | engine {r['tok_s']:9.1f} tok/s p50 {r['latency_p50_ms']:.0f} ms p99 "
                f"{r['latency_p99_ms']:.0f} ms | offline generate {r['offline_tok_s']:9.1f} tok/s | same tokens "
                f"{r['same_requests']}/{r['requests']} requests{diverge(r)} | peak {fmt_gib(r.get('peak_bytes'))}")
    xf = f"{r['x_floor']:5.2f}x floor" if r.get("x_floor") else "- floor"
    acc = f" | accept {r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""
    acc += profile_text(r)
    return (f"{head} | {r['tok_s']:9.1f} tok/s | nfe {r['nfe']:6.1f} | tpf {r['tpf']:5.2f} | "
            f"{r['ms_per_forward']:8.2f} ms/fwd | {xf} | first {r['first_call_s']:6.1f}s | peak "
            f"{fmt_gib(r.get('peak_bytes'))}{'' if r.get('peak_exact') in (True, None) else ' (running)'} | "
            f"same {r['same_tokens']}{acc}")


def profile_text(r: dict) -> str:
    """A row's `--profile` summary for its log line ('' without one)."""
    pf = r.get("profile") or {}
    if pf.get("device_events"):
        kinds = ", ".join(f"{k.split(' (')[0]} {v:.2f}" for k, v in pf["kinds_ms_per_forward"].items())
        return (f" | device per fwd: busy {pf['per_forward_ms']['busy']:.2f} ms, waiting "
                f"{pf['per_forward_ms']['gap']:.2f} ms, {pf['kernels_per_forward']:.0f} kernels ({kinds})")
    return f" | profile: {pf.get('error') or 'no device events'}" if pf else ""


def fmt_gib(b) -> str:
    return "-" if b is None else f"{b / GIB:.2f} GiB"


# --------------------------------------------------------------------------- the PyTorch baseline
def hf_baseline(task) -> list[dict]:
    """transformers eager (bf16, sdpa), same shape, random weights: generate b1 / b16 / b64 and one
    forward of a block window and of the whole canvas. On the GPU where torch has CUDA; on the CPU
    only for the tiny shape (to exercise the code)."""
    shape, P, G = task["shape"], task["prompt"], task["gen"]
    base = dict(shape=shape, kind="hf", layout="-", impl="sdpa", flags="", prompt=P, gen=G, session=task["session"])
    try:
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415
    except ImportError as e:
        print(f"# HF baseline skipped: {e}", flush=True)
        return [dict(base, case="hf", batch=0, skipped=f"torch / transformers do not import: {e}")]
    cuda = torch.cuda.is_available()
    if not cuda and shape != "tiny":
        print("# HF baseline skipped: torch has no CUDA device here", flush=True)
        return [dict(base, case="hf", batch=0, skipped="torch has no CUDA device")]
    dev = "cuda" if cuda else "cpu"
    s = SHAPES[shape]
    common = dict(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                  num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                  num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"], max_position_embeddings=4096,
                  rope_theta=s["rope_theta"], tie_word_embeddings=bool(s.get("tie_word_embeddings", False)),
                  attn_implementation="sdpa")
    if s["hf"] == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    t0 = time.perf_counter()
    torch.manual_seed(task["seed"])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        m = cls(cfg)
    m.eval()
    torch.set_default_dtype(torch.float32)
    base.update(torch_device=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__,
                transformers=transformers.__version__)
    print(f"# HF {cls.__name__} ({s['hf']}) built on {dev} in {time.perf_counter() - t0:.1f}s; torch {torch.__version__}, "
          f"transformers {transformers.__version__}", flush=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, reps, warmup=1):
        for _ in range(warmup):
            fn()
        sync()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    rows = []
    g = torch.Generator(device=dev).manual_seed(task["seed"])
    V = s["vocab_size"]
    with torch.no_grad():
        for b in task["hf_batches"]:
            if time.time() > task["deadline"]:
                print(f"# HF generate b{b}: skipped, budget spent", flush=True)
                continue
            x = torch.randint(0, V - 2, (b, P), device=dev, generator=g)

            def gen(x=x):
                return m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=G, min_new_tokens=G,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)

            if cuda:
                torch.cuda.reset_peak_memory_stats()
            dt = timed(gen, task["hf_repeats"])
            peak = torch.cuda.max_memory_allocated() if cuda else None
            rows.append(dict(base, case=f"hf_generate_b{b}", batch=b, tok_s=b * G / dt, ms_per_token=1e3 * dt / G,
                             seconds=dt, peak_bytes=peak))
            print(f"# HF generate b{b}: {b * G / dt:.1f} tok/s, {1e3 * dt / G:.2f} ms/token", flush=True)
        for T in task["hf_forwards"]:
            x = torch.randint(0, V - 2, (1, T), device=dev, generator=g)
            dt = timed(lambda x=x: m(x).logits, 5, warmup=2)
            rows.append(dict(base, case=f"hf_forward_T{T}", batch=1, tokens=T, ms_per_forward=1e3 * dt))
            print(f"# HF one forward of {T} tokens: {1e3 * dt:.2f} ms", flush=True)
    return rows


# --------------------------------------------------------------------------- the parent
class Interrupted(Exception):
    pass


def run_child(task: dict, env: dict, tmp: str, log_tail: int = 40):
    """Run one child; stream its output; return (result dict or None, rc, tail lines)."""
    tid = uuid.uuid4().hex[:8]
    task = dict(task, result=os.path.join(tmp, f"result_{tid}.json"))
    path = os.path.join(tmp, f"task_{tid}.json")
    write_json(path, task)
    tail = collections.deque(maxlen=log_tail)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_child", path], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(line, end="", flush=True)
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        res = None
        if os.path.exists(task["result"]):
            try:
                with open(task["result"]) as f:
                    res = json.load(f)
            except (OSError, json.JSONDecodeError):
                res = None
        run_child.last = (res, task)
    return res, rc, list(tail)


ENV_WORD = re.compile(r"[A-Z][A-Z0-9_]*=\S*$")


def split_variant(variant: str) -> tuple[dict, str]:
    """A variant string's environment settings (`NAME=VALUE` words, e.g. JDLLM_WINDOW_SPLITS=1) and
    its XLA flags (the other words)."""
    env, flags = {}, []
    for word in variant.split():
        if ENV_WORD.match(word):
            name, _, value = word.partition("=")
            env[name] = value
        else:
            flags.append(word)
    return env, " ".join(flags)


def child_env(flags: str, cache_dir: str | None) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peak_bytes_in_use then means what is used
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    settings, flags = split_variant(flags)
    env.update(settings)
    base_flags = env.get("XLA_FLAGS", "")
    if flags:
        env["XLA_FLAGS"] = (base_flags + " " + flags).strip()
    for k in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(k, None)
    if cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1", JDLLM_CACHE_DIR=cache_dir)
    else:
        env["JDLLM_CACHE_DIR"] = "off"
    return env


def died(rc: int, started: dict, tail: list[str]) -> str:
    spent = f" {time.time() - started['at']:.0f} s into this case" if started.get("at") else " during this case"
    if rc < 0:
        return f"the child process was killed by signal {-rc}{spent} (a time limit?)"
    return f"the child process died (exit {rc}){spent}: {error_tail(tail)}"


def child_rows(res, rc: int, tail: list[str], task: dict, *, shape: str, prompt: int, gen: int, session: str,
               device) -> list[dict]:
    """The rows a child left (`res`: its result file, or None) after exiting with `rc`. A child that
    stopped mid-case adds that case: its timed row when only the profile after the timings was
    unfinished, else an error row saying how it died."""
    rows = list((res or {}).get("rows", []))
    started = (res or {}).get("started")
    if rc == 0 or not started:
        return rows
    if started.get("row"):
        print(f"# {started['case']}: the child stopped during the profiled decode; its timed row is kept",
              flush=True)
        return rows + [started["row"]]
    c = {c.id: c for c in all_cases()}[started["case"]]
    return rows + [dict(shape=shape, case=c.id, name=c.name, label=c.label, paradigm=c.paradigm,
                        batch=c.batch, layout=task.get("layout", "-"), impl=started["impl"],
                        flags=task.get("flags", ""), prompt=task.get("prompt", prompt), gen=task.get("gen", gen),
                        session=session, device=device, window=c.window,
                        kind=MODE_KIND.get(task.get("mode"), "decode"), merge_tokens=task.get("merge_tokens"),
                        quantize=task.get("quantize"), quant_matmul=quant_matmul_mode(task.get("quantize")),
                        error=died(rc, started, tail))]


def error_tail(tail: list[str]) -> str:
    keep = [ln for ln in tail if ln.strip() and not ln.startswith("[")]
    return "\n".join(keep[-6:])[-1500:]


def git_commit() -> dict:
    out = {}
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            out["git_commit"] = r.stdout.strip()
            d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
            out["git_dirty"] = bool(d.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    if "git_commit" not in out and os.environ.get("GIT_COMMIT"):
        out["git_commit"] = os.environ["GIT_COMMIT"]
    h = hashlib.sha1()  # the code that ran, where no .git travels with the tree
    for top in ("jdllm", "pallas_kernels", "benchmarks/gpu.py"):
        p = os.path.join(ROOT, top)
        files = [p] if os.path.isfile(p) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if f.endswith(".py"))
        for fp in files:
            h.update(os.path.relpath(fp, ROOT).encode())
            with open(fp, "rb") as f:
                h.update(f.read())
    out["tree_digest"] = h.hexdigest()[:16]
    return out


def quant_matmul_mode(quantize) -> str | None:
    """For quantized rows: `$JDLLM_QUANT_MATMUL` (jdllm.model.quant_matmul_kernel: "auto" runs a few-row
    matmul of quantized weights as the Pallas kernel on a GPU, "xla" as XLA's dot), as the children
    inherit it; None for bf16 rows."""
    return (os.environ.get("JDLLM_QUANT_MATMUL") or "auto") if quantize else None


def weights_label(r: dict) -> str:
    qm = r.get("quant_matmul")
    return ((r.get("quantize") or "bf16") + ("" if qm in (None, "auto") else f" ({qm} dot)")
            + (f" + {r['kv_cache']} KV" if r.get("kv_cache") else ""))


def row_key(r: dict) -> str:
    """shape|case|batch|layout|impl|flags|prompt|gen[|merge N][|quantize][|kv-int8]|device: a later session's row
    replaces an earlier one of the same configuration on the same kind of device, never another device's."""
    key = "|".join(str(r.get(k, "")) for k in ("shape", "case", "batch", "layout", "impl", "flags", "prompt", "gen"))
    key += f"|merge{r['merge_tokens']}" if r.get("merge_tokens") is not None else ""
    key += f"|{r['quantize']}" if r.get("quantize") else ""
    key += f"|qmm-{r['quant_matmul']}" if r.get("quant_matmul") not in (None, "auto") else ""
    key += f"|kv-{r['kv_cache']}" if r.get("kv_cache") else ""
    return key + f"|{r.get('device') or '?'}"


def first_calls(r: dict) -> tuple[dict, float | None, str]:
    """A row's first-call figures: (`compile`, its cold seconds, a note naming the session they come
    from when it is not the row's own: an earlier run of the same case kept its figures)."""
    comp = r.get("compile") or {}
    own = comp.get("session") in (None, r.get("session"))
    cold = comp.get("cold_s", r.get("first_call_s")) if own else r.get("first_call_s", comp.get("cold_s"))
    return comp, cold, "" if own else f"from session {comp['session']}"


def merge_rows(db: dict, new_rows: list[dict]) -> None:
    """Add rows to db["rows"] (key -> row): a measured row replaces the earlier one, keeping its
    `compile` figures (first calls cold and from the cache, with their `session`: the tables name an
    earlier session's) unless the new row brings its own; a first-call row only sets `compile`
    (replacing another session's); a failed row does not erase an earlier figure (it is noted as
    `last_error`)."""
    rows = db.setdefault("rows", {})
    for r in new_rows:
        k = row_key(r)
        old = rows.get(k)
        if r.get("kind") == "first_call":
            if r.get("error"):
                if old is not None:
                    old["compile_error"], old["compile_error_session"] = r["error"], r.get("session")
                    continue
                rows[k] = r
                continue
            tgt = old if old is not None else {kk: v for kk, v in r.items() if kk != "compile"}
            comp = dict(tgt.get("compile") or {}) if (tgt.get("compile") or {}).get("session") == r["session"] else {}
            comp.update(r["compile"])
            tgt["compile"] = comp
            rows[k] = tgt
            continue
        if (r.get("error") or r.get("skipped")) and old is not None and not old.get("error") \
                and not old.get("skipped"):
            old["last_error"] = r.get("error") or f"skipped: {r['skipped']}"
            old["last_error_session"] = r.get("session")
            continue
        if old is not None and old.get("compile") and "compile" not in r:
            r = dict(r, compile=old["compile"])
        rows[k] = r


def load_db(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            db = json.load(f)
        rows = db.get("rows") or {}
        # re-keyed on load: a list of rows is tolerated, and files written before the device joined the key
        # (2026-11-26) come back under today's keys
        db["rows"] = {row_key(r): r for r in (rows if isinstance(rows, list) else rows.values())}
        return db
    return dict(about="benchmarks/gpu.py: end-to-end decode on a GPU; rows keyed by "
                      "shape|case|batch|layout|impl|flags|prompt|gen[|merge N][|quantize][|kv-int8]|device; see the script's docstring",
                sessions=[], rows={})


def info_ok(meta: dict) -> bool:
    """The probe ran (a child that failed before any case is only a note unless the probe failed too)."""
    return meta.get("copy_gbs") is not None


def parent_main(args) -> int:
    t_start = time.time()
    deadline = t_start + (args.budget if args.budget is not None else 1e9)
    session = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:4]
    tmp = tempfile.mkdtemp(prefix="jdllm_gpubench_")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    db = load_db(out)
    meta = dict(session=session, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                argv=sys.argv[1:], shape=args.shape, prompt=args.prompt, gen=args.gen, repeats=args.repeats,
                layouts=args.layouts, impls=args.impls, flags_variants=args.xla_flags_variants, notes=[],
                **git_commit())
    db.setdefault("sessions", []).append(meta)
    cases = select_cases(args.only, args.gen)
    ids = [c.id for c in cases]
    want_hf = (not args.only or "hf" in args.only) and not args.no_hf
    block = min(args.block, args.gen)
    print(f"# gpu.py session {session}: shape {args.shape}, prompt {args.prompt}, gen {args.gen}, block {block}, "
          f"repeats {args.repeats}, layouts {args.layouts}, impls {args.impls}, flags variants "
          f"{args.xla_flags_variants}, budget {args.budget}s; cases {ids + (['hf'] if want_hf else [])}", flush=True)
    common = dict(shape=args.shape, prompt=args.prompt, gen=args.gen, block=block, repeats=args.repeats,
                  seed=args.seed, std=args.std, head_std=args.head_std, impls=args.impls, session=session,
                  deadline=deadline, t_start=t_start, steps_per_round=args.steps_per_round, quantize=args.quantize,
                  profile=args.profile, kv_cache=args.kv_cache)
    cache_dirs: dict = {}
    state = dict(interrupted=False)

    def save():
        write_json(out, db)

    def handle(res, rc, tail, task):
        """Merge a child's rows; a child that died mid-case gets an error row for that case."""
        rows = child_rows(res, rc, tail, task, shape=args.shape, prompt=args.prompt, gen=args.gen,
                          session=session, device=meta.get("device"))
        if rc != 0 and not rows:
            note = (f"{task['kind']} child (flags {task.get('flags', '')!r}, layout {task.get('layout', '-')}) "
                    f"exited {rc} before any case: {error_tail(tail)}")
            meta["notes"].append(note)
            print(f"# {note}", flush=True)
        for r in rows:
            r.setdefault("device", meta.get("device"))
        merge_rows(db, rows)
        save()

    def launch(task, flags, cache_dir=None):
        if time.time() > deadline:
            what = task.get("cases") or task["kind"]
            print(f"# budget spent: not starting {task['kind']} {what} (flags {flags!r})", flush=True)
            meta["notes"].append(f"budget spent before {task['kind']} {what} (flags {flags!r})")
            return None
        res, rc, tail = run_child(task, child_env(flags, cache_dir), tmp)
        run_child.last = None  # handled here; an interrupt from now on has no child to collect
        handle(res, rc, tail, task)
        return res, rc

    def cases_child(group, flags, layout):
        todo = [c for c in group if c in ids]
        # --case-per-process: a child (and an empty persistent cache) per case, so that each case's peak
        # memory and cold first call are its own, not raised or warmed by the cases before it
        for part in ([[c] for c in todo] if args.case_per_process else [todo] if todo else []):
            key = (flags, layout, part[0] if args.case_per_process else None)
            if key not in cache_dirs:
                cache_dirs[key] = tempfile.mkdtemp(prefix="cache_", dir=tmp)
            task = dict(common, kind="cases", mode="run", cases=part, layout=layout, flags=flags,
                        copy_gbs=meta.get("copy_gbs"), read_gbs=meta.get("read_gbs"), device=meta.get("device"),
                        cache_dir=cache_dirs[key])
            launch(task, flags, cache_dirs[key])

    def first_call_child(flags, layout, group):
        todo = [c for c in args.cold_cases if c in group]
        if not todo:
            return
        base = dict(common, kind="cases", mode="first_call", cases=todo, layout=layout, flags=flags,
                    device=meta.get("device"), copy_gbs=meta.get("copy_gbs"), read_gbs=meta.get("read_gbs"),
                    impls=args.impls[:1])
        if args.cold_separate:
            d = tempfile.mkdtemp(prefix="cold_", dir=tmp)
            launch(dict(base, cache_dir=d, which="cold", source="a fresh process, empty persistent cache"), flags, d)
            launch(dict(base, cache_dir=d, which="cached", source="a second process, cache filled by the cold one"),
                   flags, d)
        elif args.case_per_process:
            for c in todo:
                d = cache_dirs.get((flags, layout, c))
                if d:
                    launch(dict(base, cases=[c], cache_dir=d, which="cached",
                                source="a new process, cache filled by the case's own measuring process"), flags, d)
        elif (flags, layout, None) in cache_dirs:
            d = cache_dirs[(flags, layout, None)]
            launch(dict(base, cache_dir=d, which="cached",
                        source="a new process, cache filled by the measuring process"), flags, d)

    first_group = [c for c in ids if c in PRIORITY]
    rest = [c for c in ids if c not in PRIORITY]
    try:
        res = launch(dict(common, kind="probe", flags=""), "")
        info = (res[0] or {}).get("info") if res else None
        if info:
            meta.update(info)
        else:
            meta["notes"].append("the probe child failed: no bandwidth, no floor")
        save()
        if args.long:  # the long-context cases alone, in one child (first layout, first flags variant)
            flags, layout = args.xla_flags_variants[0], args.layouts[0]
            d = tempfile.mkdtemp(prefix="cache_long_", dir=tmp)
            launch(dict(common, kind="cases", mode="long", cases=ids, layout=layout, flags=flags, cache_dir=d,
                        assume_free_gib=args.long_assume_free, merge_tokens=args.merge_tokens,
                        copy_gbs=meta.get("copy_gbs"), read_gbs=meta.get("read_gbs"), device=meta.get("device")),
                   flags, d)
        variants = [] if args.long else args.xla_flags_variants
        for flags in variants:
            for layout in args.layouts:
                cases_child(first_group, flags, layout)
        # cached first calls: after the process that filled the cache (or, --cold-separate, cold + cached),
        # and before the HF baseline: on the H100 (2026-11-26) a 240 s budget ran out after HF, twice
        for flags in variants:
            for layout in args.layouts:
                first_call_child(flags, layout, first_group)
        if want_hf:
            launch(dict(common, kind="hf", hf_batches=args.hf_batches, hf_repeats=args.hf_repeats,
                        hf_forwards=[block, args.prompt + args.gen]), "")
        for flags in variants:
            for layout in args.layouts:
                cases_child(rest, flags, layout)
        for flags in variants:
            for layout in args.layouts:
                first_call_child(flags, layout, rest)
    except (KeyboardInterrupt, Interrupted):
        state["interrupted"] = True
        last = getattr(run_child, "last", None)
        if last is not None:
            res, task = last
            handle(res, -int(signal.SIGTERM), ["interrupted"], task)
        meta["notes"].append("interrupted (SIGTERM / Ctrl-C): rows written up to here")
        print("# interrupted: writing what is done", flush=True)
    finally:
        meta["wall_s"] = time.time() - t_start
        save()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n# wrote {out} ({len(db['rows'])} rows) in {meta['wall_s']:.0f}s\n", flush=True)
    print(render(db, sessions_of=None))
    if args.write_results_md:
        write_results_md(db, args.results_md)
    failed = [r["case"] for r in db["rows"].values() if r.get("session") == session and r.get("error")]
    failed += [r["case"] for r in db["rows"].values()
               if session in (r.get("last_error_session"), r.get("compile_error_session"))]
    if failed:
        print(f"# failed this session: {failed}", flush=True)
    return 130 if state["interrupted"] else (1 if failed or meta["notes"] and not info_ok(meta) else 0)


# --------------------------------------------------------------------------- rendering
def f1(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


CASE_ORDER = {c.id: i for i, c in enumerate(all_cases())}


def render(db: dict, sessions_of=None, gpu_only: bool = False) -> str:
    """Markdown: per (shape, device) a decode table, the HF baseline, serving, and the targets."""
    rows = list(db.get("rows", {}).values())
    if gpu_only:
        rows = [r for r in rows if r.get("backend", "gpu") == "gpu" and "cpu" not in str(r.get("device", "")).lower()]
    if not rows:
        return "No GPU figures are recorded yet: `benchmarks/results/gpu.json` holds no rows.\n"
    sessions = {s["session"]: s for s in db.get("sessions", [])}
    out = []
    groups = collections.defaultdict(list)
    for r in rows:
        groups[(r.get("shape"), r.get("device") or "?")].append(r)
    for (shape, device), rs in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        ss = sorted({r.get("session") for r in rs if r.get("session")})
        vers = []
        for s in ss:
            m = sessions.get(s, {})
            vers.append(f"{s}: jax {m.get('jax', '?')}, jaxlib {m.get('jaxlib', '?')}, CUDA "
                        f"{m.get('cuda_version_smi') or m.get('cuda_runtime') or '-'}, driver "
                        f"{(m.get('nvidia_smi') or '-').split(',')[1].strip() if m.get('nvidia_smi') else '-'}, "
                        f"commit {str(m.get('git_commit') or '-')[:10]}{' (dirty)' if m.get('git_dirty') else ''}, "
                        f"tree {m.get('tree_digest', '-')}, copy {f1(m.get('copy_gbs'), '{:.0f}')} GB/s, "
                        + (f"read {f1(m.get('read_gbs'), '{:.0f}')} GB/s, " if m.get("read_gbs") else "") +
                        f"bf16 matmul {f1(m.get('matmul_tflops_bf16'), '{:.0f}')} TFLOP/s")
        dec = sorted([r for r in rs if r.get("kind") in ("decode", "first_call")],
                     key=lambda r: (CASE_ORDER.get(r["case"], 99), weights_label(r), r.get("layout"),
                                    r.get("impl"), r.get("flags"), r.get("prompt"), r.get("gen")))
        longs = sorted([r for r in rs if r.get("kind") == "long"],
                       key=lambda r: (r.get("prompt"), r.get("gen"), CASE_ORDER.get(r["case"], 99), r.get("layout"),
                                      r.get("impl"), r.get("flags")))
        out.append(f"### {shape} on {device}\n")
        for q in sorted({r.get("quantize") or "" for r in dec + longs}) or [""]:
            qs = [r for r in dec + longs if (r.get("quantize") or "") == q]
            fl = next((r.get("floor_ms") for r in qs if r.get("floor_ms")), None)
            basis = next((r.get("floor_basis", "copy") for r in qs if r.get("floor_ms")), "copy")
            wb = next((r.get("weight_bytes") for r in qs if r.get("weight_bytes")), None)
            out.append(f"Weights {f1(wb and wb / GIB, '{:.2f}')} GiB {q or 'bf16'}; floor {f1(fl, '{:.2f}')} ms per "
                       f"forward (weights a forward reads / measured {basis} bandwidth"
                       + ("; the copy was timed one pass per call, which reads low: see RESULTS.md"
                          if basis == "copy" else "") + ").\n")
        out.append("Sessions:\n")
        out.extend(f"- {v}" for v in vers)
        out.append("")
        if dec:
            out.append("| case | B | weights | layout | impl | XLA flags | P/G | tok/s | NFE | TPF | ms/fwd | x floor | "
                       "first call s: cold / cached | peak GiB | same tokens | note |")
            out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for r in dec:
                comp, cold, elsewhere = first_calls(r)
                note = []
                if elsewhere and (comp.get("cached_s") is not None or comp.get("cached_peak_bytes") is not None):
                    note.append(f"cached first call {elsewhere}")
                if r.get("error"):
                    note.append("FAILED: " + r["error"].splitlines()[-1][:120])
                if r.get("last_error"):
                    note.append("a later run failed: " + r["last_error"].splitlines()[-1][:100])
                if "acceptance_rate" in r:
                    note.append(f"acceptance {r['acceptance_rate']:.2f}")
                if r.get("peak_exact") is False:
                    note.append("peak: running (upper bound)")
                if comp.get("cached_peak_bytes") is not None:
                    note.append(f"peak of a process compiling from the cache: {comp['cached_peak_bytes'] / GIB:.1f} GiB"
                                + ("" if comp.get("cached_peak_exact") else " (running)"))
                fin = r.get("finish") or {}
                if fin and set(fin) - {"length", "stop"}:
                    note.append(f"finish {fin}")
                kvf = kv_floor_ms(r)
                if kvf and (r.get("batch") or 1) > 1 and r.get("window") == "token":  # b32 windows: compute-bound
                    note.append(f"weights + KV read floor {kvf:.2f} ms: {r['ms_per_forward'] / kvf:.2f}x")
                out.append("| " + " | ".join([
                    f"{r.get('label', r['case'])}", str(r.get("batch")), weights_label(r),
                    str(r.get("layout")), str(r.get("impl")),
                    f"`{r['flags']}`" if r.get("flags") else "-", f"{r.get('prompt')}/{r.get('gen')}",
                    f1(r.get("tok_s")), f1(r.get("nfe")), f1(r.get("tpf"), "{:.2f}"),
                    f1(r.get("ms_per_forward"), "{:.2f}"), f1(r.get("x_floor"), "{:.2f}"),
                    f"{f1(cold)} / {f1(comp.get('cached_s'))}", f1(r.get("peak_bytes") and r["peak_bytes"] / GIB,
                                                                   "{:.1f}"),
                    "-" if r.get("same_tokens") is None else ("yes" if r["same_tokens"] else "NO"),
                    "; ".join(note)]) + " |")
            out.append("")
        prof = [r for r in dec if (r.get("profile") or {}).get("device_events")]
        if prof:
            kinds = [k for k, _ in KERNEL_KINDS]
            out.append("Device time per forward (`--profile`: one more decode under `jax.profiler`; busy = the "
                       "union of the device's kernels, waiting = the rest of the span), ms:\n")
            out.append("| case | B | weights | span | busy | waiting | kernels | " + " | ".join(kinds) + " |")
            out.append("|---|---|---|---|---|---|---|" + "---|" * len(kinds))
            for r in prof:
                pf = r["profile"]
                pk = pf["kinds_ms_per_forward"]
                out.append("| " + " | ".join([r.get("label", r["case"]), str(r.get("batch")), weights_label(r),
                                              f1(pf["per_forward_ms"]["wall"], "{:.2f}"),
                                              f1(pf["per_forward_ms"]["busy"], "{:.2f}"),
                                              f1(pf["per_forward_ms"]["gap"], "{:.2f}"),
                                              f1(pf["kernels_per_forward"], "{:.0f}")]
                                             + [f1(pk.get(k), "{:.2f}") for k in kinds]) + " |")
            out.append("")
        if longs:
            out.append(render_long(longs))
        hf = sorted([r for r in rs if r.get("kind") == "hf"], key=lambda r: r["case"])
        if hf:
            out.append("PyTorch HF transformers baseline (eager, bf16, sdpa), same shape and run:\n")
            out.append("| case | B | tok/s | ms/token | ms/forward | peak GiB | note |")
            out.append("|---|---|---|---|---|---|---|")
            for r in hf:
                out.append(f"| {r['case']} | {r.get('batch')} | {f1(r.get('tok_s'))} | "
                           f"{f1(r.get('ms_per_token'), '{:.2f}')} | {f1(r.get('ms_per_forward'), '{:.2f}')} | "
                           f"{f1(r.get('peak_bytes') and r['peak_bytes'] / GIB)} | {r.get('skipped', '')} |")
            out.append("")
        sv = [r for r in rs if r.get("kind") == "serve"]
        if sv:
            out.append("Serving engine (`jdllm.serve.Engine`, AR, all requests submitted at once) vs one offline "
                       "`generate` of the same prompts:\n")
            out.append("| requests | layout | impl | engine tok/s | latency p50 / p99 ms | first token p50 / p99 ms | "
                       "offline tok/s | offline latency ms | requests with the same tokens | note |")
            out.append("|---|---|---|---|---|---|---|---|---|---|")
            for r in sv:
                if r.get("error"):
                    out.append(f"| {r.get('batch')} | {r.get('layout')} | {r.get('impl')} | - | - | - | - | - | - | "
                               f"FAILED: {r['error'].splitlines()[-1][:120]} |")
                    continue
                out.append(f"| {r['requests']} | {r['layout']} | {r['impl']} | {f1(r['tok_s'])} | "
                           f"{f1(r['latency_p50_ms'], '{:.0f}')} / {f1(r['latency_p99_ms'], '{:.0f}')} | "
                           f"{f1(r['ttft_p50_ms'], '{:.0f}')} / {f1(r['ttft_p99_ms'], '{:.0f}')} | "
                           f"{f1(r['offline_tok_s'])} | {f1(r['offline_latency_ms'], '{:.0f}')} | "
                           f"{r.get('same_requests', '?')}/{r['requests']}{diverge(r)} | "
                           f"{'' if r.get('peak_exact') is not False else 'peak running'} |")
            out.append("")
        out.append(render_targets(rs))
    return "\n".join(out)


def render_long(rows: list[dict]) -> str:
    """The --long table: prefill and decode apart; decode ms/forward (AR: ms/token) against reading the
    weights plus the KV cache up to the average live length once per forward."""
    out = ["Long contexts (`gpu.py --long`, issue 28 item 3): phase A (prefill) = the prompt's forward(s) and "
           "the first step; the decode columns are the remaining steps. KV floor: (weights a forward reads + "
           "the KV cache up to the average live length P + G/2) / the measured read bandwidth. Peak: the "
           "device's running peak; temp: the compiled programs' own temporaries (the larger of prefill and "
           "steps).\n",
           "| case | B | weights | layout | impl | P/G | canvas | tok/s | NFE | prefill s | decode ms/fwd | ms/token | "
           "KV floor ms | x KV floor | first call s (compile) | peak GiB | KV GiB | temp GiB | same tokens | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    gib = lambda b: f1(b and b / GIB, "{:.1f}")  # noqa: E731
    for r in rows:
        note = []
        if r.get("error"):
            note.append("FAILED: " + r["error"].splitlines()[-1][:120])
        if r.get("skipped"):
            note.append("SKIPPED: " + r["skipped"][:160])
        if r.get("last_error"):
            note.append("a later run failed: " + r["last_error"].splitlines()[-1][:100])
        if r.get("peak_exact") is False:
            note.append("peak: running (upper bound)")
        if r.get("merge_tokens") is not None:
            note.append(f"--merge-tokens {r['merge_tokens']}")
        first = f"{f1(r.get('first_call_s'))} ({f1(r.get('compile_s'))})" if r.get("first_call_s") else "-"
        out.append("| " + " | ".join([
            f"{r.get('label', r['case'])}", str(r.get("batch")), weights_label(r), str(r.get("layout")),
            str(r.get("impl")), f"{r.get('prompt')}/{r.get('gen')}", str(r.get("canvas", "-")), f1(r.get("tok_s")), f1(r.get("nfe")),
            f1(r.get("prefill_s"), "{:.2f}"), f1(r.get("ms_per_forward"), "{:.2f}"),
            f1(r.get("ms_per_token"), "{:.2f}"), f1(r.get("kv_floor_ms"), "{:.2f}"), f1(r.get("x_kv_floor"), "{:.2f}"),
            first, gib(r.get("peak_bytes")), gib(r.get("kv_bytes")), gib(r.get("program_temp_bytes")),
            "-" if r.get("same_tokens") is None else ("yes" if r["same_tokens"] else "NO"), "; ".join(note)]) + " |")
    return "\n".join(out) + "\n"


def render_targets(rs: list[dict]) -> str:
    """Issue 27's targets (batch 1 unless named), met / missed with the figure, per configuration."""
    hf = {r["case"]: r for r in rs if r.get("kind") == "hf" and not r.get("skipped")}
    hf_tok = hf.get("hf_generate_b1", {}).get("ms_per_token")
    hf_b64 = hf.get("hf_generate_b64", {}).get("tok_s")
    fwd = sorted((int(k[len("hf_forward_T"):]), v["ms_per_forward"]) for k, v in hf.items()
                 if k.startswith("hf_forward_T"))
    hf_win = fwd[0][1] if fwd else None
    hf_canvas = fwd[-1][1] if fwd else None
    dec = [r for r in rs if r.get("kind") in ("decode", "first_call")]
    def cfg_of(r):
        return (weights_label(r), r.get("layout"), r.get("impl"), r.get("flags") or "", r.get("prompt"),
                r.get("gen"))

    configs = sorted({cfg_of(r) for r in dec})
    lines = []

    def verdict(ok):
        return "met" if ok else "MISSED"

    for cfg in configs:
        got = {r["case"]: r for r in dec if cfg_of(r) == cfg}
        ok_rows = {k: r for k, r in got.items() if r.get("kind") == "decode" and not r.get("error")}
        quant, layout, impl, flags, P, G = cfg
        t = []
        ar = ok_rows.get("ar_b1")
        if ar and ar.get("floor_ms"):
            x = ar["ms_per_token"] / ar["floor_ms"]
            t.append(f"AR <= 1.1x floor per token: {verdict(x <= 1.1)} ({ar['ms_per_token']:.2f} ms/token = "
                     f"{x:.2f}x of {ar['floor_ms']:.2f} ms)")
        for cid, r in ok_rows.items():
            if r.get("batch") == 1 and r.get("window") == "window" and r.get("floor_ms"):
                x = r["ms_per_forward"] / r["floor_ms"]
                t.append(f"{r['label']}: window forward <= 1.2x floor: {verdict(x <= 1.2)} "
                         f"({r['ms_per_forward']:.2f} ms = {x:.2f}x)")
        for cid in ("mb_exact_b1", "mb_approx_b1"):
            r = ok_rows.get(cid)
            if r:
                lim = 0.4 * D3LLM_SGLANG_MS
                t.append(f"{r['label']}: ms/forward <= 0.4 x 18.2 = {lim:.2f} ms: "
                         f"{verdict(r['ms_per_forward'] <= lim)} ({r['ms_per_forward']:.2f} ms)")
        for cid, r in ok_rows.items():
            if r.get("batch") != 1:
                continue
            if r["window"] == "token":
                ref, mine, what = hf_tok, r["ms_per_token"], "HF generate b1 per token"
            elif r["window"] == "window":
                ref, mine, what = hf_win, r["ms_per_forward"], f"HF one forward of {fwd[0][0] if fwd else '?'} tokens"
            else:
                ref, mine, what = hf_canvas, r["ms_per_forward"], \
                    f"HF one forward of {fwd[-1][0] if fwd else '?'} tokens"
            if ref:
                t.append(f"{r['label']}: >= 3x {what} ({ref:.2f} ms): {verdict(ref / mine >= 3)} "
                         f"({mine:.2f} ms, {ref / mine:.2f}x)")
        r = ok_rows.get("ar_b64")
        if r and hf_b64:
            t.append(f"AR b64 >= 2x HF generate b64 ({hf_b64:.0f} tok/s): {verdict(r['tok_s'] >= 2 * hf_b64)} "
                     f"({r['tok_s']:.0f} tok/s, {r['tok_s'] / hf_b64:.2f}x)")
        for cid, r in got.items():
            if r.get("batch") != 1 or r.get("window") == "serve":
                continue
            comp, cold, elsewhere = first_calls(r)
            if cold is not None:
                t.append(f"{r.get('label', cid)}: first call <= 30 s cold: {verdict(cold <= 30)} ({cold:.1f} s)"
                         + (f"; <= 5 s cached: {verdict(comp['cached_s'] <= 5)} ({comp['cached_s']:.1f} s"
                            + (f", {elsewhere})" if elsewhere else ")")
                            if comp.get("cached_s") is not None else "; cached: not measured"))
        for cid, r in ok_rows.items():
            if r.get("peak_bytes") is None or not r.get("weight_bytes"):
                continue
            lim = r["weight_bytes"] + r.get("kv_bytes", 0) + 2 * GIB
            ok = r["peak_bytes"] <= lim
            comp, _, elsewhere = first_calls(r)
            cached = comp.get("cached_peak_bytes")
            t.append(f"{r['label']} b{r['batch']}: peak <= weights + KV + 2 GiB = {lim / GIB:.1f} GiB: {verdict(ok)} "
                     f"({r['peak_bytes'] / GIB:.1f} GiB{'' if r.get('peak_exact') else ', running peak'})"
                     + ("" if cached is None else
                        f"; a process compiling from the cache: {verdict(cached <= lim)} ({cached / GIB:.1f} GiB"
                        f"{'' if comp.get('cached_peak_exact') else ', running peak'}"
                        f"{', ' + elsewhere if elsewhere else ''})"))
        if quant != "bf16":  # issue 29: against bf16's rows of the same configuration
            bf16 = {r["case"]: r for r in dec if cfg_of(r) == ("bf16",) + cfg[1:] and r.get("kind") == "decode"
                    and not r.get("error")}
            for cid, r in ok_rows.items():
                b = bf16.get(cid)
                if r.get("batch") != 1 or not b or r.get("window") not in ("token", "window"):
                    continue
                lim, what = (0.6, "ms/token") if r["window"] == "token" else (0.65, "window forward")
                x = r["ms_per_forward"] / b["ms_per_forward"]
                t.append(f"{r['label']}: {quant} {what} <= {lim}x bf16's: {verdict(x <= lim)} "
                         f"({r['ms_per_forward']:.2f} vs {b['ms_per_forward']:.2f} ms = {x:.2f}x)")
                if r.get("weight_bytes") and b.get("weight_bytes") and cid == "ar_b1":
                    w = r["weight_bytes"] / b["weight_bytes"]
                    t.append(f"{quant} weights <= 0.55x bf16's: {verdict(w <= 0.55)} ({w:.2f}x)")
        if not hf:
            t.append("the HF baseline targets: no HF rows for this device and shape (torch with CUDA did not run)")
        if t:
            lines.append(f"Targets, weights {quant}, layout {layout}, impl {impl}, flags {flags or '-'}, "
                         f"prompt {P}, gen {G}:\n")
            lines.extend(f"- {x}" for x in t)
            lines.append("")
    return "\n".join(lines)


def write_results_md(db: dict, path: str) -> None:
    with open(path) as f:
        text = f.read()
    body = render(db, gpu_only=True)
    block = f"{MD_BEGIN}\n{body.rstrip()}\n{MD_END}"
    if MD_BEGIN in text and MD_END in text:
        pre, rest = text.split(MD_BEGIN, 1)
        post = rest.split(MD_END, 1)[1]
        text = pre + block + post
    else:
        text = text.rstrip() + "\n\n## End-to-end on a GPU (`benchmarks/gpu.py`)\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(f"# wrote the table into {path}", flush=True)


# --------------------------------------------------------------------------- CLI
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (default 8b)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--gen", type=int, default=256, help="generated tokens (default 256)")
    ap.add_argument("--block", type=int, default=32, help="block length of the diffusion paradigms (at most gen)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs after the first call (default 3; quick 2)")
    ap.add_argument("--case-per-process", action="store_true",
                    help="run each case in a child of its own with its own empty persistent cache (exact peak "
                         "memory and cold first call per case; ~10 s more per case for the weights)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, one more under jax.profiler: the device's time per forward by "
                         "kernel kind (matmuls, attention, other fusions, copies), busy vs waiting, top kernels")
    ap.add_argument("--only", nargs="+", default=None, metavar="CASE",
                    help="case ids (ar_b1, bd_static_b32, ...), case names (ar = every AR batch), 'hf'")
    ap.add_argument("--quick", action="store_true",
                    help=f"8B shape, cases {', '.join(QUICK_CASES)} (HF at b1 and b64), repeats 2, budget 240 s")
    ap.add_argument("--long", action="store_true",
                    help="only the long-context cases (issue 28 item 3): --long-cases at prompt --long-prompt and "
                         "generation --long-gen, prefill and decode timed apart, ms/forward against the weights + "
                         "KV-cache read floor; the KV cache is checked to fit before anything compiles; repeats 1")
    ap.add_argument("--long-prompt", type=int, default=LONG_PROMPT,
                    help=f"--long prompt tokens (default {LONG_PROMPT})")
    ap.add_argument("--long-gen", type=int, default=LONG_GEN, help=f"--long generated tokens (default {LONG_GEN})")
    ap.add_argument("--long-cases", nargs="+", default=list(LONG_CASES), metavar="CASE",
                    help=f"--long case ids (default {' '.join(LONG_CASES)}; mb_approx_b1 refreshes the whole canvas)")
    ap.add_argument("--merge-tokens", type=int, default=None, metavar="N",
                    help="--long only: merge a step's window shapes of batch x width <= N tokens into the widest "
                         "(DecodeCtx.merge_tokens; default the backend's rule, 256 on a GPU, which ignores the "
                         "cache length; 0 compiles every width): rows keyed apart")
    ap.add_argument("--long-assume-free", type=float, default=None, metavar="GIB", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=None, help="start no case or child after this many seconds")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["per_layer"],
                    help="weight layouts: per_layer (one dict per layer, fused qkv / gate_up) and/or stacked "
                         "(one [layers, ...] array per weight, lax.scan)")
    ap.add_argument("--impls", nargs="+", default=["auto"], help="attention impls (auto, pallas, xla, cudnn)")
    ap.add_argument("--quantize", default=None, choices=("int8", "fp8"),
                    help="weight-only int8 / fp8 weights (jdllm.quant; issue 29): rows keyed apart from bf16's, "
                         "floor from the quantized bytes")
    ap.add_argument("--kv-cache", default=None, choices=("int8",),
                    help="an int8 KV cache (kv_cache_dtype; issue 29: the kernels read it as int8 and scale on "
                         "chip): rows keyed apart, KV bytes and floors from its size")
    ap.add_argument("--xla-flags-variants", nargs="+", default=None, metavar="FLAGS",
                    help="XLA_FLAGS strings, each run in processes of its own ('' = none added); a word "
                         "NAME=VALUE sets that environment variable in the variant's processes instead (e.g. "
                         "'JDLLM_WINDOW_SPLITS=1'); default '' (tiny shape: '' and "
                         "'--xla_cpu_enable_fast_math=false')")
    ap.add_argument("--cold-cases", nargs="*", default=list(DEFAULT_COLD), metavar="CASE",
                    help="cases whose first call is also timed from the filled persistent cache in a new process")
    ap.add_argument("--cold-separate", action="store_true",
                    help="time the cold first call of --cold-cases in a process of its own (costs one more "
                         "compile each) instead of taking the measuring process's first call")
    ap.add_argument("--no-hf", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=None, help="HF generate batches (default 1 16 64)")
    ap.add_argument("--hf-repeats", type=int, default=None, help="HF timed runs (default 2; quick 1)")
    ap.add_argument("--steps-per-round", type=int, default=8, help="serving engine steps between host visits")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="weight std")
    ap.add_argument("--head-std", type=float, default=0.1, help="LM head std (peaked logits)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON to merge the rows into (default benchmarks/results/gpu.json)")
    ap.add_argument("--markdown", action="store_true", help="only print the tables of --out (runs nothing)")
    ap.add_argument("--write-results-md", action="store_true",
                    help="write the tables (GPU rows only) between the markers in benchmarks/RESULTS.md")
    ap.add_argument("--results-md", default=RESULTS_MD, help=argparse.SUPPRESS)
    # an XLA flag given alone as a variant ("--xla_gpu_...=x") would read as an option of this script:
    # its leading space makes it a value (stripped below)
    argv = [f" {a}" if a.startswith("--xla_") else a for a in (sys.argv[1:] if argv is None else argv)]
    args = ap.parse_args(argv)
    if args.xla_flags_variants is not None:
        args.xla_flags_variants = [v.strip() for v in args.xla_flags_variants]
    if args.quick:
        args.shape = args.shape or "8b"
        args.only = args.only or list(QUICK_CASES)
        args.repeats = args.repeats or 2
        args.hf_batches = args.hf_batches or [1, 64]
        args.hf_repeats = args.hf_repeats or 1
        args.budget = 240.0 if args.budget is None else args.budget
    if args.merge_tokens is not None and not args.long:
        ap.error("--merge-tokens applies to --long runs")
    if args.long:
        if args.quick:
            ap.error("--long and --quick are separate runs")
        args.prompt, args.gen, args.only, args.no_hf = args.long_prompt, args.long_gen, list(args.long_cases), True
        args.repeats = 1 if args.repeats is None else args.repeats  # 0: the first run's timings alone
        args.cold_cases = []
    args.shape = args.shape or "8b"
    args.repeats = args.repeats if args.long else (args.repeats or 3)
    args.hf_batches = args.hf_batches or [1, 16, 64]
    args.hf_repeats = args.hf_repeats or 2
    if args.xla_flags_variants is None:
        # the tiny self-check also runs a second variant (every XLA flag parses on every backend)
        args.xla_flags_variants = ["", "--xla_cpu_enable_fast_math=false"] if args.shape == "tiny" else [""]
    if args.only:
        known = {c.id for c in all_cases()} | {c.name for c in all_cases()} | {"hf"}
        bad = [c for c in args.only if c not in known]
        if bad:
            ap.error(f"unknown case(s) {bad}; known: {sorted(known)}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        return child_main(argv[1])
    args = parse(argv)
    if args.markdown:
        db = load_db(args.out)
        print(render(db))
        if args.write_results_md:
            write_results_md(db, args.results_md)
        return 0

    def on_term(signum, frame):
        raise Interrupted()

    signal.signal(signal.SIGTERM, on_term)
    return parent_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
