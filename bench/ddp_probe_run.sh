#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10): where a DDP rank's W2 time goes. The interconnect, a warm
# pass of both runs, each rank's kernels over a DDP fit and the single GPU's over its fit
# (bench/multi_gpu.py, HIVETUNE_MULTI_PROFILE), and cProfile over the first steps of W2 graphed as
# a rank sees it (8 examples a micro-batch).
# Usage (device tool): HIVETUNE_COMMIT=<commit> bash bench/ddp_probe_run.sh
source bench/ddp_common.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv; nvidia-smi topo -m; } | tee "$S"
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
