#!/usr/bin/env bash
# One device call: W2 kernel mix, W2 (30 steps) with the joined LoRA path, the layer-by-layer
# reference, and one micro-batch of 16; W1 in full; the GPU tests of the changed code.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$S"
timeout 120 python3 -m pytest tests/gpu/test_cuda_lora_group.py tests/gpu/test_cuda_train.py -p no:cacheprovider -q 2>&1 | tail -4 >> "$S"
echo "== W2 kernels ($(date +%T))" >> "$S"
timeout 120 python3 bench/profile_step.py W2 --steps 7 2>&1 | grep -A30 "GPU kernels per step" >> "$S"
for variant in "joined" "reference" "micro16"; do
  echo "== W2 30 steps, $variant ($(date +%T))" >> "$S"
  case $variant in
    joined) timeout 100 python3 -m hivetune bench W2 --out "$OUT/results" --max-steps 30 2>&1 | tail -1 >> "$S" ;;
    reference) HIVETUNE_REFERENCE=fused_lora timeout 100 python3 -m hivetune bench W2 --out "$OUT/results" --max-steps 30 2>&1 | tail -1 >> "$S" ;;
    micro16) timeout 100 python3 -m hivetune bench W2 --out "$OUT/results" --max-steps 30 --set batch_size=16 --set grad_accum=1 2>&1 | tail -1 >> "$S" ;;
  esac
done
echo "== W1 ($(date +%T))" >> "$S"
timeout 90 python3 -m hivetune bench W1 --out "$OUT/results" 2>&1 | tail -1 >> "$S"
echo "== done ($(date +%T))" >> "$S"
