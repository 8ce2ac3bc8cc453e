#!/usr/bin/env bash
# One device call (~8 min): the GPU tests, then W1, W2 (16 x 1) as it is, W2 with the first
# $N layers' activations offloaded (activation_offload) under a 24 GiB allocator cap, the same
# with Python's default garbage collector (HIVETUNE_REFERENCE=gc), the host's time by function
# in a narrow W2 step, and W1's kernel mix. Usage: HIVETUNE_COMMIT=<commit> N=8 bash bench/offload_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set activation_offload=$N 2>&1 | grep -E "^W2"
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set activation_offload=$N --memory-cap 24 2>&1 | grep -E "^W2|offload|rror"
HIVETUNE_REFERENCE=gc timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set activation_offload=$N --memory-cap 24 2>&1 | grep -E "^W2"
timeout 90 python3 bench/profile_step.py W2 --narrow --cprofile --steps 13 --set cuda_graphs=false > $OUT/w2-narrow-host.txt 2>&1; grep -E "steps in" $OUT/w2-narrow-host.txt
timeout 90 python3 bench/profile_step.py W1 --steps 20 --set cuda_graphs=false > $OUT/w1-kernels.txt 2>&1; grep -A25 "GPU kernels per step" $OUT/w1-kernels.txt
