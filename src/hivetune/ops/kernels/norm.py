"""The Triton kernels of ops.norm (see ops.kernels)."""

import triton
import triton.language as tl

from hivetune.ops.kernels.dropout import _keep_eighths


@triton.jit
def _row_starts(rows, H, stride_t, stride_h):
    """Where each row of x starts: row r is head r % H of token r // H (H = 1: rows stride_t apart)."""
    return (rows // H) * stride_t + (rows % H) * stride_h


@triton.jit(do_not_specialize=["eps"])
def _rms_norm_fwd(X, W, Y, RSTD, M, H, stride_t, stride_h, N, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows a program; y is written as contiguous [M, N] rows
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live = rows < M
    mask = live[:, None] & (cols < N)[None, :]
    x = tl.load(X + _row_starts(rows, H, stride_t, stride_h)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    normed = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)  # the reference's x.to(dtype)
    tl.store(Y + rows[:, None] * N + cols[None, :], (w[None, :] * normed).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=live)


@triton.jit
def _rms_norm_bwd(DY, X, W, RSTD, DX, M, H, stride_t, stride_h, N, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # y = w * xhat, xhat = x * r, r = (mean(x^2) + eps)^-1/2, w frozen:
    # dx = r * (g - xhat * mean(g * xhat)), g = dy * w; dy and dx contiguous [M, N]
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live = rows < M
    mask = live[:, None] & (cols < N)[None, :]
    x = tl.load(X + _row_starts(rows, H, stride_t, stride_h)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    at = rows[:, None] * N + cols[None, :]
    dy = tl.load(DY + at, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    r = tl.load(RSTD + rows, mask=live, other=0.0)
    xhat = x * r[:, None]
    g = dy * w[None, :]
    dx = r[:, None] * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None])
    tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=mask)


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
