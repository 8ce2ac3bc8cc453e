#!/usr/bin/env bash
# One device call (~6 min on an H100): the GPU tests, then W1, W2 (16 x 1) and W2 (2 x 8) with
# the fast path named by AB off (HIVETUNE_REFERENCE=$AB) and on, on the same machine, with the
# Triton cache warm, into $OUT/results (each JSON records its reference paths); ROUNDS=2 times
# the W1 / W2 pair twice, alternating (hosts drift within a call). Usage:
#   HIVETUNE_COMMIT=<commit> AB=dropout_matmul [ROUNDS=2] bash bench/ab_run.sh
set -u
source bench/device_prelude.sh
for ref in "$AB" ""; do
  export HIVETUNE_REFERENCE=$ref
  timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
  timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 2>&1 | grep -E "^W2"
done
for round in $(seq "${ROUNDS:-1}"); do
  for ref in "$AB" ""; do
    export HIVETUNE_REFERENCE=$ref
    echo "HIVETUNE_REFERENCE=$ref"
    timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
    timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
  done
done
export HIVETUNE_REFERENCE=
timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2"
timeout 90 python3 bench/profile_step.py W1 --steps 20 --set cuda_graphs=false > $OUT/w1-kernels.txt 2>&1; grep -A8 "GPU kernels per step" $OUT/w1-kernels.txt
