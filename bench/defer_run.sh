#!/usr/bin/env bash
# One device call (~6 min): the GPU tests, then W1 with every planned graph captured at the
# first micro-batch (HIVETUNE_GRAPH_CAPTURE_EVERY=0, the default) and captured in turn (10) and
# every 20, three rounds alternating, into $OUT/results.
# Usage: HIVETUNE_COMMIT=<commit> [SKIP_TESTS=1] bash bench/defer_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W1"
for round in 1 2 3; do
  for every in 0 10 20; do
    echo "HIVETUNE_GRAPH_CAPTURE_EVERY=$every"
    HIVETUNE_GRAPH_CAPTURE_EVERY=$every timeout 90 python3 -m hivetune bench W1 --out /tmp/w1-$every-$round 2>&1 | grep -E "^W1"
  done
done
python3 - <<'PY' > $OUT/results/w1-capture-every.json
import glob, json
rows = []
for f in sorted(glob.glob("/tmp/w1-*-*/W1-*.json")):
    every, rnd = f.split("/")[2].split("-")[1:3]
    d = json.load(open(f)); h = d["hivetune"]
    rows.append({"capture_every": int(every), "round": int(rnd), "seconds": h["seconds"], "tokens_per_s": h["tokens_per_s"],
                 "peak_gib": h["peak_memory_allocated_gib"], "graphs": h["cuda_graphs"], "file": f.split("/")[-1]})
print(json.dumps({"environment": d["environment"], "runs": rows}, indent=1))
PY
grep -c capture_every $OUT/results/w1-capture-every.json
