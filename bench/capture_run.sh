#!/usr/bin/env bash
# One device call (~5 min): where W1's graph capture time goes (cProfile over the first 3 steps),
# whether Triton reads pinned host memory (bench/uva_probe.py), and W2 16 x 1 with the gradient
# arena off and on, twice, alternating. SKIP_TESTS=1 skips the GPU tests.
# Usage: HIVETUNE_COMMIT=<commit> [SKIP_TESTS=1] bash bench/capture_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 bench/uva_probe.py 2>&1 | tail -5
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 120 python3 bench/profile_step.py W1 --first --steps 3 > $OUT/w1-first-cprofile.txt 2>&1; head -70 $OUT/w1-first-cprofile.txt | cut -c1-160
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 2>&1 | grep -E "^W2"
for round in 1 2; do
  echo "W2 REFERENCE=grad_arena"; HIVETUNE_REFERENCE=grad_arena timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
  echo "W2 default"; timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
done
