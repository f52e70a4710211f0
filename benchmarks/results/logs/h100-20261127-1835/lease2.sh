#!/usr/bin/env bash
# call 2: 32k AR end to end, int8 KV (one-row kernel) against bf16 in one lease; one-row tier cases; int8 splits
set -u
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/logs; mkdir -p $L; T0=$(date +%s)
cp benchmarks/results/gpu.json $OUT/gpu.json
timeout -k 5 100 python3 benchmarks/gpu.py --long --kv-cache int8 --long-cases ar_b1 --repeats 1 --budget 30 --no-hf --out $OUT/gpu.json > $L/long_int8.txt 2>&1; echo "rc $?" >> $L/long_int8.txt
echo "int8 $(( $(date +%s) - T0 ))s"; grep -E "ms/token|skipped|Error" $L/long_int8.txt | cut -c1-260
timeout -k 5 100 python3 benchmarks/gpu.py --long --long-cases ar_b1 --repeats 1 --budget 30 --no-hf --out $OUT/gpu.json > $L/long_bf16.txt 2>&1; echo "rc $?" >> $L/long_bf16.txt
echo "bf16 $(( $(date +%s) - T0 ))s"; grep -E "ms/token|skipped|Error" $L/long_bf16.txt | cut -c1-260
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -k 5 60 python3 -m pytest -q --tb=short -m gpu "tests/test_kernels.py::test_gpu_int8_cache_dequantized_in_the_kernel[window-1-4032-bfloat16-2]" "tests/test_kernels.py::test_gpu_int8_cache_dequantized_in_the_kernel[window-1-448-float32-2]" > $L/tier.txt 2>&1; echo "rc $?" >> $L/tier.txt
echo "tier $(( $(date +%s) - T0 ))s"; tail -3 $L/tier.txt
timeout -k 5 75 python3 benchmarks/attention.py --window-only --seq 33792 --window 1 --heads 32 --kv-heads 32 --impls pallas --kv-cache int8 --window-sweep --sweep-only "bk64 splits16,bk64 splits64" --iters 5 --out $OUT/attn_splits.json > $L/attn_splits.txt 2>&1; echo "rc $?" >> $L/attn_splits.txt
echo "splits $(( $(date +%s) - T0 ))s"; grep window $L/attn_splits.txt | cut -c1-160
