"""The LoRA A matmuls with the seeded dropout inside (ops.lora_group): xa = s dropout(x) A^T,
A's gradient g^T dropout(x), and the input gradient's masked add dropout(g A), each one Triton
kernel that draws the keep mask of the tile it loads (dropout_seeded's mask, element for
element). x [T, D] is never dropped into a tensor of its own: per LoRA group that saves, against
dropout_seeded + cuBLAS, the dropped input's write and its reads (forward, A's gradient) and
the [T, D] product the masked add reads back. The reference is dropout_seeded then cuBLAS.
"""

from __future__ import annotations

import torch

from hivetune.ops.dropout import keep_threshold
from hivetune.ops.triton_util import fused_ok, kernels, triton


@kernels
def _define_kernels():
    """The Triton kernels: defined at the first fused call, not at import (triton_util.kernels)."""
    global triton, tl, _keep_eighths, _x_piece, _a_piece_t, _dot_piece, _last_arrival, _drop_mm, _grad_piece
    global _sum_splits, _drop_mm_grad, _add_piece, _mm_drop_add
    import triton
    import triton.language as tl

    from hivetune.ops.dropout import _keep_eighths

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


# The kernels beat dropout_seeded + cuBLAS on inputs 2,048+ wide with A of at most 32 rows (the
# forward's [T, R] accumulator grows with R); cuBLAS + one elementwise pass win on narrower
# inputs (H200, benchmarks/drop_matmul_speed.py; figures in docs/log.md).
DROP_MM_MIN_D = 2048
DROP_MM_MAX_R = 32


def drop_matmul_shape(d: int, r: int) -> bool:
    """Whether the in-matmul dropout kernels are chosen for inputs d wide and A of r rows."""
    return d % 128 == 0 and d >= DROP_MM_MIN_D and r <= DROP_MM_MAX_R


def drop_matmul_ok(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether drop_matmul / drop_matmul_grad / matmul_drop_add_ take x [T, D] and A [R, D]."""
    return (fused_ok(x) and x.dim() == 2 and x.is_contiguous() and x.numel() < 2**31 and a.dtype == x.dtype
            and a.is_contiguous() and drop_matmul_shape(x.shape[1], a.shape[0]))


_COUNTERS: dict = {}


def _counters(device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters of the split kernels, one per output block, kept per device
    (each launch leaves them zero again). Made once, large, before any CUDA graph captures a
    kernel that reads them; launches on one stream only, as training's are."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _r_pad(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def drop_matmul(x: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float, scale: float,
                bt: int | None = None, splits: int | None = None) -> torch.Tensor:
    """scale * dropout_seeded(x, seed, p) @ a^T: [T, R] in x's dtype. The rows are cut into
    column splits, each program's fp32 partial sum added by the last of its row block (T / BT
    programs alone leave the GPU mostly idle, and W2's down_proj would loop over 148 column
    blocks). `bt` (rows a program) and `splits` override the rules below, which are the best of
    benchmarks/drop_matmul_speed.py --sweep on an H200 (8 splits of 64-row blocks at W2's ~3,000
    tokens: down 119 us against 427 with 2 splits of 16 rows; 16 splits of 16 rows at W1's 1,600)."""
    t, d = x.shape
    r = a.shape[0]
    bt = bt or (64 if t >= 2048 else 16)
    blocks = d // 128
    splits = min(blocks, splits or (8 if bt == 64 else 16))
    cols = triton.cdiv(blocks, splits) * 128
    splits = triton.cdiv(d, cols)
    out = x.new_empty((t, r))
    part = out if splits == 1 else torch.empty((splits, t, r), dtype=torch.float32, device=x.device)
    thr, keep_scale = keep_threshold(p)
    _drop_mm[(triton.cdiv(t, bt), splits)](x, a, out, part, _counters(x.device, triton.cdiv(t, bt)), seed, t, d, r,
                                           thr, scale * keep_scale, cols, splits, BT=bt, RP=_r_pad(r), num_warps=4)
    return out


def drop_matmul_grad(g: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, p: float,
                     splits: int | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
    """g^T @ dropout_seeded(x, seed, p): A's gradient [R, D] in fp32 (g [T, R] = d loss / d xa),
    its rows cut into `splits` (default: the sweep's best, 8; 16 for rows of at most 8 column
    blocks) summed in split order by the last program of each column block. `into` (fp32
    [R, D], contiguous): add the product to it (the same bits as ``into += product``) and
    return it."""
    t, d = x.shape
    r = g.shape[1]
    blocks = d // 128
    splits = min(triton.cdiv(t, 64), splits or (16 if blocks <= 8 else 8))
    rows = triton.cdiv(triton.cdiv(t, splits), 64) * 64
    splits = triton.cdiv(t, rows)
    out = into if into is not None else torch.empty((r, d), dtype=torch.float32, device=x.device)
    part = out if splits == 1 and into is None else torch.empty((splits, r, d), dtype=torch.float32, device=x.device)
    thr, scale = keep_threshold(p)
    _drop_mm_grad[(blocks, splits)](g, x, out, part, _counters(x.device, blocks), seed, t, d, r, thr, scale, rows,
                                    splits, BT=64, RP=_r_pad(r), ACC=into is not None, num_warps=4)
    return out


def matmul_drop_add_(out: torch.Tensor, g: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float) -> None:
    """out [T, D] += dropout_seeded(g @ a, seed, p) (g [T, R], a [R, D]), in one kernel."""
    t, d = out.shape
    r = a.shape[0]
    thr, scale = keep_threshold(p)
    _mm_drop_add[(triton.cdiv(t, 64), d // 128)](g, a, out, seed, t, d, r, thr, scale, BT=64,
                                                 RP=_r_pad(r), num_warps=4)
