#!/usr/bin/env bash
# One device call on kind nvidia-h200-x2 (issue 10): the 2-GPU tests, then W2 on 1 and 2 GPUs
# and a 14B-shape model with FSDP2 (bench/multi_gpu.py). Results into $OUT.
# Usage (device tool): HIVETUNE_COMMIT=<commit, typed here: the device has no .git of its own> bash bench/multi_gpu_run.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== 2-GPU tests ($(date +%T))" | tee -a "$OUT/summary.txt"
  timeout 200 python3 -m pytest tests/gpu/test_multi_gpu.py -p no:cacheprovider -q -o addopts="-W ignore::FutureWarning" \
    > "$OUT/multi-gpu-tests.log" 2>&1
  tail -5 "$OUT/multi-gpu-tests.log" | tee -a "$OUT/summary.txt"
fi
echo "== W2 on 1 and 2 GPUs, 14B FSDP2 ($(date +%T))" | tee -a "$OUT/summary.txt"
timeout 330 python3 bench/multi_gpu.py all --out "$OUT" 2>&1 | grep -vE "Warning|warn" | tee "$OUT/multi-gpu-bench.log" | tail -8 \
  | cut -c1-600 | tee -a "$OUT/summary.txt"
echo "== W2 on one GPU each, side by side: 2 graphed micro-batches of 8 with 128-token buckets (GPU 0), 4 of 4 (GPU 1) ($(date +%T))" | tee -a "$OUT/summary.txt"
mkdir -p "$OUT/results"
CUDA_VISIBLE_DEVICES=0 HIVETUNE_GRAPH_BUCKET=128 timeout 150 python3 -m hivetune bench W2 --out "$OUT/results" \
  --set batch_size=8 --set grad_accum=2 > "$OUT/w2-8x2-b128.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m hivetune bench W2 --out "$OUT/results" \
  --set batch_size=4 --set grad_accum=4 > "$OUT/w2-4x4.log" 2>&1 &
wait
tail -1 "$OUT/w2-8x2-b128.log" "$OUT/w2-4x4.log" | tee -a "$OUT/summary.txt"
echo "== done ($(date +%T))" | tee -a "$OUT/summary.txt"
