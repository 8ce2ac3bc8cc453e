#!/usr/bin/env bash
# One device call (~7 min): the GPU tests, then W1, W2 eager (16 x 1), and W2 with $N layers'
# activations offloaded, without and with a 24 GiB allocator cap.
# Usage: HIVETUNE_COMMIT=<commit> N=8 bash bench/offload_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set activation_offload=$N 2>&1 | grep -E "^W2"
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set activation_offload=$N 2>&1 | grep -E "^W2|offload|rror"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set activation_offload=$N --memory-cap 24 2>&1 | grep -E "^W2|offload|rror"
