#!/usr/bin/env bash
# One command for a GPU session (issues 4 and 27), run from the repo root on the GPU machine:
#   GIT_COMMIT=<sha of the tree sent> bash benchmarks/gpu_session.sh
#   0. the device, nvidia-smi, jax / jaxlib / CUDA versions            -> device.txt
#   1. benchmarks/compile_profile.py (8B decode programs compiled ahead of time with abstract weights:
#      trace / lower / XLA compile seconds per depth, option, layout; issue 27 item 2)
#                                                                       -> compile_profile.log, compile_profile.json
#   2. the GPU test tier (`pytest -m gpu`)                              -> gpu_tests.log
#   3. benchmarks/gpu.py --quick --profile (8B shape, priority cases, HF baseline, the device's time by kernel
#      kind per case)                                                   -> gpu.log, gpu.json (its table
#      is printed at the end of the step: `gpu.py --markdown` remakes it from gpu.json)
#  3b. benchmarks/gpu.py --quick --quantize $QUANT (int8 by default; issue 29), only with QUANT_S > 0 (the
#      limit of each run): QUANT_ARGS (default "--only ar_b1 bd_static_b1"), no HF, no cached first calls, once
#      per mode in QUANT_MATMULS (default "auto xla": the Pallas few-row kernel, then XLA's dot)
#                                                                       -> gpu_quant.log, gpu.json
#  3c. benchmarks/qmatmul.py (the quantized few-row matmul against XLA's bf16 and int8 dots, and a sweep of
#      its tiles, 8B shape; QMM_ARGS, default "--quick"), only with QMM_S > 0 -> qmatmul.log, qmatmul.json
#   4. benchmarks/attention.py at two sizes (Pallas, cuDNN, XLA), only with ATTN_S > 0
#                                                                       -> attention.log, attention.json
#   5. benchmarks/gpu.py --long (issue 28 item 3: AR, block_diffusion, multi_block exact at prompt 32k,
#      generation 1k, 8B shape), only with LONG_S > 0; its rows go into the same gpu.json -> gpu_long.log
#      (not yet run on a GPU; estimated 5-7 minutes on an H100 from the short runs: the probe and the
#      weights ~1 minute, then per case an ahead-of-time compile of ~0.5-2 minutes and two runs of
#      ~3-15 s each). Too long to follow steps 1-3 in one 15-minute lease: give it a call of its own
#      with the other steps off (a step whose time is 0 is skipped):
#        CP_S=0 GPU_TESTS_S=0 GPU_BENCH_S=0 LONG_S=450 bash benchmarks/gpu_session.sh
# Everything goes to $OUT (the device tool's folder: at most 8 files come back) or benchmarks/out; with
# SESSION_TAR=1 the logs of every step go into one logs.tar.gz instead (device.txt, the JSONs and the tar:
# at most 6 files whatever the steps; a wrapper that tees this script's output into $OUT should name its
# file *.txt, not *.log). Each step runs under `timeout`, so the
# whole script ends within ~9 minutes by default; steps run on after a failure; the exit status is the
# first failing step's (124: a step timed out).
# gpu.json and compile_profile.json start as copies of benchmarks/results/{gpu,compile_profile}.json, so
# the ones that come back hold the earlier sessions' rows too: copy them over benchmarks/results/, then
#   python benchmarks/gpu.py --markdown --write-results-md
#   python benchmarks/compile_profile.py --markdown
# Budgets (seconds, environment): CP_BUDGET_S (150: compile_profile.py starts no row after it; a row
# still compiling at budget + CP_GRACE_S (30) is stopped, its finished phases kept) and CP_S (195, the
# hard limit); CP_ARGS adds arguments to compile_profile.py (e.g. "--with-run" or "--shape 4b");
# GPU_TESTS_S (130); GPU_TESTS_K, a pytest -k expression selecting part of the tier (the tests an earlier
# lease did not reach, e.g. "prefix or dual or multi_block-bidirectional or serving or dfa or end_to_end": the whole
# tier took ~10 minutes on an H200); GPU_BENCH_S (200, the hard limit) and GPU_BENCH_BUDGET_S (110, after which gpu.py
# starts no new case: a case started just before it may compile for 2 minutes on the 8B shape);
# GPU_BENCH_ARGS adds arguments to gpu.py (e.g. "--only mb_approx_b1 hf" or "--layouts per_layer
# stacked"); ATTN_S (0: the attention step is skipped; 75 runs it, ~10.5 minutes in all) with ATTN_SEQ
# ("4096 16384"), ATTN_IMPLS ("pallas,pallas-mosaic-1wg,pallas-mosaic-ws,pallas-triton-bwd,
# pallas-mosaic-ws-bwd,cudnn,xla" on one line: on Hopper "pallas" is the default, the warp-specialised
# Mosaic prefill without the ping-pong and the Mosaic backward; pallas-mosaic-1wg the one-warpgroup
# prefill, pallas-mosaic-ws the warp-specialised one with the ping-pong, pallas-triton-bwd the earlier
# default (one-warpgroup forward, Triton backward), pallas-mosaic-ws-bwd both warp-specialised)
# and ATTN_ARGS ("--backward"; "--window-only --window-sweep" with ATTN_WINDOW="1 32" times the window
# kernel's Tiles variants alone, keeping the prefill rows of an earlier full run of the device; the int8 KV
# cache's window kernels, one-row and dot, at 32k on the 8B shape's heads: ATTN_SEQ=33792 ATTN_IMPLS=pallas
# ATTN_ARGS="--window-only --window-sweep --kv-cache int8 --heads 32 --kv-heads 32 --sweep-only dot,prefetch"
# (each variant compiles for ~15 s on an H200); V read as words in the windows of several rows:
# ATTN_WINDOW="32 1" ATTN_ARGS="--window-only --window-sweep --kv-cache int8 --heads 32 --kv-heads 8
# --sweep-only words,bytes,words w4"); LONG_S (0: the
# long-context step is skipped; 450 runs it, the hard limit) with LONG_BUDGET_S (LONG_S - 150: gpu.py
# starts no case after it) and LONG_ARGS (more gpu.py arguments, e.g. "--long-prompt 16384" or
# "--long-cases ar_b1 mb_exact_b1 mb_approx_b1" or "--repeats 0": the first run's timings alone, or
# "--long-cases bd_static_b1 mb_exact_b1 --merge-tokens 0": every window width compiled on its own, or
# "--kv-cache int8": an int8 KV cache, read by the kernels as int8; its rows are keyed apart from bf16's).
# CP_S, GPU_TESTS_S and GPU_BENCH_S at 0 skip their steps likewise (timeout 0 would mean no limit).
set -uo pipefail
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Python packages the GPU image lacks travel as wheels in .whl/ (ignored by git; name it in the device call's
# `carry`): today interegular, which the DFA constraint tests of the GPU tier need (the image has no
# jdllm[constraints]; without it those 3 tests fail with "the 'dfa' backend needs interegular"). Made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl interegular==0.3.3
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
T_CP=${CP_S:-195} CP_BUDGET=${CP_BUDGET_S:-150} CP_GRACE=${CP_GRACE_S:-30}
T_TESTS=${GPU_TESTS_S:-130} T_BENCH=${GPU_BENCH_S:-200} BUDGET=${GPU_BENCH_BUDGET_S:-110} T_ATTN=${ATTN_S:-0}
T_LONG=${LONG_S:-0} T_QUANT=${QUANT_S:-0} T_QMM=${QMM_S:-0}
QUANT_BUDGET=${QUANT_BUDGET_S:-$(( T_QUANT > 60 ? T_QUANT - 60 : T_QUANT / 2 ))}
LONG_BUDGET=${LONG_BUDGET_S:-$(( T_LONG > 150 ? T_LONG - 150 : T_LONG / 2 ))}
status=0
t0=$(date +%s)
note() { echo "# $(date -u +%H:%M:%S) (+$(( $(date +%s) - t0 ))s) $*"; }

{
  note "device"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi | grep -m1 "CUDA Version" || true
  timeout 60 python3 -c "import importlib.metadata as m, jax; print('jax', jax.__version__, 'jaxlib', m.version('jaxlib'), jax.devices()); print('platform', jax.devices()[0].client.platform_version)"
  python3 -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda|torch |transformers|triton)" || true
  echo "git ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
} 2>&1 | tee "$out/device.txt"

if [ "$T_CP" -gt 0 ]; then
  note "1. benchmarks/compile_profile.py (budget ${CP_BUDGET}s + ${CP_GRACE}s grace, timeout ${T_CP}s)"
  [ -f benchmarks/results/compile_profile.json ] && cp benchmarks/results/compile_profile.json "$out/compile_profile.json"
  # shellcheck disable=SC2086
  timeout -k 10 "$T_CP" python3 benchmarks/compile_profile.py --shape 8b --budget "$CP_BUDGET" --grace "$CP_GRACE" \
    --out "$out/compile_profile.json" ${CP_ARGS:-} 2>&1 | tee "$out/compile_profile.log"
  status=$(( status ? status : ${PIPESTATUS[0]} ))
else
  note "1. benchmarks/compile_profile.py skipped (CP_S=0)"
fi

if [ "$T_TESTS" -gt 0 ]; then
  note "2. GPU test tier (timeout ${T_TESTS}s)"
  # autotuning off for the tier's tiny shapes (it picks among GEMM algorithms; the tier checks results, and its
  # 37 tests took ~6 minutes on an H200 with it on, 2026-11-26)
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0" timeout -k 10 "$T_TESTS" python3 -m pytest -v --tb=short -rfE -m gpu ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} tests/ 2>&1 | tee "$out/gpu_tests.log"
  status=$(( status ? status : ${PIPESTATUS[0]} ))
else
  note "2. GPU test tier skipped (GPU_TESTS_S=0)"
fi

[ -f benchmarks/results/gpu.json ] && cp benchmarks/results/gpu.json "$out/gpu.json"
if [ "$T_BENCH" -gt 0 ]; then
  note "3. benchmarks/gpu.py --quick (budget ${BUDGET}s, timeout ${T_BENCH}s)"
  # shellcheck disable=SC2086
  # --profile: one more decode per case under jax.profiler, the device's time by kernel kind (issue 27: where
  # AR's 1.30x over the read floor goes on the H100)
  timeout -k 15 "$T_BENCH" python3 benchmarks/gpu.py --quick --profile --budget "$BUDGET" --out "$out/gpu.json" \
    ${GPU_BENCH_ARGS:-} 2>&1 | tee "$out/gpu.log"
  status=$(( status ? status : ${PIPESTATUS[0]} ))
  [ -f "$out/gpu.json" ] && python3 benchmarks/gpu.py --markdown --out "$out/gpu.json" 2>&1 | tail -40
else
  note "3. benchmarks/gpu.py --quick skipped (GPU_BENCH_S=0)"
fi

if [ "$T_QUANT" -gt 0 ]; then
  # issue 29's speed rows: weight-only int8 / fp8 against bf16's rows of step 3, once per QUANT_MATMULS mode
  # (JDLLM_QUANT_MATMUL: "auto" = the few-row matmuls through pallas_kernels.qmatmul, "xla" = XLA's dot)
  for qmm in ${QUANT_MATMULS:-auto xla}; do
    note "3b. benchmarks/gpu.py --quick --quantize ${QUANT:-int8}, JDLLM_QUANT_MATMUL=$qmm (budget ${QUANT_BUDGET}s, timeout ${T_QUANT}s)"
    # shellcheck disable=SC2086
    JDLLM_QUANT_MATMUL=$qmm timeout -k 15 "$T_QUANT" python3 benchmarks/gpu.py --quick --profile --quantize "${QUANT:-int8}" \
      --no-hf --cold-cases --budget "$QUANT_BUDGET" --out "$out/gpu.json" ${QUANT_ARGS:---only ar_b1 bd_static_b1} 2>&1 \
      | tee -a "$out/gpu_quant.log"
    status=$(( status ? status : ${PIPESTATUS[0]} ))
  done
else
  note "3b. benchmarks/gpu.py --quantize skipped (QUANT_S=0)"
fi

if [ "$T_QMM" -gt 0 ]; then
  note "3c. benchmarks/qmatmul.py ${QMM_ARGS:---quick} (timeout ${T_QMM}s)"
  [ -f benchmarks/results/qmatmul.json ] && cp benchmarks/results/qmatmul.json "$out/qmatmul.json"
  # shellcheck disable=SC2086
  timeout -k 10 "$T_QMM" python3 benchmarks/qmatmul.py ${QMM_ARGS:---quick} --out "$out/qmatmul.json" 2>&1 \
    | tee "$out/qmatmul.log"
  status=$(( status ? status : ${PIPESTATUS[0]} ))
else
  note "3c. benchmarks/qmatmul.py skipped (QMM_S=0)"
fi

if [ "$T_ATTN" -gt 0 ]; then
  note "4. benchmarks/attention.py (timeout ${T_ATTN}s)"
  # (a --window-only run keeps the prefill rows of the committed JSON when it is this device's)
  [ -f benchmarks/results/attention.json ] && cp benchmarks/results/attention.json "$out/attention.json"
  # shellcheck disable=SC2086  # ATTN_SEQ / ATTN_WINDOW are lists of lengths, ATTN_ARGS a list of arguments
  timeout -k 10 "$T_ATTN" python3 benchmarks/attention.py --seq ${ATTN_SEQ:-4096 16384} ${ATTN_ARGS:---backward} \
    --impls "${ATTN_IMPLS:-pallas,pallas-mosaic-1wg,pallas-mosaic-ws,pallas-triton-bwd,pallas-mosaic-ws-bwd,cudnn,xla}" --iters 5 \
    --window ${ATTN_WINDOW:-32 128} --out "$out/attention.json" 2>&1 | tee "$out/attention.log"
  status=$(( status ? status : ${PIPESTATUS[0]} ))
else
  note "4. benchmarks/attention.py skipped (ATTN_S=0)"
fi

if [ "$T_LONG" -gt 0 ]; then
  note "5. benchmarks/gpu.py --long (budget ${LONG_BUDGET}s, timeout ${T_LONG}s)"
  # the allocator may grow to 92% of the card (JAX's default cap is 75%): weights + a 32k KV cache + a
  # 32k-token prefill's temporaries; gpu.py checks the cache fits before compiling
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92} timeout -k 15 "$T_LONG" \
    python3 benchmarks/gpu.py --long --budget "$LONG_BUDGET" --out "$out/gpu.json" ${LONG_ARGS:-} 2>&1 \
    | tee "$out/gpu_long.log"
  status=$(( status ? status : ${PIPESTATUS[0]} ))
else
  note "5. benchmarks/gpu.py --long skipped (LONG_S=0)"
fi

if [ "${SESSION_TAR:-0}" = 1 ]; then
  (cd "$out" && ls ./*.log >/dev/null 2>&1 && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
fi
note "done, exit status $status"
exit "$status"
