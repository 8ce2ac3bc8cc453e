"""Micro-batches: padded rows, or one packed row with per-example positions.

Both carry the loss targets as flat indices into the [B*T] hidden states plus the target ids,
computed on the host, so the loss gathers exactly the target rows with no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hivetune.data.formats import Encoded
from hivetune.ops.attention import Packed


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    target_index: torch.Tensor  # [N] positions in the flattened [B*T] that predict a target
    target_ids: torch.Tensor  # [N] the token each of those positions must predict
    layout: Packed | None  # None: one example per row, right-padded
    n_examples: int
    n_tokens: int  # real (non-pad) tokens
    # int64 [n]: the seeded LoRA dropout's seeds for this micro-batch's forward, one a group call
    # (train.dropout_seeds; None: drawn from torch's CUDA generator, or no seeded dropout)
    dropout_seeds: torch.Tensor | None = None

    def to(self, device) -> "MicroBatch":
        layout = self.layout
        if layout is not None:
            layout = Packed(layout.cu_seqlens.to(device, non_blocking=True), layout.max_seqlen, layout.lengths)
        seeds = self.dropout_seeds.to(device, non_blocking=True) if self.dropout_seeds is not None else None
        return MicroBatch(self.input_ids.to(device, non_blocking=True),
                          self.position_ids.to(device, non_blocking=True),
                          self.target_index.to(device, non_blocking=True),
                          self.target_ids.to(device, non_blocking=True),
                          layout, self.n_examples, self.n_tokens, seeds)


def _targets(example: Encoded, row_start: int) -> tuple[list[int], list[int]]:
    """Position t predicts token t+1: positions row_start+t for each target token t+1."""
    mask, tokens = example.mask, example.ids
    kept = [t for t in range(len(tokens) - 1) if mask[t + 1]]
    return [row_start + t for t in kept], [tokens[t + 1] for t in kept]


def collate_padded(examples: list[Encoded], pad_id: int) -> MicroBatch:
    width = max(len(e.ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    index, ids = [], []
    for row, e in enumerate(examples):
        input_ids[row, : len(e.ids)] = torch.tensor(e.ids)
        i, t = _targets(e, row * width)
        index += i
        ids += t
    positions = torch.arange(width).expand(len(examples), -1).contiguous()
    return MicroBatch(input_ids, positions, torch.tensor(index, dtype=torch.long),
                      torch.tensor(ids, dtype=torch.long), None, len(examples),
                      sum(len(e.ids) for e in examples))


def collate_packed(examples: list[Encoded], pad_to_multiple: int = 1, pad_id: int = 0) -> MicroBatch:
    """All examples in one row; positions restart at 0 for each; attention stays per example."""
    ids, positions, index, targets, cu = [], [], [], [], [0]
    for e in examples:
        i, t = _targets(e, len(ids))
        index += i
        targets += t
        ids += e.ids
        positions += range(len(e.ids))
        cu.append(len(ids))
    real = len(ids)
    pad = -real % pad_to_multiple
    if pad:  # padding forms its own segment, attended only by itself; it is never a target
        ids += [pad_id] * pad
        positions += range(pad)
        cu.append(len(ids))
    lengths = tuple(b - a for a, b in zip(cu, cu[1:]))
    layout = Packed(torch.tensor(cu, dtype=torch.int32), max(lengths), lengths)
    return MicroBatch(torch.tensor([ids]), torch.tensor([positions]), torch.tensor(index, dtype=torch.long),
                      torch.tensor(targets, dtype=torch.long), layout, len(examples), real)
