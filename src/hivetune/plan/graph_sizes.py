"""CUDA-graph sizes: which token counts a run's graphs are captured at.

A graph fixes every shape, so each packed micro-batch is padded to a graph size that holds it
and at least one pad token. These functions are pure arithmetic over token counts; the loop
(train.graph_plan) feeds them the step plan's micro-batches and train.replay captures the
sizes they return. The planner (plan.planner) uses the same grid for its memory figures.
"""

from __future__ import annotations

import math
from collections import Counter

# The fixed grid for micro-batches no planned size holds. W1: 7 token buckets, 8% pad tokens
# (128: 13 buckets, 4%; 512: 4, 16%).
BUCKET_TOKENS = 256
# Planned sizes are multiples of this. A replay's time grows ~54 us a token with no step at the
# matmuls' 128-row tiles, so a fine grain only pads less (docs/log.md).
GRAIN = 16
# Above this many matmul TFLOP per micro-batch (4 x linear weights x tokens) the GPU outruns the
# host's dispatch anyway and graphs cost capture time and pool memory for nothing: W2's
# 16-example micro-batches (~82 TFLOP) ran 16.80 s graphed against 16.96 s eager (docs/log.md).
MAX_TFLOP_PER_MICRO_BATCH = 60.0
# With gradient checkpointing the host dispatches each layer's forward twice and the step is
# host-bound further up: W2 on an nf4 base (~82 TFLOP a micro-batch) ran 300 ms a step eager
# against 250 graphed on an H200 (docs/log.md).
MAX_TFLOP_PER_MICRO_BATCH_CHECKPOINTING = 120.0
# A deferred capture's host pass runs while the GPU works through the replays queued ahead of it,
# so the GPU loses little to it: what it costs is its instantiation beside the replays and the
# micro-batches that take a larger graph until it is ready. plan_sizes counts it as this share of
# a capture with the GPU idle. W4: 4 graphs and 9,318 pad tokens against 2 and 25,526; at an
# eighth, 7 graphs whose preloads and instantiations cost more than their padding saved (docs/log.md).
DEFERRED_CAPTURE_SHARE = 1 / 4


def bucket_tokens(n_tokens: int, bucket: int = BUCKET_TOKENS) -> int:
    """Smallest multiple of `bucket` holding n_tokens plus at least one pad token."""
    return (n_tokens + 1 + bucket - 1) // bucket * bucket


def micro_batch_tflop(linear_weight_count: int, tokens: float) -> float:
    """Matmul TFLOP of a micro-batch of `tokens` (forward plus input gradient: 4 x weights x tokens)."""
    return 4 * linear_weight_count * tokens / 1e12


def max_tflop(checkpointing: bool = False) -> float:
    """The largest micro-batch (matmul TFLOP) CUDA graphs pay for."""
    return MAX_TFLOP_PER_MICRO_BATCH_CHECKPOINTING if checkpointing else MAX_TFLOP_PER_MICRO_BATCH


def launch_bound(linear_weight_count: int, tokens: float, checkpointing: bool = False) -> bool:
    """Whether a micro-batch of `tokens` is small enough for CUDA graphs to pay (max_tflop)."""
    return micro_batch_tflop(linear_weight_count, tokens) <= max_tflop(checkpointing)


def grid_keys(micro: list[tuple[int, int]], bucket: int = BUCKET_TOKENS) -> list[tuple[int, int]]:
    """The (bucket tokens, cu_seqlens entries) keys of these micro-batches on the fixed grid."""
    return sorted({(bucket_tokens(t, bucket), segments) for t, segments in micro})


def plan_sizes(tokens: list[int], capture_tokens: float, grain: int = GRAIN) -> list[int]:
    """The graph sizes (multiples of `grain`) that minimise capture cost + padding for these
    micro-batch token counts, a graph's capture counted as `capture_tokens` tokens of GPU work
    (its host pass over the GPU's time per token): each micro-batch takes the smallest size that
    holds it and a pad token. Exact, by dynamic programming over the grain-rounded sizes sorted:
    cost(j) = min over i < j of cost(i) + capture_tokens + the padding of the counts in (i, j]
    padded to size j. W1 (562 micro-batches) at 15,000 tokens a capture: 5 graphs and 68,887
    pad tokens, against the 256-token grid's 7 graphs and 71,895."""
    if not tokens:
        return []
    need = sorted({bucket_tokens(t, grain) for t in tokens})
    by_size: dict[int, list[int]] = {}
    for t in tokens:
        by_size.setdefault(bucket_tokens(t, grain), []).append(t)
    n = len(need)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        size, pad = need[j - 1], 0
        for i in range(j - 1, -1, -1):  # sizes i+1..j all padded to size j
            pad += sum(size - t for t in by_size[need[i]])
            cost = best[i] + capture_tokens + pad
            if cost < best[j]:
                best[j], cut[j] = cost, i
    sizes, j = [], n
    while j > 0:
        sizes.append(need[j - 1])
        j = cut[j]
    return sorted(sizes)


def size_uses(sizes: dict[int, list[int]], micro: list[tuple[int, int]]) -> Counter:
    """How many of these (tokens, cu_seqlens entries) micro-batches take each planned (size,
    entries) key: the smallest size of their segment count above their tokens."""
    uses: Counter = Counter()
    for t, segments in micro:
        size = next((s for s in sorted(sizes.get(segments) or ()) if s > t), None)
        if size is not None:
            uses[(size, segments)] += 1
    return uses


def target_capacities(sizes: dict[int, list[int]], micro: list[tuple[int, int]],
                      targets: list[int]) -> dict[tuple[int, int], int]:
    """Each planned graph's target capacity: the most targets among this rank's micro-batches
    (its own tokens, segment count; `targets` alike) that take it (the smallest size above their
    tokens); the largest size of a segment count holds the most of any of them (until the plan is
    made every micro-batch of that count takes it). Keys without a micro-batch keep a target a
    token. The LM head and the loss run on a graph's target rows, pad rows included, so a
    capacity below the token count saves that work (W2's targets are 69% of its tokens)."""
    capacity: dict[tuple[int, int], int] = {}
    for (t, segments), n in zip(micro, targets):
        planned = sizes.get(segments) or []
        size = next((s for s in planned if s > t), None)
        if size is not None:
            capacity[(size, segments)] = max(capacity.get((size, segments), 0), n)
    for segments, planned in sizes.items():
        if planned:
            top = (max(planned), segments)
            most = max((n for (_, seg), n in zip(micro, targets) if seg == segments), default=top[0])
            capacity[top] = max(capacity.get(top, 0), most)
    return {key: min(c, key[0]) for key, c in capacity.items()}


def capture_cost_tokens(capture_s: float, gpu_s_per_token: float) -> float:
    """A capture's cost for plan_sizes, in tokens of GPU work: the largest graph's capture time
    over the GPU's time a token, rounded down to a power of two (the same plan from run to run
    despite the timing's noise). Down, not to the nearest: the largest graph's capture is the
    slowest (first-time costs); W1 plans 5 graphs at 16,384 against 3 at 32,768, which pad
    more and run ~0.5 s longer (docs/log.md)."""
    return 2.0 ** math.floor(math.log2(max(capture_s / max(gpu_s_per_token, 1e-9), 1.0)))


def defers_captures(capture_s: float, replay_s: float) -> bool:
    """Whether the planned sizes below each segment count's largest (deferrable) are captured one
    after each replay, the host pass overlapping the GPU's work on the replay just queued, rather
    than all at the first micro-batch with the GPU idle: where a replay's GPU time (`replay_s`, at
    the plan's mean micro-batch) covers at least a quarter of a capture's host time (`capture_s`,
    the largest's, its instantiation included). W2 under DDP (~0.1 s a replay, 0.1-0.23 s a
    capture) defers; W1 (~17 ms a replay, ~0.14 s a capture) captures all at once."""
    return 4 * replay_s >= capture_s


def deferrable(keys: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """The (tokens, cu_seqlens entries) keys whose capture can wait (defers_captures): all but
    each segment count's largest, so that every micro-batch of the plan has a captured graph
    that holds it from the first step (one that had none would take a grid size, captured when
    met: a graph more)."""
    largest = {}
    for tokens, segments in keys:
        largest[segments] = max(largest.get(segments, 0), tokens)
    return {(t, seg) for t, seg in keys if t < largest[seg]}
