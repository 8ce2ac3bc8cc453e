# Sourced by the 2-GPU runners (ddp_ab_run.sh, ddp_probe_run.sh): the environment, $OUT and its
# summary file $S, DDP (the W2 DDP command) and run NAME COMMAND..., which runs a
# bench/multi_gpu.py command and appends its result line (time, tokens/s, graph stats) to $S.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 HIVETUNE_CACHE=/tmp/hivetune-cache OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S="$OUT/summary.txt"
run() {  # name, then the command
  local name=$1; shift
  echo "== $name ($(date +%T))" | tee -a "$S"
  timeout 170 "$@" 2>&1 | grep "^{" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['mode'], r['seconds'], 's', r['tokens_per_s'], 'tokens/s', json.dumps(r['cuda_graphs']))" | tee -a "$S"
}
DDP=(python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/multi_gpu.py ddp W2)
