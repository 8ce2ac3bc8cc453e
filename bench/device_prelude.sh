# Sourced by the device runners: environment, versions, then the GPU tests into $OUT/gpu-tests.log
# (SKIP_TESTS=1 skips them).
[ -n "${HIVETUNE_COMMIT:-}" ] || echo "warning: HIVETUNE_COMMIT unset: results name the device copy's git HEAD" >&2
export PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hc PYTHONPATH=$PWD/src TRITON_CACHE_DIR=/tmp/triton-cache
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
mkdir -p $OUT/results
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 320 python3 -m pytest tests/gpu tests/ops/test_elementwise.py -q -rfE --tb=short -p no:cacheprovider \
    -o addopts="-W ignore::FutureWarning" > $OUT/gpu-tests.log 2>&1
  tail -3 $OUT/gpu-tests.log; grep -E "^FAILED|^E " $OUT/gpu-tests.log | head -20
fi
