"""Rotate-half RoPE as one Triton kernel each way, and the RoPE of q and k with v's copy out of a
joined q/k/v projection in one kernel (rope_qkv), beside the plain-PyTorch reference. The
kernels save nothing but the cos / sin tables every layer shares.
"""

from __future__ import annotations

import torch

from hivetune.ops.triton_util import fused_ok, kernels, triton


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, D]; rotate-half form x*cos + [-x2, x1]*sin."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@kernels
def _define_kernels():
    """The Triton kernels: defined at the first fused call, not at import (triton_util.kernels)."""
    global triton, tl, _rotate, _rope, _rope_heads, _rope_qkv
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2, sign):
        """Rotate-half RoPE of the halves x1, x2 (sign -1: the transpose, i.e. backward)."""
        if sign > 0:
            return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
        return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1

    @triton.jit
    def _rope(X, COS, SIN, Y, heads, HALF, X_TOKEN_STRIDE, sign, H_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
        # One token, all heads: y1 = x1 c1 - sign x2 s1, y2 = x2 c2 + sign x1 s2 (sign -1: the
        # transpose, i.e. backward: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1).
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, H_BLOCK)[:, None]
        d = tl.arange(0, D_BLOCK)[None, :]
        mask = (h < heads) & (d < HALF)
        base = t * heads * 2 * HALF + h * 2 * HALF + d
        at = t * X_TOKEN_STRIDE + h * 2 * HALF + d  # X may be a column slice of a q/k/v output
        x1 = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + at + HALF, mask=mask, other=0.0).to(tl.float32)
        dm = d < HALF
        c1 = tl.load(COS + t * 2 * HALF + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t * 2 * HALF + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t * 2 * HALF + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t * 2 * HALF + HALF + d, mask=dm, other=0.0).to(tl.float32)
        y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, sign)
        tl.store(Y + base, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + base + HALF, y2.to(Y.dtype.element_ty), mask=mask)
    @triton.jit
    def _rope_heads(SRC, DST, src_at, dst_at, c1, c2, s1, s2, heads, HALF, sign, ROTATE: tl.constexpr,
                    H_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
        # one token's `heads` heads of 2 HALF: rotated as _rope does (ROTATE), or copied
        h = tl.arange(0, H_BLOCK)[:, None]
        d = tl.arange(0, D_BLOCK)[None, :]
        mask = (h < heads) & (d < HALF)
        src = SRC + src_at + h * 2 * HALF + d
        dst = DST + dst_at + h * 2 * HALF + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if ROTATE:
            y1, y2 = _rotate(x1, x2, c1, c2, s1, s2, sign)
        else:
            y1 = x1
            y2 = x2
        tl.store(dst, y1.to(DST.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, y2.to(DST.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_qkv(QS, KS, VS, QD, KD, VD, COS, SIN, HQ, HK, HALF, Q_SRC, KV_SRC, Q_DST, KV_DST, sign,
                  HQ_BLOCK: tl.constexpr, HK_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
        """One token: RoPE of its q and k heads and a copy of its v heads, from Q/K/VS to Q/K/VD
        (token strides *_SRC, *_DST): forward, a joined q/k/v projection into three tensors;
        backward (sign -1), their gradients into one joined gradient."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D_BLOCK)[None, :]
        dm = d < HALF
        c1 = tl.load(COS + t * 2 * HALF + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t * 2 * HALF + HALF + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t * 2 * HALF + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t * 2 * HALF + HALF + d, mask=dm, other=0.0).to(tl.float32)
        _rope_heads(QS, QD, t * Q_SRC, t * Q_DST, c1, c2, s1, s2, HQ, HALF, sign, True, HQ_BLOCK, D_BLOCK)
        _rope_heads(KS, KD, t * KV_SRC, t * KV_DST, c1, c2, s1, s2, HK, HALF, sign, True, HK_BLOCK, D_BLOCK)
        _rope_heads(VS, VD, t * KV_SRC, t * KV_DST, c1, c2, s1, s2, HK, HALF, sign, False, HK_BLOCK, D_BLOCK)


def _rope_launch(x, cos, sin, sign: int):
    """y (contiguous) = RoPE(x); x is read in place when its heads and tokens are evenly strided
    (a contiguous tensor, or a q / k column slice of a fused q/k/v output)."""
    b, t, heads, d = x.shape
    if not (x.stride(3) == 1 and x.stride(2) == d and x.stride(0) == t * x.stride(1)):
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = d // 2
    _rope[(b * t,)](x, cos, sin, y, heads, half, x.stride(1), sign, H_BLOCK=triton.next_power_of_2(heads),
                    D_BLOCK=triton.next_power_of_2(half))
    return y


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_launch(dy.contiguous(), cos, sin, -1), None, None


def _rope_qkv_launch(src, dst, cos, sin, hq: int, hk: int, sign: int) -> None:
    """src / dst: (q, k, v) pointers' tensors and their token strides, as _rope_qkv takes them."""
    (qs, ks, vs, q_src, kv_src), (qd, kd, vd, q_dst, kv_dst) = src, dst
    half = cos.shape[-1] // 2
    _rope_qkv[(cos.numel() // cos.shape[-1],)](qs, ks, vs, qd, kd, vd, cos, sin, hq, hk, half, q_src, kv_src, q_dst,
                                               kv_dst, sign, HQ_BLOCK=triton.next_power_of_2(hq),
                                               HK_BLOCK=triton.next_power_of_2(hk),
                                               D_BLOCK=triton.next_power_of_2(half))


class RoPEQKVFunction(torch.autograd.Function):
    """A joined q/k/v projection [B, T, (HQ + 2 HK) D] -> RoPE(q) [B, T, HQ, D], RoPE(k), v [B, T,
    HK, D], contiguous, in one kernel; the backward writes the joined gradient in one kernel."""

    @staticmethod
    def forward(ctx, joined: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int):
        b, t, width = joined.shape
        d = width // (hq + 2 * hk)
        cos, sin = cos.contiguous(), sin.contiguous()
        q = joined.new_empty((b, t, hq, d))
        k, v = joined.new_empty((b, t, hk, d)), joined.new_empty((b, t, hk, d))
        _rope_qkv_launch((joined, joined[..., hq * d:], joined[..., (hq + hk) * d:], width, width),
                         (q, k, v, hq * d, hk * d), cos, sin, hq, hk, 1)
        ctx.save_for_backward(cos, sin)
        ctx.hq, ctx.hk, ctx.shape = hq, hk, joined.shape
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        hq, hk = ctx.hq, ctx.hk
        b, t, width = ctx.shape
        d = width // (hq + 2 * hk)
        dq, dk, dv = (g.contiguous() if g is not None else torch.zeros((b, t, h, d), dtype=cos.dtype, device=cos.device)
                      for g, h in ((dq, hq), (dk, hk), (dv, hk)))
        dx = dq.new_empty(ctx.shape)
        _rope_qkv_launch((dq, dk, dv, hq * d, hk * d), (dx, dx[..., hq * d:], dx[..., (hq + hk) * d:], width, width),
                         cos, sin, hq, hk, -1)
        return dx, None, None, None, None


def rope_qkv_ok(joined: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether rope_qkv takes a joined q/k/v output [B, T, W] and cos [B, T, D] (else: split,
    apply_rope of q and of k, v as it is)."""
    return (fused_ok(joined) and joined.dim() == 3 and joined.is_contiguous() and cos.dtype == joined.dtype
            and cos.shape == (*joined.shape[:2], cos.shape[-1]) and cos.shape[-1] % 2 == 0)


def rope_qkv(joined: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int):
    """(RoPE(q), RoPE(k), v) of a joined q/k/v projection [B, T, (hq + 2 hk) D], each contiguous
    [B, T, heads, D]: one kernel each way, against a split, two RoPE kernels and v's copy (and in
    backward two RoPE kernels and a cat)."""
    return RoPEQKVFunction.apply(joined, cos, sin, hq, hk)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, D] (rotate-half RoPE)."""
    if (fused_ok(x) and cos.dtype == x.dtype and x.dim() == 4 and cos.shape == (*x.shape[:2], x.shape[-1])
            and x.shape[-1] % 2 == 0):
        return RoPEFunction.apply(x, cos, sin)
    return rope_reference(x, cos, sin)
