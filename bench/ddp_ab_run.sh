#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10): W2 on one GPU and DDP on two, warm, then DDP with the
# graphs captured in turn (HIVETUNE_GRAPH_CAPTURE_EVERY), then a DDP fit with each rank's kernels
# and idle gaps profiled (bench/multi_gpu.py, HIVETUNE_MULTI_PROFILE).
# Usage (device tool): HIVETUNE_COMMIT=<commit> [EXTRA="VAR=value ..."] bash bench/ddp_ab_run.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
run() {  # name, then the command
  local name=$1; shift
  echo "== $name ($(date +%T))" | tee -a "$S"
  timeout 170 "$@" 2>&1 | grep "^{" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['mode'], r['seconds'], 's', r['tokens_per_s'], 'tokens/s', json.dumps(r['cuda_graphs']))" | tee -a "$S"
}
DDP=(python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multi_gpu.py ddp W2)
run "ddp, warm-up pass" "${DDP[@]}"
run "single, warm-up pass" python3 bench/multi_gpu.py single W2
for pass in ${PASSES:-1 2}; do
  run "single $pass" python3 bench/multi_gpu.py single W2
  run "ddp $pass" "${DDP[@]}"
  HIVETUNE_GRAPH_CAPTURE_EVERY=1 run "ddp $pass, captures in turn" "${DDP[@]}"
  if [ -n "${EXTRA:-}" ]; then (export $EXTRA; run "ddp $pass, $EXTRA" "${DDP[@]}"); fi
done
HIVETUNE_MULTI_PROFILE=$OUT run "ddp, kernels profiled" "${DDP[@]}"
head -1 "$OUT"/kernels-*.txt | tee -a "$S"
echo "== done ($(date +%T))" | tee -a "$S"
