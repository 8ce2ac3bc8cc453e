#!/usr/bin/env bash
# One device call on 2 GPUs (issue 10): where the W2 DDP run loses against half the one-GPU time.
# The graph relaunch probe (how far the host can queue replays ahead), then, warm: W2 on one GPU
# and DDP on two, then both with every kernel and idle gap profiled. (Session 15 ran it at 9356b1a
# with DDP capturing the graphs in turn every 4 and 8 micro-batches too, an experiment since removed.)
# Eight files at most come back: summary.txt, runs.jsonl, relaunch-probe.json, profiles.txt.
# Usage (device tool): HIVETUNE_COMMIT=<commit> bash bench/ddp_diag_run.sh
source bench/ddp_common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$S"
python3 bench/graph_relaunch_probe.py > "$OUT/relaunch-probe.json" 2>&1; cut -c1-1500 "$OUT/relaunch-probe.json"
run "ddp, warm-up pass" "${DDP[@]}"
run "single, warm-up pass" python3 bench/multi_gpu.py single W2
run "single" python3 bench/multi_gpu.py single W2
run "ddp" "${DDP[@]}"
HIVETUNE_MULTI_PROFILE=/tmp/prof/single run "single, kernels profiled" python3 bench/multi_gpu.py single W2
HIVETUNE_MULTI_PROFILE=/tmp/prof/ddp run "ddp, kernels profiled" "${DDP[@]}"
for f in /tmp/prof/*/kernels-*.txt; do echo "#### $f"; cat "$f"; done > "$OUT/profiles.txt"
head -qn1 /tmp/prof/*/kernels-*.txt | tee -a "$S"
echo "== done ($(date +%T))" | tee -a "$S"
