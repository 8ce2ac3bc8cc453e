#!/usr/bin/env bash
# One device call for a speed iteration (~4 min): GPU tests, W1 and W2 (no baseline), the W1
# kernel mix with graphs off, and where W2's steps synchronise with the host.
# Usage (device tool): HIVETUNE_COMMIT=<commit> bash bench/iterate_run.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$S"
echo "== GPU tests ($(date +%T))" >> "$S"
timeout 200 python3 -m pytest tests/gpu tests/ops/test_elementwise.py -p no:cacheprovider -q -o addopts="-W ignore::FutureWarning" > "$OUT/gpu-tests.log" 2>&1
tail -25 "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" >> "$S"
echo "== W1 ($(date +%T))" >> "$S"
timeout 90 python3 -m hivetune bench W1 --out "$OUT/results" 2>&1 | grep -vE "Warning|warn" | tail -2 >> "$S"
echo "== W2 ($(date +%T))" >> "$S"
timeout 150 python3 -m hivetune bench W2 --out "$OUT/results" 2>&1 | grep -vE "Warning|warn" | tail -2 >> "$S"
echo "== W1 kernels, graphs off ($(date +%T))" >> "$S"
timeout 90 python3 bench/profile_step.py W1 --steps 15 --set cuda_graphs=false 2>&1 | grep -A32 "GPU kernels per step" >> "$S"
echo "== W1 graphed step timing ($(date +%T))" >> "$S"
timeout 60 python3 bench/profile_step.py W1 --steps 103 --no-profile 2>&1 | tail -2 >> "$S"
echo "== W2 host synchronisations ($(date +%T))" >> "$S"
timeout 100 python3 bench/profile_step.py W2 --steps 6 --sync-debug 2>&1 | grep -A16 "synchronising calls" >> "$S"
echo "== done ($(date +%T))" >> "$S"
