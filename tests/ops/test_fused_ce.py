"""Fused, chunked LM-head cross-entropy against the plain reference (loss and d/d hidden)."""

from __future__ import annotations

import pytest
import torch

from hivetune.ops.fused_ce import chunk_rows_for, fused_target_loss_sum
from hivetune.ops.loss import target_loss_sum

CASES = [  # (dtype, rows, vocab, hidden, chunk_bytes, rtol)
    (torch.float32, 37, 1003, 24, 4 * 1003 * 5, 1e-5),  # 8 chunks of 5 rows, odd sizes
    (torch.float32, 64, 512, 64, 1 << 30, 1e-5),  # one chunk
    (torch.bfloat16, 50, 777, 32, 4 * 777 * 7, 2e-2),
]


@pytest.mark.parametrize("dtype,rows,vocab,hidden,chunk_bytes,rtol", CASES)
def test_fused_matches_reference(dtype, rows, vocab, hidden, chunk_bytes, rtol):
    torch.manual_seed(0)
    states = torch.randn(2, rows, hidden, dtype=dtype)
    weight = (torch.randn(vocab, hidden) / hidden**0.5).to(dtype)
    target_index = torch.randperm(2 * rows)[: rows + 3]
    target_ids = torch.randint(0, vocab, (target_index.numel(),))

    ref_h = states.clone().requires_grad_(True)
    ref = target_loss_sum(ref_h, weight, target_index, target_ids)
    ref.backward()
    fused_h = states.clone().requires_grad_(True)
    fused = fused_target_loss_sum(fused_h, weight, target_index, target_ids, chunk_bytes=chunk_bytes)
    (fused * 0.5).backward()  # a non-unit upstream gradient must scale dh

    assert fused.dtype == torch.float32
    assert fused.item() == pytest.approx(ref.item(), rel=rtol)
    assert torch.allclose(fused_h.grad.float() * 2, ref_h.grad.float(), rtol=rtol, atol=rtol * 1e-2)
    assert ref_h.grad.abs().sum() > 0


def test_chunk_rows_bound_the_logits():
    assert chunk_rows_for(151936) == (256 << 20) // (151936 * 4) == 441
    assert chunk_rows_for(10**12) == 1


def test_trainable_head_is_refused():
    weight = torch.randn(10, 4, requires_grad=True)
    with pytest.raises(ValueError, match="frozen LM head"):
        fused_target_loss_sum(torch.randn(1, 3, 4), weight, torch.tensor([0]), torch.tensor([1]))
