#!/usr/bin/env bash
# One device call: W2 on one GPU as 16 x 1 eager, 16 x 1 graphed (HIVETUNE_GRAPH_MAX_TFLOP lifted)
# and 2 x 8 graphed, warm Triton cache, results into $OUT/results.
#   HIVETUNE_COMMIT=<commit> bash bench/w2_graphs_run.sh
set -u
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/results
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
HIVETUNE_GRAPH_MAX_TFLOP=200 timeout 150 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
