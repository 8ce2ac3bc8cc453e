"""CUDA graphs for a packed micro-batch: forward, loss and backward replayed as one graph.

Why: W1 (a 0.5B model, ~1,600 tokens per step) keeps the GPU busy ~25 ms of a ~133 ms eager
step; the rest is host time dispatching ~3,300 kernels. A graph replays them all with one launch.

How. A graph fixes every shape and address, so each micro-batch is padded to a bucket:

- tokens: T real tokens -> Tb, the smallest graph size above T (below). The Tb - T pad tokens form
  their own segment of ``cu_seqlens`` (attention never crosses a segment), so real tokens see
  exactly what they saw unpadded; ``max_seqlen`` is Tb (an upper bound; flash skips empty blocks).
- targets: padded to Tb entries (never fewer than the real ones, as targets < tokens) with id
  -100, which the loss ignores (no loss, no gradient); their index points at the last pad token.
- the step's target count (the loss divisor) is a device scalar filled before each replay.

Which sizes Tb: plan_sizes weighs a graph's capture (a host pass, ~0.2 s on W1) against the
padding a coarser set of sizes costs on the GPU, over the token counts of every micro-batch the
step plan holds (known before the first step). The first micro-batch runs eagerly (its real
work, and the warm-up capture needs); the largest graph is captured, and the second micro-batch's
replay of it gives the GPU time a token (plan_on_replay; HIVETUNE_REFERENCE=plan_on_replay: a
timing replay of the first micro-batch padded to it, the loss divided by infinity, exact zeros
everywhere); then every planned size is captured, largest first, without synchronising the
device (capture runs nothing): at once, or, where a replay's GPU time covers a quarter of a
capture's host time (defers_captures: W2 under DDP), each segment count's largest at once and
the others one after each replay once 3 replays are queued and no instantiation is in flight,
their shapes met first by a two-layer capture (deferrable, CAPTURE_LEAD and the notes below
it). Each size holds as many target rows as its micro-batches bring (target_capacities). A
micro-batch no size holds takes the 256-token grid (bucket_tokens), captured when met.
The sizes go into checkpoints (train.save_all_ranks, one entry per rank): a resumed run on the
same number of processes captures them again instead of timing anew (saved_sizes).

Instantiation (cudaGraphInstantiate: 15-30 ms of each W1 capture's ~0.1-0.2 s of host time on
an H100, 596717a) runs on a worker thread where torch can capture without instantiating
(keep_graph): each graph's instantiation overlaps the next graph's capture and the replays of
graphs already instantiated; a replay waits for its own graph's (stats: instantiate_wait_s).
HIVETUNE_REFERENCE=graph_instantiate instantiates inside capture_end, as before. The largest
graph is waited for at once (its timing replay), so the planner's capture cost still includes
one instantiation.

All graphs share one memory pool; each replay's loss is cloned at once, so no graph's output is
alive while another replays. Gradients accumulate in place into persistent .grad tensors, views
of one buffer (lora_group.GradArena) that LoRAGroup's backward adds into; the LoRA parameters
sit in a buffer laid out alike (FusedAdamW's flat step), placed there before any capture. fit
may set grads to None between steps: they are re-attached (zeroed, one kernel) before the next
micro-batch. Dropout: fit's micro-batches carry their seeds (train.dropout_seeds, drawn on the
host per step and micro-batch), which a bucket's static inputs hold like the token ids, so every
replay gets its micro-batch's masks and no graph draws from torch's CUDA generator. (A caller's
micro-batch without seeds gets seeds drawn on the host at load; and where the model's dropout
is not the seeded one, the graphs draw from the CUDA generator, whose offset each replay
advances.)

Falls back to eager with one line on stderr when the run is on CUDA but cannot be graphed
(fp16 loss scaling, no flash varlen attention, gradient checkpointing, FSDP, a failed capture).
Under DDP each rank replays its own graphs; the gradient all-reduce runs after the step, outside.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from hivetune.data.batch import MicroBatch
from hivetune.data.formats import parse_json_line
from hivetune.core.device import cuda_index
from hivetune.parallel.distributed import all_gather_objects, rank_speeds
from hivetune.core.errors import UserError
from hivetune.core.fallbacks import forced
from hivetune.ops.attention import Packed, varlen_supported
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.loss import target_loss_sum

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index; fused_target_loss_sum takes it too
# W1: 7 token buckets, 8% pad tokens (128: 13 buckets, 4%; 512: 4, 16%). HIVETUNE_GRAPH_BUCKET
# overrides it for experiments (bench/profile_step.py --bucket).
BUCKET_TOKENS = 256
# Graph sizes chosen by plan_sizes are multiples of this; HIVETUNE_GRAPH_GRAIN=n for experiments.
# 16 since session 33 (64 before). bench/size_cost.py (W2's graph, 8 examples, one H200) found no
# saving at multiples of the matmuls' 128-row tiles: a replay's milliseconds grow ~54 us a token
# with +-3 ms steps that follow no tile (1,456 tokens 77.5 ms, 1,472 80.8, 1,480 77.8, 1,488 80.3;
# bench/results/ddp-33/), so a finer grain only pads less. W2 DDP with batch_order=balanced
# (e8d315c, 2 x H200): one 1,456-token graph, 846 pad tokens a rank, 8.77 / 8.74 s, against one
# of 1,472, 2,318 pad tokens, 8.89 / 8.99 s at 64.
GRAIN = 16
MAX_GRAPHS = 48  # keys beyond this many run eagerly
# Capturing the sizes after the largest in turn, one every N micro-batches before that micro-batch's
# replay, was tried and removed (session 15): W1 (H200, 91912cc) 11.43-11.85 s against 11.55-11.58;
# W2 DDP (2 x H100, 9356b1a) every 4: 10.87 s, every 8: 11.30, against 11.18, each capture still
# leaving the GPU idle 0.22-0.26 s: under DDP capture_begin first waits for the NCCL work in flight
# (the previous step's all-reduce), so nothing was queued. defers_captures captures after a replay:
# the GPU works through it meanwhile. Replaying the step's two all-reduces from a CUDA graph too
# (so that no eager NCCL work is in flight at a capture), with one deferred capture every 3
# replays so the host could build a lead, was tried and removed (session 19): W2 DDP (2 x H200,
# 189cf85, one pass each) 10.13 s, and 10.22 s with the spacing, against 10.38 s; deferred_idle
# stayed 3 of 3, so something else still drains the queue before a capture. Its 2-GPU test (a
# 6-step `hivetune train`) timed out, and a graph that captured a collective must be destroyed
# before destroy_process_group, which otherwise waits for it for good (pytorch#115388).
# Measured since (stats begin_each_s, idle_before_begin; W2 DDP, 2 x H200, f5cd96b): the deferred
# captures' capture_begin returns in 0-0.1 ms and the GPU still had queued work just before it
# (both ranks, both deferred captures). What idles the GPU is the capture's host pass, 0.10-0.26 s,
# outlasting the one replay (~0.09 s) queued ahead of it: the host has no larger lead then.
# Capturing the sizes after each segment count's largest on a worker thread while this thread
# replays (each size taken at a due call, so the run stays deterministic) was tried and removed
# (session 21; the code is in git at d6b00fa). It needed the graphs' dropout seeds in their static
# inputs (capture_begin's generator prologue would otherwise race the replays' own) and the
# worker's own cuBLAS / cuBLASLt handles made before its first capture (made inside one, their
# allocations invalidate it). It lost everywhere: W1 (H100) 10.10 / 10.38 s against 9.97 / 10.01
# with the captures at once (the loop's ~8 ms of host work a step shares the GIL, and the worker
# was 0.65-0.84 s late); W2 under DDP (2 x H100) 10.93 / 10.96 s, and 10.61 s with the loop held
# to 2 replays ahead of the GPU (waiting with the GIL released), against 10.44 / 10.56 / 10.33 s
# with the deferred captures: each capture on the worker took 0.5-0.76 s against 0.1-0.34 s on
# this thread (capture_begin also waits for the NCCL work in flight, which the loop renews each
# step), so the loop waited 0.9-1.5 s for it.
# Above this many matmul TFLOP per micro-batch (4 x linear weights x tokens) the GPU outruns the
# host's dispatch anyway: W2 (7B) with 16 examples (~2,900 tokens: ~82 TFLOP) measured 23.8 s with
# graphs against 21.4 s eager (capture time, padding) and 65 against 40 GiB reserved. With 8
# examples (~46 TFLOP; W2 on 2 GPUs, or 2 x 8 on one) the eager step is dispatch-bound: 6,463
# against ~13,700 tokens/s with 16 (H100, faae9e6). Re-measured with today's graphs (2 x H200,
# cc35b65, GPU 0, after an untimed pass of each): W2's 16-example micro-batches graphed 16.80 s
# (4 sizes, 5% padding; the first graphed pass 19.26 s) against 16.96 s eager: no gain to pay
# their capture and pool memory for.
MAX_TFLOP_PER_MICRO_BATCH = float(os.environ.get("HIVETUNE_GRAPH_MAX_TFLOP", 60.0))  # env: experiments
# Deferred captures (defers_captures) wait until this many replays are queued ahead of the GPU
# (GraphedForwardBackward._lead_enough); HIVETUNE_REFERENCE=capture_lead: 0, one capture after
# every replay; HIVETUNE_CAPTURE_LEAD=n sets it (experiments, tests). Alone it gained nothing
# (sessions 25-26, 2 x H100 and 2 x H200): a capture made with replays queued took 0.3-0.7 s on
# the host against 0.1-0.29 s with the GPU idle, until the preload met its shapes first (below).
# What waits (bench/capture_stall.py, one H100, bfaebca and 7d79771, four 100-ms replays queued):
# - the first capture of a shape whose kernel is new: 391-414 ms in that call (a torch linear),
#   the queue drained, with CUDA_MODULE_LOADING=EAGER too; 0.4-1.3 ms in all for a token count
#   captured, or run eagerly, before with the GPU idle;
# - instantiating a 3,000-node graph (a W2 step's size): 401 ms queued against 34 ms idle (the
#   W2 profile at 5b63908 showed the loop's CUDA calls blocked meanwhile, 76-104 ms), though a
#   capture of a seen token count made meanwhile on another thread did not wait (0.8 ms);
# - not a cudaMalloc (0.6-1.3 ms either way).
# Tried and removed (session 27, 2 x H100; the ratio against one GPU of the same machine):
# - the deferred capture enqueueing nothing on the loop's stream before its host pass, its
#   instantiation at the next lead (5a0917a): 9.84 / 9.92 s against 9.66 / 10.15; replays waited
#   0.6 s for the late instantiations;
# - products inside a capture taking their eager 256-token bucket's cuBLASLt algorithm (0bd961c):
#   10.20 / 10.67 s against 10.13 / 10.26 (lead 3 too: 10.01 / 10.26); the stall moved from
#   ops.blas to torch's linear;
# - the warm-up before the first capture cut to the first layer, the first micro-batch replayed
#   (9c7a5bf): warmup_s 0.25-0.31 s against 0.40, the run 9.60 / 9.68 s against 9.59.
CAPTURE_LEAD = 3  # by default since session 28 (with the four below: see them)
# The four below are on by default since session 28, each with its reference name in
# HIVETUNE_REFERENCE (fastpath's table). W2 under DDP on 2 x H200 (bench/results/ddp-28/): 9.40 /
# 9.27 s with all of them and the lead of 3 against 9.60 / 9.72 s without (b86b9bf, experiment
# variables then); 9.53 / 9.39 s against 9.82 / 9.89 s with the five reference names (12d0b73).
# W1 on one H200: 8.8 / 8.9 s against 9.1 / 9.1 s.
# - graph_preload (GraphedForwardBackward._preload): each deferred size's shapes met once by a
#   capture of the first layers (PRELOAD_LAYERS) while the GPU idles (after the plan); its real
#   capture later meets no new kernel behind queued replays. With the lead of 3 (2 x H100, ff7b4d4 and
#   9c7a5bf): 9.83 / 9.85 s against 9.96 / 10.12 without.
# - plan_on_replay (GraphedForwardBackward._finish_plan): no timing replay (its ~0.09 s of W2 GPU
#   work thrown away); the sizes are planned on the GPU time of the next micro-batch's replay of
#   the largest graph, real work.
# - target_capacity (target_capacities): each planned size holds as many targets as the most its
#   micro-batches bring (the largest size: the most of any), not one a token. The LM head and
#   the loss run on a graph's target rows, pad rows included: W2's targets are 69% of its tokens
#   (responses only), so a 1,536-token graph computed ~540 head rows a micro-batch for nothing.
# - instantiation_wait (GraphedForwardBackward._instantiated): a deferred capture waits (replay
#   by replay, the host never blocks) until no background instantiation is in flight. An
#   instantiation with replays queued waits for the queue to drain (bench/capture_stall.py) and
#   holds up the loop's CUDA calls meanwhile; the W2 timeline at ff7b4d4 showed the 1,408-token
#   capture beginning while the previous one instantiated, and taking 0.41 s.

# graph_preload captures the model cut to this many layers. Two, not one: the first layer's input
# (the frozen embedding's output) needs no gradient, so its backward has no input-gradient
# products; the second layer's has them, at every size as every later layer does. With one layer
# (d679db4 and before), W2 DDP's deferred 1,600-token capture (2 x H200) took 0.33-0.38 s on the
# host, and a 1,344-token one 0.34 s, against 0.09-0.18 s for the others: the pattern of a capture
# meeting a kernel first behind queued replays (bench/capture_stall.py). With two (86db57f, two
# machines, bench/results/ddp-31/): 0.085-0.16 s for every deferred capture, 6 sizes included,
# and one step after the second above 1.3x the median in 8 runs (111 ms); the whole run
# 9.17-9.21 s against 9.14-9.32 s with one layer (within run-to-run noise), the preload (GPU
# idle) 5-15 ms longer a size.
# HIVETUNE_PRELOAD_LAYERS=n sets the count (experiments).
PRELOAD_LAYERS = 2


def preload_layers() -> int:
    """How many first layers graph_preload's captures keep (PRELOAD_LAYERS unless the experiment sets it)."""
    return int(os.environ.get("HIVETUNE_PRELOAD_LAYERS") or PRELOAD_LAYERS)


last_stats: dict = {}  # the most recent GraphedForwardBackward's counters (read by the benchmark)
last_graphed = None  # the most recent one, kept only with HIVETUNE_GRAPH_TIMING=1 (profiling)


def bucket_tokens(n_tokens: int, bucket: int = BUCKET_TOKENS) -> int:
    """Smallest multiple of `bucket` holding n_tokens plus at least one pad token."""
    return (n_tokens + 1 + bucket - 1) // bucket * bucket


def keeps_graphs() -> bool:
    """Whether this torch captures a graph without instantiating it (CUDAGraph(keep_graph=True)
    and instantiate(): torch 2.7 and later), which background instantiation needs."""
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except (TypeError, RuntimeError):
        return False
    return hasattr(torch.cuda.CUDAGraph, "instantiate")


def pad_packed_batch(batch: MicroBatch, tokens: int, pad_id: int = 0, targets: int | None = None) -> MicroBatch:
    """A packed micro-batch padded to `tokens` tokens and `targets` targets (default `tokens`;
    CPU tensors).

    Loss and gradients are those of the unpadded batch: the pad tokens are one extra segment
    (attention stays inside it) and the pad targets carry IGNORE_INDEX.
    """
    layout = batch.layout
    t = batch.input_ids.shape[1]
    extra = tokens - t
    n = batch.target_ids.numel()
    targets = tokens if targets is None else targets
    if batch.input_ids.shape[0] != 1 or not isinstance(layout, Packed):
        raise ValueError("pad_packed_batch takes a packed micro-batch (one row)")
    if extra < 1:
        raise ValueError(f"bucket of {tokens} tokens cannot hold {t} tokens and a pad segment")
    if n > targets:
        raise ValueError(f"bucket of {targets} targets cannot hold {n} targets")
    input_ids = torch.cat([batch.input_ids[0], batch.input_ids.new_full((extra,), pad_id)])
    positions = torch.cat([batch.position_ids[0], torch.arange(extra, dtype=batch.position_ids.dtype)])
    cu = torch.cat([layout.cu_seqlens, torch.tensor([tokens], dtype=layout.cu_seqlens.dtype)])
    target_index = torch.cat([batch.target_index, batch.target_index.new_full((targets - n,), tokens - 1)])
    target_ids = torch.cat([batch.target_ids, batch.target_ids.new_full((targets - n,), IGNORE_INDEX)])
    lengths = tuple(layout.lengths) + (extra,) if layout.lengths else ()
    return MicroBatch(input_ids[None], positions[None], target_index, target_ids,
                      Packed(cu, tokens, lengths), batch.n_examples, batch.n_tokens, batch.dropout_seeds)


def batch_key(batch: MicroBatch, bucket: int = BUCKET_TOKENS) -> tuple[int, int]:
    """A packed micro-batch's graph: (bucket tokens, cu_seqlens entries once padded)."""
    return bucket_tokens(batch.input_ids.shape[1], bucket), len(batch.layout.cu_seqlens) + 1


def planned_micro_batches(run, start: int | None = None, paced: bool = False) -> list[tuple[int, int]]:
    """(tokens, cu_seqlens entries once padded) of every micro-batch of the run's step plan from
    step `start` (default: where the run starts), from the example lengths (collate_packed: one
    segment per example, no padding); under torchrun, of this rank's share of each step
    (Dist.shard), as the training loop cuts it.

    paced: each micro-batch's tokens are the most any rank has at that place of the step (this
    rank's segment count kept). Under DDP the step's all-reduce waits for the slowest rank, so
    a step costs the largest graph any rank replays there: the sizes to plan are for those
    counts. Planned on their own counts, W2's two ranks (93 steps of 8 + 8 examples in random
    order, a capture costed at 2,048 tokens, the 16-token grain) choose [1424, 1568, 1728] and
    [1360, 1472, 1568, 1728], and the slower rank's graphs sum to 142,768 tokens a rank; planned
    on the paced counts, both choose [1424, 1568, 1728]: 142,144 (tests/ops/test_graphs_bucketing.py)."""
    lengths = getattr(run.data, "lengths", None)
    if lengths is None:
        return []

    def micro_tokens(share: list[int]) -> list[int]:  # the tokens of each micro-batch the loop cuts
        return [sum(lengths[j] for j in part) for part in _micro_parts(run, share)]

    def entries(counts: list[int], share: list[int]) -> list[tuple[int, int]]:  # (tokens, cu_seqlens entries)
        return [(tokens, len(part) + 2) for tokens, part in zip(counts, _micro_parts(run, share))]

    out = []
    speeds = rank_speeds(run.parallel.world) if paced and run.parallel.enabled else None
    for shares, mine in _step_shares(run, start):
        if speeds:  # experiments: shares in proportion to speed; the sizes planned on every rank's counts
            for share in shares:
                out += entries(micro_tokens(share), share)
            continue
        counts = micro_tokens(mine)
        if paced:
            for other, share in enumerate(shares):
                if other != run.parallel.rank:
                    theirs = micro_tokens(share)
                    counts = [max(c, t) for c, t in itertools.zip_longest(counts, theirs[:len(counts)], fillvalue=0)]
        out += entries(counts, mine)
    return out


def _step_shares(run, start: int | None):
    """(every rank's share, this rank's) of each step from `start` (default: the run's start)."""
    lengths, parallel = getattr(run.data, "lengths", None), run.parallel
    for step in run.steps[run.start_step if start is None else start:]:
        shares = parallel.shares(step, lengths) if parallel.enabled else [step]
        yield shares, shares[parallel.rank]


def _micro_parts(run, share: list[int]) -> list[list[int]]:
    """A rank's share of a step cut into micro-batches, as the loop cuts it (train.micro_parts)."""
    from hivetune.train.loop import micro_parts

    return micro_parts(run, share)


def planned_micro_targets(run, start: int | None = None) -> list[int]:
    """The target count of each micro-batch planned_micro_batches lists (this rank's own), from
    the examples' counts (TokenizedExamples.n_targets); [] without them."""
    counts = getattr(run.data, "n_targets", None)
    if counts is None or getattr(run.data, "lengths", None) is None:
        return []
    return [sum(counts[j] for j in part) for _, mine in _step_shares(run, start) for part in _micro_parts(run, mine)]


def ranks_agree_at_start(run) -> bool:
    """Whether the graphs' first call may agree with the other ranks (one collective at the
    launch-bound check, one in the plan): under torchrun only when every rank has a micro-batch
    in the run's first step, so that every rank makes that first call at the same place (a rank
    with no example there, e.g. a run resumed at an epoch's short last step, would make it a
    step later, into another collective). One process: True (the collectives are no-ops)."""
    parallel = run.parallel
    if not parallel.enabled:
        return True
    if run.start_step >= len(run.steps):
        return False
    return all(parallel.shares(run.steps[run.start_step], getattr(run.data, "lengths", None)))


def planned_keys(run, bucket: int = BUCKET_TOKENS) -> list[tuple[int, int]]:
    """batch_key of every micro-batch left in the run's step plan (fixed `bucket` grid)."""
    return sorted({(bucket_tokens(t, bucket), segments) for t, segments in planned_micro_batches(run)})


def plan_sizes(tokens: list[int], capture_tokens: float, grain: int = GRAIN,
               size_cost: Callable[[int], float] | None = None) -> list[int]:
    """The graph sizes (multiples of `grain`) that minimise capture cost + padding for these
    micro-batch token counts, a graph's capture counted as `capture_tokens` tokens of GPU work
    (its host pass over the GPU's time per token): each micro-batch takes the smallest size that
    holds it and a pad token. Exact, by dynamic programming over the grain-rounded sizes sorted:
    cost(j) = min over i < j of cost(i) + capture_tokens + the padding of the counts in (i, j]
    padded to size j. W1 (562 micro-batches) at 15,000 tokens a capture (~0.2 s at ~13 us a
    token): 5 graphs and 68,887 pad tokens, against the 256-token grid's 7 graphs and 71,895.

    size_cost (experiments: HIVETUNE_SIZE_COSTS, measured_size_cost): a graph's replay cost by
    size, in tokens of GPU work, in place of the size itself: a micro-batch then costs what its
    size's replay measured, not its token count. The replay time does not grow evenly with the
    size (W2 DDP, 2 x H200: 1,600 tokens took what 1,728 did)."""
    if not tokens:
        return []
    weight = size_cost or (lambda size: size)
    need = sorted({bucket_tokens(t, grain) for t in tokens})
    by_size: dict[int, list[int]] = {}
    for t in tokens:
        by_size.setdefault(bucket_tokens(t, grain), []).append(t)
    n = len(need)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        size, pad = need[j - 1], 0
        for i in range(j - 1, -1, -1):  # sizes i+1..j all padded to size j
            pad += sum(weight(size) - t for t in by_size[need[i]])
            cost = best[i] + capture_tokens + pad
            if cost < best[j]:
                best[j], cut[j] = cost, i
    sizes, j = [], n
    while j > 0:
        sizes.append(need[j - 1])
        j = cut[j]
    return sorted(sizes)


def measured_size_cost(path: str) -> Callable[[int], float]:
    """HIVETUNE_SIZE_COSTS=path (experiments): bench/size_cost.py's JSON lines ({"size": tokens,
    "ms_median": a replay's milliseconds}) as plan_sizes' size_cost: the milliseconds at a size,
    linear between the measured sizes and along the nearest pair's slope beyond them, over the
    median milliseconds a token of the measured sizes (so a capture's cost, in tokens, weighs the
    same). A file without two measured sizes is a UserError naming it."""
    points: dict[int, float] = {}
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read it (HIVETUNE_SIZE_COSTS): {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row, error = parse_json_line(line)
        if error is not None:
            raise UserError(f"{path}:{n}: {error} (HIVETUNE_SIZE_COSTS)")
        if isinstance(row, dict) and "size" in row and "ms_median" in row:
            points[int(row["size"])] = float(row["ms_median"])
    if len(points) < 2:
        raise UserError(f"{path}: HIVETUNE_SIZE_COSTS needs replay times at two sizes or more "
                        f"(bench/size_cost.py's size / ms_median lines), found {len(points)}")
    sizes = sorted(points)
    per_token = sorted(points[s] / s for s in sizes)[len(sizes) // 2]

    def cost(size: int) -> float:
        k = min(max(bisect.bisect_left(sizes, size), 1), len(sizes) - 1)
        lo, hi = sizes[k - 1], sizes[k]
        ms = points[lo] + (points[hi] - points[lo]) * (size - lo) / (hi - lo)
        return ms / per_token

    return cost


def target_capacities(sizes: dict[int, list[int]], micro: list[tuple[int, int]],
                      targets: list[int]) -> dict[tuple[int, int], int]:
    """Each planned graph's target capacity: the most targets among this rank's micro-batches
    (its own tokens, segment count; `targets` alike) that take it (the smallest size above their
    tokens); the largest size of a segment count holds the most of any of them (until the plan is
    made every micro-batch of that count takes it). Keys without a micro-batch keep a target a token."""
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
    slowest (first-time costs), and W1's 562 micro-batches plan 3 graphs at 32,768 (119,447 pad
    tokens: 11.26 and 11.30 s on an H100, 19cfefa and 596717a) against 5 at 16,384 (68,887 pad
    tokens: 10.59-11.11 s in 6 runs), the first ~0.25 s worse at W1's real ~12,000 (~0.12 s a
    capture, ~10 us a token), 7 graphs at 8,192 about as good as 5."""
    return 2.0 ** math.floor(math.log2(max(capture_s / max(gpu_s_per_token, 1e-9), 1.0)))


def defers_captures(capture_s: float, replay_s: float) -> bool:
    """Whether the planned sizes below each segment count's largest (deferrable) are captured one
    after each replay, the host pass overlapping the GPU's work on the replay just queued (until
    its turn, a micro-batch takes the smallest captured size that holds it), rather than all at the
    first micro-batch with the GPU idle: where a replay's GPU time (`replay_s`, at the plan's mean
    micro-batch) covers at least a quarter of a capture's host time (`capture_s`, the largest's, its
    instantiation included). W2 under DDP on 2 x H100: ~0.1 s a replay against 0.1-0.23 s a
    capture, three captures after the largest (~0.45 s of idle GPU at the start); over four pairs
    of runs (5acece1, cd7630d) 0.07 s less on average, inside the spread, each capture outlasting
    its replay. A third (before session 28) left W2 on 2 x H200 (~0.083 s a replay, 0.19-0.24 s a
    capture) deferring in some runs and not in others; deferred, the preload, the lead and the wait
    for instantiations (CAPTURE_LEAD) gain 0.3 s there. W1 (~17 ms a replay, ~0.14 s a capture)
    keeps its captures together: one every 10 or 20 micro-batches measured no gain there (91912cc,
    H200), the host being ~8 ms of each ~18 ms step and the larger graphs' padding costing as much.
    HIVETUNE_REFERENCE=deferred_captures: never."""
    return 4 * replay_s >= capture_s and not forced("deferred_captures")


def deferrable(keys: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """The (tokens, cu_seqlens entries) keys whose capture can wait (defers_captures): all but
    each segment count's largest, so that every micro-batch of the plan has a captured graph
    that holds it from the first step (one that had none would take a grid size, captured when
    met: a graph more)."""
    largest = {}
    for tokens, segments in keys:
        largest[segments] = max(largest.get(segments, 0), tokens)
    return {(t, seg) for t, seg in keys if t < largest[seg]}


def saved_sizes(run) -> dict[int, list[int]] | None:
    """This rank's graph sizes from the checkpoint the run resumed from (train.save_all_ranks
    keeps every rank's), or None: a fresh run, or one resumed on another number of processes
    (whose shares, so whose micro-batches, differ), plans its own. The plan times a capture and a
    replay, and that measurement varies from run to run (W2 on 2 x H100: 2,048 or 4,096 tokens a
    capture at the same commit), so planning again could pick other sizes, other matmul shapes."""
    saved = run.counters.get("graph_sizes")
    if not isinstance(saved, list) or len(saved) != run.parallel.world or saved[run.parallel.rank] is None:
        return None
    return {int(seg): [int(t) for t in sizes] for seg, sizes in saved[run.parallel.rank].items()}


def _first_line(e: Exception) -> str:
    """An exception as one line for the graphs-off note: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def ignoring_loss_fn(loss_fn):
    """The loss function with IGNORE_INDEX targets counting nothing, or None if unknown."""
    if loss_fn is fused_target_loss_sum:
        return lambda h, w, index, ids: fused_target_loss_sum(h, w, index, ids, ignore_index=IGNORE_INDEX)
    if loss_fn is target_loss_sum:  # F.cross_entropy ignores -100 already
        return target_loss_sum
    return None


def micro_step_fn(run, loss_fn):
    """fit's per-micro-batch call ``(batch on the host, step target count) -> detached loss``:
    graphed when run.cfg.cuda_graphs and the run allows it, else train.forward_backward."""
    from hivetune.train.loop import forward_backward

    def eager(batch, n_targets):
        return forward_backward(run, batch.to(run.device), n_targets, loss_fn)

    if not getattr(run.cfg, "cuda_graphs", False) or run.device.type != "cuda":
        return eager
    reason = graphs_unsupported(run, loss_fn)
    if reason:
        print(f"hivetune: CUDA graphs off ({reason}); eager steps", file=sys.stderr)
        return eager
    return GraphedForwardBackward(run, loss_fn, eager)


def graphs_unsupported(run, loss_fn) -> str | None:
    """Why this CUDA run cannot be graphed, or None."""
    if getattr(run, "strategy", "none") == "fsdp":
        return "FSDP sharding"
    if run.scaler is not None:
        return "fp16 loss scaling"
    if run.precision not in ("bf16", "fp16"):
        return f"{run.precision}: flash varlen attention needs bf16"
    if not run.cfg.packing:
        return "packing is off"
    if run.cfg.gradient_checkpointing:
        return "gradient checkpointing"
    if ignoring_loss_fn(loss_fn) is None:
        return "unknown loss function"
    probe = torch.empty(1, 1, 1, 1, dtype=torch.bfloat16, device=run.device)
    if not varlen_supported(probe):
        return "flash varlen attention unavailable"
    return None


class _Bucket:
    """Static device inputs of one graph: one int64 buffer holding input ids, positions, target
    index, target ids, cu_seqlens and the dropout seeds (one host-to-device copy per micro-batch)."""

    def __init__(self, tokens: int, segments: int, n_examples: int, device, seeds: int = 0,
                 targets: int | None = None):
        self.tokens, self.segments, self.seeds = tokens, segments, seeds
        t, c = tokens, tokens if targets is None else targets  # c: the target capacity
        self.targets = c
        self.flat = torch.zeros(2 * t + 2 * c + segments + 1 + seeds, dtype=torch.long, device=device)
        end = 2 * t + 2 * c
        self.cu_src = self.flat[end:end + segments + 1]
        self.cu = torch.zeros(segments + 1, dtype=torch.int32, device=device)
        self.n_targets = torch.ones((), dtype=torch.float32, device=device)
        self.batch = MicroBatch(self.flat[:t].view(1, t), self.flat[t:2 * t].view(1, t),
                                self.flat[2 * t:2 * t + c], self.flat[2 * t + c:end], Packed(self.cu, t, ()),
                                n_examples, 0, self.flat[end + segments + 1:] if seeds else None)
        self.graph = None
        self.ready = None  # background instantiation: the Future of graph.instantiate()
        self.loss = None

    def load(self, padded: MicroBatch, n_targets: int) -> None:
        parts = [padded.input_ids[0], padded.position_ids[0], padded.target_index, padded.target_ids,
                 padded.layout.cu_seqlens.long()]
        if self.seeds:  # a micro-batch without seeds of its own (a caller outside fit): drawn here
            given = padded.dropout_seeds
            parts.append(given.cpu() if given is not None and given.numel() == self.seeds
                         else torch.randint(0, 2**31 - 1, (self.seeds,), dtype=torch.long))
        host = torch.cat(parts)
        # Pinned: the copy is asynchronous, and torch's host allocator keeps the block until it is done.
        self.flat.copy_(host.pin_memory(), non_blocking=True)
        self.n_targets.fill_(float(n_targets))


class GraphedForwardBackward:
    """Callable ``(batch, n_targets) -> loss``, replaying one CUDA graph per token bucket."""

    def __init__(self, run, loss_fn, eager, bucket: int = 0, max_graphs: int = MAX_GRAPHS,
                 defer: bool | None = None):
        from hivetune.model.lora import lora_parameters
        from hivetune.ops.lora_group import GradArena

        self.run, self.eager = run, eager
        self.loss_fn = ignoring_loss_fn(loss_fn)
        # A fixed grid when asked for (experiments: HIVETUNE_GRAPH_BUCKET, bench/profile_step.py
        # --bucket), else the sizes plan_sizes picks at the first capture (self.sizes).
        fixed = bucket or int(os.environ.get("HIVETUNE_GRAPH_BUCKET", 0))
        self.bucket, self.planned = fixed or BUCKET_TOKENS, not fixed
        self.sizes: dict[int, list[int]] = {}  # cu_seqlens entries -> graph sizes (tokens)
        self.grain = int(os.environ.get("HIVETUNE_GRAPH_GRAIN") or GRAIN)
        self.capacity: dict[tuple[int, int], int] = {}  # target_capacity: a new graph's targets
        self.max_graphs = max_graphs
        self.params = lora_parameters(run.model)
        # The persistent gradients, in one buffer: LoRAGroup adds into them (no autograd adds)
        # (and the parameters in a buffer laid out alike, for FusedAdamW's flat step: before capture)
        self.arena = (GradArena(self.params, getattr(run.model, "lora_casts", None), move_params=True)
                      if GradArena.usable(self.params) and not forced("grad_arena") else None)
        self.grads = self.arena.grads if self.arena is not None else [torch.zeros_like(p) for p in self.params]
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=run.device)
        self.background = not forced("graph_instantiate") and keeps_graphs()
        self.agree = ranks_agree_at_start(run)  # whether the first call's choices are agreed across ranks
        self.instantiator = None  # the worker thread instantiating captured graphs (background)
        self.warmed = False
        self.n_seeds = 0  # dropout seeds a micro-batch (set at the warm-up: fit's micro-batches carry them)
        # Whether the planned sizes after the largest are captured one after each replay (see
        # defers_captures); None: as the plan's timing decides. The keys still to capture:
        self.defer, self.pending = defer, []
        # the deferred sizes' buckets, whose shapes a capture of the first layers met (_preload)
        self.preloaded: dict[tuple[int, int], _Bucket] = {}
        # plan_on_replay: the plan left for the next call (_finish_plan), and the calls so far
        self.plan_due: dict | None = None
        self.calls = 0
        self.after_instantiation = not forced("instantiation_wait")
        # A deferred capture waits for a lead of queued replays (_lead_enough); 0: none.
        self.lead = 0 if forced("capture_lead") else int(os.environ.get("HIVETUNE_CAPTURE_LEAD") or CAPTURE_LEAD)
        self.replayed: collections.deque = collections.deque(maxlen=max(self.lead, 1))
        self.waited = 0
        self.off: str | None = None
        self.flops_per_token = 4 * run.model.args.linear_weight_count
        self.replay_events: list | None = [] if os.environ.get("HIVETUNE_GRAPH_TIMING") else None
        self.stats = {"graphs": 0, "replays": 0, "eager": 0, "capture_s": 0.0, "pad_tokens": 0, "tokens": 0,
                      "bucket_tokens": self.bucket if not self.planned else "planned", "sizes": None,
                      "capture_tokens": None, "off": None,
                      "warmup_s": None, "capture_each_s": [],  # where capture_s went
                      # of each capture: the host's time in capture_begin, and whether the GPU had
                      # run out of queued work just before it (a wait there that the queue covered
                      # would leave the GPU idle: what drains the queue before DDP's captures?)
                      "begin_each_s": [], "idle_before_begin": [],
                      "instantiate": "background" if self.background else "in capture",
                      "instantiate_wait_s": 0.0,  # host time replays waited for their graph's instantiation
                      "deferred": 0, "deferred_idle": 0}  # captures after a replay; those the GPU ran dry in
        global last_stats, last_graphed
        last_stats = self.stats
        last_graphed = self if self.replay_events is not None else None

    def __call__(self, batch: MicroBatch, n_targets: int) -> torch.Tensor:
        self.calls += 1
        loss = self._call(batch, n_targets)
        if self.plan_due is not None and self.calls > self.plan_due["call"]:
            self._finish_plan()  # every rank's second call, whatever its path (a collective)
        return loss

    def _call(self, batch: MicroBatch, n_targets: int) -> torch.Tensor:
        if not self.off and not self.buckets and not self.warmed:
            self._check_launch_bound(batch)
        if self.off or not isinstance(batch.layout, Packed):
            self.stats["eager"] += 1
            return self.eager(batch, n_targets)
        self._attach_grads()
        key = self.key_of(batch)
        tokens = key[0]
        bucket = self.buckets.get(key)
        full = bucket is None and len(self.buckets) >= self.max_graphs
        if full or (bucket is not None and not self._ready(bucket)):
            self.stats["eager"] += 1
            return self.eager(batch, n_targets)
        padded = pad_packed_batch(batch, tokens, self.run.pad_id,
                                  bucket.targets if bucket is not None else self.capacity.get(key))
        self.stats["tokens"] += batch.input_ids.shape[1]
        self.stats["pad_tokens"] += tokens - batch.input_ids.shape[1]
        if bucket is None:
            return self._capture(key, batch, padded, n_targets)
        bucket.load(padded, n_targets)
        due = self.plan_due
        if due is not None and key == due["top"] and due["events"] is None:  # the plan's timing
            due["events"] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            due["events"][0].record()
        self._replay(bucket)
        if due is not None and due["events"] is not None and key == due["top"]:
            due["events"][1].record()
        loss = bucket.loss.clone()  # now: the next replay of a graph in this pool may overwrite it
        if self.pending and self._instantiated() and self._lead_enough():
            self._capture_deferred()
        return loss

    def _instantiating(self) -> bool:
        return any(b.ready is not None and not b.ready.done() for b in self.buckets.values())

    def _instantiated(self) -> bool:
        """instantiation_wait: whether no background instantiation is in flight (else
        the deferred capture waits for a later replay; stats held_for_instantiation counts those
        replays). Always True with HIVETUNE_REFERENCE=instantiation_wait."""
        if not self.after_instantiation:
            return True
        busy = self._instantiating()
        if busy:
            self.stats["held_for_instantiation"] = self.stats.get("held_for_instantiation", 0) + 1
        return not busy

    def _lead_enough(self) -> bool:
        """Whether the next deferred capture goes now: once the replay `lead` calls back is still
        queued on the GPU (the host is that many replays ahead, so the GPU has work through the
        capture's host pass), or after 4 x lead replays without such a lead (a host that never
        leads still captures). stats lead_waits: "queued" or "cap", a capture each.
        HIVETUNE_REFERENCE=capture_lead: one capture after every replay, whatever the lead."""
        if not self.lead:
            return True
        done = torch.cuda.Event()
        done.record()
        self.replayed.append(done)
        self.waited += 1
        queued = len(self.replayed) == self.lead and not self.replayed[0].query()
        if queued or self.waited >= 4 * self.lead:
            self.waited = 0
            self.replayed.clear()
            self.stats["lead_waits"] = self.stats.get("lead_waits", []) + [("queued" if queued else "cap")]
            return True
        return False

    def _capture_deferred(self) -> None:
        """The next deferred size, captured while the GPU runs the replay just queued (and what
        was queued before it). stats: deferred counts these captures, deferred_idle those after
        which the replay had finished (the GPU waited for the rest of the host pass)."""
        queued = torch.cuda.Event()
        queued.record()
        key = self.pending.pop(0)
        # stats began_instantiating: deferred captures begun while an instantiation was in flight
        if self._instantiating():
            self.stats["began_instantiating"] = self.stats.get("began_instantiating", 0) + 1
        t0 = time.perf_counter()
        preloaded = self.preloaded.pop(key, None)
        captured = key in self.buckets or self._capture_key(key, preloaded)
        self.stats["capture_s"] = round(self.stats["capture_s"] + time.perf_counter() - t0, 3)
        self.stats["deferred"] += 1
        self.stats["deferred_idle"] += int(queued.query())
        if not captured:
            self.pending = []

    def key_of(self, batch: MicroBatch) -> tuple[int, int]:
        """The graph of a micro-batch: the smallest planned size captured so far that holds it
        and a pad token, with its segment count; the fixed grid's bucket where nothing planned
        holds it."""
        t, segments, n = batch.input_ids.shape[1], len(batch.layout.cu_seqlens) + 1, batch.target_ids.numel()
        size = next((s for s in self.sizes.get(segments, ())
                     if s > t and (s, segments) in self.buckets and n <= self.buckets[(s, segments)].targets), None)
        return (size, segments) if size else batch_key(batch, self.bucket)

    def _check_launch_bound(self, batch: MicroBatch) -> None:
        """Graphs remove host dispatch time (~5 ms a layer); a micro-batch whose matmuls alone
        keep the GPU busier than that gains little and pays capture time and pool memory."""
        tflop = self.flops_per_token * batch.input_ids.numel() / 1e12
        # Under DDP the largest rank's: every rank decides alike, so all of them reach _plan's
        # collective (or none does).
        if self.agree:
            tflop = max(all_gather_objects(self.run.parallel, tflop))
        if tflop > MAX_TFLOP_PER_MICRO_BATCH:
            self._turn_off(f"compute-bound micro-batches, ~{tflop:.0f} TFLOP each")

    def _turn_off(self, reason: str) -> None:
        self.off = self.stats["off"] = reason
        print(f"hivetune: CUDA graphs off ({reason}); eager steps", file=sys.stderr)

    def _replay(self, bucket: _Bucket) -> None:
        if self.replay_events is None:
            bucket.graph.replay()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            bucket.graph.replay()
            end.record()
            self.replay_events.append((bucket.tokens, start, end))
        self.stats["replays"] += 1

    def replay_ms(self) -> dict[int, float]:
        """HIVETUNE_GRAPH_TIMING=1: mean GPU milliseconds of a replay per bucket (after a sync)."""
        torch.cuda.synchronize()
        times: dict[int, list[float]] = {}
        for tokens, start, end in self.replay_events or []:
            times.setdefault(tokens, []).append(start.elapsed_time(end))
        return {t: round(sum(v) / len(v), 3) for t, v in sorted(times.items())}

    def _attach_grads(self) -> None:
        """Point every LoRA .grad at its persistent tensor (the graphs accumulate into those)."""
        if self.arena is not None and all(p.grad is None for p in self.params):  # after zero_grad: one memset
            self.arena.flat.zero_()
            for p, g in zip(self.params, self.grads):
                p.grad = g
            return
        fresh = []
        for p, g in zip(self.params, self.grads):
            current = p.grad
            if current is g:
                continue
            if current is None:
                fresh.append(g)
            else:
                g.copy_(current)
            p.grad = g
        if fresh:
            torch._foreach_zero_(fresh)

    def _body(self, bucket: _Bucket) -> torch.Tensor:
        from hivetune.train.loop import forward_backward

        bucket.cu.copy_(bucket.cu_src)
        return forward_backward(self.run, bucket.batch, bucket.n_targets, self.loss_fn)

    def _capture(self, key, batch: MicroBatch, padded: MicroBatch, n_targets: int) -> torch.Tensor:
        """A key without a graph: returns this micro-batch's loss, having captured what it can.

        The first time, an eager run on the capture stream (cuBLAS workspace, lazy inits) does
        this micro-batch's real work; then the graphs of every key the step plan will meet are
        captured, largest first, so that the smaller ones reuse the shared pool's blocks (capture
        executes nothing, so the static inputs' contents do not matter then). A key the plan did
        not foresee is captured when met, then replayed."""
        t0 = time.perf_counter()
        loss = None
        if not self.warmed:
            # the graphs' dropout seeds come from their static inputs where fit gives them
            self.n_seeds = batch.dropout_seeds.numel() if batch.dropout_seeds is not None else 0
            bucket = _Bucket(key[0], key[1] - 1, padded.n_examples, self.run.device, self.n_seeds)
            bucket.load(padded, n_targets)
            main = torch.cuda.current_stream()
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):
                loss = self._body(bucket)
            main.wait_stream(self.stream)
            loss.record_stream(main)
            self.warmed = True
            self.stats["warmup_s"] = round(time.perf_counter() - t0, 3)  # host time; the GPU runs on
            # The warm-up's activations went back to the ordinary allocator's cache, where the
            # graphs' private pool cannot reuse them: hand them back first, or the run reserves
            # one micro-batch of activations twice (W2 2 x 8: 36.9 GiB reserved, 22.9 allocated).
            torch.cuda.empty_cache()
            keys = self._plan(batch) if self.planned else planned_keys(self.run, self.bucket)
            self._capture_planned(sorted(set(keys) | {self.key_of(batch)}, reverse=True))
        elif self._capture_key(key, None) and self._ready(self.buckets[key]):
            bucket = self.buckets[key]
            bucket.load(padded, n_targets)
            self._replay(bucket)
            loss = bucket.loss.clone()
        self.stats["capture_s"] = round(self.stats["capture_s"] + time.perf_counter() - t0, 3)
        return loss if loss is not None else self.eager(batch, n_targets)

    def _capture_planned(self, keys: list[tuple[int, int]]) -> None:
        """The planned keys (largest first): captured now, or left pending where deferred."""
        keys = keys[:self.max_graphs]
        later = deferrable(keys) if self.defer else set()
        for planned in keys:
            if planned in later and planned not in self.buckets:
                self.pending.append(planned)
            elif self.off or (planned not in self.buckets and not self._capture_key(planned, None)):
                break
        if self.pending and not self.off and not forced("graph_preload"):
            self._preload(self.pending)

    def _finish_plan(self) -> None:
        """plan_on_replay, at every rank's second call: the GPU seconds a token of the replay of
        the largest graph it just queued (waited for: the GPU then idles through the plan's host
        work, as after the timing replay), agreed across ranks, plan the sizes; the ones not
        deferred are captured now. A rank whose second micro-batch took another graph (or none)
        brings no timing, as a rank without the plan's shape at hand does in _plan."""
        due, self.plan_due = self.plan_due, None
        timing = None
        if due["events"] is not None:
            start, end = due["events"]
            end.synchronize()
            timing = (due["capture_s"], start.elapsed_time(end) / 1000 / due["top"][0])
        agreed = all_gather_objects(self.run.parallel, timing) if self.agree else [timing]
        if self.off:
            return
        t0 = time.perf_counter()
        keys = self._sizes_from([t for t in agreed if t is not None], due["micro"])
        self._capture_planned(sorted(set(keys), reverse=True))  # `top` among them: captured already
        self.stats["capture_s"] = round(self.stats["capture_s"] + time.perf_counter() - t0, 3)

    def _plan(self, batch: MicroBatch) -> list[tuple[int, int]]:
        """Capture the largest graph the plan needs and time its capture (the host pass every graph
        costs); the GPU seconds a token come from the next call's replay of it (plan_on_replay:
        plan_due, _finish_plan), or, with HIVETUNE_REFERENCE=plan_on_replay, from a timing replay
        now; then plan_sizes picks the rest. The timing replay runs the warm-up micro-batch,
        padded to the largest size, with the loss divided by infinity: its loss and every
        gradient it adds are exact zeros, and the CUDA generator is set back after it (a resumed
        run draws the masks an unbroken one does)."""
        own = (batch.input_ids.shape[1], len(batch.layout.cu_seqlens) + 1)
        # The whole plan, resumed or not (a resumed run takes its checkpoint's sizes: saved_sizes).
        # Under DDP on the slowest rank's counts (HIVETUNE_REFERENCE=paced_sizes: this rank's own).
        micro = planned_micro_batches(self.run, start=0, paced=not forced("paced_sizes")) or [own]
        top_t, top_segments = max(micro)
        top = (bucket_tokens(top_t, self.grain), top_segments)
        if not forced("target_capacity"):  # the most targets of any micro-batch
            most = max(planned_micro_targets(self.run, start=0), default=top[0])
            self.capacity[top] = min(max(most, batch.target_ids.numel()), top[0])
        t0 = time.perf_counter()
        captured = self._capture_key(top, None) and self._ready(self.buckets[top])
        capture_s = time.perf_counter() - t0  # the host pass and the instantiation, as before background ones
        saved = saved_sizes(self.run)
        if saved is None and not forced("plan_on_replay"):
            # the sizes wait for the next call's replay of `top` (_finish_plan); till then every
            # micro-batch of its segment count takes it
            self.plan_due = {"call": self.calls, "top": top, "capture_s": capture_s, "micro": micro, "events": None}
            self.sizes = {top_segments: [top[0]]}
            self.stats["plan"] = "on the first replay"
            return [top] if captured else []
        timing = None  # (capture seconds, GPU seconds a token), if this rank can measure them
        if captured and saved is None and own[1] == top_segments and own[0] < top[0]:
            big = self.buckets[top]
            big.load(pad_packed_batch(batch, top[0], self.run.pad_id, big.targets), 1)
            big.n_targets.fill_(float("inf"))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            rng = torch.cuda.get_rng_state(self.run.device)  # the replay's dropout draws are not the run's
            start.record()
            big.graph.replay()
            end.record()
            end.synchronize()
            torch.cuda.set_rng_state(rng, self.run.device)
            timing = (capture_s, start.elapsed_time(end) / 1000 / top[0])
        # Every rank reaches this once, whatever its branch (ranks_agree_at_start: else each
        # rank plans on its own timing, as before): under DDP the ranks plan on the
        # mean of their timings, so on the same capture cost (each rank's own, rounded to a power
        # of two, differed: 2,048 and 4,096 tokens, [1408, 1536, 1600, 1728] against
        # [1408, 1536, 1728] on W2's 2 x H100 at 36ab81e), so they replay graphs of the same sizes.
        agreed = all_gather_objects(self.run.parallel, timing) if self.agree else [timing]
        timings = [t for t in agreed if t is not None]
        if not captured:
            return []
        if saved is not None:  # resumed: the sizes the run planned before (the same padding)
            self.sizes = self.run.graph_sizes = saved
            self.stats["sizes"], self.stats["capture_tokens"] = dict(saved), "saved"
            self._set_capacities()
            return ([(size, seg) for seg, sizes in saved.items() for size in sizes]
                    or planned_keys(self.run, self.bucket))
        return self._sizes_from(timings, micro)

    def _sizes_from(self, timings: list[tuple[float, float]], micro: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The planned sizes (self.sizes, run.graph_sizes, stats) from the ranks' (capture
        seconds, GPU seconds a token) and the plan's micro-batches; their keys."""
        if not timings:  # no micro-batch of the plan's shape at hand: the grid
            self.sizes, self.run.graph_sizes = {}, {}
            return planned_keys(self.run, self.bucket)
        capture_s, s_per_token = (sum(t[i] for t in timings) / len(timings) for i in (0, 1))
        capture_tokens = capture_cost_tokens(capture_s, s_per_token)
        # experiments: HIVETUNE_CAPTURE_TOKENS=n (the capture cost plan_sizes weighs), HIVETUNE_GRAPH_DEFER=1 / 0
        capture_tokens = float(os.environ.get("HIVETUNE_CAPTURE_TOKENS") or capture_tokens)
        if self.defer is None and os.environ.get("HIVETUNE_GRAPH_DEFER") in ("0", "1"):
            self.defer = os.environ["HIVETUNE_GRAPH_DEFER"] == "1"
        if self.defer is None:
            self.defer = defers_captures(capture_s, s_per_token * sum(t for t, _ in micro) / len(micro))
        self.stats["capture_tokens"] = round(capture_tokens)
        groups: dict[int, list[int]] = {}
        for t, segments in micro:
            groups.setdefault(segments, []).append(t)
        costs = os.environ.get("HIVETUNE_SIZE_COSTS")  # experiments: measured replay costs by size
        size_cost = measured_size_cost(costs) if costs else None
        self.sizes = self.run.graph_sizes = {seg: plan_sizes(ts, capture_tokens, self.grain, size_cost)
                                             for seg, ts in groups.items()}
        self.stats["sizes"] = {seg: sizes for seg, sizes in self.sizes.items()}
        self._set_capacities()
        return [(size, seg) for seg, sizes in self.sizes.items() for size in sizes]

    def _set_capacities(self) -> None:
        """target_capacity: each planned size's target capacity
        from this rank's own micro-batches (stats target_capacity; a graph already captured keeps
        its own: the largest took the most targets of any micro-batch, in _plan)."""
        if forced("target_capacity"):
            return
        micro, targets = planned_micro_batches(self.run, start=0), planned_micro_targets(self.run, start=0)
        if micro and len(micro) == len(targets):
            self.capacity = target_capacities(self.sizes, micro, targets)
            self.stats["target_capacity"] = {f"{t}x{seg}": c for (t, seg), c in sorted(self.capacity.items())}

    def _preload(self, keys: list[tuple[int, int]]) -> None:
        """Each deferred size met once now, while the GPU idles (the replay the plan timed was
        waited for): a capture of the model cut to its first PRELOAD_LAYERS layers (embedding,
        final norm, head and loss kept), dropped unrun, into the bucket the size's real capture
        takes later. A capture that meets a new shape behind queued replays waits for them
        (graph_preload), which leaves the GPU idle for the rest of the host pass. Skipped with
        activation offload (it plans per layer index). stats: preloaded (sizes), preload_s."""
        model = self.run.model
        layers = model.model.layers
        if len(layers) < 2 or getattr(model, "activation_offload", None) is not None:
            return
        t0, key = time.perf_counter(), keys[0]
        model.model.layers = torch.nn.ModuleList(layers[:preload_layers()])
        try:
            for key in keys:
                bucket = self._new_bucket(key)
                # never instantiated (where torch can keep a graph uninstantiated): nothing of it runs
                self._record(torch.cuda.CUDAGraph(keep_graph=True) if keeps_graphs() else torch.cuda.CUDAGraph(),
                             bucket)
                self.preloaded[key] = bucket
        except Exception as e:  # noqa: BLE001 - as a failed capture: eager from here
            self._capture_failed(f"a preload capture (the first {len(model.model.layers)} layers) of a {key[0]}-token "
                                f"bucket failed: {_first_line(e)}")
        finally:
            model.model.layers = layers
        self.stats["preloaded"] = len(self.preloaded)
        self.stats["preload_s"] = round(time.perf_counter() - t0, 3)

    def _instantiator(self):
        if self.instantiator is None:
            from concurrent.futures import ThreadPoolExecutor

            device = cuda_index(self.run.device)
            self.instantiator = ThreadPoolExecutor(1, thread_name_prefix="hivetune-graphs",
                                                   initializer=torch.cuda.set_device, initargs=(device,))
        return self.instantiator

    def _ready(self, bucket: _Bucket) -> bool:
        """Whether the bucket's graph can replay: waits for its background instantiation; a
        failed one turns graphs off, as a failed capture does."""
        if bucket.ready is None:
            return not self.off
        ready, bucket.ready = bucket.ready, None
        t0 = time.perf_counter()
        try:
            ready.result()
        except Exception as e:  # noqa: BLE001 - as in _capture_key: run eagerly from now on
            self._turn_off(f"instantiating a {bucket.tokens}-token graph failed: {_first_line(e)}")
            return False
        finally:
            self.stats["instantiate_wait_s"] = round(self.stats["instantiate_wait_s"] + time.perf_counter() - t0, 3)
        return True

    def _capture_key(self, key, bucket: _Bucket | None) -> bool:
        t0 = time.perf_counter()
        bucket = bucket or self._new_bucket(key)
        # Background: capture_end leaves the graph uninstantiated, and the worker thread
        # instantiates it (the driver's part, GIL released) while this thread captures the next
        # one or replays others. "thread_local": the capture forbids unsafe CUDA calls in this
        # thread only, so the worker's instantiation is not one of them.
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.background else torch.cuda.CUDAGraph()
        try:
            bucket.loss = self._record(graph, bucket, timed=True)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly from now on
            self._capture_failed(f"capture of a {key[0]}-token bucket failed: {_first_line(e)}")
            return False
        bucket.graph = graph
        if self.background:
            bucket.ready = self._instantiator().submit(graph.instantiate)
        self.buckets[key] = bucket
        self.stats["graphs"] += 1
        self.stats["capture_each_s"].append(round(time.perf_counter() - t0, 3))
        return True

    def _new_bucket(self, key: tuple[int, int]) -> _Bucket:
        """The static inputs of the graph of `key` (tokens, cu_seqlens entries): one example a
        segment but the pad one, the run's dropout seeds, the key's target capacity."""
        return _Bucket(key[0], key[1] - 1, key[1] - 2, self.run.device, self.n_seeds, self.capacity.get(key))

    def _record(self, graph: torch.cuda.CUDAGraph, bucket: _Bucket, timed: bool = False) -> torch.Tensor:
        """The bucket's forward, loss and backward captured into `graph` on the capture stream;
        returns the captured loss. timed: stats idle_before_begin and begin_each_s.

        Not torch.cuda.graph: it synchronises the device first, which would idle the GPU for the
        whole host pass instead of letting it work through the queued replays (capture executes
        nothing, and replays run in stream order after them). capture_begin does run one thing,
        on the capture stream: it zeroes the CUDA generator's graph offset, which a replay
        drawing from the generator reads (not fit's: their seeds are static inputs). Ordered
        after the queued replays, and later work after it (GPU-side waits: the host goes on)."""
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            if timed:
                queued = torch.cuda.Event()
                queued.record(main)
                self.stats["idle_before_begin"].append(queued.query())
            begin = time.perf_counter()
            graph.capture_begin(self.pool, capture_error_mode="thread_local" if self.background else "global")
            if timed:
                self.stats["begin_each_s"].append(round(time.perf_counter() - begin, 4))
            try:
                loss = self._body(bucket)
            finally:
                graph.capture_end()
        main.wait_stream(self.stream)
        return loss

    def _capture_failed(self, reason: str) -> None:
        """After a capture that raised: the device settled, the generator released, eager from here."""
        torch.cuda.synchronize()
        release_generator(self.run.device)
        self._turn_off(reason)


def release_generator(device) -> None:
    """After a failed capture: torch's CUDA generator of `device` as it was, out of the capture
    state the aborted capture left it in (capture_end raised before its epilogue), where every
    later random draw on the device would fail ("Offset increment outside graph capture
    encountered unexpectedly"). Its state is replaced by a clone (seed and offset kept)."""
    generator = torch.cuda.default_generators[cuda_index(device)]
    generator.graphsafe_set_state(generator.clone_state())


def with_buckets(batch: MicroBatch, bucket: int = BUCKET_TOKENS, pad_id: int = 0) -> MicroBatch:
    """The padded batch a graph would see (tests: padding must not change loss or gradients)."""
    return pad_packed_batch(batch, bucket_tokens(batch.input_ids.shape[1], bucket), pad_id)
