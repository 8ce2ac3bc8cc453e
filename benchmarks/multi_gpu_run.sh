#!/usr/bin/env bash
# On 2 GPUs (kind nvidia-h200-x2): the 2-GPU tests, then W2 on one GPU and on two (DDP, same
# global batch), each warmed first, and a 14B-shape model with FSDP2 in bf16 and with DDP on an
# nf4 base (benchmarks/multi_gpu.py). New result lines land in $OUT/results/W2-<device>.jsonl and
# 14B-<device>.jsonl; append them to benchmarks/results/ here.
# Usage: bash benchmarks/multi_gpu_run.sh <commit>   (the device's copy of the tree may have no .git)
set -uo pipefail
COMMIT=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/summary.txt"
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: the figures alone (the tests in another call: one call runs 600 s at most)
  echo "== 2-GPU tests ($(date +%T))" | tee -a "$OUT/summary.txt"
  timeout 330 python3 -m pytest tests/gpu/test_multi_gpu.py -p no:cacheprovider -q -o addopts="-W ignore::FutureWarning" \
    --durations=10 > "$OUT/multi-gpu-tests.log" 2>&1
  tail -15 "$OUT/multi-gpu-tests.log" | tee -a "$OUT/summary.txt"
fi
# A cold Triton cache compiles inside the first run: one untimed pass of each first.
echo "== warm-up: W2 on one GPU and on two, untimed ($(date +%T))" | tee -a "$OUT/summary.txt"
timeout 90 python3 benchmarks/multi_gpu.py single W2 > /dev/null 2>&1
timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/multi_gpu.py ddp W2 > /dev/null 2>&1
echo "== W2 on 1 and 2 GPUs, 14B FSDP2 ($(date +%T))" | tee -a "$OUT/summary.txt"
timeout 400 python3 benchmarks/multi_gpu.py all --out "$OUT" --results "$OUT/results" --commit "$COMMIT" 2>&1 \
  | grep -vE "Warning|warn" | tee "$OUT/multi-gpu-bench.log" | tail -8 | cut -c1-600 | tee -a "$OUT/summary.txt"
echo "== done ($(date +%T))" | tee -a "$OUT/summary.txt"
