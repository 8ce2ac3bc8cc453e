#!/usr/bin/env bash
# One device call (~6 min): the GPU tests, then W2 (16 x 1) and W1 with the fast path named by
# AB off (HIVETUNE_REFERENCE=$AB) and on, alternating, on one machine with a warm kernel cache.
# Usage: HIVETUNE_COMMIT=<commit> AB=autocast bash bench/ab_host_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 2>&1 | grep -E "^W2"
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
for ref in "$AB" "" "$AB" ""; do
  echo "HIVETUNE_REFERENCE=$ref"
  HIVETUNE_REFERENCE=$ref timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
done
for ref in "$AB" ""; do
  echo "HIVETUNE_REFERENCE=$ref"
  HIVETUNE_REFERENCE=$ref timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
done
