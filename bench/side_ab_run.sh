#!/usr/bin/env bash
# One device call (~8 min) on one GPU (issue 3): the GPU tests at this tree, then W1 under the
# 4 GiB cap with the defaults and with VARIANT (default HIVETUNE_LORA_SIDE_STREAM=0: the LoRA
# weight gradients on the one stream), alternating, twice each after an untimed warm-up; then
# bench/wide_memory_run.sh (where the wide layout's extra reserved memory goes).
# VARIANT_ARGS: bench arguments of the variant's runs (e.g. "--set wide_lora=true").
# Usage (device tool):
#   HIVETUNE_COMMIT=<commit> [SKIP_TESTS=1] [VARIANT="VAR=value ..."] [VARIANT_ARGS=...] bash bench/side_ab_run.sh
set -u
source bench/device_prelude.sh
VARIANT=${VARIANT:-HIVETUNE_LORA_SIDE_STREAM=0}
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 --memory-cap 4 2>&1 | grep -E "^W|rror"
for round in 1 2; do
  echo "== round $round ($(date +%T))"
  timeout 90 python3 -m hivetune bench W1 --out $OUT/results --memory-cap 4 2>&1 | grep -E "^W|rror"
  echo "-- $VARIANT ${VARIANT_ARGS:-}"
  (export $VARIANT; timeout 90 python3 -m hivetune bench W1 --out $OUT/variant --memory-cap 4 ${VARIANT_ARGS:-} 2>&1 \
    | grep -E "^W|rror")
done
SKIP_TESTS=1 CAPS=4 bash bench/wide_memory_run.sh  # 3 files: with the 4 W1 files and the test log, 8 (the most)
