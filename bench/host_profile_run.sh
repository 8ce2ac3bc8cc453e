#!/usr/bin/env bash
# One device call (~4 min, one GPU; issue 3): where the host's time goes in W2's eager steps under the 24 GiB cap
# (host_embeddings, activation_offload=5): after an untimed warm-up, one bench run sampled by py-spy (Python
# frames) and one with --native (C / C++ frames too), as collapsed stacks into $OUT. py-spy is not in the
# image: fetch its wheel here (pip download py-spy --no-deps -d pyspy_wheel) and carry pyspy_wheel (ignored).
# The --native run left no file on the H200 of 197c29b (py-spy fell ~3 s behind at 200 Hz in the first).
# Usage: HIVETUNE_COMMIT=<commit> bash bench/host_profile_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
pip install -q --no-deps --no-index pyspy_wheel/*.whl 2>&1 | tail -1
A="--set host_embeddings=true --set activation_offload=5"
timeout 170 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 $A --memory-cap 24 2>&1 | grep -E "^W|rror"
timeout 200 py-spy record --rate 200 --format raw -o $OUT/w2-capped-pyspy.txt -- \
  python3 -m hivetune bench W2 --out /tmp/r1 $A --memory-cap 24 2>&1 | grep -E "^W|rror|py-spy|Error"
timeout 200 py-spy record --rate 100 --native --format raw -o $OUT/w2-capped-pyspy-native.txt -- \
  python3 -m hivetune bench W2 --out /tmp/r2 $A --memory-cap 24 2>&1 | grep -E "^W|rror|py-spy|Error"
ls -la $OUT
