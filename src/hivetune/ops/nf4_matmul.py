"""y = x W^T + b with W in NF4 (ops.nf4), the weight dequantized tile by tile inside the matmul
(Triton), never whole; the input gradient dx = g W the same way. The reference is
ops.quant_linear.dequant_linear (the whole weight dequantized, then the matmul), which runs
where the kernels do not: CPUs, fp32, no Triton, fused_ops off, in-features not a multiple of
64, HIVETUNE_REFERENCE=fused_layers.

A [BLOCK_N, 64] tile of W is one 64-block per row: 32 packed bytes and one 8-bit scale code per
row, dequantized as ops.nf4 does (fp32 level * absmax, absmax = map[code] * absmax2 + offset,
no fused multiply-add), cast to the compute dtype and fed to tl.dot with fp32 accumulation. So
the weights the matmul sees equal the reference's bit for bit; the sums differ only by
accumulation order.
"""

from __future__ import annotations

import torch

from hivetune.ops.nf4 import BLOCK, _tables, dequantize_parts
from hivetune.ops.quant_linear import dequant_linear
from hivetune.ops.triton_util import fused_ok, kernels, triton

TILE_M, TILE_N, TILE_K = 64, 64, BLOCK  # TILE_K = one NF4 block: one scale per row and tile


def fused_matmul_ok(x: torch.Tensor, in_features: int) -> bool:
    """Whether the Triton kernels take this input (else the reference runs)."""
    return in_features % BLOCK == 0 and fused_ok(x)


class NF4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, packed, q_absmax, absmax2, offset, out_features):
        ctx.save_for_backward(packed, q_absmax, absmax2, offset)
        ctx.out_features = out_features
        x2 = x.reshape(-1, x.shape[-1])
        y = matmul(x2, packed, q_absmax, absmax2, offset, out_features, bias)
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, g):
        packed, q_absmax, absmax2, offset = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dx = input_grad(g2, packed, q_absmax, absmax2, offset, packed.numel() * 2 // ctx.out_features)
        return dx.view(*g.shape[:-1], -1), None, None, None, None, None, None


def nf4_linear(x: torch.Tensor, packed, q_absmax, absmax2, offset, shape: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] for the NF4 weight of `shape` (out, in): the kernels where
    fused_matmul_ok, else the reference. Under autocast, x runs in the autocast dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    if not fused_matmul_ok(x, shape[1]):
        return dequant_linear(x, lambda dtype: dequantize_parts(packed, q_absmax, absmax2, offset, shape, dtype), bias)
    with torch.autocast(device, enabled=False):
        return NF4Linear.apply(x, bias, packed, q_absmax, absmax2, offset, shape[0])


def matmul(x, packed, q_absmax, absmax2, offset, n, bias=None) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ W^T + bias -> [M, N] in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    levels, dmap = _tables(x.device)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, TILE_N))
    _forward_kernel[grid](x, packed, q_absmax, absmax2, offset, levels, dmap, bias if bias is not None else y, y,
                          m, n, k, HAS_BIAS=bias is not None, BM=TILE_M, BN=TILE_N, BK=TILE_K, enable_fp_fusion=False)
    return y


def input_grad(g, packed, q_absmax, absmax2, offset, k) -> torch.Tensor:
    """g [M, N] @ W -> [M, K] in g's dtype."""
    g = g.contiguous()
    m, n = g.shape
    levels, dmap = _tables(g.device)
    dx = torch.empty((m, k), dtype=g.dtype, device=g.device)
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(k, TILE_K))
    _input_grad_kernel[grid](g, packed, q_absmax, absmax2, offset, levels, dmap, dx, m, n, k,
                             BM=TILE_M, BN=TILE_N, BK=TILE_K, enable_fp_fusion=False)
    return dx


@kernels
def _define_kernels():
    """The Triton kernels: defined at the first fused call, not at import (triton_util.kernels)."""
    global triton, tl, DQ_BLOCK_C, _weight_tile, _forward_kernel, _input_grad_kernel
    import triton
    import triton.language as tl

    from hivetune.ops.nf4 import DQ_BLOCK_C

    @triton.jit
    def _weight_tile(packed, q_absmax, absmax2, offset, levels, dmap, rows, k0, N, K,
                     BN: tl.constexpr, BK: tl.constexpr):
        """W[rows, k0:k0 + BK] in fp32 (BK = 64: one NF4 block per row); rows past N read 0."""
        inside = rows < N
        j = k0 // 2 + tl.arange(0, BK // 2)
        byte = tl.load(packed + rows[:, None].to(tl.int64) * (K // 2) + j[None, :],
                       mask=inside[:, None], other=0).to(tl.int32)
        hi = tl.load(levels + (byte >> 4))
        lo = tl.load(levels + (byte & 15))
        block = rows.to(tl.int64) * (K // BK) + k0 // BK
        code = tl.load(q_absmax + block, mask=inside, other=0).to(tl.int32)
        scale = tl.load(dmap + code) * tl.load(absmax2 + block // DQ_BLOCK_C, mask=inside, other=0.0)
        scale = scale + tl.load(offset)
        return tl.reshape(tl.join(hi * scale[:, None], lo * scale[:, None]), (BN, BK))

    @triton.jit
    def _forward_kernel(x, packed, q_absmax, absmax2, offset, levels, dmap, bias, y, M, N, K,
                        HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(x + rows[:, None].to(tl.int64) * K + k[None, :], mask=rows[:, None] < M, other=0.0)
            w = _weight_tile(packed, q_absmax, absmax2, offset, levels, dmap, cols, k0, N, K, BN, BK)
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(y + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y.dtype.element_ty), mask=mask)

    @triton.jit
    def _input_grad_kernel(g, packed, q_absmax, absmax2, offset, levels, dmap, dx, M, N, K,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        k0 = tl.program_id(1) * BK
        acc = tl.zeros((BM, BK), dtype=tl.float32)
        for n0 in range(0, N, BN):
            n = n0 + tl.arange(0, BN)
            a = tl.load(g + rows[:, None].to(tl.int64) * N + n[None, :],
                        mask=(rows[:, None] < M) & (n[None, :] < N), other=0.0)
            w = _weight_tile(packed, q_absmax, absmax2, offset, levels, dmap, n, k0, N, K, BN, BK)
            acc += tl.dot(a, w.to(a.dtype))
        k = k0 + tl.arange(0, BK)
        tl.store(dx + rows[:, None].to(tl.int64) * K + k[None, :], acc.to(dx.dtype.element_ty),
                 mask=rows[:, None] < M)
