"""The loop's side of CUDA graphs: whether a run is graphed, and what its size plan reads.

micro_step_fn gives fit its per-micro-batch call, graphed (train.replay) where the run allows
it. The graphs plan their sizes over every micro-batch of the step plan, known before the first
step from the example lengths; this module lists them as the loop cuts them (the run's steps,
this rank's share, micro_parts), with the processes' agreement (all_gather) and the sizes a
resumed run planned before (saved in checkpoints, one entry per rank).
"""

from __future__ import annotations

import itertools
import sys

import torch

from hivetune.ops.attention import varlen_supported
from hivetune.parallel.distributed import all_gather_objects
from hivetune.plan.graph_sizes import BUCKET_TOKENS, grid_keys
from hivetune.train import step
from hivetune.train.graph_batch import ignoring_loss_fn, step_refusal
from hivetune.train.replay import GraphedForwardBackward, PlanInputs


def micro_step_fn(run, loss_fn):
    """fit's per-micro-batch call ``(batch on the host, step target count) -> detached loss``:
    graphed when run.cfg.cuda_graphs and the run allows it, else step.forward_backward."""

    def eager(batch, n_targets):
        return step.forward_backward(run, batch.to(run.device), n_targets, loss_fn)

    if not getattr(run.cfg, "cuda_graphs", False) or run.device.type != "cuda":
        return eager
    reason = graphs_unsupported(run, loss_fn)
    if reason:
        print(f"hivetune: CUDA graphs off ({reason}); eager steps", file=sys.stderr)
        return eager
    return graphed(run, loss_fn, eager)


def graphed(run, loss_fn, eager, **options) -> GraphedForwardBackward:
    """The run's GraphedForwardBackward: step.forward_backward captured with the loss that ignores
    pad targets; the plan's inputs read at its first capture; the sizes it plans kept in
    run.graph_sizes (checkpoints save them). options: bucket, max_graphs, defer (tests)."""
    ignoring = ignoring_loss_fn(loss_fn)
    agree = ranks_agree_at_start(run)
    planned: list[PlanInputs] = []

    def plan():  # once, at the first capture
        if not planned:
            planned.append(plan_inputs(run))
        return planned[0]

    def body(batch, n_targets):
        return step.forward_backward(run, batch, n_targets, ignoring)

    def gather(value):
        return all_gather_objects(run.parallel, value)

    def keep_sizes(sizes):
        run.graph_sizes = sizes

    return GraphedForwardBackward(body, eager, run.model, run.device, run.pad_id, plan=plan,
                                  gather=gather if agree else None, on_sizes=keep_sizes, **options)


def graphs_unsupported(run, loss_fn) -> str | None:
    """Why this CUDA run cannot be graphed, or None."""
    refusal = step_refusal(run)
    if refusal:
        return refusal
    if not run.cfg.packing:
        return "packing is off"
    if ignoring_loss_fn(loss_fn) is None:
        return "unknown loss function"
    probe = torch.empty(1, 1, 1, 1, dtype=torch.bfloat16, device=run.device)
    if not varlen_supported(probe):
        return "flash varlen attention unavailable"
    return None


def plan_inputs(run) -> PlanInputs:
    """What the graphs' size plan reads of the run (replay.PlanInputs)."""
    own = planned_micro_batches(run, start=0)
    micro = planned_micro_batches(run, start=0, paced=True) if run.parallel.enabled else own
    upcoming = own if run.start_step == 0 else planned_micro_batches(run)
    return PlanInputs(micro, own, planned_micro_targets(run, start=0), upcoming, saved_sizes(run))


def planned_micro_batches(run, start: int | None = None, paced: bool = False) -> list[tuple[int, int]]:
    """(tokens, cu_seqlens entries once padded) of every micro-batch of the run's step plan from
    step `start` (default: where the run starts), from the example lengths (collate_packed: one
    segment per example, no padding); under torchrun, of this rank's share of each step
    (Dist.shard), as the training loop cuts it.

    paced: each micro-batch's tokens are the most any rank has at that place of the step (this
    rank's segment count kept). Under DDP the step's all-reduce waits for the slowest rank, so
    a step costs the largest graph any rank replays there: the sizes to plan are for those
    counts, and every rank plans the same sizes (tests/ops/test_graphs_bucketing.py)."""
    lengths = getattr(run.data, "lengths", None)
    if lengths is None:
        return []

    def micro_tokens(share: list[int]) -> list[int]:  # the tokens of each micro-batch the loop cuts
        return [sum(lengths[j] for j in part) for part in step.micro_parts(run, share)]

    out = []
    for shares, mine in _step_shares(run, start):
        counts = micro_tokens(mine)
        if paced:
            for other, share in enumerate(shares):
                if other != run.parallel.rank:
                    theirs = micro_tokens(share)
                    counts = [max(c, t) for c, t in itertools.zip_longest(counts, theirs[:len(counts)], fillvalue=0)]
        out += [(tokens, len(part) + 2) for tokens, part in zip(counts, step.micro_parts(run, mine))]
    return out


def planned_keys(run, bucket: int = BUCKET_TOKENS) -> list[tuple[int, int]]:
    """batch_key of every micro-batch left in the run's step plan (fixed `bucket` grid)."""
    return grid_keys(planned_micro_batches(run), bucket)


def _step_shares(run, start: int | None):
    """(every rank's share, this rank's) of each step from `start` (default: the run's start)."""
    lengths, parallel = getattr(run.data, "lengths", None), run.parallel
    for example_ids in run.steps[run.start_step if start is None else start:]:
        shares = parallel.shares(example_ids, lengths) if parallel.enabled else [example_ids]
        yield shares, shares[parallel.rank]


def planned_micro_targets(run, start: int | None = None) -> list[int]:
    """The target count of each micro-batch planned_micro_batches lists (this rank's own), from
    the examples' counts (TokenizedExamples.n_targets); [] without them."""
    counts = getattr(run.data, "n_targets", None)
    if counts is None or getattr(run.data, "lengths", None) is None:
        return []
    return [sum(counts[j] for j in part) for _, mine in _step_shares(run, start)
            for part in step.micro_parts(run, mine)]


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


def saved_sizes(run) -> dict[int, list[int]] | None:
    """This rank's graph sizes from the checkpoint the run resumed from (loop.save_all_ranks
    keeps every rank's), or None: a fresh run, or one resumed on another number of processes
    (whose shares, so whose micro-batches, differ), plans its own. The plan times a capture and a
    replay, and that timing varies from run to run, so planning again could pick other sizes,
    other matmul shapes."""
    saved = run.counters.get("graph_sizes")
    if not isinstance(saved, list) or len(saved) != run.parallel.world or saved[run.parallel.rank] is None:
        return None
    return {int(seg): [int(t) for t in sizes] for seg, sizes in saved[run.parallel.rank].items()}
