#!/usr/bin/env bash
# One device call (~8 min, one H100; issue 3): the GPU tests of the changed parts (cuBLASLt plans and
# their buckets, the offload, the fused layers); W2 under the 24 GiB cap (host_embeddings, activation_offload=5)
# warmed up, a cProfile of a fresh process's first steps, then step by step (bench/step_probe.py): the
# defaults, one heuristic query per shape (HIVETUNE_REFERENCE=lt_buckets), the scaled offload's budget
# at 95% (HIVETUNE_OFFLOAD_BUDGET=0.95, an experiment removed after this call, whose run stopped on a
# bug of its own), the defaults again; then one bench run into $OUT/results.
# Usage: HIVETUNE_COMMIT=<commit> bash bench/h100_capped_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
G=tests/gpu
timeout 150 python3 -m pytest $G/test_cuda_blas.py $G/test_cuda_offload.py $G/test_auto_offload.py \
  $G/test_fused_layers.py -q -rfE --tb=short -p no:cacheprovider -o addopts="-W ignore::FutureWarning" > $OUT/gpu-tests-part.log 2>&1
tail -2 $OUT/gpu-tests-part.log; grep -E "^FAILED|^E " $OUT/gpu-tests-part.log | head -10
A="--set host_embeddings=true --set activation_offload=5"
timeout 170 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 $A --memory-cap 24 2>&1 | grep -E "^W|rror"
timeout 120 python3 bench/profile_step.py W2 --first --steps 2 --cap 24 $A > $OUT/cprofile-w2-first-capped.txt 2>&1
head -3 $OUT/cprofile-w2-first-capped.txt | tail -1
probe() {  # name, env...
  local name=$1; shift
  echo "== $name"
  env "$@" timeout 170 python3 bench/step_probe.py W2 --cap 24 $A --json $OUT/steps-$name.json 2>&1 \
    | grep -vE "^hivetune:|arn" | cut -c1-400
}
probe defaults-1 X=1
probe lt-per-shape HIVETUNE_REFERENCE=lt_buckets
probe budget95 HIVETUNE_OFFLOAD_BUDGET=0.95
probe defaults-2 X=1
timeout 170 python3 -m hivetune bench W2 --out $OUT/results $A --memory-cap 24 2>&1 | grep -E "^W|rror"
