# Sourced by the device runners: environment, versions, then the GPU tests into $OUT/gpu-tests.log.
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
mkdir -p $OUT/results
timeout 200 python3 -m pytest tests/gpu tests/ops/test_elementwise.py -q -p no:cacheprovider -o addopts="-W ignore::FutureWarning" > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log; grep -E "^FAILED|Error" $OUT/gpu-tests.log | head
