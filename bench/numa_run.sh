#!/usr/bin/env bash
# One device call (~5 min, one GPU): does the host's NUMA placement set W2's speed under 24 GiB?
# bench/numa_probe.py (the GPU's node, copy bandwidth and launch cost by node), then W2 capped
# (host_embeddings, activation_offload=5) bound (sched_setaffinity) to the GPU's node and, where the process
# may run on another, to that one, alternating ROUNDS times. (The capped step under the profiler,
# its idle gaps and synchronising calls: bench/w2_gaps_run.sh.)
# Usage: HIVETUNE_COMMIT=<commit> SKIP_TESTS=1 [ROUNDS="1 2"] [RUN_TIMEOUT=120] bash bench/numa_run.sh
set -u
source bench/device_prelude.sh
timeout 90 python3 bench/numa_probe.py --out $OUT/results 2>&1 | tail -12
read -r LOCAL OTHER < <(python3 - <<'EOF'
import sys
sys.path.insert(0, "bench")
from numa_probe import gpu_node, nodes
found, (_, node) = nodes(), gpu_node()
local = node if node in found else next(iter(found))
other = next((n for n in found if n != local), None)
fmt = lambda n: ",".join(map(str, sorted(found[n])))
print(fmt(local), fmt(other) if other is not None else "-")
EOF
)
echo "local CPUs: $LOCAL; other node's CPUs: $OTHER"
pin() {  # CPU list, then a command: the command bound to those CPUs (taskset, where the image lacks it)
  local cpus=$1; shift
  python3 -c 'import os, sys; from numa_probe import cpulist
os.sched_setaffinity(0, cpulist(sys.argv[1])); os.execvp(sys.argv[2], sys.argv[2:])' "$cpus" "$@"
}
ARGS="--memory-cap 24 --set host_embeddings=true --set activation_offload=5"
run() {  # label, CPU list ("-": none given), then extra bench arguments
  local label=$1 cpus=$2; shift 2
  local bind="" out=$OUT/$label
  [ "$cpus" = - ] || bind="pin $cpus"
  [ "$label" != warm ] || out=/tmp/warm
  echo "-- $label"
  PYTHONPATH=$PYTHONPATH:$PWD/bench $bind timeout ${RUN_TIMEOUT:-120} python3 -m hivetune bench W2 --out "$out" \
    $ARGS "$@" 2>&1 | grep -E "^W|rror"
}
run warm "$LOCAL" --max-steps 5 > /dev/null
for round in ${ROUNDS:-1 2}; do
  echo "== round $round ($(date +%T))"
  run local "$LOCAL"
  if [ "$OTHER" != - ]; then run other "$OTHER"; else run unbound -; fi
done
