#!/usr/bin/env bash
# One device call (~3 min) on one GPU (issue 3): bench/wide_memory_probe.py for W1 with and
# without the wide layout, under the 4 GiB cap and uncapped: the allocator's pools at each stage
# and when graphs turn off. One JSON file a run into $OUT.
# Usage (device tool): HIVETUNE_COMMIT=<commit> SKIP_TESTS=1 [CAPS="4 0"] bash bench/wide_memory_run.sh
set -u
source bench/device_prelude.sh
for cap in ${CAPS:-4 0}; do
  for wide in false true; do
    echo "== wide $wide, cap $cap ($(date +%T))"
    timeout 120 python3 bench/wide_memory_probe.py --wide $wide --cap $cap > $OUT/wide-memory-$wide-cap$cap.jsonl 2>&1
    tail -1 $OUT/wide-memory-$wide-cap$cap.jsonl | python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
print(r['seconds'], 's; peak reserved', r['peak_reserved_gib'], 'allocated', r['peak_allocated_gib'],
      '; wide groups', r['wide_groups'], '; graphs off:', r['cuda_graphs'].get('off'))
for s in r['stages']:
    print('  ', s['stage'][:60], s['reserved_gib'], s['allocated_gib'], json.dumps(s['pools']))" || tail -5 $OUT/wide-memory-$wide-cap$cap.jsonl
  done
done
