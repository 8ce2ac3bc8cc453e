"""Rotate-half RoPE as one Triton kernel each way, and the RoPE of q and k with v's copy out of a
joined q/k/v projection in one kernel (rope_qkv), or with the q and k RMSNorms of Qwen3-style
layers before it (qk_norm_rope), beside the plain-PyTorch reference. The RoPE kernels save
nothing but the cos / sin tables every layer shares; qk_norm_rope saves the joined projection,
which its v (a view of it) keeps alive for attention anyway.
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
    """The Triton kernels (ops.kernels.rope): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, _rope, _rope_qkv, _qk_norm_rope, _qk_norm_rope_bwd
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.rope import _rope, _rope_qkv, _qk_norm_rope, _qk_norm_rope_bwd


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


def _blocks(hq: int, hk: int, d: int) -> dict:
    """The joined q/k/v kernels' block sizes: q's and k's head counts, half a head, to powers of two."""
    return {"HQ_BLOCK": triton.next_power_of_2(hq), "HK_BLOCK": triton.next_power_of_2(hk),
            "D_BLOCK": triton.next_power_of_2(d // 2)}


def _head_grads(grads, heads, b: int, t: int, d: int, like: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of q, k and v [B, T, heads, D] as the joined kernels read them: contiguous,
    zeros (like `like`) for an output that got none."""
    return [g.contiguous() if g is not None else like.new_zeros((b, t, h, d)) for g, h in zip(grads, heads)]


def _rope_qkv_launch(src, dst, cos, sin, hq: int, hk: int, sign: int) -> None:
    """src / dst: (q, k, v) pointers' tensors and their token strides, as _rope_qkv takes them."""
    (qs, ks, vs, q_src, kv_src), (qd, kd, vd, q_dst, kv_dst) = src, dst
    half = cos.shape[-1] // 2
    _rope_qkv[(cos.numel() // cos.shape[-1],)](qs, ks, vs, qd, kd, vd, cos, sin, hq, hk, half, q_src, kv_src, q_dst,
                                               kv_dst, sign, **_blocks(hq, hk, 2 * half))


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
        dq, dk, dv = _head_grads((dq, dk, dv), (hq, hk, hk), b, t, d, cos)
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


class QKNormRoPEFunction(torch.autograd.Function):
    """A joined q/k/v projection [B, T, (HQ + 2 HK) D] -> RoPE(RMSNorm(q)) [B, T, HQ, D],
    RoPE(RMSNorm(k)) [B, T, HK, D] (contiguous) and v, a view of the joined tensor: one kernel
    each way, the backward writing the joined gradient (q, k through RoPE and the norms, v's as
    it comes). The norms' weights are frozen (no gradient); 1/rms is recomputed in backward."""

    @staticmethod
    def forward(ctx, joined, q_weight, k_weight, eps: float, cos, sin, hq: int, hk: int):
        b, t, width = joined.shape
        d = width // (hq + 2 * hk)
        cos, sin = cos.contiguous(), sin.contiguous()
        q, k = joined.new_empty((b, t, hq, d)), joined.new_empty((b, t, hk, d))
        _qk_norm_rope[(b * t,)](joined, q, k, q_weight, k_weight, cos, sin, hq, hk, d // 2, width, eps,
                                **_blocks(hq, hk, d))
        ctx.save_for_backward(joined, q_weight, k_weight, cos, sin)
        ctx.eps, ctx.hq, ctx.hk = eps, hq, hk
        return q, k, joined[..., (hq + hk) * d:].view(b, t, hk, d)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        joined, q_weight, k_weight, cos, sin = ctx.saved_tensors
        hq, hk = ctx.hq, ctx.hk
        b, t, width = joined.shape
        d = width // (hq + 2 * hk)
        dq, dk, dv = _head_grads((dq, dk, dv), (hq, hk, hk), b, t, d, joined)
        dx = torch.empty_like(joined)
        _qk_norm_rope_bwd[(b * t,)](dq, dk, dv, joined, dx, q_weight, k_weight, cos, sin, hq, hk, d // 2, width,
                                    ctx.eps, **_blocks(hq, hk, d))
        return dx, None, None, None, None, None, None, None


def qk_norm_rope_ok(joined: torch.Tensor, cos: torch.Tensor, q_norm, k_norm) -> bool:
    """Whether qk_norm_rope takes a joined q/k/v output with these q / k RMSNorms (weight times
    the normalised row, decoder.RMSNorm): frozen weights of the head's width in its dtype, one
    eps, and what rope_qkv_ok asks of the rest."""
    return (rope_qkv_ok(joined, cos) and q_norm.eps == k_norm.eps and all(
        not norm.weight.requires_grad and norm.weight.shape == (cos.shape[-1],) and norm.weight.dtype == joined.dtype
        and norm.weight.is_contiguous() for norm in (q_norm, k_norm)))


def qk_norm_rope(joined: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm, k_norm, hq: int, hk: int):
    """(RoPE(q_norm(q)), RoPE(k_norm(k)), v) of a joined q/k/v projection [B, T, (hq + 2 hk) D]:
    one kernel each way, against two norm and two RoPE kernels and, in backward, a cat of the
    three gradients."""
    return QKNormRoPEFunction.apply(joined, q_norm.weight, k_norm.weight, float(q_norm.eps), cos, sin, hq, hk)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, D] (rotate-half RoPE)."""
    if (fused_ok(x) and cos.dtype == x.dtype and x.dim() == 4 and cos.shape == (*x.shape[:2], x.shape[-1])
            and x.shape[-1] % 2 == 0):
        return RoPEFunction.apply(x, cos, sin)
    return rope_reference(x, cos, sin)
