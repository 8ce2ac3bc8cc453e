#!/usr/bin/env bash
# One device call (~7 min) on one GPU (issues 3 and 10): the GPU tests, then W1 under its 4 GiB
# cap with the graphs instantiated on a worker thread (the default) and inside capture_end
# (HIVETUNE_REFERENCE=graph_instantiate), alternating, three rounds, after an untimed warm-up of
# each. Results into $OUT/results; one line per run with its capture and instantiation times.
# Usage (device tool): HIVETUNE_COMMIT=<commit> [SKIP_TESTS=1] [ROUNDS="1 2 3"] bash bench/instantiate_run.sh
set -u
source bench/device_prelude.sh
timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 --memory-cap 4 2>&1 | grep -E "^W|rror"
HIVETUNE_REFERENCE=graph_instantiate timeout 60 python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 --memory-cap 4 2>&1 | grep -E "^W|rror"
for round in ${ROUNDS:-1 2 3}; do
  for ref in "" graph_instantiate; do
    echo "== round $round, HIVETUNE_REFERENCE=$ref ($(date +%T))"
    HIVETUNE_REFERENCE=$ref timeout 90 python3 -m hivetune bench W1 --out $OUT/results --memory-cap 4 2>&1 | grep -E "^W|rror"
  done
done
python3 -c "
import glob, json
for p in sorted(glob.glob('$OUT/results/W1-*.json')):
    r = json.load(open(p)); h = r['hivetune']; g = h.get('cuda_graphs') or {}
    print(p.rsplit('/', 1)[1], h['seconds'], g.get('instantiate'), g.get('capture_s'), g.get('warmup_s'),
          g.get('capture_each_s'), g.get('instantiate_wait_s'), g.get('sizes'), g.get('pad_tokens'))
"
