#!/usr/bin/env bash
# One device call (~7 min): the GPU tests, then W1 three ways, twice, alternating (the gradient
# arena off: HIVETUNE_REFERENCE=grad_arena; the default; lora_inputs=recompute), W2 16 x 1 with
# the arena off and on, and W1's graph replay kernel by kernel, into $OUT/results.
# Usage: HIVETUNE_COMMIT=<commit> bash bench/inputs_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 2>&1 | grep -E "^W2"
for round in 1 2; do
  echo "REFERENCE=grad_arena"; HIVETUNE_REFERENCE=grad_arena timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
  echo "default"; timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
  echo "lora_inputs=recompute"; timeout 90 python3 -m hivetune bench W1 --out $OUT/results --set lora_inputs=recompute 2>&1 | grep -E "^W1"
done
echo "W2 REFERENCE=grad_arena"; HIVETUNE_REFERENCE=grad_arena timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
echo "W2 default"; timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 90 python3 bench/graph_gaps.py W1 --steps 12 --top 40 --out $OUT/results 2>&1 | tail -42
