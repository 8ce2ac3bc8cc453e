#!/usr/bin/env bash
# One device call (~5 min, one GPU): W2 capped at 24 GiB (host_embeddings, activation_offload=5) under the
# profiler (the GPU idle gaps: w2-gaps.json), its synchronising calls, its host dispatch alone
# (--narrow), and the uncapped defaults under the profiler. Usage: HIVETUNE_COMMIT=<commit> bash bench/w2_gaps_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
A="--cap 24 --set host_embeddings=true --set activation_offload=5"
timeout 150 python3 bench/profile_step.py W2 --steps 6 $A --gaps $OUT/w2-gaps.json > $OUT/w2-profile.txt 2>&1
grep -E "under the profiler|idle a step" $OUT/w2-profile.txt; tail -3 $OUT/w2-profile.txt
timeout 120 python3 bench/profile_step.py W2 --steps 4 $A --sync-debug 2>&1 | grep -A16 "synchronising calls"
timeout 90 python3 bench/profile_step.py W2 --narrow --no-profile --steps 30 $A 2>&1 | grep steps
timeout 150 python3 bench/profile_step.py W2 --steps 6 --gaps $OUT/w2-gaps-uncapped.json > $OUT/w2-profile-uncapped.txt 2>&1
grep -E "under the profiler|idle a step" $OUT/w2-profile-uncapped.txt
