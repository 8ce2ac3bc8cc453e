#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10): W2 on one GPU and DDP on two, warm, each pass optionally
# with a DDP variant (EXTRA), then a DDP fit with each rank's kernels and idle gaps profiled
# (bench/multi_gpu.py, HIVETUNE_MULTI_PROFILE).
# Usage (device tool):
#   HIVETUNE_COMMIT=<commit> [TESTS=1] [EXTRA="VAR=value ...[;VAR=value ...]"] [PROFILE=0] \
#     [PROFILE_ENV="VAR=value ..."] [RUN_TIMEOUT=170] [TESTS_TIMEOUT=240] bash bench/ddp_ab_run.sh
# (variants apart by ";"; config overrides through HIVETUNE_MULTI_SET=key=value; PROFILE=0 skips the
# profiled fit; TESTS=1 runs tests/gpu/test_multi_gpu.py first, into $OUT/gpu-tests.log)
source bench/ddp_common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
[ -z "${TESTS:-}" ] || gpu_tests tests/gpu/test_multi_gpu.py
run "ddp, warm-up pass" "${DDP[@]}"
run "single, warm-up pass" python3 bench/multi_gpu.py single W2
for pass in ${PASSES:-1 2}; do
  run "single $pass" python3 bench/multi_gpu.py single W2
  run "ddp $pass" "${DDP[@]}"
  IFS=';' read -ra variants <<< "${EXTRA:-}"
  for v in "${variants[@]}"; do
    if [ -n "$v" ]; then (export $v; run "ddp $pass, $v" "${DDP[@]}"); fi
  done
done
if [ "${PROFILE:-1}" != 0 ]; then
  ([ -z "${PROFILE_ENV:-}" ] || export ${PROFILE_ENV}; HIVETUNE_MULTI_PROFILE=$OUT run "ddp, kernels profiled ${PROFILE_ENV:-}" "${DDP[@]}")
  head -1 "$OUT"/kernels-*.txt | tee -a "$S"
fi
echo "== done ($(date +%T))" | tee -a "$S"
