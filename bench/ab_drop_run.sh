#!/usr/bin/env bash
# One device call: the dropout-in-matmul kernels' GPU time against dropout + cuBLAS, their GPU
# tests, then bench/ab_run.sh's A/B unless the kernels lose in sum (QUICK=1: stop after the tests).
#   HIVETUNE_COMMIT=<commit> bash bench/ab_drop_run.sh
set -u
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p $OUT/results
timeout 120 python3 bench/drop_matmul_speed.py --out $OUT/results/drop-matmul-speed-$HIVETUNE_COMMIT.json
timeout 120 python3 -m pytest tests/ops/test_elementwise.py tests/gpu/test_cuda_lora_group.py -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" 2>&1 | tail -3
[ "${QUICK:-0}" = 1 ] && exit 0
python3 -c "import json, sys; rows = json.load(open(sys.argv[1]))['rows']; sys.exit(sum(r['new_us'] for r in rows) >= sum(r['old_us'] for r in rows))" $OUT/results/drop-matmul-speed-$HIVETUNE_COMMIT.json || { echo "the kernels lose: no A/B"; exit 0; }
AB=dropout_matmul bash bench/ab_run.sh
