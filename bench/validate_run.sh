#!/usr/bin/env bash
# One device call (~8 min) on one GPU, for a session's first call: the GPU tests at this tree,
# the graph relaunch probe (issue 10), then W1 under a 4 GiB allocator cap and W2 under a 24 GiB
# cap (host embeddings, activation_offload=${N:-5}), each twice after an untimed warm-up, with
# nvidia-smi sampling SM clock, power and utilisation every 200 ms during the W2 runs (issue 3:
# whether W2 is power-bound). Results, logs and the smi samples into $OUT (8 files at most).
# Usage (device tool): HIVETUNE_COMMIT=<commit> [SKIP_TESTS=1] bash bench/validate_run.sh
set -u
source bench/device_prelude.sh
python3 bench/graph_relaunch_probe.py > $OUT/relaunch-probe.json 2>&1; cut -c1-400 $OUT/relaunch-probe.json
W2="--set host_embeddings=true --set activation_offload=${N:-5} --memory-cap 24"
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 --memory-cap 4 2>&1 | grep -E "^W|rror"
timeout 90 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 $W2 2>&1 | grep -E "^W|rror"
for round in 1 2; do
  echo "== round $round ($(date +%T))"
  timeout 90 python3 -m hivetune bench W1 --out $OUT/results --memory-cap 4 2>&1 | grep -E "^W|this host|rror"
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,utilization.gpu --format=csv -lms 200 > $OUT/smi-w2-$round.csv &
  smi=$!
  timeout 120 python3 -m hivetune bench W2 --out $OUT/results $W2 2>&1 | grep -E "^W|this host|rror"
  kill $smi
done
python3 - "$OUT" <<'PY'
import csv, glob, json, statistics, sys
for path in sorted(glob.glob(sys.argv[1] + "/smi-w2-*.csv")):
    rows = [r for r in csv.reader(open(path)) if r and r[0][:1].isdigit()]
    busy = [r for r in rows if float(r[3].split()[0]) > 50]
    if busy:
        print(path.rsplit("/", 1)[1], json.dumps({"samples": len(busy),
              "sm_mhz_median": statistics.median(float(r[1].split()[0]) for r in busy),
              "power_w_median": statistics.median(float(r[2].split()[0]) for r in busy)}))
PY
python3 -c "
import glob, json
for p in sorted(glob.glob('$OUT/results/*.json')):
    r = json.load(open(p)); h = r.get('hivetune', r)
    print(p.rsplit('/', 1)[1], h.get('tokens_per_s'), h.get('seconds'), h.get('peak_memory_reserved_gib'), h.get('allocator'))
"
