"""A packed micro-batch as a CUDA graph sees it: padded to a graph size, in static device inputs.

A graph fixes every shape and address. pad_packed_batch pads T real tokens to a graph size: the
pad tokens form their own segment of ``cu_seqlens`` (attention never crosses a segment), so
real tokens see exactly what they saw unpadded, and the pad targets carry IGNORE_INDEX, which
the loss ignores (no loss, no gradient). Bucket holds one graph's static inputs.
"""

from __future__ import annotations

import torch

from hivetune.core.device import FP16_NO_GRAPHS, cuda_index
from hivetune.data.batch import MicroBatch
from hivetune.ops.attention import Packed
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.loss import target_loss_sum
from hivetune.plan.graph_sizes import BUCKET_TOKENS, bucket_tokens

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index; fused_target_loss_sum takes it too


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


def with_buckets(batch: MicroBatch, bucket: int = BUCKET_TOKENS, pad_id: int = 0) -> MicroBatch:
    """The padded batch a graph would see (tests: padding must not change loss or gradients)."""
    return pad_packed_batch(batch, bucket_tokens(batch.input_ids.shape[1], bucket), pad_id)


def ignoring_loss_fn(loss_fn):
    """The loss function with IGNORE_INDEX targets counting nothing, or None if unknown."""
    if loss_fn is fused_target_loss_sum:
        return lambda h, w, index, ids, softcap=None: fused_target_loss_sum(h, w, index, ids, ignore_index=IGNORE_INDEX,
                                                                             softcap=softcap)
    if loss_fn is target_loss_sum:  # F.cross_entropy ignores -100 already
        return target_loss_sum
    return None


def step_refusal(run) -> str | None:
    """Why no training step of this run can be graphed (the SFT and the preference step alike):
    FSDP sharding, fp16 loss scaling, a precision without flash varlen attention; else None."""
    if getattr(run, "strategy", "none") == "fsdp":
        return "FSDP sharding"
    if run.scaler is not None:
        return FP16_NO_GRAPHS
    if run.precision not in ("bf16", "fp16"):
        return f"{run.precision}: flash varlen attention needs bf16"
    return None


def release_generator(device) -> None:
    """After a failed capture: torch's CUDA generator of `device` as it was, out of the capture
    state the aborted capture left it in (capture_end raised before its epilogue), where every
    later random draw on the device would fail ("Offset increment outside graph capture
    encountered unexpectedly"). Its state is replaced by a clone (seed and offset kept)."""
    generator = torch.cuda.default_generators[cuda_index(device)]
    generator.graphsafe_set_state(generator.clone_state())


def first_line(e: Exception) -> str:
    """An exception as one line for the graphs-off note: its type and its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


class Bucket:
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
