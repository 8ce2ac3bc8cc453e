#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10): where a DDP step's time goes. The GPUs' link (nvidia-smi
# topo), their clocks, power and temperature every 0.2 s through the call and which processes hold
# a context on each GPU, the gradient all-reduce alone (bench/multi_gpu.py allreduce: W2's 80.7M
# fp32 values, median of 20 after a barrier each; ALLREDUCE=0 skips it), then W2 under DDP with
# each rank's step timeline (HIVETUNE_MULTI_TIMELINE: per step the micro-batches' GPU time, the
# all-reduce's with its wait for the other rank, the rest up to the next step, and the host's
# lead), optionally per variant (EXTRA, apart by ";"; PASSES=2 repeats defaults and variants),
# optionally one DDP fit profiled (PROFILE_ENV: its variables, "X=1" for the defaults;
# kernels-rank<r>.txt: kernels, idle gaps, the host's CUDA calls), and W2 on one GPU (after an
# untimed pass: the eager run's own Triton variants compile the first time), optionally
# per variant too (SINGLES, apart by ";", e.g. CUDA_VISIBLE_DEVICES=1). TESTS="pytest args" runs
# GPU tests first (gpu-tests.log). CAPTURE_PROFILE_ENV="VAR=value ..." (e.g. HIVETUNE_GRAPH_DEFER=1):
# one DDP fit with each deferred capture under cProfile (bench/multi_gpu.py capture_profile).
# HIVETUNE_RANK_SPEEDS=auto in a variant: the ranks' speeds from the first defaults timeline (bench/rank_speeds.py).
# SIZE_COST="args" ("-": its defaults): bench/size_cost.py on GPU 0 after the tests (size-cost.jsonl:
# a W2 graph's replay time by token count); a variant HIVETUNE_SIZE_COSTS=$OUT/size-cost.jsonl then
# plans the graph sizes on those replay times (ops.graphs.measured_size_cost) instead of tokens.
# Usage (device tool): HIVETUNE_COMMIT=<commit> [EXTRA="VAR=value ...[;...]"] [PROFILE_ENV="VAR=value ..."]
#   [PASSES=2] [SINGLES="VAR=value[;...]"] [TESTS="tests/gpu/..."] [ALLREDUCE=0] [CAPTURE_PROFILE_ENV=...]
#   [SINGLE_FIRST=1: the one-GPU runs before the DDP ones, so that a call cut short keeps them]
#   [SIZE_COST="--grain 32" or SIZE_COST=- (the defaults)] [FSDP14B=1: the 14B-shape FSDP2 run last]
#   bash bench/ddp_timeline_run.sh
# Files: summary.txt (the runs and each rank's timeline summary), runs.jsonl, allreduce.jsonl,
# timelines.tar.gz (every rank's per-step marks, gpu-clocks.csv, gpu-apps.txt, topo.txt, captures/),
# kernels-rank<r>.txt (PROFILE_ENV), gpu-tests.log (TESTS).
source bench/ddp_common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
mkdir -p "$OUT/timelines"
nvidia-smi topo -m > "$OUT/timelines/topo.txt" 2>&1
reasons=clocks_event_reasons.active
nvidia-smi --query-gpu=$reasons --format=csv,noheader > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,$reasons \
  --format=csv -lms 200 > "$OUT/timelines/gpu-clocks.csv" 2>&1 &
clocks=$!
(while sleep 5; do date +%T; nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv,noheader; done) \
  > "$OUT/timelines/gpu-apps.txt" 2>&1 &
apps=$!
[ -z "${TESTS:-}" ] || gpu_tests $TESTS
if [ -n "${SIZE_COST:-}" ]; then
  echo "== size cost ($(date +%T))" | tee -a "$S"
  [ "$SIZE_COST" = - ] && SIZE_COST=
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/size_cost.py $SIZE_COST > "$OUT/size-cost.jsonl" 2> "$OUT/size-cost.err"
  tail -n +2 "$OUT/size-cost.jsonl" | tee -a "$S"; tail -3 "$OUT/size-cost.err" | tee -a "$S"
fi
one_gpu() {
  run "single, warm-up pass" python3 bench/multi_gpu.py single W2  # its eager shapes' Triton variants compiled
  run "single" python3 bench/multi_gpu.py single W2
  IFS=';' read -ra singles <<< "${SINGLES:-}"
  for v in "${singles[@]}"; do
    [ -n "$v" ] && (export $v; run "single, $v" python3 bench/multi_gpu.py single W2)
  done
}
[ "${SINGLE_FIRST:-0}" = 0 ] || one_gpu
run "ddp, warm-up pass" "${DDP[@]}"
if [ "${ALLREDUCE:-1}" != 0 ]; then
  timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multi_gpu.py allreduce 2>/dev/null \
    | grep "^{" | tee "$OUT/allreduce.jsonl" | tee -a "$S"
fi
timeline() {  # label, then the variant's VAR=value words (none: the defaults)
  local label=$1; shift
  mkdir -p "$OUT/timelines/$label"
  (for v in "$@"; do
     # HIVETUNE_RANK_SPEEDS=auto: each rank's speed from the first defaults timeline (1 / its median micro-batch)
     [ "$v" = HIVETUNE_RANK_SPEEDS=auto ] \
       && v=HIVETUNE_RANK_SPEEDS=$(python3 bench/rank_speeds.py "$OUT/timelines/defaults-1")
     echo "variant $label: $v" | tee -a "$S"
     export "$v"; done
   HIVETUNE_MULTI_TIMELINE="$OUT/timelines/$label" run "ddp, timeline, $label" "${DDP[@]}")
  for f in "$OUT/timelines/$label"/timeline-rank*.json; do
    python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['summary'])" "$f" | tee -a "$S"
  done
}
IFS=';' read -ra variants <<< "${EXTRA:-}"
for pass in $(seq 1 "${PASSES:-1}"); do
  timeline "defaults-$pass"
  for v in "${variants[@]}"; do
    [ -n "$v" ] && timeline "$(echo "$v" | tr ' =/,' '_-__')-$pass" $v
  done
done
if [ -n "${CAPTURE_PROFILE_ENV:-}" ]; then  # each deferred capture under cProfile (captures-rank<r>.txt)
  (export ${CAPTURE_PROFILE_ENV}; HIVETUNE_MULTI_CAPTURE_PROFILE=$OUT/timelines/captures \
     run "ddp, captures profiled, ${CAPTURE_PROFILE_ENV}" "${DDP[@]}")
fi
if [ -n "${PROFILE_ENV:-}" ]; then  # one DDP fit with each rank's kernels and host CUDA calls profiled
  (export ${PROFILE_ENV}; HIVETUNE_MULTI_PROFILE=$OUT run "ddp, profiled, ${PROFILE_ENV}" "${DDP[@]}")
fi
[ "${SINGLE_FIRST:-0}" != 0 ] || one_gpu
if [ "${FSDP14B:-0}" != 0 ]; then  # the 14B-shape model under FSDP2 (bench/multi_gpu.py fsdp 14B)
  RUN_TIMEOUT=240 run "fsdp 14B" python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multi_gpu.py fsdp 14B
fi
kill $clocks $apps 2>/dev/null
tar -czf "$OUT/timelines.tar.gz" -C "$OUT" timelines && rm -rf "$OUT/timelines"
echo "== done ($(date +%T))" | tee -a "$S"
