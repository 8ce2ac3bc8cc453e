#!/usr/bin/env bash
# One device call (~7 min): W1 and W2 within 24 GiB (host_embeddings, activation_offload=$N,
# default 4) at this tree and at an older commit, alternating, on the same host: separates a
# change's effect from the host spread (W2 on two H200 hosts: 16,270 at a9f3af5, 11,991 at
# 86175b8's reference path). The older source must be in old/src (untracked, so it travels):
#   git archive <old> src | tar -x -C old        # here, before the device call
#   HIVETUNE_COMMIT=<new> OLD=<old> [ROUNDS=2] [N=4] [CAP=24] [SKIP_TESTS=1] bash bench/same_host_ab.sh
# CAP: the allocator's cap in GiB, as on a card of that size (offload 4 runs out of memory under 24, 5 fits).
set -u
source bench/device_prelude.sh
[ -d old/src ] || { echo "old/src missing: git archive <old> src | tar -x -C old"; exit 2; }
envs() {  # the environment of a tree: new (this one) or old
  [ "$1" = old ] && echo "PYTHONPATH=$PWD/old/src HIVETUNE_COMMIT=$OLD" || echo "PYTHONPATH=$PWD/src"
}
W2="--set host_embeddings=true --set activation_offload=${N:-4}${CAP:+ --memory-cap $CAP}"
for which in new old; do  # warm both trees' Triton kernels first
  timeout 60 env $(envs $which) python3 -m hivetune bench W1 --out /tmp/warm --max-steps 30 2>&1 | grep -E "^W|this host|rror"
  timeout 90 env $(envs $which) python3 -m hivetune bench W2 --out /tmp/warm --max-steps 5 $W2 2>&1 | grep -E "^W|this host|rror"
done
for round in $(seq ${ROUNDS:-2}); do
  for which in new old; do
    echo "== $which, round $round"
    timeout 90 env $(envs $which) python3 -m hivetune bench W1 --out $OUT/results 2>&1 | grep -E "^W|this host|rror"
    timeout 120 env $(envs $which) python3 -m hivetune bench W2 --out $OUT/results $W2 2>&1 | grep -E "^W|this host|rror"
  done
done
