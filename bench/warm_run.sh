#!/usr/bin/env bash
# One device call (~5 min on an H100): the GPU tests, then short W1 / W2 runs that warm
# Triton's kernel cache, then W1, W2 (16 x 1) and W2 (2 graphed micro-batches of 8) into
# $OUT/results with the cache warm (the JSON records it). Usage (device tool):
#   HIVETUNE_COMMIT=<commit, typed here: the device has no .git of its own> bash bench/warm_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 2>&1 | grep -E "^W2"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
# the host's dispatch time for W2's kernels (tiny widths: wall = host), eager
timeout 90 python3 bench/profile_step.py W2 --narrow --no-profile --steps 23 --set cuda_graphs=false 2>&1 | tail -1
