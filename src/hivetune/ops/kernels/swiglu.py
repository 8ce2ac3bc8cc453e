"""The Triton kernels of ops.swiglu (see ops.kernels)."""

import triton
import triton.language as tl

from hivetune.ops.kernels.dropout import _hashed_keep


@triton.jit
def _swiglu_values(G, U, Y, i, n, COLS, STRIDE):
    """(which of i are < n, silu(g) * u there in Y's dtype, rounded as F.silu and the
    product are); gate / up element i sits at row * STRIDE + col, so one kernel reads
    separate tensors (STRIDE = COLS) or the halves of a joined [.., 2 COLS] one."""
    mask = i < n
    at = (i // COLS) * STRIDE + i % COLS
    g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
    return mask, (act * u).to(Y.dtype.element_ty)


@triton.jit
def _swiglu_fwd(G, U, Y, n, COLS, STRIDE, BLOCK: tl.constexpr):
    # y[i] for i < n = rows x COLS
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask, y = _swiglu_values(G, U, Y, i, n, COLS, STRIDE)
    tl.store(Y + i, y, mask=mask)


@triton.jit
def _swiglu_grads(G, U, DG, DU, dy, at, mask):
    # y = g * s(g) * u:  du = dy * g * s,  dg = dy * u * s * (1 + g * (1 - s))
    g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(DU + at, (dy * g * s).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + at, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, G, U, DG, DU, n, COLS, STRIDE, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    dy = tl.load(DY + i, mask=mask, other=0.0).to(tl.float32)
    _swiglu_grads(G, U, DG, DU, dy, (i // COLS) * STRIDE + i % COLS, mask)


@triton.jit
def _swiglu_drop_fwd(G, U, Y, YD, SEED, n, COLS, STRIDE, thr, scale, BLOCK: tl.constexpr,
                     WRITE_Y: tl.constexpr):
    """Y = silu(G) * U (with WRITE_Y) and YD = dropout_hashed(Y), gate / up element i at
    (i // COLS) STRIDE + i % COLS as in _swiglu_fwd."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m, y = _swiglu_values(G, U, YD, i, n, COLS, STRIDE)
    if WRITE_Y:
        tl.store(Y + i, y, mask=m)
    keep = _hashed_keep(SEED, i, thr)
    tl.store(YD + i, tl.where(keep, y.to(tl.float32) * scale, 0.0).to(YD.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_drop_bwd(DY, DYD, G, U, DG, DU, SEED, n, COLS, STRIDE, thr, scale, BLOCK: tl.constexpr):
    """_swiglu_bwd of dy + the dropout's backward of dyd (its mask drawn again)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    at = (i // COLS) * STRIDE + i % COLS
    dy = tl.load(DY + i, mask=m, other=0.0).to(tl.float32)
    keep = _hashed_keep(SEED, i, thr)
    dy += tl.where(keep, tl.load(DYD + i, mask=m, other=0.0).to(tl.float32) * scale, 0.0)
    _swiglu_grads(G, U, DG, DU, dy, at, m)
