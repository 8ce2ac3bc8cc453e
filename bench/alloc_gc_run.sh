#!/usr/bin/env bash
# One device call (~5 min, one GPU; issue 3): the cuBLASLt and offload GPU tests, then W2 under the 24 GiB
# cap (host_embeddings, activation_offload=5) warmed up and step by step (bench/step_probe.py): the
# defaults (expandable segments) against the allocator's garbage collection at 90% of the cap
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,garbage_collection_threshold:0.9, which frees cached
# blocks without the device sync of a retry), alternating, two rounds.
# Usage: HIVETUNE_COMMIT=<commit> bash bench/alloc_gc_run.sh
set -u
SKIP_TESTS=1 source bench/device_prelude.sh
G=tests/gpu
timeout 100 python3 -m pytest $G/test_auto_offload.py $G/test_cuda_blas.py $G/test_cuda_offload.py -q -rfE --tb=short \
  -p no:cacheprovider -o addopts="-W ignore::FutureWarning" > $OUT/gpu-tests-part.log 2>&1
tail -1 $OUT/gpu-tests-part.log; grep -E "^FAILED|^E " $OUT/gpu-tests-part.log | head -6
A="--set host_embeddings=true --set activation_offload=5"
timeout 150 python3 -m hivetune bench W2 --out /tmp/warm --max-steps 20 $A --memory-cap 24 2>&1 | grep -E "^W|rror"
for round in 1 2; do
  for gc in "" 0.9; do
    conf=expandable_segments:True${gc:+,garbage_collection_threshold:$gc}
    echo "== round $round: $conf"
    PYTORCH_CUDA_ALLOC_CONF=$conf timeout 150 python3 bench/step_probe.py W2 --cap 24 $A \
      --json $OUT/steps-$round-gc${gc:-off}.json 2>&1 | grep -E "^W2|^step to step|^other" | cut -c1-260
  done
done
