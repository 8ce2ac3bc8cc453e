#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10, session 33): the step order and the graph grain on W1 (one
# GPU) and on W2 (one GPU against DDP on two). W1 on GPU 0 after an untimed 40-step pass (its
# Triton kernels compiled): for each round (W1_ROUNDS, default 1), the defaults, then each
# W1_VARIANTS entry (apart by ";", each "VAR=value ..." words, HIVETUNE_SET=key=value for a
# `--set`), each a `hivetune bench W1` whose JSON lands in w1-results.tgz and whose line lands in
# w1-summary.txt; then bench/ddp_timeline_run.sh with this call's environment (SINGLE_FIRST, SINGLES,
# EXTRA, PASSES ...).
# Usage (device tool): HIVETUNE_COMMIT=<commit> [W1_VARIANTS="...;..."] [W1_ROUNDS=2] [DDP settings]
#   bash bench/order_grain_run.sh
source bench/ddp_common.sh
S=$OUT/w1-summary.txt  # ddp_timeline_run.sh starts summary.txt afresh
mkdir -p /tmp/w1-results
w1() {  # label, then VAR=value words (HIVETUNE_SET=key=value: a --set)
  local label=$1; shift
  local sets=() envs=()
  for v in "$@"; do
    case "$v" in HIVETUNE_SET=*) sets+=(--set "${v#HIVETUNE_SET=}");; *) envs+=("$v");; esac
  done
  echo "== W1, $label ($(date +%T))" | tee -a "$S"
  env "${envs[@]}" CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m hivetune bench W1 --out /tmp/w1-results "${sets[@]}" 2>&1 \
    | grep -E "^W1|rror" | tail -2 | tee -a "$S"
}
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m hivetune bench W1 --out /tmp/w1-warm --max-steps 40 2>&1 | grep -E "rror" | tail -2
IFS=';' read -ra w1_variants <<< "${W1_VARIANTS:-}"
for round in $(seq 1 "${W1_ROUNDS:-1}"); do
  w1 "defaults-$round"
  for v in "${w1_variants[@]}"; do
    [ -n "$v" ] && w1 "$v-$round" $v
  done
done
tar -czf "$OUT/w1-results.tgz" -C /tmp w1-results
bash bench/ddp_timeline_run.sh
