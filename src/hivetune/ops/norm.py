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
    """The Triton kernels: defined at the first fused call, not at import (triton_util.kernels)."""
    global triton, tl, _keep_eighths, _rms_norm_fwd, _rms_norm_bwd, _row_piece, _row_layout, _row_pieces
    global _norm_drop_piece, _rms_norm_drop_fwd, _grad_in_piece, _norm_dx_piece, _rms_norm_drop_bwd
    import triton
    import triton.language as tl

    from hivetune.ops.dropout import _keep_eighths

    @triton.jit(do_not_specialize=["eps"])
    def _rms_norm_fwd(X, W, Y, RSTD, stride, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        normed = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)  # the reference's x.to(dtype)
        tl.store(Y + row * stride + cols, (w * normed).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_norm_bwd(DY, X, W, RSTD, DX, stride, N, BLOCK: tl.constexpr):
        # y = w * xhat, xhat = x * r, r = (mean(x^2) + eps)^-1/2, w frozen:
        # dx = r * (g - xhat * mean(g * xhat)), g = dy * w
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(RSTD + row)
        xhat = x * r
        g = dy * w
        dx = r * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
        tl.store(DX + row * stride + cols, dx.to(DX.dtype.element_ty), mask=mask)

    # RMSNorm with the LoRA dropout of its output in the same pass (a q/k/v or gate/up group
    # reads norm(x) undropped for its base matmul and dropped for its A matmul). A row of
    # N = 128 G columns is read as _keep_eighths' 8 pieces of [GP, 16] (GP: G to a power of two),
    # so each piece's keep mask comes out of one Philox draw per 8 elements, in its layout.

    @triton.jit
    def _row_piece(X, at, inside):
        return tl.load(X + at, mask=inside, other=0.0).to(tl.float32)

    @triton.jit
    def _row_layout(row, N, GP: tl.constexpr):
        """A row's mask groups (N // 128), their indices g, which are real, and piece 0's
        offsets in the weight (wat) and in the [rows, N] tensor (at); piece q is 16 q further."""
        groups = N // 128
        g = tl.arange(0, GP)
        wat = g[:, None] * 128 + tl.arange(0, 16)[None, :]
        return groups, g, (g < groups)[:, None], wat, row * N + wat

    @triton.jit
    def _row_pieces(X, at, inside):
        return (_row_piece(X, at, inside), _row_piece(X, at + 16, inside), _row_piece(X, at + 32, inside),
                _row_piece(X, at + 48, inside), _row_piece(X, at + 64, inside), _row_piece(X, at + 80, inside),
                _row_piece(X, at + 96, inside), _row_piece(X, at + 112, inside))

    @triton.jit
    def _norm_drop_piece(Y, YD, W, x, rstd, at, yat, wat, inside, keep, scale, WRITE_Y: tl.constexpr):
        w = tl.load(W + wat, mask=inside, other=0.0).to(tl.float32)
        y = (w * (x * rstd).to(YD.dtype.element_ty).to(tl.float32)).to(YD.dtype.element_ty)  # rms_norm's bits
        if WRITE_Y:
            tl.store(Y + yat, y, mask=inside)
        tl.store(YD + at, tl.where(keep, y.to(tl.float32) * scale, 0.0).to(YD.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["eps"])
    def _rms_norm_drop_fwd(X, W, Y, YD, RSTD, SEED, N, Y_STRIDE, eps, thr, scale, GP: tl.constexpr,
                           WRITE_Y: tl.constexpr):
        """One row: Y = rms_norm(X) (with WRITE_Y, and RSTD; Y's rows Y_STRIDE apart) and
        YD = dropout_seeded(Y) (the same mask, element for element)."""
        row = tl.program_id(0).to(tl.int64)
        groups, g, inside, wat, at = _row_layout(row, N, GP)
        yat = row * Y_STRIDE + wat
        x0, x1, x2, x3, x4, x5, x6, x7 = _row_pieces(X, at, inside)
        ss = tl.sum(x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3 + x4 * x4 + x5 * x5 + x6 * x6 + x7 * x7)
        rstd = 1.0 / tl.sqrt(ss / N + eps)
        k0, k1, k2, k3, k4, k5, k6, k7 = _keep_eighths(SEED, row * groups + g, thr)
        _norm_drop_piece(Y, YD, W, x0, rstd, at, yat, wat, inside, k0, scale, WRITE_Y)
        _norm_drop_piece(Y, YD, W, x1, rstd, at + 16, yat + 16, wat + 16, inside, k1, scale, WRITE_Y)
        _norm_drop_piece(Y, YD, W, x2, rstd, at + 32, yat + 32, wat + 32, inside, k2, scale, WRITE_Y)
        _norm_drop_piece(Y, YD, W, x3, rstd, at + 48, yat + 48, wat + 48, inside, k3, scale, WRITE_Y)
        _norm_drop_piece(Y, YD, W, x4, rstd, at + 64, yat + 64, wat + 64, inside, k4, scale, WRITE_Y)
        _norm_drop_piece(Y, YD, W, x5, rstd, at + 80, yat + 80, wat + 80, inside, k5, scale, WRITE_Y)
        _norm_drop_piece(Y, YD, W, x6, rstd, at + 96, yat + 96, wat + 96, inside, k6, scale, WRITE_Y)
        _norm_drop_piece(Y, YD, W, x7, rstd, at + 112, yat + 112, wat + 112, inside, k7, scale, WRITE_Y)
        if WRITE_Y:
            tl.store(RSTD + row, rstd)

    @triton.jit
    def _grad_in_piece(DY, DYD, W, at, dyat, wat, inside, keep, scale, HAS_DYD: tl.constexpr):
        """g = (dy + keep * scale * dyd) * w: the gradient reaching the norm's output through
        both of its uses, the dropout's backward drawn again from the seed."""
        g = tl.load(DY + dyat, mask=inside, other=0.0).to(tl.float32)
        if HAS_DYD:
            g += tl.where(keep, tl.load(DYD + at, mask=inside, other=0.0).to(tl.float32) * scale, 0.0)
        return g * tl.load(W + wat, mask=inside, other=0.0).to(tl.float32)

    @triton.jit
    def _norm_dx_piece(DX, DR, x, g, r, dot, N, at, inside, HAS_DR: tl.constexpr):
        xhat = x * r
        dx = r * (g - xhat * (dot / N))
        if HAS_DR:
            dx += tl.load(DR + at, mask=inside, other=0.0).to(tl.float32)
        tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=inside)

    @triton.jit
    def _rms_norm_drop_bwd(DY, DYD, DR, X, W, RSTD, DX, SEED, N, DY_STRIDE, thr, scale, GP: tl.constexpr,
                           HAS_DYD: tl.constexpr, HAS_DR: tl.constexpr):
        """dx of _rms_norm_drop_fwd given dy (d loss / d Y; rows DY_STRIDE apart), dyd (d loss /
        d YD) and dr, the gradient of the residual stream that bypasses the norm (added here, not
        by autograd): g = (dy + keep * scale * dyd) * w, dx = r (g - xhat mean(g xhat)) + dr."""
        row = tl.program_id(0).to(tl.int64)
        groups, g, inside, wat, at = _row_layout(row, N, GP)
        dyat = row * DY_STRIDE + wat
        k0, k1, k2, k3, k4, k5, k6, k7 = _keep_eighths(SEED, row * groups + g, thr)
        g0 = _grad_in_piece(DY, DYD, W, at, dyat, wat, inside, k0, scale, HAS_DYD)
        g1 = _grad_in_piece(DY, DYD, W, at + 16, dyat + 16, wat + 16, inside, k1, scale, HAS_DYD)
        g2 = _grad_in_piece(DY, DYD, W, at + 32, dyat + 32, wat + 32, inside, k2, scale, HAS_DYD)
        g3 = _grad_in_piece(DY, DYD, W, at + 48, dyat + 48, wat + 48, inside, k3, scale, HAS_DYD)
        g4 = _grad_in_piece(DY, DYD, W, at + 64, dyat + 64, wat + 64, inside, k4, scale, HAS_DYD)
        g5 = _grad_in_piece(DY, DYD, W, at + 80, dyat + 80, wat + 80, inside, k5, scale, HAS_DYD)
        g6 = _grad_in_piece(DY, DYD, W, at + 96, dyat + 96, wat + 96, inside, k6, scale, HAS_DYD)
        g7 = _grad_in_piece(DY, DYD, W, at + 112, dyat + 112, wat + 112, inside, k7, scale, HAS_DYD)
        x0, x1, x2, x3, x4, x5, x6, x7 = _row_pieces(X, at, inside)
        r = tl.load(RSTD + row)
        dot = tl.sum(g0 * x0 + g1 * x1 + g2 * x2 + g3 * x3 + g4 * x4 + g5 * x5 + g6 * x6 + g7 * x7) * r
        _norm_dx_piece(DX, DR, x0, g0, r, dot, N, at, inside, HAS_DR)
        _norm_dx_piece(DX, DR, x1, g1, r, dot, N, at + 16, inside, HAS_DR)
        _norm_dx_piece(DX, DR, x2, g2, r, dot, N, at + 32, inside, HAS_DR)
        _norm_dx_piece(DX, DR, x3, g3, r, dot, N, at + 48, inside, HAS_DR)
        _norm_dx_piece(DX, DR, x4, g4, r, dot, N, at + 64, inside, HAS_DR)
        _norm_dx_piece(DX, DR, x5, g5, r, dot, N, at + 80, inside, HAS_DR)
        _norm_dx_piece(DX, DR, x6, g6, r, dot, N, at + 96, inside, HAS_DR)
        _norm_dx_piece(DX, DR, x7, g7, r, dot, N, at + 112, inside, HAS_DR)


# ---------------------------------------------------------------- autograd Functions

class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n = x2.shape[-1]
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n)
        _rms_norm_fwd[(x2.shape[0],)](x2, weight, y, rstd, x2.stride(0), n, eps, BLOCK=block,
                                      num_warps=min(16, max(1, block // 256)))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        dx = torch.empty_like(x2)
        block = triton.next_power_of_2(x2.shape[-1])
        _rms_norm_bwd[(x2.shape[0],)](dy2, x2, weight, rstd, dx, x2.stride(0), x2.shape[-1], BLOCK=block,
                                      num_warps=min(16, max(1, block // 256)))
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
