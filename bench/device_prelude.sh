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
# W2 as on a 24 GiB card (with bench's --memory-cap 24 / step_probe's --cap 24), for the runners below.
W2_CAPPED="--set host_embeddings=true --set activation_offload=5"
warm_w2_capped() {  # an untimed 20-step W2 under the cap: a fresh machine compiles its Triton kernels here
  timeout 170 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 $W2_CAPPED --memory-cap 24 2>&1 \
    | grep -E "^W|rror"
}
ab_w2_capped() {  # REF LABEL: W2 under the cap step by step (bench/step_probe.py) with HIVETUNE_REFERENCE=REF and
  # with the defaults, alternating, ROUNDS rounds (default 2), into $OUT/steps-<round>-<REF, or LABEL>.json
  local round ref
  for round in ${ROUNDS:-1 2}; do
    for ref in $1 ""; do
      echo "== round $round: ${ref:-$2 (default)}"
      HIVETUNE_REFERENCE=$ref timeout 170 python3 bench/step_probe.py W2 --cap 24 $W2_CAPPED \
        --json $OUT/steps-$round-${ref:-$2}.json 2>&1 | grep -vE "^hivetune:|arn"
    done
  done
}
