#!/usr/bin/env bash
# One device call (~7 min): the GPU tests, then W1's graph replay taken apart kernel by kernel
# (bench/graph_gaps.py: JSON with the kernel mix), W1, W2 eager (16 x 1) and W2 with $N layers'
# activations offloaded (default 8), into $OUT/results.
# Usage: HIVETUNE_COMMIT=<commit> [N=8] bash bench/mix_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 2>&1 | grep -E "^W2"
timeout 90 python3 bench/graph_gaps.py W1 --steps 12 --top 70 --out $OUT/results 2>&1 | tail -72
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set activation_offload=${N:-8} 2>&1 | grep -E "^W2|offload|rror"
