#!/usr/bin/env bash
# One device call: bench/warm_run.sh (GPU tests, warm-up, W1, W2 16 x 1, W2 2 x 8), then W2 2 x 8
# with 512-token graph buckets (fewer captures, more padding) and W2 2 x 8 eager (graphs off).
#   HIVETUNE_COMMIT=<commit, typed here: the device has no .git of its own> bash bench/session_run.sh
set -u
bash bench/warm_run.sh
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p $OUT/results-extra
HIVETUNE_GRAPH_BUCKET=512 timeout 120 python3 -m hivetune bench W2 --out $OUT/results-extra --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
HIVETUNE_GRAPH_MAX_TFLOP=1 timeout 120 python3 -m hivetune bench W2 --out $OUT/results-extra --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
