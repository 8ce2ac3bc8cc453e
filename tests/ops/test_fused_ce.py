"""Fused, chunked LM-head cross-entropy against the plain reference (loss and d/d hidden), with
and without Gemma 2's final logit soft-cap; the Triton row kernel against the PyTorch chunk (on
a GPU, or on the CPU under TRITON_INTERPRET=1 with Triton installed)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hivetune.ops import triton_util
from hivetune.ops.fused_ce import ce_rows, chunk_ce, chunk_rows_for, fused_target_loss_sum
from hivetune.ops.loss import cap_logits, target_loss_sum

RUNS_TRITON = triton_util.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # (dtype, rows, vocab, hidden, chunk_bytes, rtol)
    (torch.float32, 37, 1003, 24, 4 * 1003 * 5, 1e-5),  # 8 chunks of 5 rows, odd sizes
    (torch.float32, 64, 512, 64, 1 << 30, 1e-5),  # one chunk
    (torch.bfloat16, 50, 777, 32, 4 * 777 * 7, 2e-2),
]


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("dtype,rows,vocab,hidden,chunk_bytes,rtol", CASES)
def test_fused_matches_reference(dtype, rows, vocab, hidden, chunk_bytes, rtol, softcap):
    torch.manual_seed(0)
    states = torch.randn(2, rows, hidden, dtype=dtype)
    weight = (torch.randn(vocab, hidden) / hidden**0.5).to(dtype)  # logits up to ~4: a cap of 1.5 binds
    target_index = torch.randperm(2 * rows)[: rows + 3]
    target_ids = torch.randint(0, vocab, (target_index.numel(),))

    ref_h = states.clone().requires_grad_(True)
    ref = target_loss_sum(ref_h, weight, target_index, target_ids, softcap=softcap)
    ref.backward()
    fused_h = states.clone().requires_grad_(True)
    fused = fused_target_loss_sum(fused_h, weight, target_index, target_ids, chunk_bytes=chunk_bytes,
                                  softcap=softcap)
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


def test_softcapped_loss_is_the_ce_of_capped_logits():
    """Against the formula written out (and it differs from the uncapped loss), ignored rows
    counting nothing."""
    torch.manual_seed(1)
    states, weight = torch.randn(1, 30, 16), torch.randn(50, 16)
    index, ids = torch.arange(30), torch.randint(0, 50, (30,))
    ids[::4] = -100
    logits = states[0] @ weight.t()
    capped = 5.0 * torch.tanh(logits / 5.0)
    keep = ids != -100
    want = (torch.logsumexp(capped, -1) - capped.gather(1, ids.clamp(min=0)[:, None])[:, 0])[keep].sum()
    h = states.clone().requires_grad_(True)
    got = fused_target_loss_sum(h, weight, index, ids, ignore_index=-100, softcap=5.0)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert target_loss_sum(states, weight, index, ids, softcap=5.0).item() == pytest.approx(want.item(), rel=1e-6)
    assert abs(fused_target_loss_sum(states, weight, index, ids, ignore_index=-100).item() - want.item()) > 1.0
    h_ref = states.clone().requires_grad_(True)
    F.cross_entropy(cap_logits(h_ref[0] @ weight.t(), 5.0), ids, reduction="sum").backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)
    assert h.grad[0, ::4].abs().max() == 0 and h.grad.abs().max() > 1e-2


@pytest.mark.skipif(not RUNS_TRITON, reason="needs Triton on a GPU (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_triton_rows_match_the_pytorch_chunk(softcap):
    """The kernel's per-row CE and d CE / d logits against chunk_ce on the same bf16 logits
    (V = 5,000 spans two of its column blocks); ignored rows give zeros."""
    assert triton_util.load_kernels()
    torch.manual_seed(2)
    logits = (torch.randn(6, 5000) * 4).to(torch.bfloat16).to(DEVICE)
    targets = torch.tensor([0, 4999, 17, -100, 2500, 4096], device=DEVICE)
    row_loss = torch.empty(6, dtype=torch.float32, device=DEVICE)
    grad = logits.clone()
    ce_rows(grad, targets, row_loss, -100, softcap)
    keep = targets != -100
    want_loss, want_grad = chunk_ce(logits.float(), targets.clamp(min=0), softcap, grad=True)
    torch.testing.assert_close(row_loss, torch.where(keep, want_loss, 0.0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad.float(), want_grad * keep[:, None], rtol=2e-2, atol=1e-4)
