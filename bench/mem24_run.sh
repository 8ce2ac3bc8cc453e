#!/usr/bin/env bash
# One device call (~5 min): the GPU tests, then W2 with 8 and 10 layers' activations offloaded
# under a 24 GiB allocator cap. Usage: HIVETUNE_COMMIT=<commit> bash bench/mem24_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set activation_offload=8 2>&1 | grep -E "^W2"
for n in 8 10; do
  timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set activation_offload=$n --memory-cap 24 2>&1 | grep -E "^W2|offload|rror"
done
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set activation_offload=8 2>&1 | grep -E "^W2|rror"
