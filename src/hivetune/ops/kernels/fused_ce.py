"""The Triton kernels of ops.fused_ce (see ops.kernels)."""

import triton
import triton.language as tl


@triton.jit
def _capped(x, cap, HAS_CAP: tl.constexpr):
    """cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1) (exact at both ends: +-1)."""
    if HAS_CAP:
        x = cap * (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0))
    return x


# TARGETS and LOSS are a chunk's slices, 8- or 4-byte aligned by where the chunk starts: one
# specialization for all (a CUDA graph's capture would otherwise compile another; one load or
# store a row either way)
@triton.jit(do_not_specialize_on_alignment=["TARGETS", "LOSS"])
def _ce_rows(LOGITS, TARGETS, LOSS, stride, V, ignore, cap, BLOCK: tl.constexpr, HAS_CAP: tl.constexpr):
    """One row per program: LOSS[row] = lse - logit[target] (0 for ignored rows), and the row
    overwritten with d loss / d logits = softmax - onehot(target) (zeros when ignored); with
    HAS_CAP over the capped logits, the gradient times 1 - (capped / cap)^2."""
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride
    t = tl.load(TARGETS + row)
    m = tl.full((BLOCK,), -1e30, tl.float32)  # per-lane running max and sum of exp
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        x = tl.where(cols < V, _capped(x, cap, HAS_CAP), float("-inf"))
        new_m = tl.maximum(m, x)
        s = s * tl.exp(m - new_m) + tl.exp(x - new_m)
        m = new_m
    row_max = tl.max(m, 0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), 0))
    keep = t != ignore
    tt = tl.where(keep, t, 0)
    x_t = _capped(tl.load(base + tt).to(tl.float32), cap, HAS_CAP)
    tl.store(LOSS + row, tl.where(keep, lse - x_t, 0.0))
    w = tl.where(keep, 1.0, 0.0)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _capped(tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32), cap, HAS_CAP)
        p = tl.exp(x - lse) - tl.where(cols == tt, 1.0, 0.0)
        if HAS_CAP:
            p = p * (1.0 - (x / cap) * (x / cap))
        tl.store(base + cols, (p * w).to(LOGITS.dtype.element_ty), mask=cols < V)
