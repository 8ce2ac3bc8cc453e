# Sourced by the 2-GPU runners (ddp_ab_run.sh, ddp_probe_run.sh): the environment, $OUT and its
# summary file $S, DDP (the W2 DDP command) and run NAME COMMAND..., which runs a
# bench/multi_gpu.py command, appends its result (time, tokens/s, graph stats) to $S and its
# whole JSON record (with the device, versions and commit), named, to $OUT/runs.jsonl.
[ -n "${HIVETUNE_COMMIT:-}" ] || echo "warning: HIVETUNE_COMMIT unset: results name the device copy's git HEAD" >&2
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache OMP_NUM_THREADS=4
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
run() {  # name, then the command
  local name=$1; shift
  echo "== $name ($(date +%T))" | tee -a "$S"
  timeout ${RUN_TIMEOUT:-170} "$@" 2>&1 | grep "^{" | NAME="$name" python3 -c "
import json, os, sys
for line in sys.stdin:
    r = json.loads(line)
    with open(os.environ['OUT'] + '/runs.jsonl', 'a') as f:
        f.write(json.dumps({'name': os.environ['NAME'], **r}) + chr(10))
    print(r['mode'], r['seconds'], 's', r['tokens_per_s'], 'tokens/s', json.dumps(r['cuda_graphs']),
          'sizes per rank:', [g.get('sizes') for g in r.get('cuda_graphs_per_rank', [])])" | tee -a "$S"
}
DDP=(python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multi_gpu.py ddp W2)
gpu_tests() {  # pytest arguments: the GPU tests, logged to $OUT/gpu-tests.log, their tail to $S
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest "$@" -q -rfE --tb=short -p no:cacheprovider \
    -o addopts="-W ignore::FutureWarning" > "$OUT/gpu-tests.log" 2>&1
  tail -1 "$OUT/gpu-tests.log" | tee -a "$S"; grep -E "^FAILED|^E " "$OUT/gpu-tests.log" | head -10
}
