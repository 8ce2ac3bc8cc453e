#!/usr/bin/env bash
# One device call (~6.5 min, one GPU; issue 3): the whole GPU suite into $OUT/gpu-tests.log, then the issue's
# two figures at this commit: W1 under a 4 GiB allocator cap (after an untimed 60-step warm-up that compiles
# W1's kernels), twice, and W2 under the 24 GiB cap (host_embeddings, activation_offload=5, after a 20-step
# warm-up), once; the results into $OUT/results.  Usage: HIVETUNE_COMMIT=<commit> bash bench/verify_run.sh
set -u
source bench/device_prelude.sh
timeout 90 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 60 --memory-cap 4 2>&1 | grep -E "^W|rror"
for i in 1 2; do
  timeout 90 python3 -m hivetune bench W1 --out $OUT/results --memory-cap 4 2>&1 | grep -E "^W|rror"
done
A="--set host_embeddings=true --set activation_offload=5"
timeout 150 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 $A --memory-cap 24 2>&1 | grep -E "^W|rror"
timeout 150 python3 -m hivetune bench W2 --out $OUT/results $A --memory-cap 24 2>&1 | grep -E "^W|rror"
