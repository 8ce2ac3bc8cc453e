"""The fp32 gradients of the LoRA parameters that ops.lora_group's backward makes: matmuls with
an fp32 result from bf16 / fp16 inputs (cuBLAS writes fp32, so no cast kernel), added into the
parameters' .grad where those wait for them (grads_into), and the buffer that holds every
.grad as one (GradArena).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hivetune.ops import blas

if TYPE_CHECKING:
    from hivetune.ops.lora_casts import CastCache


_MM_OUT_DTYPE: bool | None = None  # whether torch.mm takes out_dtype (tried once)


def mm_fp32(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """alpha a @ b with a float32 result: one kernel on CUDA for bf16 / fp16 inputs (cuBLAS
    writes fp32), else the matmul then a cast (a no-op for fp32 inputs)."""
    global _MM_OUT_DTYPE
    if a.is_cuda and a.dtype != torch.float32 and blas.available(a.device):
        return blas.gemm(a, b, alpha=alpha, out_dtype=torch.float32)
    if alpha != 1.0:
        out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
        add_mm_fp32_(out, a, b, alpha)
        return out
    if _MM_OUT_DTYPE is not False and a.is_cuda and a.dtype != torch.float32:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            return out
        except (TypeError, RuntimeError):  # torch without mm(out_dtype=)
            _MM_OUT_DTYPE = False
    return (a @ b).float()


_ADDMM_OUT_DTYPE: bool | None = None  # whether torch.addmm takes out_dtype with out= (tried once)


def add_mm_fp32_(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """into (fp32) += alpha a @ b. On CUDA with bf16 / fp16 inputs the addition rides in
    cuBLAS's epilogue (beta = 1); elsewhere the product then the add, which is what autograd's
    gradient accumulation does (the same bits)."""
    global _ADDMM_OUT_DTYPE
    if a.is_cuda and a.dtype != torch.float32 and blas.available(a.device):
        blas.gemm(a, b, into, alpha, 1.0)
        return
    if _ADDMM_OUT_DTYPE is not False and a.is_cuda and a.dtype != torch.float32:
        try:
            torch.addmm(into, a, b, alpha=alpha, out_dtype=torch.float32, out=into)
            _ADDMM_OUT_DTYPE = True
            return
        except (TypeError, RuntimeError):  # torch without addmm(out_dtype=)
            _ADDMM_OUT_DTYPE = False
    into.add_(mm_fp32(a, b), alpha=alpha)


def grads_into(params, joined_rows: int = 0) -> tuple | None:
    """The .grad tensors the backward adds into (autograd then has nothing to accumulate), or
    None where it must hand fresh gradients to autograd: a parameter without a .grad yet (the
    first micro-batch of an eager step, which autograd takes as it is, no copy), a .grad autograd
    would not simply add to, or grad mode on (a double backward). `joined_rows`: the .grads must
    also be consecutive in one buffer (GradArena), returned as one [n r, d] view."""
    grads = []
    for p in params:
        g = p.grad
        if g is None or g.dtype != p.dtype or g.shape != p.shape or not g.is_contiguous():
            return None
        grads.append(g)
    if torch.is_grad_enabled():
        return None
    if not joined_rows:
        return tuple(grads)
    first = grads[0]
    step = first.numel() * first.element_size()
    if any(g.data_ptr() != first.data_ptr() + i * step for i, g in enumerate(grads)):
        return None
    return (first.as_strided((joined_rows, first.shape[1]), (first.shape[1], 1)),)


class GradArena:
    """The LoRA parameters' gradients as views of one flat buffer, each group's A gradients
    consecutive (one [n r, d] block: LoRAGroup adds dA of q/k/v with one matmul), for training
    that keeps its gradients between micro-batches (CUDA graphs). Zeroing them is one kernel,
    and LoRAGroup's backward adds each gradient into its view (grads_into) instead of handing
    autograd a fresh tensor to add: W1 ran 336 such adds a micro-batch, 0.47 ms of GPU time and
    a kernel launch each. `casts`: the model's CastCache (its groups), or None.

    `move_params`: the parameters' values move into a buffer laid out like the gradients' (each
    becomes a view of it), so that FusedAdamW steps them all with one kernel over flat tensors.
    Before any CUDA graph is captured: a graph reads its parameters at the addresses it saw."""

    def __init__(self, params: list, casts: "CastCache | None", move_params: bool = False):
        order, seen = [], set()
        wanted = {id(p) for p in params}
        for a, b, _, _ in (casts.slots.values() if casts is not None else ()):
            for p in (*a, *b):
                if id(p) in wanted and id(p) not in seen:
                    order.append(p)
                    seen.add(id(p))
        order += [p for p in params if id(p) not in seen]
        self.flat = torch.zeros(sum(p.numel() for p in order), dtype=params[0].dtype, device=params[0].device)
        views, at = {}, 0
        for p in order:
            views[id(p)] = self.flat[at:at + p.numel()].view(p.shape)
            at += p.numel()
        self.grads = [views[id(p)] for p in params]  # in the order of `params`
        if move_params:
            self.params = torch.empty_like(self.flat)
            with torch.no_grad():
                for p in params:
                    view = self.params[views[id(p)].storage_offset():][:p.numel()].view(p.shape)
                    view.copy_(p)
                    p.data = view

    @staticmethod
    def usable(params: list) -> bool:
        return bool(params) and all(p.dtype == params[0].dtype and p.device == params[0].device for p in params)
