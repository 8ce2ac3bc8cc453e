#!/usr/bin/env bash
# One device call for issue 4 (~9.5 minutes): the planner's accuracy grid (time-boxed), the real
# CUDA out-of-memory test, and `hivetune tune` timed on the W1 shape. Results into $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$S"
echo "== plan grid ($(date +%T))" >> "$S"
timeout 400 python3 bench/plan_grid.py --out "$OUT/results" --budget ${GRID_BUDGET:-340} > "$OUT/plan-grid.log" 2>&1
tail -4 "$OUT/plan-grid.log" >> "$S"
echo "== OOM test ($(date +%T))" >> "$S"
timeout 90 python3 -m pytest tests/gpu/test_oom_auto.py -s -p no:cacheprovider -q -o addopts="-W ignore::FutureWarning" > "$OUT/oom-test.log" 2>&1
tail -3 "$OUT/oom-test.log" >> "$S"
echo "== tune W1 ($(date +%T))" >> "$S"
timeout 150 python3 bench/tune_w1.py --out "$OUT/results" > "$OUT/tune-w1.log" 2>&1
tail -25 "$OUT/tune-w1.log" >> "$S"
echo "== done ($(date +%T))" >> "$S"
