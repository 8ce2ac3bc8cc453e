#!/usr/bin/env bash
# One device call (~4 min): W2's GPU kernel mix (eager, 16 x 1) and W2 with $N offloaded layers
# under a 24 GiB cap. Usage: HIVETUNE_COMMIT=<commit> N=12 bash bench/w2_kernels_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
timeout 150 python3 bench/profile_step.py W2 --steps 8 > $OUT/w2-kernels.txt 2>&1; grep -A45 "GPU kernels per step" $OUT/w2-kernels.txt
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set activation_offload=$N --memory-cap 24 2>&1 | grep -E "^W2|offload|rror"
