#!/usr/bin/env bash
# One device call (~8 min, one GPU; issue 3): test_oom_auto after each of the GPU test files that made its
# calibration error in the suite (one process each, errors shown); W2's host dispatch at this tree
# (narrow model, eager: cProfile, and plain timing) uncapped and capped (host_embeddings,
# activation_offload=5); then W2 step by step (bench/step_probe.py), uncapped defaults against
# capped offload 5, alternating, ROUNDS rounds (default 2), after an untimed warm-up run.
# Usage: HIVETUNE_COMMIT=<commit> bash bench/offload_cost_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
G=tests/gpu
if [ -z "${SKIP_BISECT:-}" ]; then
  for f in test_fallbacks test_fused_layers test_graphs test_host_embedding; do
    echo "== $f"
    timeout 100 python3 -m pytest $G/$f.py $G/test_oom_auto.py -s -q -p no:cacheprovider --tb=line \
      -o addopts="-W ignore::FutureWarning" 2>&1 | grep -E "examples: reserved|a step adds|passed|failed|Error|error" | tail -6
  done
fi
A="--set host_embeddings=true --set activation_offload=5"
N="--narrow --set cuda_graphs=false"
timeout 100 python3 bench/profile_step.py W2 $N --cprofile --steps 10 --cap 24 $A > $OUT/cprofile-narrow-eager-capped.txt 2>&1
head -4 $OUT/cprofile-narrow-eager-capped.txt | tail -2
for i in 1 2; do
  timeout 90 python3 bench/profile_step.py W2 $N --no-profile --steps 30 --cap 24 $A 2>&1 | grep -o "^.*steps in [^,]*"
  timeout 90 python3 bench/profile_step.py W2 $N --no-profile --steps 30 2>&1 | grep -o "^.*steps in [^,]*"
done
timeout 170 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 $A --memory-cap 24 2>&1 | grep -E "^W|rror"
for round in ${ROUNDS:-1 2}; do
  echo "== round $round: defaults, uncapped"
  timeout 170 python3 bench/step_probe.py W2 --json $OUT/steps-uncapped-$round.json 2>&1 | grep -vE "^hivetune:|arn"
  echo "== round $round: capped, offload 5"
  timeout 170 python3 bench/step_probe.py W2 --cap 24 $A --json $OUT/steps-capped-$round.json 2>&1 | grep -vE "^hivetune:|arn"
done
