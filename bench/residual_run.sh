#!/usr/bin/env bash
# One device call (~8 min): the GPU tests; W1 and W2 16 x 1 with the residual add outside the
# matmul (HIVETUNE_REFERENCE=residual_epilogue) and inside (the default), twice, alternating;
# W2 with host_embeddings and activation_offload=$N (default 4) twice; cProfile of W1's first
# steps (warm-up and captures), into $OUT/results.
# Usage: HIVETUNE_COMMIT=<commit> [N=4] [SKIP_TESTS=1] bash bench/residual_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set host_embeddings=true --set activation_offload=${N:-4} 2>&1 | grep -E "^W2|rror"
for round in 1 2; do
  for ref in residual_epilogue ""; do
    echo "HIVETUNE_REFERENCE=$ref"
    HIVETUNE_REFERENCE=$ref timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
    HIVETUNE_REFERENCE=$ref timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
  done
  echo "W2 host_embeddings + offload ${N:-4}"
  timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set host_embeddings=true --set activation_offload=${N:-4} 2>&1 | grep -E "^W2|rror"
done
timeout 120 python3 bench/profile_step.py W1 --first --steps 2 > $OUT/w1-first-cprofile.txt 2>&1; head -45 $OUT/w1-first-cprofile.txt | cut -c1-150
