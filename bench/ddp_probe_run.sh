#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10): where a DDP rank's W2 time goes. The interconnect, a warm
# pass of both runs, each rank's kernels over a DDP fit and the single GPU's over its fit
# (bench/multi_gpu.py, HIVETUNE_MULTI_PROFILE), and cProfile over the first steps of W2 graphed as
# a rank sees it (8 examples a micro-batch).
# Usage (device tool): HIVETUNE_COMMIT=<commit> bash bench/ddp_probe_run.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv; nvidia-smi topo -m; } | tee "$S"
run() {  # name, then the command
  local name=$1; shift
  echo "== $name ($(date +%T))" | tee -a "$S"
  timeout 170 "$@" 2>&1 | grep -vE "Warning|warn" | grep "^{" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['mode'], r['seconds'], 's', r['tokens_per_s'], 'tokens/s', json.dumps(r['cuda_graphs']))" | tee -a "$S"
}
DDP=(python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multi_gpu.py ddp W2)
run "ddp, warm-up pass" "${DDP[@]}"
run "single, warm-up pass" python3 bench/multi_gpu.py single W2
run "ddp" "${DDP[@]}"
run "single" python3 bench/multi_gpu.py single W2
HIVETUNE_MULTI_PROFILE=$OUT run "ddp, kernels profiled" "${DDP[@]}"
HIVETUNE_MULTI_PROFILE=$OUT/single run "single, kernels profiled" python3 bench/multi_gpu.py single W2
cp "$OUT/single/kernels-rank0.txt" "$OUT/kernels-single.txt" && rm -rf "$OUT/single"
head -1 "$OUT"/kernels-*.txt | tee -a "$S"
echo "== first steps, W2 as a rank (8 a micro-batch, graphed), cProfile ($(date +%T))" | tee -a "$S"
timeout 120 python3 bench/profile_step.py W2 --first --steps 2 --set batch_size=8 --set grad_accum=2 \
  > "$OUT/first-steps-cprofile.txt" 2>&1
echo "== done ($(date +%T))" | tee -a "$S"
