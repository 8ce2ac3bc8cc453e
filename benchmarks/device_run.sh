#!/usr/bin/env bash
# One device call on one GPU (about 6 minutes on an H200): the GPU tests, then W1 and W2 with
# `hivetune bench`, each once untimed (a fresh machine compiles its Triton kernels there) and
# once timed; W1 with HF Trainer + PEFT in the same process (20 timed steps, extrapolated); W2
# uncapped and as on a 24 GiB card (graphed with its first 4 layers checkpointed, and eager with 5
# layers' activations offloaded). The new result lines land in $OUT/results/<workload>-<device>.jsonl:
# append them to benchmarks/results/ here (`cat $OUT/results/W1-h200.jsonl >> benchmarks/results/W1-h200.jsonl`).
# Usage: bash benchmarks/device_run.sh <commit>   (the device's copy of the tree may have no .git)
set -uo pipefail
COMMIT=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results" "$OUT/logs"
S="$OUT/summary.txt"
log() { echo "== $* ($(date +%T))" | tee -a "$S"; }
bench() { timeout 200 python3 -m hivetune bench "$@" --commit "$COMMIT" 2>&1 | grep -vE "Warning|warn" | tail -3 | tee -a "$S"; }
W2_24GIB="--set host_embeddings=true --set gradient_checkpointing=true --set checkpoint_layers=4 --memory-cap 24"
W2_24GIB_OFFLOAD="--set host_embeddings=true --set activation_offload=5 --memory-cap 24"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$S"
log "GPU tests"
timeout 320 python3 -m pytest tests/gpu -q -rfE --tb=short -p no:cacheprovider -o addopts="-W ignore::FutureWarning" \
  > "$OUT/logs/gpu-tests.log" 2>&1
tail -3 "$OUT/logs/gpu-tests.log" | tee -a "$S"
log "untimed passes (kernel compiles)"
bench W1 --out /tmp/warm --max-steps 30
bench W2 --out /tmp/warm --max-steps 20 $W2_24GIB
log "W1, with HF + PEFT (20 timed steps)"
bench W1 --out "$OUT/results" --baseline hf-peft --baseline-steps 20
log "W2"
bench W2 --out "$OUT/results"
log "W2 as on a 24 GiB card"
bench W2 --out "$OUT/results" $W2_24GIB
bench W2 --out "$OUT/results" $W2_24GIB_OFFLOAD
log "done"
