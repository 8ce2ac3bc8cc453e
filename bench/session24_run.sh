#!/usr/bin/env bash
# One device call (~7 min, one GPU; issue 3): the side-stream gradient test, then W2 under the 24 GiB cap
# (host_embeddings, activation_offload=5) step by step (bench/step_probe.py) with the per-bucket cuBLASLt
# heuristic against the per-shape one (HIVETUNE_REFERENCE=lt_buckets), alternating, ROUNDS rounds (default 2)
# after an untimed warm-up, and one uncapped default run for the cap's cost on this machine.
# Usage: HIVETUNE_COMMIT=<commit> bash bench/session24_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" \
  "tests/gpu/test_graphs.py::test_lora_weight_gradients_on_a_side_stream_match_the_one_stream_graphs" 2>&1 | tail -3
warm_w2_capped
ab_w2_capped lt_buckets buckets
echo "== uncapped, defaults"
timeout 170 python3 bench/step_probe.py W2 --json $OUT/steps-uncapped.json 2>&1 | grep -vE "^hivetune:|arn"
