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
    """The Triton kernels (ops.kernels.lora_dropout): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, _keep_eighths, _x_piece, _a_piece_t, _dot_piece, _last_arrival, _drop_mm, _grad_piece
    global _sum_splits, _drop_mm_grad, _add_piece, _mm_drop_add
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.lora_dropout import (_keep_eighths, _x_piece, _a_piece_t, _dot_piece, _last_arrival, _drop_mm, _grad_piece, _sum_splits,
        _drop_mm_grad, _add_piece, _mm_drop_add)


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
