set -u
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/results $OUT/warm
timeout 90 python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/results 2>&1 | grep -E "^W2"
echo "== warm Triton disk cache"
timeout 90 python3 -m hivetune bench W1 --out $OUT/warm 2>&1 | grep -E "^W1"
timeout 120 python3 -m hivetune bench W2 --out $OUT/warm 2>&1 | grep -E "^W2"
echo "== W1 kernels"; timeout 90 python3 bench/profile_step.py W1 --steps 15 --set cuda_graphs=false 2>&1 | grep -A30 "GPU kernels per step"
timeout 200 python3 -m pytest tests/gpu tests/ops/test_elementwise.py -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log
