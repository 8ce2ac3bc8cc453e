"""LM head + cross-entropy fused and chunked, with the gradient computed in the forward pass.

The LM head is frozen under LoRA, so the only gradient needed is d loss / d hidden:
for a chunk of target rows h [c, H] and head W [V, H],

    logits = h W^T            [c, V]   (fp32 after the matmul)
    loss   = sum(logsumexp(logits) - logits[target])
    dh     = (softmax(logits) - onehot(target)) W      [c, H]

Computing dh right away lets each chunk's [c, V] logits be freed before the next chunk, so
peak memory holds one chunk of logits (chunk_bytes, 256 MiB by default) instead of all N x V
of them plus their softmax and gradient (for W1: 1,200 targets x 151,936 vocab x ~10 bytes =
1.8 GB per micro-batch). The reference path is ``hivetune.ops.loss.target_loss_sum``.
"""

from __future__ import annotations

import torch


class FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
                ignore_index: int | None = None):
        compute_dtype = weight.dtype
        # Rows whose target is ignore_index (padding of a CUDA-graph bucket) add no loss and no
        # gradient; they go through the head as target 0 and are masked after.
        keep = None
        if ignore_index is not None:
            keep = targets != ignore_index
            targets = torch.where(keep, targets, 0)
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        grad_rows = torch.empty(rows.shape, dtype=compute_dtype, device=rows.device) if ctx.needs_input_grad[0] else None
        with torch.autocast(rows.device.type, enabled=False):
            h_all = rows.to(compute_dtype)
            for start in range(0, rows.shape[0], chunk_rows):
                h = h_all[start:start + chunk_rows]
                t = targets[start:start + chunk_rows]
                logits = (h @ weight.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                row_loss = lse - logits.gather(1, t[:, None]).squeeze(1)
                k = keep[start:start + chunk_rows] if keep is not None else None
                total += (row_loss if k is None else row_loss * k).sum()
                if grad_rows is not None:
                    probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                    probs[torch.arange(t.shape[0], device=t.device), t] -= 1.0
                    g = probs.to(compute_dtype) @ weight
                    grad_rows[start:start + chunk_rows] = g if k is None else g * k[:, None]
        ctx.save_for_backward(grad_rows)
        ctx.rows_dtype = rows.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad_rows,) = ctx.saved_tensors
        if grad_rows is None:
            return None, None, None, None, None
        return (grad_rows * grad_total).to(ctx.rows_dtype), None, None, None, None


def chunk_rows_for(vocab: int, chunk_bytes: int = 256 << 20) -> int:
    """Rows per chunk so that one chunk's fp32 logits take at most chunk_bytes."""
    return max(1, chunk_bytes // (vocab * 4))


def fused_target_loss_sum(hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_index: torch.Tensor,
                          target_ids: torch.Tensor, chunk_bytes: int = 256 << 20,
                          ignore_index: int | None = None) -> torch.Tensor:
    """Same value and hidden-gradient as target_loss_sum, with one chunk of logits alive at a time.

    The head must be frozen (LoRA never adapts it): its gradient is not computed. Targets equal
    to ignore_index (when given; -100 as in F.cross_entropy) count nothing.
    """
    if lm_head_weight.requires_grad:
        raise ValueError("fused_target_loss_sum needs a frozen LM head; use target_loss_sum")
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
    return FusedLinearCrossEntropy.apply(rows, lm_head_weight, target_ids,
                                         chunk_rows_for(lm_head_weight.shape[0], chunk_bytes), ignore_index)
