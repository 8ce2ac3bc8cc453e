#!/usr/bin/env bash
# One device call (~9 min, one GPU; issue 3): W2 under the 24 GiB cap (host_embeddings, activation_offload=5)
# with the offload scaled to each micro-batch (ActivationOffload.layers_for) against 5 layers every step
# (HIVETUNE_REFERENCE=scaled_offload), step by step (bench/step_probe.py), alternating, ROUNDS rounds
# (default 2), after an untimed warm-up run; a cProfile of a fresh process's first steps; then one bench
# run of the default into $OUT/results.  Usage: HIVETUNE_COMMIT=<commit> bash bench/scaled_offload_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
warm_w2_capped
timeout 120 python3 bench/profile_step.py W2 --first --steps 2 --cap 24 $W2_CAPPED > $OUT/cprofile-w2-first-capped.txt 2>&1
head -3 $OUT/cprofile-w2-first-capped.txt | tail -1
ab_w2_capped scaled_offload scaled
timeout 170 python3 -m hivetune bench W2 --out $OUT/results $W2_CAPPED --memory-cap 24 2>&1 | grep -E "^W|rror"
