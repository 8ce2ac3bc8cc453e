#!/usr/bin/env bash
# One device call (~8 min): the GPU tests, the dropout-matmul kernels against the tree in $OLD
# (a `git archive` of an earlier commit's src and bench, carried as an untracked folder), their
# split sweep, Triton's launch cost, then W1 and W2 (16 x 1) and what is alive at W2's peak.
# Usage: HIVETUNE_COMMIT=<commit> OLD=old049 bash bench/kernels_run.sh
set -u
source bench/device_prelude.sh
(cd $OLD && PYTHONPATH=$PWD/src timeout 60 python3 bench/drop_matmul_speed.py --out $OUT/results/drop-matmul-speed-old.json) 2>&1 | tail -8
timeout 60 python3 bench/drop_matmul_speed.py --out $OUT/results/drop-matmul-speed-new.json 2>&1 | tail -8
timeout 120 python3 bench/drop_matmul_speed.py --sweep --out $OUT/results/drop-matmul-sweep.json 2>&1 | tail -8
timeout 60 python3 bench/launch_cost.py --out $OUT/results 2>&1 | head -14
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 2>&1 | grep -E "^W2"
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 bench/profile_step.py W2 --memory --steps 5 > $OUT/w2-memory.txt 2>&1; head -25 $OUT/w2-memory.txt
timeout 90 python3 bench/profile_step.py W2 --narrow --no-profile --steps 30 --set cuda_graphs=false 2>&1 | grep steps
