#!/usr/bin/env bash
# One device call: GPU tests, then the W1 and W2 workloads; everything lands in $OUT.
# Usage (device tool): bash bench/device_run.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest tests/gpu -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
timeout 200 python3 -m hivetune bench W1 --out "$OUT/results" 2>&1 | tee "$OUT/bench-w1.log" | tail -5
timeout 200 python3 -m hivetune bench W2 --out "$OUT/results" 2>&1 | tee "$OUT/bench-w2.log" | tail -5
