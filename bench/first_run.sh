#!/usr/bin/env bash
# One device call (~5 min): GPU tests, then where W1's time goes: cProfile over a fresh
# process's first steps (lazy inits, graph capture), the kernel mix of an eager step, and
# the GPU time of each graph replay. Usage (device tool):
#   HIVETUNE_COMMIT=<commit> bash bench/first_run.sh
set -u
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 200 python3 -m pytest tests/gpu tests/ops/test_elementwise.py -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log; grep -E "^FAILED|Error" $OUT/gpu-tests.log | head
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 bench/profile_step.py W1 --first --steps 3 > $OUT/w1-first.txt 2>&1; head -3 $OUT/w1-first.txt
timeout 90 python3 bench/profile_step.py W1 --steps 20 --set cuda_graphs=false > $OUT/w1-kernels.txt 2>&1; grep -A3 "GPU kernels per step" $OUT/w1-kernels.txt
timeout 90 python3 bench/profile_step.py W1 --steps 100 --no-profile > $OUT/w1-replay.txt 2>&1; tail -2 $OUT/w1-replay.txt
timeout 90 python3 bench/profile_step.py W1 --narrow --steps 100 --no-profile > $OUT/w1-narrow.txt 2>&1; tail -2 $OUT/w1-narrow.txt
