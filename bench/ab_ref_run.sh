#!/usr/bin/env bash
# One device call (~8 min): the GPU tests, W1's graph replay by kernel (graph_gaps), then W1 and
# W2 (16 x 1 eager, and within 24 GiB: host_embeddings + activation_offload=$N, default 4) with
# HIVETUNE_REFERENCE=$REF (default norm_dropout) and without, alternating, $ROUNDS rounds
# (default 2; W2 in the first $W2_ROUNDS, default 1), into $OUT/results.
# Usage: HIVETUNE_COMMIT=<commit> [REF=norm_dropout] [ROUNDS=2] [N=4] [SKIP_TESTS=1] [NO_W2=1] bash bench/ab_ref_run.sh
set -u
source bench/device_prelude.sh
REF=${REF:-norm_dropout}
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1|rror"
[ -n "${NO_W2:-}" ] || timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set host_embeddings=true --set activation_offload=${N:-4} 2>&1 | grep -E "^W2|rror"
timeout 90 python3 bench/graph_gaps.py W1 --steps 12 --top 40 --out $OUT/results 2>&1 | grep -v Warn | tail -42
for round in $(seq ${ROUNDS:-2}); do
  for ref in $REF ""; do
    echo "HIVETUNE_REFERENCE=$ref"
    HIVETUNE_REFERENCE=$ref timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1|rror"
    [ -n "${NO_W2:-}" ] || [ "$round" -gt "${W2_ROUNDS:-1}" ] || {
      HIVETUNE_REFERENCE=$ref timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2|rror"
      HIVETUNE_REFERENCE=$ref timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set host_embeddings=true --set activation_offload=${N:-4} 2>&1 | grep -E "^W2|rror"; }
  done
done
