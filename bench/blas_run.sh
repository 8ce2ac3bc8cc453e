#!/usr/bin/env bash
# Device calls (one GPU; issue 3) for ops.blas (cuBLASLt plans cached) against torch's matmuls
# (HIVETUNE_REFERENCE=cublaslt). PART=1 (~6 min): the GPU tests, bench/lt_probe.py (host and GPU
# time of each product), the narrow W2 step's host dispatch each way, alternating. PART=2 (~8 min):
# W2 step by step (bench/step_probe.py) each way, uncapped and under the 24 GiB cap, alternating,
# after an untimed warm-up of each.  Usage: HIVETUNE_COMMIT=<commit> PART=1|2 bash bench/blas_run.sh
set -u
if [ "${PART:-1}" = 1 ]; then
  source bench/device_prelude.sh
  timeout 60 python3 bench/lt_probe.py --json $OUT/lt-probe.json 2>&1 | tail -10
  N="--narrow --set cuda_graphs=false --no-profile --steps 30"
  for i in 1 2; do
    echo "-- plans"; timeout 90 python3 bench/profile_step.py W2 $N 2>&1 | grep -o "^.*steps in [^,]*"
    echo "-- torch"; HIVETUNE_REFERENCE=cublaslt timeout 90 python3 bench/profile_step.py W2 $N 2>&1 \
      | grep -o "^.*steps in [^,]*"
  done
  timeout 100 python3 bench/profile_step.py W2 --narrow --set cuda_graphs=false --cprofile --steps 10 \
    > $OUT/cprofile-narrow-eager-plans.txt 2>&1
else
  SKIP_TESTS=1 source bench/device_prelude.sh
  A="--cap 24 --set host_embeddings=true --set activation_offload=5"
  timeout 170 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 2>&1 | grep -E "^W|rror"
  HIVETUNE_REFERENCE=cublaslt timeout 170 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 2>&1 \
    | grep -E "^W|rror"
  for round in ${ROUNDS:-1 2}; do
    for cap in "" "$A"; do
      echo "== round $round ${cap:-uncapped}: plans"
      timeout 170 python3 bench/step_probe.py W2 $cap --json $OUT/steps-plans-$round${cap:+-capped}.json 2>&1 \
        | grep -vE "^hivetune:|arn"
      echo "== round $round ${cap:-uncapped}: torch"
      HIVETUNE_REFERENCE=cublaslt timeout 170 python3 bench/step_probe.py W2 $cap \
        --json $OUT/steps-torch-$round${cap:+-capped}.json 2>&1 | grep -vE "^hivetune:|arn"
    done
  done
fi
