#!/usr/bin/env bash
# One device call (~9 min, one GPU; issue 3): direct Triton launches (ops.launch) against Triton's own
# path (HIVETUNE_REFERENCE=triton_launch). The new GPU tests and the fused-kernel files; the narrow eager W2
# step's host time (GPU work negligible) both ways, alternating; then W2 under the 24 GiB cap
# (host_embeddings, activation_offload=5) step by step both ways, alternating, ROUNDS rounds (default 2),
# and with HIVETUNE_OFFLOAD_SHARE=0.9 (an experiment) once.  Usage: HIVETUNE_COMMIT=<commit> bash bench/launch_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
G=tests/gpu
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" --tb=short \
  $G/test_fast_launch.py $G/test_fused_layers.py tests/ops/test_elementwise.py $G/test_host_embedding.py \
  > $OUT/gpu-tests-launch.log 2>&1
tail -3 $OUT/gpu-tests-launch.log; grep -E "^FAILED|^E " $OUT/gpu-tests-launch.log | head -20
A="--set host_embeddings=true --set activation_offload=5"
N="--narrow --set cuda_graphs=false"
for i in 1 2; do
  for ref in triton_launch ""; do
    echo "narrow eager ${ref:-direct}: $(HIVETUNE_REFERENCE=$ref timeout 90 python3 bench/profile_step.py W2 $N \
      --no-profile --steps 30 2>&1 | grep -o "^.*steps in [^,]*")"
  done
done
timeout 170 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 $A --memory-cap 24 2>&1 | grep -E "^W|rror"
for round in ${ROUNDS:-1 2}; do
  for ref in triton_launch ""; do
    echo "== round $round: ${ref:-direct launches (default)}"
    HIVETUNE_REFERENCE=$ref timeout 170 python3 bench/step_probe.py W2 --cap 24 $A \
      --json $OUT/steps-$round-${ref:-direct}.json 2>&1 | grep -vE "^hivetune:|arn"
  done
done
echo "== share 0.9"
HIVETUNE_OFFLOAD_SHARE=0.9 timeout 170 python3 bench/step_probe.py W2 --cap 24 $A --json $OUT/steps-share0.9.json \
  2>&1 | grep -vE "^hivetune:|arn"
