#!/usr/bin/env bash
# One device call (~5 min): GPU tests, then where W1's time goes: cProfile over a fresh
# process's first steps (lazy inits, graph capture), the kernel mix of an eager step, and
# the GPU time of each graph replay. Usage (device tool):
#   HIVETUNE_COMMIT=<commit> bash bench/first_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 bench/profile_step.py W1 --first --steps 3 > $OUT/w1-first.txt 2>&1; head -3 $OUT/w1-first.txt
timeout 90 python3 bench/profile_step.py W1 --steps 20 --set cuda_graphs=false > $OUT/w1-kernels.txt 2>&1; grep -A3 "GPU kernels per step" $OUT/w1-kernels.txt
timeout 90 python3 bench/profile_step.py W1 --steps 100 --no-profile > $OUT/w1-replay.txt 2>&1; tail -2 $OUT/w1-replay.txt
timeout 90 python3 bench/profile_step.py W1 --narrow --steps 100 --no-profile > $OUT/w1-narrow.txt 2>&1; tail -2 $OUT/w1-narrow.txt
