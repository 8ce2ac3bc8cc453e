#!/usr/bin/env bash
# One device call (about 5 minutes on an H200): GPU tests, W1 and W2 with the HF Trainer + PEFT
# baseline (timed steps, extrapolated), W1 eager for comparison, W1 step timings and GPU time per
# graph replay for three graph bucket sizes. The device tool returns at most 8 files, so
# everything is packed into $OUT/device-run.tgz (results/*.json, logs) plus $OUT/summary.txt.
# Usage (device tool): HIVETUNE_COMMIT=$(git rev-parse --short HEAD) bash bench/device_run.sh
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
log "W1 eager, 100 steps"
timeout 45 python3 -m hivetune bench W1 --out "$WORK/results" --max-steps 100 --set cuda_graphs=false 2>&1 \
  | tee "$WORK/logs/bench-w1-eager.log" | tail -1 | tee -a "$S"
log "W1 with the PyTorch reference RMSNorm / RoPE / SwiGLU (HIVETUNE_FUSED_OPS=0), graphs on"
HIVETUNE_FUSED_OPS=0 timeout 60 python3 -m hivetune bench W1 --out "$WORK/results" 2>&1 \
  | tee "$WORK/logs/bench-w1-unfused.log" | tail -1 | tee -a "$S"
log "W2 + HF+PEFT baseline (6 timed steps)"
timeout 150 python3 -m hivetune bench W2 --out "$WORK/results" --baseline hf-peft --baseline-steps 6 2>&1 \
  | tee "$WORK/logs/bench-w2.log" | grep -vE "Warning|warn" | tail -3 | tee -a "$S"
log "W2 with the PyTorch reference RMSNorm / RoPE / SwiGLU (HIVETUNE_FUSED_OPS=0)"
HIVETUNE_FUSED_OPS=0 timeout 60 python3 -m hivetune bench W2 --out "$WORK/results" 2>&1 \
  | tee "$WORK/logs/bench-w2-unfused.log" | tail -1 | tee -a "$S"
for b in 256 512 128; do
  log "W1 step timing, graph bucket $b (GPU ms per replay from CUDA events)"
  timeout 40 python3 bench/profile_step.py W1 --steps 203 --no-profile --bucket $b 2>&1 \
    | tee "$WORK/logs/w1-bucket-$b.log" | tail -2 | tee -a "$S"
done
log "done"
