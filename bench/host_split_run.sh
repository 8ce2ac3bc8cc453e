#!/usr/bin/env bash
# One device call (~8 min, one GPU; issue 3): the GPU tests, test_oom_auto alone with its figures
# printed, then where W2's host time goes: cProfile over the narrow model (host dispatch alone) capped
# at 24 GiB (host_embeddings, activation_offload=5) and uncapped, the narrow steps' wall time of both,
# then one W2 bench run under the cap.  Usage: HIVETUNE_COMMIT=<commit> [SKIP_TESTS=1] bash bench/host_split_run.sh
set -u
source bench/device_prelude.sh
timeout 150 python3 -m pytest tests/gpu/test_oom_auto.py -s -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" \
  > $OUT/oom-auto.log 2>&1
grep -E "a step adds|passed|failed|error" $OUT/oom-auto.log | tail -5
A="--set host_embeddings=true --set activation_offload=5"
timeout 100 python3 bench/profile_step.py W2 --narrow --cprofile --steps 10 --cap 24 $A > $OUT/cprofile-narrow-capped.txt 2>&1
timeout 100 python3 bench/profile_step.py W2 --narrow --cprofile --steps 10 > $OUT/cprofile-narrow-uncapped.txt 2>&1
head -3 $OUT/cprofile-narrow-*.txt
for i in 1 2; do
  timeout 90 python3 bench/profile_step.py W2 --narrow --no-profile --steps 30 --cap 24 $A 2>&1 | grep steps
  timeout 90 python3 bench/profile_step.py W2 --narrow --no-profile --steps 30 2>&1 | grep steps
done
timeout 170 python3 -m hivetune bench W2 --out $OUT/results --memory-cap 24 $A 2>&1 | grep -E "^W|rror"
