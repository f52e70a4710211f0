#!/usr/bin/env bash
# call 1: window kernel sweeps (int8 KV, MHA and GQA) and the quantized matmul [K,N] vs [N,K]
set -u
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/logs; mkdir -p $L
T0=$(date +%s)
{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi; python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"; } > $L/device.txt 2>&1
echo "device $(( $(date +%s) - T0 ))s"
timeout -k 5 150 python3 benchmarks/attention.py --window-only --seq 33792 --window 1 --heads 32 --kv-heads 32 --impls pallas --kv-cache int8 --window-sweep --sweep-only "dot,prefetch,prefetch w8,bk64 splits32" --iters 5 --out $OUT/attn_mha.json > $L/attn_mha.txt 2>&1; echo "rc $?" >> $L/attn_mha.txt
echo "mha $(( $(date +%s) - T0 ))s"; grep window $L/attn_mha.txt | cut -c1-160
timeout -k 5 100 python3 benchmarks/attention.py --window-only --seq 33792 --window 1 --heads 32 --kv-heads 8 --impls pallas --kv-cache int8 --window-sweep --sweep-only "heads,heads prefetch" --iters 5 --out $OUT/attn_gqa.json > $L/attn_gqa.txt 2>&1; echo "rc $?" >> $L/attn_gqa.txt
echo "gqa $(( $(date +%s) - T0 ))s"; grep window $L/attn_gqa.txt | cut -c1-160
timeout -k 5 110 python3 benchmarks/qmatmul.py --quick --only "default (dot, k128 n128, auto splits, w4 s3)" "[N, K] storage" "[N, K] k64" "accumulate k32" "reduce k128 n128" --out $OUT/qmatmul.json > $L/qmatmul.txt 2>&1; echo "rc $?" >> $L/qmatmul.txt
echo "qmm $(( $(date +%s) - T0 ))s"; tail -40 $L/qmatmul.txt | cut -c1-200
