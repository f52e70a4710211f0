#!/usr/bin/env bash
# Everything a GPU session owes issue 4, in one command (run from the repo root on the GPU machine):
#   1. the compiled-kernel tests (`pytest -m gpu`: Triton and, on Hopper, Mosaic GPU vs the reference),
#   2. benchmarks/attention.py with --backward (full sizes: S = 1k..32k, head_dim 128, bf16).
# Logs and JSON go to $OUT (the device tool's folder) or benchmarks/out. Steps run on after a failure;
# the exit status is the first failing step's.
set -uo pipefail
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/device.txt"
python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
status=$(( status ? status : ${PIPESTATUS[0]} ))
python3 benchmarks/attention.py --backward --out "$out/attention.json" 2>&1 | tee "$out/attention.log"
status=$(( status ? status : ${PIPESTATUS[0]} ))
exit "$status"
