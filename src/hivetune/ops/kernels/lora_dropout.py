"""The Triton kernels of ops.lora_dropout (see ops.kernels)."""

import triton
import triton.language as tl

from hivetune.ops.kernels.dropout import _keep_eighths


# The LoRA A matmuls with the dropout inside. x is row-major [T, D] with D a multiple of 128,
# so a row's 128-column blocks are _keep_eighths' groups: (t D + k0) / 128.


@triton.jit
def _x_piece(X, rows, cols, D, inside, keep):
    x = tl.load(X + rows[:, None].to(tl.int64) * D + cols[None, :], mask=inside[:, None], other=0.0)
    return x * keep.to(x.dtype)  # (tl.where here trips an assertion in Triton 3.6's LLVM lowering)


@triton.jit
def _a_piece_t(A, cols, rr, D, R):  # A[rr, cols]^T: [16, RP]
    return tl.load(A + rr[None, :] * D + cols[:, None], mask=rr[None, :] < R, other=0.0)


@triton.jit
def _dot_piece(acc, X, A, rows, cols, rr, D, R, inside, keep):
    return tl.dot(_x_piece(X, rows, cols, D, inside, keep), _a_piece_t(A, cols, rr, D, R), acc)


@triton.jit
def _last_arrival(COUNT, i, splits):
    """Whether this program is the last of `splits` to finish block i (its partial result
    stored before): the one that then sums every split's partial, in split order (the same
    bits whichever program comes last), and resets the counter for the next launch. The
    barrier orders the program's stores before the counter's release; the acquire orders
    the partial loads after it."""
    tl.debug_barrier()
    last = tl.atomic_add(COUNT + i, 1, sem="acq_rel") == splits - 1
    tl.debug_barrier()
    return last


@triton.jit(do_not_specialize=["T", "cols_per_split", "splits"])
def _drop_mm(X, A, OUT, PART, COUNT, SEED, T, D, R, thr, scale, cols_per_split, splits,
             BT: tl.constexpr, RP: tl.constexpr):
    """OUT [T, R] = scale * (X * keep) @ A^T, the columns cut into `splits`: each program
    stores its split's fp32 partial to PART[s] and the last of a row block sums them."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    split = tl.program_id(1)
    inside = rows < T
    rr = tl.arange(0, RP)
    j = tl.arange(0, 16)
    acc = tl.zeros((BT, RP), dtype=tl.float32)
    start = split * cols_per_split
    for k0 in range(start, tl.minimum(start + cols_per_split, D), 128):
        k_0, k_1, k_2, k_3, k_4, k_5, k_6, k_7 = _keep_eighths(SEED, rows * (D // 128) + k0 // 128, thr)
        acc = _dot_piece(acc, X, A, rows, k0 + j, rr, D, R, inside, k_0)
        acc = _dot_piece(acc, X, A, rows, k0 + 16 + j, rr, D, R, inside, k_1)
        acc = _dot_piece(acc, X, A, rows, k0 + 32 + j, rr, D, R, inside, k_2)
        acc = _dot_piece(acc, X, A, rows, k0 + 48 + j, rr, D, R, inside, k_3)
        acc = _dot_piece(acc, X, A, rows, k0 + 64 + j, rr, D, R, inside, k_4)
        acc = _dot_piece(acc, X, A, rows, k0 + 80 + j, rr, D, R, inside, k_5)
        acc = _dot_piece(acc, X, A, rows, k0 + 96 + j, rr, D, R, inside, k_6)
        acc = _dot_piece(acc, X, A, rows, k0 + 112 + j, rr, D, R, inside, k_7)
    at = rows[:, None] * R + rr[None, :]
    inside2 = inside[:, None] & (rr[None, :] < R)
    if splits == 1:
        tl.store(OUT + at, (acc * scale).to(OUT.dtype.element_ty), mask=inside2)
    else:
        tl.store(PART + split.to(tl.int64) * T * R + at, acc * scale, mask=inside2)
        if _last_arrival(COUNT, tl.program_id(0), splits):
            total = tl.zeros((BT, RP), dtype=tl.float32)
            for s in range(0, splits):
                total += tl.load(PART + s * T * R + at, mask=inside2, other=0.0, cache_modifier=".cg")
            tl.store(OUT + at, total.to(OUT.dtype.element_ty), mask=inside2)
            tl.atomic_xchg(COUNT + tl.program_id(0), 0)


@triton.jit
def _grad_piece(OUT, acc, rr, cols, D, R):
    tl.store(OUT + rr[:, None] * D + cols[None, :], acc, mask=rr[:, None] < R)


@triton.jit
def _sum_splits(OUT, PART, rr, cols, D, R, splits, RP: tl.constexpr, ACC: tl.constexpr):
    m = rr[:, None] < R
    at = rr[:, None] * D + cols[None, :]
    total = tl.zeros((RP, 16), dtype=tl.float32)
    for s in range(0, splits):
        total += tl.load(PART + s * R * D + at, mask=m, other=0.0, cache_modifier=".cg")
    if ACC:  # OUT + (the splits' sum): the bits of adding the finished product to OUT
        total = tl.load(OUT + at, mask=m, other=0.0) + total
    tl.store(OUT + at, total, mask=m)


@triton.jit(do_not_specialize=["T", "rows_per_split", "splits"])
def _drop_mm_grad(G, X, OUT, PART, COUNT, SEED, T, D, R, thr, scale, rows_per_split, splits,
                  BT: tl.constexpr, RP: tl.constexpr, ACC: tl.constexpr):
    """OUT [R, 128-column block] (fp32) = scale * G^T @ (X * keep): the gradient of A
    (G = d loss / d xa, [T, R]); with ACC, OUT += that. The rows are cut into `splits`: each
    program stores its split's sum to PART[s], and the last of a column block adds them in
    split order (and then OUT's value, with ACC). One summation order per output element:
    deterministic."""
    k0 = tl.program_id(0) * 128
    split = tl.program_id(1)
    rr = tl.arange(0, RP)
    j = tl.arange(0, 16)
    a0 = tl.zeros((RP, 16), dtype=tl.float32)
    a1 = tl.zeros((RP, 16), dtype=tl.float32)
    a2 = tl.zeros((RP, 16), dtype=tl.float32)
    a3 = tl.zeros((RP, 16), dtype=tl.float32)
    a4 = tl.zeros((RP, 16), dtype=tl.float32)
    a5 = tl.zeros((RP, 16), dtype=tl.float32)
    a6 = tl.zeros((RP, 16), dtype=tl.float32)
    a7 = tl.zeros((RP, 16), dtype=tl.float32)
    start = split * rows_per_split
    end = tl.minimum(start + rows_per_split, T)
    for t0 in range(start, end, BT):
        rows = t0 + tl.arange(0, BT)
        inside = rows < end
        k_0, k_1, k_2, k_3, k_4, k_5, k_6, k_7 = _keep_eighths(SEED, rows * (D // 128) + k0 // 128, thr)
        g = tl.load(G + rows[None, :] * R + rr[:, None], mask=inside[None, :] & (rr[:, None] < R), other=0.0)
        a0 = tl.dot(g, _x_piece(X, rows, k0 + j, D, inside, k_0), a0)
        a1 = tl.dot(g, _x_piece(X, rows, k0 + 16 + j, D, inside, k_1), a1)
        a2 = tl.dot(g, _x_piece(X, rows, k0 + 32 + j, D, inside, k_2), a2)
        a3 = tl.dot(g, _x_piece(X, rows, k0 + 48 + j, D, inside, k_3), a3)
        a4 = tl.dot(g, _x_piece(X, rows, k0 + 64 + j, D, inside, k_4), a4)
        a5 = tl.dot(g, _x_piece(X, rows, k0 + 80 + j, D, inside, k_5), a5)
        a6 = tl.dot(g, _x_piece(X, rows, k0 + 96 + j, D, inside, k_6), a6)
        a7 = tl.dot(g, _x_piece(X, rows, k0 + 112 + j, D, inside, k_7), a7)
    out = PART + split.to(tl.int64) * R * D  # PART is OUT itself when there is one split
    _grad_piece(out, a0 * scale, rr, k0 + j, D, R)
    _grad_piece(out, a1 * scale, rr, k0 + 16 + j, D, R)
    _grad_piece(out, a2 * scale, rr, k0 + 32 + j, D, R)
    _grad_piece(out, a3 * scale, rr, k0 + 48 + j, D, R)
    _grad_piece(out, a4 * scale, rr, k0 + 64 + j, D, R)
    _grad_piece(out, a5 * scale, rr, k0 + 80 + j, D, R)
    _grad_piece(out, a6 * scale, rr, k0 + 96 + j, D, R)
    _grad_piece(out, a7 * scale, rr, k0 + 112 + j, D, R)
    if splits > 1 or ACC:
        if _last_arrival(COUNT, tl.program_id(0), splits):
            for q in range(0, 8):
                _sum_splits(OUT, PART, rr, k0 + 16 * q + j, D, R, splits, RP, ACC)
            tl.atomic_xchg(COUNT + tl.program_id(0), 0)


@triton.jit
def _add_piece(OUT, g, A, rows, cols, rr, D, R, inside, keep, scale):
    a = tl.load(A + rr[:, None] * D + cols[None, :], mask=rr[:, None] < R, other=0.0)
    t = tl.dot(g, a) * scale
    at = rows[:, None].to(tl.int64) * D + cols[None, :]
    o = tl.load(OUT + at, mask=inside[:, None], other=0.0).to(tl.float32)
    tl.store(OUT + at, (o + t * keep.to(tl.float32)).to(OUT.dtype.element_ty), mask=inside[:, None])


@triton.jit(do_not_specialize=["T"])
def _mm_drop_add(G, A, OUT, SEED, T, D, R, thr, scale, BT: tl.constexpr, RP: tl.constexpr):
    """OUT [T, D] += scale * keep * (G @ A), one [BT, 128] tile a program: the LoRA branch's
    input gradient through the dropout."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    k0 = tl.program_id(1) * 128
    inside = rows < T
    rr = tl.arange(0, RP)
    j = tl.arange(0, 16)
    g = tl.load(G + rows[:, None] * R + rr[None, :], mask=inside[:, None] & (rr[None, :] < R), other=0.0)
    k_0, k_1, k_2, k_3, k_4, k_5, k_6, k_7 = _keep_eighths(SEED, rows * (D // 128) + k0 // 128, thr)
    _add_piece(OUT, g, A, rows, k0 + j, rr, D, R, inside, k_0, scale)
    _add_piece(OUT, g, A, rows, k0 + 16 + j, rr, D, R, inside, k_1, scale)
    _add_piece(OUT, g, A, rows, k0 + 32 + j, rr, D, R, inside, k_2, scale)
    _add_piece(OUT, g, A, rows, k0 + 48 + j, rr, D, R, inside, k_3, scale)
    _add_piece(OUT, g, A, rows, k0 + 64 + j, rr, D, R, inside, k_4, scale)
    _add_piece(OUT, g, A, rows, k0 + 80 + j, rr, D, R, inside, k_5, scale)
    _add_piece(OUT, g, A, rows, k0 + 96 + j, rr, D, R, inside, k_6, scale)
    _add_piece(OUT, g, A, rows, k0 + 112 + j, rr, D, R, inside, k_7, scale)
