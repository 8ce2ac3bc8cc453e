"""Several processes, one run: torch.distributed under torchrun (DDP or FSDP2).

torchrun sets RANK / LOCAL_RANK / WORLD_SIZE; `init` joins the process group (NCCL on CUDA,
gloo on the CPU). The global batch of an optimizer step is batch_size * grad_accum * world
examples: every rank knows the whole step (the same seeded plan), trains on its share
(ids[rank::world]), and the gradient is the sum over ranks of sum(token losses) / (the
step's target tokens over all ranks), so it equals the one-process gradient of that step.

- ddp: the LoRA parameters are replicated; after each step's micro-batches their gradients
  are summed over ranks by one all-reduce of a flat buffer (allreduce_gradients). Not the
  DistributedDataParallel wrapper: its reducer hooks into autograd, so a CUDA graph cannot
  hold the backward, and graphs are what keep a rank's share of a small step (W2: 8 examples
  a GPU) from waiting on the host's kernel dispatch. LoRA gradients are small (W2: 80M fp32,
  one NCCL all-reduce of ~1-2 ms over NVLink), so the overlap with the backward that DDP's
  buckets buy is worth less than the graphs.
- fsdp: FSDP2 (`fully_shard`) shards each decoder layer's parameters, the frozen base
  included, for models whose base does not fit on one GPU; gradients are reduce-scattered
  (averaged, the same factor world applies).

Rank 0 alone writes files (config, metrics, checkpoints, adapter); the others wait at barriers.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hivetune.core.errors import UserError
from hivetune.core.fileio import die_with_parent
from hivetune.ops.adamw import one_buffer
from hivetune.data.shares import balanced_split
from hivetune.plan import plan

STRATEGIES = ("auto", "ddp", "fsdp")


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, ids: list, lengths=None) -> list:
        """This rank's share of a step's examples: every world-th one, from its rank; with the
        examples' token lengths, shares of equal size (as far as the count divides) whose token
        sums are balanced, so that no rank waits on a longer one every step. Every rank computes
        the same split; each share keeps the step's order."""
        if not self.enabled:
            return ids
        return self.shares(ids, lengths)[self.rank]

    def shares(self, ids: list, lengths=None) -> list[list]:
        """Every rank's share of a step's examples (shard's split, indexed by rank)."""
        if lengths is None:
            return [ids[r::self.world] for r in range(self.world)]
        return balanced_split(ids, lengths, self.world)


def env_world() -> Dist:
    """The rank layout torchrun gave this process (one process without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Dist()
    return Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def init(device_name: str) -> Dist:
    """Join the process group when launched by torchrun with more than one process."""
    d = env_world()
    if not d.enabled or (dist.is_available() and dist.is_initialized()):
        return d
    if not dist.is_available():
        raise UserError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts each worker in a session of its own: a torchrun killed with SIGKILL would
        # leave its workers training into the run folder, holding its lock
        die_with_parent()
    use_cuda = device_name != "cpu" and torch.cuda.is_available()
    if use_cuda:
        if d.local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {d.local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                            f"use --nproc-per-node {torch.cuda.device_count()} or fewer")
        torch.cuda.set_device(d.local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            device_id=torch.device("cuda", d.local_rank) if use_cuda else None)
    return d


def device_for(d: Dist, device: torch.device) -> torch.device:
    """cuda -> cuda:LOCAL_RANK under torchrun."""
    if d.enabled and device.type == "cuda":
        return torch.device("cuda", d.local_rank)
    return device


def on_main(d: Dist, fn, *args):
    """Run fn on rank 0 only and hand its result (or its UserError) to every rank, so a
    refusal on rank 0 stops all ranks with the same message instead of hanging them."""
    if not d.enabled:
        return fn(*args)
    box = [None, None]
    if d.is_main:
        try:
            box[0] = fn(*args)
        except UserError as e:
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise UserError(box[1])
    return box[0]


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def all_gather_objects(d: Dist, obj) -> list:
    if not d.enabled:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def sum_across(d: Dist, tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (one collective); returns the tensor."""
    if d.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def choose_strategy(strategy: str, base_bytes: int, device: torch.device, cfg=None, model_args=None,
                    total_bytes: int = 0) -> str:
    """auto: DDP when the planner says the whole run fits on one of these GPUs, FSDP2 otherwise
    (without a plan: DDP when the frozen base takes at most half a GPU); on the CPU always DDP."""
    if strategy != "auto":
        return strategy
    if device.type != "cuda":
        return "ddp"
    total = total_bytes or torch.cuda.get_device_properties(device).total_memory
    if cfg is not None and model_args is not None:
        try:  # the planner sizes a micro-batch at max_length tokens an example without data: an upper bound
            verdict = plan(dataclasses.replace(cfg, data=""), memory_gib=total / 2**30, model_args=model_args)
            return "ddp" if verdict.fits else "fsdp"
        except (UserError, ValueError, KeyError) as e:
            print(f"hivetune: note: no plan for the DDP / FSDP choice ({e}); deciding by the base's size",
                  file=sys.stderr)
    return "ddp" if base_bytes <= total // 2 else "fsdp"


def wrap(model: torch.nn.Module, strategy: str, d: Dist, device: torch.device) -> torch.nn.Module:
    """The module the loop calls forward on: the model itself for ddp (replicated; gradients
    all-reduced after each step), or the model after FSDP2 has sharded it in place (its
    layers first, then the root)."""
    if strategy == "ddp":
        # The frozen base is the same on every rank (loaded from the same files) and the LoRA
        # init is seeded alike on every rank: nothing to broadcast.
        return model
    from torch.distributed.fsdp import fully_shard  # loaded here: FSDP's import is slow, and only FSDP runs need it

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def gradient_sync(module: torch.nn.Module, strategy: str, enabled: bool):
    """Context for one micro-batch: FSDP reduce-scatters only on the last one (ddp syncs after
    the step, in allreduce_gradients)."""
    if strategy == "fsdp":
        module.set_requires_gradient_sync(enabled)
    return nullcontext()


def allreduce_gradients(params: list[torch.nn.Parameter], d: Dist) -> None:
    """ddp: every parameter's gradient becomes its sum over ranks, in one collective over a
    flat copy (a rank with no examples this step contributes zeros)."""
    if not d.enabled:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    arena = one_buffer(grads)  # CUDA graphs' GradArena: reduced where it is, no copies
    if arena is not None:
        dist.all_reduce(arena, op=dist.ReduceOp.SUM)
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    torch._foreach_copy_(grads, torch._utils._unflatten_dense_tensors(flat, grads))


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    """`hivetune train --nproc-per-node N ...` -> the torchrun command that runs the same
    train on N local processes (single node; multi-node: call torchrun yourself)."""
    rest, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        rest.append(a)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "hivetune", *rest]
