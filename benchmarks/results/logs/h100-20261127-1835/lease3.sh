#!/usr/bin/env bash
# call 4: the one-row kernel's new default splits end to end (32k AR, int8 KV); fp8 weights for the first time
set -u
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/logs; mkdir -p $L; T0=$(date +%s)
cp benchmarks/results/gpu.json $OUT/gpu.json
timeout -k 5 75 python3 benchmarks/gpu.py --long --kv-cache int8 --long-cases ar_b1 --repeats 1 --budget 30 --no-hf --out $OUT/gpu.json > $L/long_int8_default.txt 2>&1; echo "rc $?" >> $L/long_int8_default.txt
echo "int8 $(( $(date +%s) - T0 ))s"; grep -E "ms/token \||skipped|Error" $L/long_int8_default.txt | cut -c1-260
timeout -k 5 45 python3 benchmarks/qmatmul.py --scheme fp8 --quick --only "default (dot, k128 n128, auto splits, w4 s3)" --out $OUT/qmatmul_fp8.json > $L/qmatmul_fp8.txt 2>&1; echo "rc $?" >> $L/qmatmul_fp8.txt
echo "qmm fp8 $(( $(date +%s) - T0 ))s"; grep "^| " $L/qmatmul_fp8.txt | cut -c1-200
timeout -k 5 75 python3 benchmarks/gpu.py --quick --quantize fp8 --only ar_b1 --no-hf --cold-cases --budget 20 --out $OUT/gpu.json > $L/quick_fp8.txt 2>&1; echo "rc $?" >> $L/quick_fp8.txt
echo "fp8 $(( $(date +%s) - T0 ))s"; grep -E "ms/token \||skipped|Error|0.6x" $L/quick_fp8.txt | cut -c1-260
