#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10): W2 on one GPU and DDP on two, warm, each pass optionally
# with a DDP variant (EXTRA), then a DDP fit with each rank's kernels and idle gaps profiled
# (bench/multi_gpu.py, HIVETUNE_MULTI_PROFILE).
# Usage (device tool): HIVETUNE_COMMIT=<commit> [EXTRA="VAR=value ..."] [PROFILE=0] bash bench/ddp_ab_run.sh
# (config overrides go through EXTRA="HIVETUNE_MULTI_SET=key=value"; PROFILE=0 skips the profiled fit)
source bench/ddp_common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
run "ddp, warm-up pass" "${DDP[@]}"
run "single, warm-up pass" python3 bench/multi_gpu.py single W2
for pass in ${PASSES:-1 2}; do
  run "single $pass" python3 bench/multi_gpu.py single W2
  run "ddp $pass" "${DDP[@]}"
  if [ -n "${EXTRA:-}" ]; then (export $EXTRA; run "ddp $pass, $EXTRA" "${DDP[@]}"); fi
done
if [ "${PROFILE:-1}" != 0 ]; then
  HIVETUNE_MULTI_PROFILE=$OUT run "ddp, kernels profiled" "${DDP[@]}"
  head -1 "$OUT"/kernels-*.txt | tee -a "$S"
fi
echo "== done ($(date +%T))" | tee -a "$S"
