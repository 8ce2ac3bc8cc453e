#!/usr/bin/env bash
# One device call (~7 min): the GPU tests, W1 (its capture times in the JSON), then W2 16 x 1
# three ways, twice, alternating: the default; host_embeddings=true; host_embeddings=true with
# activation_offload=$N (default 4), into $OUT/results.
# Usage: HIVETUNE_COMMIT=<commit> [N=4] [SKIP_TESTS=1] bash bench/w2_fit_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 --set host_embeddings=true --set activation_offload=${N:-4} 2>&1 | grep -E "^W2|rror"
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
for round in 1 2; do
  echo "W2 default"; timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
  echo "W2 host_embeddings"; timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set host_embeddings=true 2>&1 | grep -E "^W2|rror"
  echo "W2 host_embeddings + offload ${N:-4}"; timeout 120 python3 -m hivetune bench W2 --out $OUT/results --set host_embeddings=true --set activation_offload=${N:-4} 2>&1 | grep -E "^W2|rror"
done
