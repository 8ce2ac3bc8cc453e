#!/usr/bin/env bash
# One device call (~3 min) on one GPU (issue 3): bench/wide_memory_probe.py for W1 with and
# without the wide layout (with it, o_proj's and down_proj's weights are stacked: lora.stack_frozen),
# under the 4 GiB cap and uncapped: the allocator's pools at each stage, when graphs turn off,
# and the large segments' blocks after assembly. One JSON file a run into $OUT.
# Usage (device tool): HIVETUNE_COMMIT=<commit> SKIP_TESTS=1 [CAPS="4 0"] bash bench/wide_memory_run.sh
set -u
source bench/device_prelude.sh
for cap in ${CAPS:-4 0}; do
  for variant in false true; do
    wide=$variant
    echo "== wide $variant, cap $cap ($(date +%T))"
    timeout 120 python3 bench/wide_memory_probe.py --wide $wide --cap $cap \
      > $OUT/wide-memory-$variant-cap$cap.jsonl 2>&1
    tail -1 $OUT/wide-memory-$variant-cap$cap.jsonl | python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
print(r['seconds'], 's; peak reserved', r['peak_reserved_gib'], 'allocated', r['peak_allocated_gib'],
      '; wide groups', r['wide_groups'], '; graphs off:', r['cuda_graphs'].get('off'))
for seg in r['layout_after_assemble']:
    print('   segment', seg['mib'], 'MiB,', seg['free_mib'], 'free:', seg['blocks'][:8])
for s in r['stages']:
    print('  ', s['stage'][:60], s['reserved_gib'], s['allocated_gib'], json.dumps(s['pools']))" || tail -5 $OUT/wide-memory-$variant-cap$cap.jsonl
  done
done
