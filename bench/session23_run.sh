#!/usr/bin/env bash
# One device call (~8 min, one GPU; issue 3): the whole GPU suite into $OUT/gpu-tests.log, then W2 under the
# 24 GiB cap (host_embeddings, activation_offload=5) warmed up, step by step (bench/step_probe.py): this
# session's defaults (the offload scaled to each micro-batch, one cuBLASLt heuristic query per token bucket)
# against both off (HIVETUNE_REFERENCE=scaled_offload,lt_buckets), alternating, two rounds; then one bench
# run into $OUT/results.  Usage: HIVETUNE_COMMIT=<commit> bash bench/session23_run.sh
set -u
source bench/device_prelude.sh
A="--set host_embeddings=true --set activation_offload=5"
timeout 170 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 $A --memory-cap 24 2>&1 | grep -E "^W|rror"
for round in 1 2; do
  for ref in "scaled_offload,lt_buckets" ""; do
    side=new; [ -n "$ref" ] && side=reference
    echo "== round $round: ${ref:-defaults}"
    HIVETUNE_REFERENCE=$ref timeout 170 python3 bench/step_probe.py W2 --cap 24 $A --json $OUT/steps-$round-$side.json \
      2>&1 | grep -vE "^hivetune: (CUDA graphs|note)|arn" | cut -c1-300
  done
done
timeout 170 python3 -m hivetune bench W2 --out $OUT/results $A --memory-cap 24 2>&1 | grep -E "^W|rror"
