#!/usr/bin/env bash
# One device call (~7 min, one GPU): which GPU test file, run before tests/gpu/test_oom_auto.py, shrinks
# its calibration (each group in its own process, the calibration's figures printed); then W2 under
# the 24 GiB cap, step by step (bench/step_probe.py: GPU time and allocator retries per step), with
# OFFLOADS layers offloaded (default "5 6 7").  Usage: HIVETUNE_COMMIT=<commit> bash bench/retry_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
G=tests/gpu
if [ -z "${SKIP_BISECT:-}" ]; then
  for group in "$G/test_auto_offload.py" "$G/test_cuda_fast_optimizer.py $G/test_cuda_lora_group.py $G/test_cuda_offload.py" \
      "$G/test_cuda_resume.py $G/test_cuda_train.py" \
      "$G/test_fallbacks.py $G/test_fused_layers.py $G/test_graphs.py $G/test_host_embedding.py"; do
    echo "== $group"
    timeout 150 python3 -m pytest $group $G/test_oom_auto.py -s -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" \
      2>&1 | grep -E "examples: reserved|a step adds|passed|failed" | tail -4
  done
fi
for n in ${OFFLOADS:-5 6 7}; do
  echo "== activation_offload=$n"
  timeout 170 python3 bench/step_probe.py W2 --cap 24 --set host_embeddings=true --set activation_offload=$n \
    --json $OUT/steps-offload$n.json 2>&1 | grep -vE "^hivetune:|Warning|warn"
done
