#!/usr/bin/env bash
# One device call: W1, W2 16 x 1 and W2 2 x 8 (warm Triton cache), then a W2 step profile.
set -u
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/results
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
timeout 150 python3 bench/profile_step.py W2 --steps 6 > $OUT/profile-w2.txt 2>&1; head -60 $OUT/profile-w2.txt
