#!/usr/bin/env bash
# One device call: where a W1 / W2 step spends its GPU time (kernel mix with graphs off, graph
# replay timing with graphs on) and a bf16 + gradient-checkpointing sanity run.
# Usage (device tool): HIVETUNE_COMMIT=<commit, typed here: the device has no .git of its own> bash bench/probe_run.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S="$OUT/probe.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$S"
echo "== W1 kernels (graphs off, 12 steps)" | tee -a "$S"
timeout 100 python3 bench/profile_step.py W1 --steps 15 --set cuda_graphs=false 2>&1 | grep -A42 "GPU kernels per step" >> "$S"
echo "== W1 graphed timing" | tee -a "$S"
timeout 60 python3 bench/profile_step.py W1 --steps 103 --no-profile 2>&1 | tail -2 >> "$S"
echo "== W2 kernels (graphs off, 5 steps)" | tee -a "$S"
timeout 120 python3 bench/profile_step.py W2 --steps 8 2>&1 | grep -A42 "GPU kernels per step" >> "$S"
echo "== W2 graphed 2x8 timing" | tee -a "$S"
timeout 120 python3 bench/profile_step.py W2 --steps 20 --no-profile --set batch_size=8 --set grad_accum=2 --set cuda_graphs=true 2>&1 | tail -2 >> "$S"
echo "== done" >> "$S"
