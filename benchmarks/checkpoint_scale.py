"""Checkpoints of a real size: load and conversion time and peak host memory.

Writes a synthetic Hugging Face directory shaped like a real model (random bf16
weights, sharded safetensors + index, written one shard at a time, in its own
process), then measures each step in a fresh subprocess:

  baseline        a process that imports jax + jdllm and does nothing
  load_hf_1dev    jdllm.load(hf_dir) onto one CPU device
  load_hf_mesh    jdllm.load(hf_dir, mesh=1x8) onto 8 fake CPU devices
  load_hf_int8_1dev
                  jdllm.load(hf_dir, quantize="int8") onto one CPU device: each slice quantized as
                  it is read from the safetensors (the 8B shape's int8 weights, 7.5 GiB, fit this
                  machine where its bf16 ones and a converted copy do not)
  convert         jdllm convert hf_dir -> Orbax checkpoint (streaming, slice by slice)
  convert_int8    the same with --quantize int8 (each slice quantized on the host as it streams)
  convert_whole   the former converter: the whole params tree on the host, then
                  Orbax StandardCheckpointer.save (for the before/after comparison)
  load_ckpt_1dev  jdllm.load(ckpt) onto one CPU device
  load_ckpt_mesh  jdllm.load(ckpt, mesh=1x8): Orbax restore straight into the shardings
  load_ckpt_int8_1dev, load_ckpt_int8_mesh
                  jdllm.load(ckpt, quantize="int8") of the plain bf16 checkpoint (one device / 1x8):
                  each slice quantized as it is read, so the bf16 weights never all exist at once
  staging_ckpt    jdllm.load's read of a checkpoint (one layer's slice at a time), each slice
                  freed once placed: the host memory a load needs beyond the weights (what a
                  GPU host holds), measurable for models whose weights do not fit this machine
  staging_orbax   the same through Orbax (one stacked parameter at a time: the fallback for
                  layouts the per-layer reader does not open)

Peak RSS is the process's VmHWM (/proc/self/status): unlike ru_maxrss it is not
inherited from the parent across fork + exec. On CPU "devices" the loaded
weights live in the same process, so a load's peak includes the model itself:
the host overhead is peak - baseline - model bytes.

The streaming converter's target: peak RSS <= 3 x the largest tensor + 1 GB (the
`bound_gb` column). An 8B model's load onto CPU devices holds its 16 GB in the
process, so for that shape run the conversion and the restore's staging only:

    python benchmarks/checkpoint_scale.py --shape qwen3-0.6b --dir /tmp/ckpt_scale
    python benchmarks/checkpoint_scale.py --shape llama3-8b --steps baseline,convert,staging_ckpt --dir /tmp/ckpt8b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
             max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
             tie_word_embeddings=True, eos_token_id=151645)
SHAPES = {  # config.json of each shape
    "qwen3-0.6b": dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "sdar-1.7b": dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "llama3-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False, eos_token_id=128001, bos_token_id=128000,
                      hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def random_bf16(rng, shape):
    """Random finite bf16 weights of magnitude 2^-10 .. 2^-3 (random sign and mantissa), drawn
    as raw bits: an 8B model's 16 GB in seconds, and as incompressible as real weights."""
    import ml_dtypes  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    r = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    r = (r & 0x807F) | ((((r >> 7) & 0x7) + 0x75) << 7).astype(np.uint16)
    return r.view(ml_dtypes.bfloat16)


def write_hf(path: str, shape: str, shard_bytes: int) -> dict:
    import numpy as np  # noqa: PLC0415
    from safetensors.numpy import save_file  # noqa: PLC0415

    sys.path.insert(0, ROOT)
    from jdllm.config import ModelConfig  # noqa: PLC0415
    from jdllm.hf_layout import hf_tensor_names  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    conf = dict(SHAPES[shape], torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f)
    cfg = ModelConfig.from_hf(path)
    slots = hf_tensor_names(cfg)
    rng = np.random.default_rng(0)
    weight_map, shard, size, n, largest, total = {}, {}, 0, 0, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            fn = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(path, fn), metadata={"format": "pt"})
            weight_map.update({k: fn for k in shard})
            shard, size, n = {}, 0, n + 1

    for name, slot in slots.items():
        t = random_bf16(rng, slot.hf_shape)
        nbytes = t.nbytes
        largest, total = max(largest, nbytes), total + nbytes
        if size and size + nbytes > shard_bytes:
            flush()
        shard[name], size = t, size + nbytes
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return dict(params=sum(v.hf_shape[0] * (v.hf_shape[1] if len(v.hf_shape) > 1 else 1) for v in slots.values()),
                model_bytes=total, largest_tensor_bytes=largest, shards=n)


CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
what, src, dst = sys.argv[1:4]

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) / 2**20  # kB -> GB

t0 = time.perf_counter()
import jax
import jdllm
from jdllm import sharding
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
biggest = weights_gb = 0
if what.startswith("load_"):
    mesh = sharding.make_mesh("model=8") if what.endswith("mesh") else None
    quantize = "int8" if "_int8" in what else None
    m = jdllm.load(dst if what.startswith("load_ckpt") else src, dtype="bfloat16", mesh=mesh, quantize=quantize)
    jax.block_until_ready(m.params)
    biggest = max(max(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(m.params))
    weights_gb = sum(x.nbytes for x in jax.tree.leaves(m.params)) / 2**30
elif what == "staging_orbax":
    from jdllm.checkpoint import iter_restored_params
    for keys, x in iter_restored_params(dst, dtype="bfloat16"):
        biggest = max(biggest, x.block_until_ready().nbytes)
        x.delete()
elif what == "staging_ckpt":
    from jdllm.checkpoint import iter_layer_slices, read_jdllm_meta
    slices = iter_layer_slices(dst, read_jdllm_meta(dst)["config"], dtype="bfloat16")
    assert next(slices)
    for _, _, x in slices:
        biggest = max(biggest, x.block_until_ready().nbytes)
        x.delete()
elif what in ("convert", "convert_int8"):
    from convert.io import convert_checkpoint
    if what == "convert":
        convert_checkpoint(src, dst, dtype="bfloat16", overwrite=True, progress=False)
    else:  # beside the plain one, removed after
        import shutil
        convert_checkpoint(src, dst + "_int8", dtype="bfloat16", overwrite=True, progress=False, quantize="int8")
        shutil.rmtree(dst + "_int8")
elif what == "convert_whole":
    import shutil
    import ml_dtypes, numpy as np, orbax.checkpoint as ocp
    from jdllm.checkpoint import SafetensorsDir
    from jdllm.config import ModelConfig
    from jdllm.hf_layout import params_from_hf_tensors
    params = params_from_hf_tensors(SafetensorsDir(src), ModelConfig.from_hf(src), dtype=ml_dtypes.bfloat16)
    shutil.rmtree(dst + "_whole", ignore_errors=True)
    with ocp.StandardCheckpointer() as ck:
        ck.save(dst + "_whole", params)
        ck.wait_until_finished()
    shutil.rmtree(dst + "_whole", ignore_errors=True)
dt = time.perf_counter() - t0
print(json.dumps(dict(what=what, seconds=round(dt, 2), import_s=round(t_import, 2),
                      peak_rss_gb=round(status("VmHWM"), 3), end_rss_anon_gb=round(status("RssAnon"), 3),
                      end_rss_file_gb=round(status("RssFile"), 3),
                      largest_device_buffer_gb=round(biggest / 2**30, 3), weights_gb=round(weights_gb, 3))))
"""


def child(what: str, src: str, dst: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT), what, src, dst], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "?"
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    return f"{os.cpu_count()} x {cpu}, {mem:.0f} GiB RAM"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--dir", default="/tmp/jdllm_ckpt_scale")
    p.add_argument("--shard-mb", type=int, default=512)
    p.add_argument("--steps", default="baseline,load_hf_1dev,load_hf_mesh,convert_whole,convert,load_ckpt_mesh")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the synthetic HF directory a --keep run left in --dir (no rewrite)")
    p.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    hf_dir, ck_dir = os.path.join(args.dir, "hf"), os.path.join(args.dir, "jdllm")
    if args.write_only:
        print(json.dumps(write_hf(hf_dir, args.shape, args.shard_mb << 20)))
        return 0
    info_file = os.path.join(args.dir, "info.json")
    if args.reuse and os.path.isfile(info_file):
        with open(info_file) as f:
            info = json.load(f)
        if info["shape"] != args.shape:
            raise SystemExit(f"{args.dir} holds shape {info['shape']}, not {args.shape}")
    else:
        t0 = time.perf_counter()
        # in its own process: the writer's memory must not count in the measured children
        info = json.loads(subprocess.run(
            [sys.executable, __file__, "--write-only", "--shape", args.shape, "--dir", args.dir,
             "--shard-mb", str(args.shard_mb)], capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        info.update(shape=args.shape, write_s=round(time.perf_counter() - t0, 1))
        with open(info_file, "w") as f:
            json.dump(info, f)
    print(json.dumps(info), flush=True)
    bound = 3 * info["largest_tensor_bytes"] / 2**30 + 1
    rows = []
    for what in args.steps.split(","):
        r = child(what, hf_dir, ck_dir)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{args.shape}: model {info['model_bytes'] / 2**30:.2f} GiB, largest tensor "
          f"{info['largest_tensor_bytes'] / 2**30:.2f} GiB, bound 3 x largest + 1 = {bound:.2f} GiB")
    print(f"{'step':<16} {'wall s':>8} {'peak RSS GiB':>13} {'<= bound':>9}")
    for r in rows:
        ok = "yes" if r["peak_rss_gb"] <= bound else "NO"
        print(f"{r['what']:<16} {r['seconds']:>8.1f} {r['peak_rss_gb']:>13.3f} "
              f"{ok if r['what'].startswith('convert') else '':>9}")
    meta = dict(load_average=os.getloadavg(), bound_gb=round(bound, 3), machine=_machine(), **info)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
