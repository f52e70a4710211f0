#!/usr/bin/env bash
# What waits for a GPU, as device calls of at most ~9 minutes each, highest value first. Run from the repo
# root on the lent machine (the device tool runs it there, $OUT set):
#   CALL=1 bash benchmarks/next_lease.sh     # issue 27: the switches that cut kernels per step, A/B end to end
#   CALL=2 bash benchmarks/next_lease.sh     # issue 29: int8 tiles read as words (window, qmatmul, end to end)
#   CALL=3 bash benchmarks/next_lease.sh     # the GPU tier's new cases, issue 28's windows, the cold first call's peak
# Each step runs under `timeout` and logs to $OUT/logs/<step>.txt; gpu.json starts as a copy of
# benchmarks/results/gpu.json, so the one that comes back holds the earlier rows too (copy it over, then
# `python benchmarks/gpu.py --markdown --write-results-md`). Every switch timed here is untimed so far:
#   JDLLM_NORM_INTO_MATMUL   (on by default for one row since fb6f1e9: 8B AR step 578 -> 514 kernels deviceless;
#                             "=0" is the old program, so the pair below is the before / after)
#   --xla_gpu_experimental_force_split_k=1 (o and down GEMMs in one kernel each; with the fold 514 -> 465)
#   JDLLM_WINDOW_SPLITS=1    (one program per KV head writes the window's attention, no merge kernel: 8B AR
#                             482 -> 450 kernels per step, block_diffusion 522 -> 458 deviceless; with
#                             force_split_k too, fewer again)
#   JDLLM_MERGE_TOKENS=128   (multi_block approx's suffixes 128 / 192 wide instead of 256)
#   JDLLM_INT8_V_WORDS=1, JDLLM_QMATMUL_WORDS=1 (int8 tiles read as 32-bit words: no byte loads in the PTX)
# A variant that wins becomes the default; one that loses is written down in RESULTS.md and left off.
set -u
case ${CALL:-1} in 1|2|3) ;; *) echo "CALL must be 1, 2 or 3" >&2; exit 2 ;; esac
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-benchmarks/out}
L=$out/logs
mkdir -p "$L"
T0=$(date +%s)
for f in gpu attention; do [ -f "benchmarks/results/$f.json" ] && cp "benchmarks/results/$f.json" "$out/$f.json"; done

step() {  # step NAME SECONDS COMMAND...: the command under timeout, its log, one summary line
  local name=$1 limit=$2
  shift 2
  timeout -k 5 "$limit" "$@" > "$L/$name.txt" 2>&1
  echo "rc $?" >> "$L/$name.txt"
  echo "# $name done at +$(( $(date +%s) - T0 ))s"
  grep -E "ms/fwd|ms/token \||window|^\| |skipped|Error|passed|failed|^rc" "$L/$name.txt" | cut -c1-220 | tail -30
}

# every call records its machine (a lease may run only CALL=2 or 3): device, driver / CUDA, jax / jaxlib
{ echo "CALL=${CALL:-1}"; date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi
  python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"; } > "$L/device.txt" 2>&1

case ${CALL:-1} in
1)
  # ~35 s of weights and probe, then ~25-30 s per case and variant (8 children)
  step kernels 380 python3 benchmarks/gpu.py --quick --no-hf --cold-cases --only ar_b1 bd_static_b1 --budget 320 \
    --out "$out/gpu.json" --xla-flags-variants "" "JDLLM_NORM_INTO_MATMUL=0" "--xla_gpu_experimental_force_split_k=1" \
    "JDLLM_WINDOW_SPLITS=1" "JDLLM_WINDOW_SPLITS=1 --xla_gpu_experimental_force_split_k=1"
  step merge128 160 python3 benchmarks/gpu.py --quick --no-hf --cold-cases --only mb_approx_b1 --budget 110 \
    --out "$out/gpu.json" --xla-flags-variants "" "JDLLM_MERGE_TOKENS=128"
  ;;
2)
  step win32 110 python3 benchmarks/attention.py --window-only --seq 33792 --window 32 --heads 32 --kv-heads 32 --impls pallas \
    --kv-cache int8 --window-sweep --sweep-only "words,bytes,words w4" --iters 5 --out "$out/attn_words.json"
  step win1gqa 80 python3 benchmarks/attention.py --window-only --seq 33792 --window 1 --heads 32 --kv-heads 8 --impls pallas \
    --kv-cache int8 --window-sweep --sweep-only "words,bytes" --iters 5 --out "$out/attn_words_gqa.json"
  step qmatmul 110 python3 benchmarks/qmatmul.py --quick --only "default (dot, k128 n128, auto splits, w4 s3)" words "words k64" \
    "[N, K] storage" --out "$out/qmatmul.json"
  step quant 150 python3 benchmarks/gpu.py --quick --quantize int8 --no-hf --cold-cases --only ar_b1 bd_static_b1 --budget 100 \
    --out "$out/gpu.json" --xla-flags-variants "" "JDLLM_QMATMUL_WORDS=1"
  # --long runs its first flags variant only: one run each, keyed apart by the flags
  for v in "" "JDLLM_INT8_V_WORDS=1"; do
    step "kv8${v:+_words}" 90 python3 benchmarks/gpu.py --long --kv-cache int8 --long-cases bd_static_b1 --repeats 1 --no-hf \
      --budget 30 --out "$out/gpu.json" --xla-flags-variants "$v"
  done
  ;;
3)
  XLA_FLAGS=--xla_gpu_autotune_level=0 step tier 240 python3 -m pytest -q --tb=short -rfE -m gpu \
    -k "paradigm or gpu_int8_cache or quantized_matmul_compiled or norm or one_split" tests/
  # issue 28's figure at its own shape (32 query heads, 8 KV heads, D 128, bf16): T = 32 and 128 windows at
  # S = 4k and 32k against the copy rate (the H100 figures so far are T = 1 or other head counts)
  step attn28 100 python3 benchmarks/attention.py --window-only --seq 4096 32768 --window 32 128 --heads 32 --kv-heads 8 \
    --impls pallas --iters 5 --out "$out/attention.json"
  # the cold process's peak (issue 27: 18.0 GiB against 17.1; XLA's GEMM autotuner at compile time)
  step peak 200 python3 benchmarks/gpu.py --quick --no-hf --only ar_b1 --case-per-process --budget 150 --out "$out/gpu.json" \
    --xla-flags-variants "" "--xla_gpu_autotune_level=2" "--xla_gpu_redzone_scratch_max_megabytes=512"
  ;;
esac
echo "# call ${CALL:-1} took $(( $(date +%s) - T0 ))s"
