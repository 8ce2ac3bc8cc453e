"""RMSNorm as one Triton kernel each way, and RMSNorm with the LoRA dropout of its output in the
same pass, beside the plain-PyTorch reference.

rms_norm saves the bf16 input and one fp32 rstd for backward (the reference: fp32 input, fp32
normalised, bf16 normalised, 10 H bytes a token); the weight is frozen under LoRA, so there is
no weight gradient. Rounding follows the reference (bf16 after the scaling), so the forward
matches it to about one bf16 ulp; the gradient is computed in fp32 from the saved input.
"""

from __future__ import annotations

import torch

from hivetune.ops import dropout
from hivetune.ops.dropout import keep_threshold
from hivetune.ops.triton_util import fused_ok, kernels, triton


# ---------------------------------------------------------------- references (the oracle)

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * x / sqrt(mean(x^2) + eps), the statistic in fp32 as transformers does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


@kernels
def _define_kernels():
    """The Triton kernels (ops.kernels.norm): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, _keep_eighths, _rms_norm_fwd, _rms_norm_bwd, _row_piece, _row_layout, _row_pieces
    global _norm_drop_piece, _rms_norm_drop_fwd, _grad_in_piece, _norm_dx_piece, _rms_norm_drop_bwd
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.norm import (_keep_eighths, _rms_norm_fwd, _rms_norm_bwd, _row_piece, _row_layout, _row_pieces, _norm_drop_piece,
        _rms_norm_drop_fwd, _grad_in_piece, _norm_dx_piece, _rms_norm_drop_bwd)


# ---------------------------------------------------------------- autograd Functions

def rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x as rows of its last dim without a copy where its layout allows: (t, H, stride_t,
    stride_h), row r of x starting at (r // H) * stride_t + (r % H) * stride_h of t's storage.
    H = 1 where the leading dims fold into one; H = x.shape[-2] where only those before it fold
    (q or k of a Qwen3 layer: heads of a [B, T, H, D] view into the joined q/k/v projection);
    else a contiguous copy."""
    n = x.shape[-1]
    if x.stride(-1) == 1:
        try:
            x2 = x.view(-1, n)
            return x2, 1, x2.stride(0), 0
        except RuntimeError:
            pass
        if x.dim() >= 3:
            try:
                x3 = x.view(-1, x.shape[-2], n)
                return x3, x3.shape[1], x3.stride(0), x3.stride(1)
            except RuntimeError:
                pass
    x2 = x.reshape(-1, n).contiguous()
    return x2, 1, x2.stride(0), 0


def _norm_grid(n: int) -> tuple[int, dict]:
    """Rows a program and warps: ~2,048 elements a program (narrow rows, q/k norms' 128, go 16
    to a program instead of one warp each)."""
    block = triton.next_power_of_2(n)
    per = max(1, 2048 // block)
    return per, {"ROWS": per, "BLOCK": block, "num_warps": min(16, max(1, per * block // 256))}


class RMSNormFunction(torch.autograd.Function):
    """Saves x as it came where its rows can be read in place (rows_of; the q/k norms of a joined
    projection keep a view of it, which attention's v keeps anyway) and an fp32 1/rms per row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        shape, n = x.shape, x.shape[-1]
        t, heads, stride_t, stride_h = rows_of(x)
        m = x.numel() // n
        y = torch.empty(shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        per, meta = _norm_grid(n)
        _rms_norm_fwd[(triton.cdiv(m, per),)](t, weight, y, rstd, m, heads, stride_t, stride_h, n, eps, **meta)
        ctx.save_for_backward(t, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        t, weight, rstd = ctx.saved_tensors
        n = t.shape[-1]
        m = rstd.shape[0]
        t, heads, stride_t, stride_h = rows_of(t)  # as saved: an offload may hand back a copy
        dy2 = dy.reshape(m, n).contiguous()
        dx = torch.empty((m, n), dtype=t.dtype, device=t.device)
        per, meta = _norm_grid(n)
        _rms_norm_bwd[(triton.cdiv(m, per),)](dy2, t, weight, rstd, dx, m, heads, stride_t, stride_h, n, **meta)
        return dx.view(dy.shape), None, None


# Warps of the norm kernels with the dropout (benchmarks/fused_sweep.py times others);
# 0: by the row's width.
NORM_DROP_WARPS = 0


def _norm_drop_warps(gp: int) -> int:
    return NORM_DROP_WARPS or min(8, max(1, gp // 2))


def _norm_drop_launch(x2, weight, eps, seed, p, write_y: bool, room: int = 0):
    n = x2.shape[1]
    yd = torch.empty_like(x2)
    y = x2.new_empty((x2.shape[0], n + room))[:, :n] if write_y else yd
    rstd = torch.empty(x2.shape[0] if write_y else 1, dtype=torch.float32, device=x2.device)
    thr, scale = keep_threshold(p)
    gp = triton.next_power_of_2(n // 128)
    _rms_norm_drop_fwd[(x2.shape[0],)](x2, weight, y, yd, rstd, seed, n, y.stride(0), eps, thr, scale, GP=gp,
                                       WRITE_Y=write_y, num_warps=_norm_drop_warps(gp))
    return y, yd, rstd


class RMSNormDropFunction(torch.autograd.Function):
    """(rms_norm(x), dropout_seeded(rms_norm(x), seed, p), x) in one kernel each way (see
    rms_norm_dropped). Saves what RMSNormFunction saves (x and 1/rms) and the seed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, seed: torch.Tensor, p: float, room: int):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros read
        x2 = x.reshape(-1, x.shape[-1])
        y, yd, rstd = _norm_drop_launch(x2, weight, eps, seed, p, True, room)
        ctx.save_for_backward(x2, weight, rstd, seed)
        ctx.p, ctx.x_shape = p, x.shape
        return y.view(x.shape), yd.view(x.shape), x  # x as it is: autograd hands its gradient here

    @staticmethod
    def backward(ctx, dy, dyd, dr):
        x2, weight, rstd, seed = ctx.saved_tensors
        n = x2.shape[1]
        dx = torch.empty_like(x2)
        if dy is None:
            dy = torch.zeros_like(x2)
        thr, scale = keep_threshold(ctx.p)
        gp = triton.next_power_of_2(n // 128)
        dyd, dr = (t.reshape(x2.shape).contiguous() if t is not None else None for t in (dyd, dr))
        dy = dy.reshape(x2.shape)
        if dy.stride(1) != 1:  # rows may lie apart (a wide LoRA group's gradient), not elements
            dy = dy.contiguous()
        _rms_norm_drop_bwd[(x2.shape[0],)](dy, dyd if dyd is not None else dy, dr if dr is not None else dy, x2,
                                           weight, rstd, dx, seed, n, dy.stride(0), thr, scale, GP=gp,
                                           HAS_DYD=dyd is not None, HAS_DR=dr is not None,
                                           num_warps=_norm_drop_warps(gp))
        return dx.view(ctx.x_shape), None, None, None, None, None


# ---------------------------------------------------------------- functional wrappers

def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm takes the Triton kernel (whose output is the same bits in and out of
    autocast, so a backward may recompute it)."""
    return fused_ok(x) and weight.dtype == x.dtype and not weight.requires_grad and x.shape[-1] <= 65536


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if rms_norm_fused(x, weight):
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_dropped_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm_dropped takes x: the Triton norm (rms_norm_fused), the seeded dropout's
    conditions, rows of a multiple of 128 columns (the mask's groups then stay within a row).
    Else the norm, then dropout_seeded."""
    return rms_norm_fused(x, weight) and dropout.seeded_dropout_ok(x) and x.shape[-1] % 128 == 0


def rms_norm_dropped(x: torch.Tensor, weight: torch.Tensor, eps: float, seed: torch.Tensor, p: float,
                     room: int = 0):
    """(y, yd, x'): y = rms_norm(x), yd = dropout_seeded(y, seed, p), and x' = x for the residual
    add that bypasses the norm, whose gradient the norm's backward then adds in its own kernel
    (no add by autograd). For a LoRA group reading y in its base matmul and yd in its A matmul
    (lora.FusedProjections.normed): against rms_norm then dropout_seeded, one kernel and one
    read of y less forward, and backward the dropout's masked add and the residual's add ride in
    the norm's backward kernel. rms_norm_dropped_ok(x, weight) must hold.
    `room`: y's rows lie that many elements further apart, the columns after each row left to
    the caller (a wide LoRA group writes its A matmul's output there: ops.lora_group)."""
    return RMSNormDropFunction.apply(x, weight, eps, seed, p, room)


def rms_norm_dropped_only(x: torch.Tensor, weight: torch.Tensor, eps: float, seed: torch.Tensor,
                          p: float) -> torch.Tensor:
    """rms_norm_dropped's yd alone, outside autograd (the same bits): a LoRA group's backward
    recomputes its dropped input from the norm's input with it."""
    x2 = x.reshape(-1, x.shape[-1])
    return _norm_drop_launch(x2, weight, eps, seed, p, False)[1].view(x.shape)
