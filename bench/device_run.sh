#!/usr/bin/env bash
# One device call (about 6 minutes): GPU tests, W1 and W2 with the HF Trainer + PEFT baseline
# (timed steps, extrapolated), and each again with the layer-by-layer LoRA reference path. The device tool returns at most 8 files, so
# everything is packed into $OUT/device-run.tgz (results/*.json, logs) plus $OUT/summary.txt.
# Usage (device tool): HIVETUNE_COMMIT=<commit, typed here: the device has no .git of its own> bash bench/device_run.sh
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache
OUT=${OUT:-/tmp/out}
WORK=/tmp/hivetune-device
rm -rf "$WORK" && mkdir -p "$WORK/results" "$WORK/logs" "$OUT"
S="$OUT/summary.txt"
pack() { tar czf "$OUT/device-run.tgz" -C "$WORK" results logs; }
# Pack after every stage: a run cut off at the time limit still returns what it finished.
log() { pack; echo "== $* ($(date +%T))" | tee -a "$S"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$S"
log "GPU tests"
timeout 150 python3 -m pytest tests/gpu tests/ops/test_elementwise.py -p no:cacheprovider -s -o addopts="-W ignore::FutureWarning" 2>&1 \
  | tee "$WORK/logs/gpu-tests.log" | grep -E "passed|failed|W1 packed|FAILED|Error" | tail -15 | tee -a "$S"
log "W1 (CUDA graphs) + HF+PEFT baseline (20 timed steps)"
timeout 130 python3 -m hivetune bench W1 --out "$WORK/results" --baseline hf-peft --baseline-steps 20 2>&1 \
  | tee "$WORK/logs/bench-w1.log" | grep -vE "Warning|warn" | tail -3 | tee -a "$S"
log "W1 with the layer-by-layer LoRA reference (HIVETUNE_REFERENCE=fused_lora), graphs on"
HIVETUNE_REFERENCE=fused_lora timeout 60 python3 -m hivetune bench W1 --out "$WORK/results" 2>&1 \
  | tee "$WORK/logs/bench-w1-reference-lora.log" | tail -1 | tee -a "$S"
log "W2 + HF+PEFT baseline (6 timed steps)"
timeout 150 python3 -m hivetune bench W2 --out "$WORK/results" --baseline hf-peft --baseline-steps 6 2>&1 \
  | tee "$WORK/logs/bench-w2.log" | grep -vE "Warning|warn" | tail -3 | tee -a "$S"
log "W2 with the layer-by-layer LoRA reference (HIVETUNE_REFERENCE=fused_lora)"
HIVETUNE_REFERENCE=fused_lora timeout 80 python3 -m hivetune bench W2 --out "$WORK/results" 2>&1 \
  | tee "$WORK/logs/bench-w2-reference-lora.log" | tail -1 | tee -a "$S"
log "done"
