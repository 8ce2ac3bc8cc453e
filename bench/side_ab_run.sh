#!/usr/bin/env bash
# One device call (~8 min) on one GPU (issue 3): the GPU tests at this tree, then WORKLOAD
# (default W1) under CAP GiB (default 4; 0: none) with the defaults and with VARIANT (default
# HIVETUNE_LORA_SIDE_STREAM=0: the LoRA weight gradients on the one stream), alternating, ROUNDS
# rounds (default 2) after an untimed warm-up of each (the variant may compile kernels of its
# own); then, where FINAL_ARGS is set, one run of the defaults with those bench arguments (of
# FINAL_WORKLOAD, default WORKLOAD); then bench/wide_memory_run.sh (where the wide layout's extra
# reserved memory goes; MEMORY=0: not run).
# VARIANT_ARGS: bench arguments of the variant's runs (e.g. "--set wide_lora=true").
# Usage (device tool):
#   HIVETUNE_COMMIT=<commit> [SKIP_TESTS=1] [MEMORY=0] [WORKLOAD=W2] [CAP=0] [VARIANT="VAR=value ..."] \
#     [VARIANT_ARGS=...] [ROUNDS="1 2 3"] [FINAL_WORKLOAD=W2] [FINAL_ARGS="--memory-cap 24 --set ..."] \
#     bash bench/side_ab_run.sh
# (graph_instantiate's A/B, once bench/instantiate_run.sh: VARIANT=HIVETUNE_REFERENCE=graph_instantiate)
set -u
source bench/device_prelude.sh
VARIANT=${VARIANT:-HIVETUNE_LORA_SIDE_STREAM=0}
WORKLOAD=${WORKLOAD:-W1}
run() {  # out folder, then extra bench arguments
  local out=$1; shift
  timeout 170 python3 -m hivetune bench $WORKLOAD --out "$out" --memory-cap ${CAP:-4} "$@" 2>&1 | grep -E "^W|rror"
}
run /tmp/warm --max-steps 30
(export $VARIANT; run /tmp/warm --max-steps 30 ${VARIANT_ARGS:-})
for round in ${ROUNDS:-1 2}; do
  echo "== round $round ($(date +%T))"
  run $OUT/results
  echo "-- $VARIANT ${VARIANT_ARGS:-}"
  (export $VARIANT; run $OUT/variant ${VARIANT_ARGS:-})
done
if [ -n "${FINAL_ARGS:-}" ]; then
  echo "== $FINAL_ARGS"
  timeout 170 python3 -m hivetune bench ${FINAL_WORKLOAD:-$WORKLOAD} --out $OUT/final $FINAL_ARGS 2>&1 \
    | grep -E "^W|rror"
fi
[ "${MEMORY:-1}" = 0 ] || SKIP_TESTS=1 CAPS=4 bash bench/wide_memory_run.sh  # 2 files (+ 4 W1 files, test log)
