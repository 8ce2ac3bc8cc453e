#!/usr/bin/env bash
# One device call (~5 min): where W2's step goes. The W2 benchmark (16 x 1, eager), its kernel
# mix, what is alive at its memory peak, the host's dispatch time alone (--narrow), and 16 x 1
# under CUDA graphs; then W1. Usage: HIVETUNE_COMMIT=<commit> SKIP_TESTS=1 bash bench/w2_probe_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 2>&1 | grep -E "^W2"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
timeout 120 python3 bench/profile_step.py W2 --steps 8 > $OUT/w2-kernels.txt 2>&1; grep -E "under the profiler|GPU kernels per step" -A12 $OUT/w2-kernels.txt | head -30
timeout 120 python3 bench/profile_step.py W2 --memory --steps 2 > $OUT/w2-memory.txt 2>&1; head -30 $OUT/w2-memory.txt
timeout 90 python3 bench/profile_step.py W2 --narrow --no-profile --steps 30 --set cuda_graphs=false 2>&1 | grep steps
HIVETUNE_GRAPH_MAX_TFLOP=1000 timeout 150 python3 bench/profile_step.py W2 --no-profile --steps 60 2>&1 | grep -E "steps|replay"
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
