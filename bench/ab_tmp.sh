set -u
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src
C=${HIVETUNE_COMMIT}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest tests/gpu/test_fused_layers.py tests/gpu/test_cuda_lora_group.py tests/gpu/test_graphs.py tests/gpu/test_cuda_train.py tests/gpu/test_cuda_resume.py -q -p no:cacheprovider 2>&1 | tail -3
mkdir -p $OUT/results
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
echo "== W2 graphed 16x1"; HIVETUNE_GRAPH_MAX_TFLOP=200 timeout 150 python3 -m hivetune bench W2 --out /tmp/r 2>&1 | grep -E "^W2|graph"
echo "== W2 graphed 2x8"; timeout 150 python3 -m hivetune bench W2 --out /tmp/r --set batch_size=8 --set grad_accum=2 2>&1 | grep -E "^W2|graph"
echo "== W1 kernels"; timeout 90 python3 bench/profile_step.py W1 --steps 15 --set cuda_graphs=false 2>&1 | grep -A12 "GPU kernels per step"
