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

On GPUs with Triton each chunk's softmax and gradient are one kernel (``_ce_rows``): it reads the
bf16 logits that the matmul wrote, finds each row's log-sum-exp in fp32, and writes the
gradient (softmax - onehot) back over the logits in place; the next matmul turns it into dh.
The plain-PyTorch chunk (the CPU path and the oracle) runs about 15 kernels over fp32 copies:
on W1 the CE was ~3 ms of a ~20 ms step, and its three fp32 copies of a chunk were at the peak
of memory. So a chunk is sized by its compute-dtype logits: ``chunk_rows_for(vocab, bytes_per)``.

With `softcap` (Gemma 2's final logit cap) the CE is over c = cap * tanh(x / cap) of the head's
logits x, and the chain rule adds one factor: dx = (softmax(c) - onehot) * (1 - (c / cap)^2).
The kernel caps each logit as it reads it; the PyTorch chunk caps them in place and makes the
factor once the log-sum-exp's temporary is gone (no more fp32 chunks alive than uncapped).
"""

from __future__ import annotations

import torch

from hivetune.ops import blas
from hivetune.ops.triton_util import fused_ok, kernels, triton

CE_BLOCK = 4096  # vocabulary columns per step of the kernel's two passes over a row
CHUNK_BYTES = 256 << 20  # one chunk's logits (chunk_rows_for); plan.memory sizes the loss with it


@kernels
def _define_kernels():
    """The Triton kernels (ops.kernels.fused_ce): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, _capped, _ce_rows
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.fused_ce import _capped, _ce_rows


def triton_ce_ok(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the chunks take the Triton kernel (a CUDA bf16 / fp16 head with Triton installed)."""
    return triton is not None and weight.dtype in (torch.bfloat16, torch.float16) and fused_ok(weight) \
        and rows.is_cuda


def ce_rows(logits, targets, row_loss, ignore: int, softcap: float | None) -> None:
    """One _ce_rows launch over a chunk of logits [c, V] (turned into d loss / d logits in place)."""
    _ce_rows[(logits.shape[0],)](logits, targets, row_loss, logits.stride(0), logits.shape[1], ignore,
                                 0.0 if softcap is None else float(softcap), BLOCK=CE_BLOCK,
                                 HAS_CAP=softcap is not None, num_warps=8)


def chunk_ce(logits: torch.Tensor, targets: torch.Tensor, softcap: float | None, grad: bool):
    """The PyTorch chunk: (per-row CE [c], d CE / d logits [c, V] or None) of fp32 logits [c, V],
    capped first with softcap; the gradient is computed in place of `logits`.

    Capped or not, one [c, V] buffer is held beside `logits` at a time (logsumexp's x - max, then
    with softcap the factor 1 - (c / cap)^2), so a chunk of chunk_rows_for's size holds what the
    uncapped one does (plan.memory's LOSS_CHUNK_COPIES)."""
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)  # c = cap tanh(x / cap), in place
    lse = torch.logsumexp(logits, dim=-1)
    row_loss = lse - logits.gather(1, targets[:, None]).squeeze(1)
    if not grad:
        return row_loss, None
    # d cap tanh(x / cap) / dx = 1 - tanh^2 = 1 - (c / cap)^2, made before c turns into the softmax
    slope = logits.div(softcap).square_().neg_().add_(1.0) if softcap is not None else None
    probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the (capped) logits
    probs[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
    if slope is not None:
        probs.mul_(slope)
    return row_loss, probs


def _triton_chunks(h_all, weight, targets, chunk_rows, ignore_index, grad_rows, softcap):
    """The chunk loop with one Triton kernel per chunk for the softmax and its gradient."""
    row_loss = torch.empty(h_all.shape[0], dtype=torch.float32, device=h_all.device)
    vocab = weight.shape[0]
    ignore = -1 if ignore_index is None else int(ignore_index)  # target ids are never negative
    # One logits buffer for every chunk: `logits = h @ W^T` in the loop held the next chunk's
    # logits beside the last one's (W2: 0.25 GiB more at the peak of memory, the loss).
    buf = h_all.new_empty((min(chunk_rows, h_all.shape[0]), vocab))
    for start in range(0, h_all.shape[0], chunk_rows):
        h = h_all[start:start + chunk_rows]
        logits = buf[:h.shape[0]]  # [c, V] in the compute dtype; the kernel turns it into the gradient
        blas.gemm(h, weight.t(), logits)
        ce_rows(logits, targets[start:start + chunk_rows], row_loss[start:], ignore, softcap)
        if grad_rows is not None:
            blas.gemm(logits, weight, grad_rows[start:start + chunk_rows])
    return row_loss.sum()


class FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
                ignore_index: int | None = None, softcap: float | None = None):
        compute_dtype = weight.dtype
        grad_rows = torch.empty(rows.shape, dtype=compute_dtype, device=rows.device) if ctx.needs_input_grad[0] else None
        ctx.rows_dtype = rows.dtype
        if triton_ce_ok(rows, weight):
            with torch.autocast(rows.device.type, enabled=False):
                total = _triton_chunks(rows.to(compute_dtype), weight, targets, chunk_rows, ignore_index, grad_rows,
                                       softcap)
            ctx.save_for_backward(grad_rows)
            return total
        # Rows whose target is ignore_index (padding of a CUDA-graph bucket) add no loss and no
        # gradient; they go through the head as target 0 and are masked after.
        keep = None
        if ignore_index is not None:
            keep = targets != ignore_index
            targets = torch.where(keep, targets, 0)
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        with torch.autocast(rows.device.type, enabled=False):
            h_all = rows.to(compute_dtype)
            for start in range(0, rows.shape[0], chunk_rows):
                h = h_all[start:start + chunk_rows]
                t = targets[start:start + chunk_rows]
                row_loss, dlogits = chunk_ce((h @ weight.t()).float(), t, softcap, grad_rows is not None)
                k = keep[start:start + chunk_rows] if keep is not None else None
                total += (row_loss if k is None else row_loss * k).sum()
                if grad_rows is not None:
                    g = dlogits.to(compute_dtype) @ weight
                    grad_rows[start:start + chunk_rows] = g if k is None else g * k[:, None]
                del dlogits  # freed before the next chunk's logits: two [chunk, V] buffers at most
        ctx.save_for_backward(grad_rows)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad_rows,) = ctx.saved_tensors
        if grad_rows is None:
            return None, None, None, None, None, None
        return (grad_rows * grad_total).to(ctx.rows_dtype), None, None, None, None, None


def chunk_rows_for(vocab: int, chunk_bytes: int = CHUNK_BYTES, bytes_per_logit: int = 4) -> int:
    """Rows per chunk so that one chunk's logits take at most chunk_bytes (fp32 logits in the
    PyTorch chunk; the Triton kernel's are the head's dtype, 2 bytes)."""
    return max(1, chunk_bytes // (vocab * bytes_per_logit))


def fused_target_loss_sum(hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_index: torch.Tensor,
                          target_ids: torch.Tensor, chunk_bytes: int = CHUNK_BYTES,
                          ignore_index: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Same value and hidden-gradient as target_loss_sum, with one chunk of logits alive at a time.

    The head must be frozen (LoRA never adapts it): its gradient is not computed. Targets equal
    to ignore_index (when given; -100 as in F.cross_entropy) count nothing. softcap: the CE of
    softcap * tanh(logits / softcap) (Gemma 2's final_logit_softcapping).
    """
    if lm_head_weight.requires_grad:
        raise ValueError("fused_target_loss_sum needs a frozen LM head; use target_loss_sum")
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
    per = lm_head_weight.element_size() if triton_ce_ok(rows, lm_head_weight) else 4
    return FusedLinearCrossEntropy.apply(rows, lm_head_weight, target_ids,
                                         chunk_rows_for(lm_head_weight.shape[0], chunk_bytes, per), ignore_index,
                                         softcap)
