#!/usr/bin/env bash
# One device call: GPU tests, dropout kernel timing, W1 / W2 figures (warm cache), W2 kernel mix.
set -u
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/results
timeout 200 python3 -m pytest tests/gpu tests/ops/test_elementwise.py -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log; grep -E "^FAILED|Error" $OUT/gpu-tests.log | head
timeout 60 python3 bench/dropout_speed.py
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
timeout 150 python3 bench/profile_step.py W2 --steps 6 > $OUT/profile-w2.txt 2>&1; grep -A12 "GPU kernels per step" $OUT/profile-w2.txt
