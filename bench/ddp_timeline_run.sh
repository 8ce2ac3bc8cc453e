#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10): where a DDP step's time goes. The GPUs' link (nvidia-smi
# topo), the gradient all-reduce alone (bench/multi_gpu.py allreduce: W2's 80.7M fp32 values,
# median of 20 after a barrier each), then W2 under DDP with each rank's step timeline
# (HIVETUNE_MULTI_TIMELINE: per step the micro-batches' GPU time, the all-reduce's with its wait
# for the other rank, the rest up to the next step, and the host's lead), optionally per variant
# (EXTRA, apart by ";"), optionally one DDP fit profiled (PROFILE_ENV: its variables, "X=1" for the
# defaults; kernels-rank<r>.txt: kernels, idle gaps, the host's CUDA calls), and W2 on one GPU.
# Usage (device tool): HIVETUNE_COMMIT=<commit> [EXTRA="VAR=value ...[;...]"] [PROFILE_ENV="VAR=value ..."]
#   bash bench/ddp_timeline_run.sh
# Files: summary.txt (the runs and each rank's timeline summary), runs.jsonl, allreduce.jsonl,
# topo.txt, timelines.tar.gz (every rank's per-step marks), kernels-rank<r>.txt (PROFILE_ENV).
source bench/ddp_common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
run "ddp, warm-up pass" "${DDP[@]}"
timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multi_gpu.py allreduce 2>/dev/null \
  | grep "^{" | tee "$OUT/allreduce.jsonl" | tee -a "$S"
timeline() {  # label, then the variant's VAR=value words (none: the defaults)
  local label=$1; shift
  mkdir -p "$OUT/timelines/$label"
  (for v in "$@"; do export "$v"; done
   HIVETUNE_MULTI_TIMELINE="$OUT/timelines/$label" run "ddp, timeline, $label" "${DDP[@]}")
  for f in "$OUT/timelines/$label"/timeline-rank*.json; do
    python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['summary'])" "$f" | tee -a "$S"
  done
}
timeline defaults
IFS=';' read -ra variants <<< "${EXTRA:-}"
for v in "${variants[@]}"; do
  [ -n "$v" ] && timeline "$(echo "$v" | tr ' =/' '_-_')" $v
done
if [ -n "${PROFILE_ENV:-}" ]; then  # one DDP fit with each rank's kernels and host CUDA calls profiled
  (export ${PROFILE_ENV}; HIVETUNE_MULTI_PROFILE=$OUT run "ddp, profiled, ${PROFILE_ENV}" "${DDP[@]}")
fi
run "single" python3 bench/multi_gpu.py single W2
tar -czf "$OUT/timelines.tar.gz" -C "$OUT" timelines && rm -rf "$OUT/timelines"
echo "== done ($(date +%T))" | tee -a "$S"
