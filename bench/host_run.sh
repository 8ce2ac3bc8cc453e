#!/usr/bin/env bash
# One device call: the host's dispatch cost. Per-op call cost (launch_cost.py), then W2 and W1
# with tiny widths (profile_step.py --narrow: wall time = host time), eager, timed and under cProfile.
#   HIVETUNE_COMMIT=<commit, typed here> bash bench/host_run.sh
set -u
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/results
python3 bench/launch_cost.py --out $OUT/results 2>&1 | tail -14
for w in W2 W1; do
  timeout 120 python3 bench/profile_step.py $w --narrow --no-profile --steps 23 --set cuda_graphs=false 2>&1 | tail -2
  timeout 120 python3 bench/profile_step.py $w --narrow --no-profile --steps 23 2>&1 | tail -3
done
timeout 150 python3 bench/profile_step.py W2 --narrow --cprofile --steps 13 --set cuda_graphs=false > $OUT/host-profile-w2-narrow.txt 2>&1
head -75 $OUT/host-profile-w2-narrow.txt
