"""RMSNorm, RoPE and SwiGLU as one Triton kernel each way, beside their plain-PyTorch references.

Why: in eager PyTorch each of these is 5-12 small kernels forward and as many backward, and the
norm keeps fp32 copies of its input for backward. In W1 (24 layers, ~1,600 tokens a step) they
are about 40% of the ~3,300 kernels of a step; under CUDA graphs launch cost is gone but each
kernel still costs a few microseconds of GPU time, and W2's norms hold ~5 GB of fp32 copies.

What each saves for backward (per token, hidden H, intermediate I, bf16 = 2 bytes):
- rms_norm: the bf16 input and one fp32 rstd (reference: fp32 input, fp32 normalised, bf16
  normalised: 10 H bytes), and the weight is frozen under LoRA, so no weight gradient.
- swiglu(gate, up) = silu(gate) * up: gate and up (reference: also silu(gate), 2 I bytes).
- apply_rope: nothing but the cos / sin tables it shares with every layer.

Layers: Triton kernel -> autograd Function -> functional wrapper choosing the kernel or the
reference (CPU, fp32, no Triton, a trainable norm weight, HIVETUNE_FUSED_OPS=0).
Rounding follows the references (bf16 after the norm's scaling and after silu), so forward
outputs match them to about one bf16 ulp; gradients are computed in fp32 from the saved inputs.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: CPUs, ROCm builds without it, old GPUs take the references
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def fused_ok(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take this tensor (else the PyTorch reference runs).
    HIVETUNE_FUSED_OPS=0, or HIVETUNE_REFERENCE=fused_layers (or all), forces the references."""
    from hivetune.fastpath import forced, note_fallback

    if x.dtype not in (torch.bfloat16, torch.float16) or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if os.environ.get("HIVETUNE_FUSED_OPS", "1") == "0" or forced("fused_layers"):
        note_fallback("fused_layers", "fused RMSNorm / RoPE / SwiGLU", "asked for the reference", "PyTorch ops")
        return False
    if triton is None:
        note_fallback("fused_layers", "fused RMSNorm / RoPE / SwiGLU", "Triton is not installed", "PyTorch ops")
        return False
    return True


# ---------------------------------------------------------------- references (the oracle)

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w * x / sqrt(mean(x^2) + eps), the statistic in fp32 as transformers does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, D]; rotate-half form x*cos + [-x2, x1]*sin."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ---------------------------------------------------------------- kernels

if triton is not None:
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

    @triton.jit
    def _swiglu_fwd(G, U, Y, n, COLS, STRIDE, BLOCK: tl.constexpr):
        # y[i] for i < n = rows x COLS; gate / up element i sits at row * STRIDE + col, so one
        # kernel reads separate tensors (STRIDE = COLS) or the halves of a joined [.., 2 COLS] one.
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        at = (i // COLS) * STRIDE + i % COLS
        g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)  # F.silu rounds here
        tl.store(Y + i, (act * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(DY, G, U, DG, DU, n, COLS, STRIDE, BLOCK: tl.constexpr):
        # y = g * s(g) * u:  du = dy * g * s,  dg = dy * u * s * (1 + g * (1 - s))
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        at = (i // COLS) * STRIDE + i % COLS
        dy = tl.load(DY + i, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        tl.store(DU + at, (dy * g * s).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + at, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)

    @triton.jit
    def _masked_add(OUT, T, M, n, keep, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        o = tl.load(OUT + i, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(T + i, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(M + i, mask=mask, other=0).to(tl.float32)
        tl.store(OUT + i, (o + t * m * keep).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _keep4(SEED, offsets, p):
        """The dropout's keep mask for the 4 elements 4 o .. 4 o + 3 of each Philox offset o
        (one tl.rand4x draw covers 4 elements: tl.rand per element ran Philox 4 times as often,
        and W2's dropout ran at ~480 GB/s), laid out along the last axis: element e is kept when
        rand4x(seed, e // 4)[e % 4] >= p. Every kernel that draws a mask uses this mapping."""
        r0, r1, r2, r3 = tl.rand4x(tl.load(SEED), offsets)
        return tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3)) >= p

    @triton.jit
    def _seeded_dropout(OUT, X, SEED, n, p, scale, ADD: tl.constexpr, Q: tl.constexpr):
        """OUT = X * keep / (1 - p), or with ADD, OUT += X * keep / (1 - p) (the dropout's
        backward, which draws the mask again: it is never stored). 4 Q elements a program."""
        pid = tl.program_id(0)
        keep = _keep4(SEED, pid * Q + tl.arange(0, Q), p)
        i = pid.to(tl.int64) * 4 * Q + tl.arange(0, 4 * Q)
        m = i < n
        y = tl.where(keep, tl.load(X + i, mask=m, other=0.0).to(tl.float32) * scale, 0.0)
        if ADD:
            y += tl.load(OUT + i, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + i, y.to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _keep_tile(SEED, rows, k0, D, p, BK: tl.constexpr):
        """_keep4's mask for the [rows, k0 .. k0 + BK) tile of a row-major [T, D] tensor (D and
        k0 multiples of 4, so a row's elements start a Philox offset)."""
        return _keep4(SEED, (rows[:, None] * D + k0) // 4 + tl.arange(0, BK // 4)[None, :], p)

    @triton.jit
    def _drop_mm(X, A, XA, SEED, T, D, R, p, scale, BT: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr):
        """XA [T, R] = scale * (X * keep) @ A^T: the dropout applied as X's tiles load."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        rr = tl.arange(0, RP)
        acc = tl.zeros((BT, RP), dtype=tl.float32)
        for k0 in range(0, D, BK):
            cols = k0 + tl.arange(0, BK)
            x = tl.load(X + rows[:, None].to(tl.int64) * D + cols[None, :],
                        mask=(rows[:, None] < T) & (cols[None, :] < D), other=0.0)
            x = tl.where(_keep_tile(SEED, rows, k0, D, p, BK), x, tl.zeros_like(x))
            a = tl.load(A + rr[None, :] * D + cols[:, None], mask=(rr[None, :] < R) & (cols[:, None] < D), other=0.0)
            acc = tl.dot(x, a, acc)
        tl.store(XA + rows[:, None] * R + rr[None, :], (acc * scale).to(XA.dtype.element_ty),
                 mask=(rows[:, None] < T) & (rr[None, :] < R))

    @triton.jit
    def _drop_mm_grad(G, X, OUT, SEED, T, D, R, p, scale, rows_per_split,
                      BT: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr):
        """OUT[s] [R, D] (fp32) = scale * G[t]^T @ (X[t] * keep) over split s's rows t: the
        gradient of A (G: d loss / d xa [T, R]). Each output element has one program and one
        summation order: deterministic."""
        cols = tl.program_id(0) * BK + tl.arange(0, BK)
        split = tl.program_id(1)
        rr = tl.arange(0, RP)
        acc = tl.zeros((RP, BK), dtype=tl.float32)
        start = split * rows_per_split
        for t0 in range(start, tl.minimum(start + rows_per_split, T), BT):
            rows = t0 + tl.arange(0, BT)
            inside = rows < tl.minimum(start + rows_per_split, T)
            x = tl.load(X + rows[:, None].to(tl.int64) * D + cols[None, :],
                        mask=inside[:, None] & (cols[None, :] < D), other=0.0)
            x = tl.where(_keep_tile(SEED, rows, tl.program_id(0) * BK, D, p, BK), x, tl.zeros_like(x))
            g = tl.load(G + rows[None, :] * R + rr[:, None], mask=inside[None, :] & (rr[:, None] < R), other=0.0)
            acc = tl.dot(g, x, acc)
        tl.store(OUT + split.to(tl.int64) * R * D + rr[:, None] * D + cols[None, :], acc * scale,
                 mask=(rr[:, None] < R) & (cols[None, :] < D))

    @triton.jit
    def _mm_drop_add(G, A, OUT, SEED, T, D, R, p, scale, BT: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr):
        """OUT [T, D] += scale * keep * (G @ A): the LoRA branch's input gradient through the dropout."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        rr = tl.arange(0, RP)
        g = tl.load(G + rows[:, None] * R + rr[None, :], mask=(rows[:, None] < T) & (rr[None, :] < R), other=0.0)
        a = tl.load(A + rr[:, None] * D + cols[None, :], mask=(rr[:, None] < R) & (cols[None, :] < D), other=0.0)
        t = tl.dot(g, a) * scale
        inside = (rows[:, None] < T) & (cols[None, :] < D)
        at = rows[:, None].to(tl.int64) * D + cols[None, :]
        o = tl.load(OUT + at, mask=inside, other=0.0).to(tl.float32)
        o += tl.where(_keep_tile(SEED, rows, tl.program_id(1) * BK, D, p, BK), t, 0.0)
        tl.store(OUT + at, o.to(OUT.dtype.element_ty), mask=inside)

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
        if sign > 0:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        else:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        tl.store(Y + base, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + base + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def _elementwise_grid(n: int, block: int):
    return (triton.cdiv(n, block),)


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


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up; `joined`: gate and up are the halves of one [.., 2 I] tensor (a fused
    gate/up projection), read in place, and the gradient comes back as one [.., 2 I] tensor."""
    BLOCK = 1024

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor | None, reuse: bool = False):
        """`reuse` (joined only): the caller owns `gate` and drops it, so backward may write
        the gradient over it: one [.., 2 I] buffer less at the peak of W2's backward."""
        ctx.reuse = reuse
        if up is None:
            joined = gate.contiguous()
            ctx.reuse = reuse and joined is gate
            ctx.save_for_backward(joined)
            return swiglu_raw(joined)
        g, u = gate.contiguous(), up.contiguous()
        cols = g.shape[-1]
        y = torch.empty_like(g)
        ctx.save_for_backward(g, u)
        n = y.numel()
        _swiglu_fwd[_elementwise_grid(n, SwiGLUFunction.BLOCK)](g, u, y, n, cols, cols, BLOCK=SwiGLUFunction.BLOCK)
        return y

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous()
        n, cols = dy.numel(), dy.shape[-1]
        saved = ctx.saved_tensors  # unpacked once: a checkpointed layer allows no second unpack
        if len(saved) == 1:
            (joined,) = saved
            dgu = joined if ctx.reuse else torch.empty_like(joined)  # each element read, then written
            _swiglu_bwd[_elementwise_grid(n, SwiGLUFunction.BLOCK)](dy, joined, joined[..., cols:], dgu, dgu[..., cols:],
                                                                     n, cols, 2 * cols, BLOCK=SwiGLUFunction.BLOCK)
            return dgu, None, None
        gate, up = saved
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        _swiglu_bwd[_elementwise_grid(n, SwiGLUFunction.BLOCK)](dy, gate, up, dg, du, n, cols, cols,
                                                                 BLOCK=SwiGLUFunction.BLOCK)
        return dg, du, None


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


# ---------------------------------------------------------------- functional wrappers

def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm takes the Triton kernel (whose output is the same bits in and out of
    autocast, so a backward may recompute it)."""
    return fused_ok(x) and weight.dtype == x.dtype and not weight.requires_grad and x.shape[-1] <= 65536


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if rms_norm_fused(x, weight):
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if fused_ok(gate) and up.dtype == gate.dtype and up.shape == gate.shape:
        return SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)


def masked_add_(out: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, keep: float) -> None:
    """out += t * mask * keep in one kernel (contiguous tensors of one shape; mask bool)."""
    n = out.numel()
    _masked_add[_elementwise_grid(n, 1024)](out, t, mask.view(torch.uint8), n, keep, BLOCK=1024)


def seeded_dropout_ok(x: torch.Tensor) -> bool:
    """Whether dropout can draw its mask from a seed in the Triton kernels (contiguous, fewer
    than 2^31 elements: the Philox offsets are int32)."""
    return fused_ok(x) and x.is_contiguous() and x.numel() < 2**31


def new_dropout_seed(device) -> torch.Tensor:
    """A seed for _seeded_dropout, drawn from torch's CUDA generator (so torch.manual_seed and the
    checkpointed RNG state decide it, and CUDA graphs draw a new one at each replay)."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


SEEDED_Q = 512  # Philox draws a program: 4 x 512 elements


def dropout_seeded(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p) with the mask of `seed` (contiguous x; seeded_dropout_ok)."""
    y = torch.empty_like(x)
    n = x.numel()
    _seeded_dropout[_elementwise_grid(n, 4 * SEEDED_Q)](y, x, seed, n, p, 1.0 / (1.0 - p), ADD=False, Q=SEEDED_Q)
    return y


def seeded_masked_add_(out: torch.Tensor, t: torch.Tensor, seed: torch.Tensor, p: float) -> None:
    """out += t * keep / (1 - p) with dropout_seeded's mask for `seed` (contiguous, one shape)."""
    n = out.numel()
    _seeded_dropout[_elementwise_grid(n, 4 * SEEDED_Q)](out, t, seed, n, p, 1.0 / (1.0 - p), ADD=True, Q=SEEDED_Q)


# ---- the LoRA A matmuls with the seeded dropout inside (ops.lora_group) ----
# x [T, D] is never dropped into a tensor of its own: each kernel draws the keep mask of the
# tile it loads (dropout_seeded's mask, element for element). Per LoRA group that saves, against
# dropout_seeded + matmul, a kernel forward, two backward and a [T, D] write and read each time
# (W1: ~290 of a step's ~2,200 kernels; W2: ~40% of the bytes its LoRA branches move).

DROP_MM_MAX_R = 256  # rows of A_all (n x r) the kernels take; more: dropout_seeded + cuBLAS


def drop_matmul_ok(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether drop_matmul / drop_matmul_grad / matmul_drop_add_ take x [T, D] and A [R, D]."""
    from hivetune.fastpath import forced

    return (fused_ok(x) and x.dim() == 2 and x.is_contiguous() and x.numel() < 2**31 and x.shape[1] % 4 == 0
            and a.dtype == x.dtype and a.is_contiguous() and a.shape[0] <= DROP_MM_MAX_R
            and not forced("dropout_matmul"))


def _r_pad(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def drop_matmul(x: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float, scale: float) -> torch.Tensor:
    """scale * dropout_seeded(x, seed, p) @ a^T, [T, R] in x's dtype, in one kernel."""
    t, d = x.shape
    r = a.shape[0]
    out = x.new_empty((t, r))
    bt = 16 if triton.cdiv(t, 32) < 256 else 32  # enough programs to fill the GPU
    _drop_mm[(triton.cdiv(t, bt),)](x, a, out, seed, t, d, r, p, scale / (1.0 - p), BT=bt, BK=64, RP=_r_pad(r),
                                    num_warps=4)
    return out


def drop_matmul_grad(g: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """g^T @ dropout_seeded(x, seed, p): A's gradient [R, D] in fp32 (g [T, R] = d loss / d xa)."""
    t, d = x.shape
    r = g.shape[1]
    rp = _r_pad(r)
    bk = 64 if rp <= 64 else 32
    blocks = triton.cdiv(d, bk)
    splits = max(1, min(triton.cdiv(t, 128), 256 // blocks))  # rows split when D alone gives few programs
    rows = triton.cdiv(triton.cdiv(t, splits), 64) * 64
    splits = triton.cdiv(t, rows)
    out = torch.empty((splits, r, d), dtype=torch.float32, device=x.device)
    _drop_mm_grad[(blocks, splits)](g, x, out, seed, t, d, r, p, 1.0 / (1.0 - p), rows, BT=64, BK=bk, RP=rp,
                                    num_warps=4)
    return out[0] if splits == 1 else out.sum(0)


def matmul_drop_add_(out: torch.Tensor, g: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float) -> None:
    """out [T, D] += dropout_seeded(g @ a, seed, p) (g [T, R], a [R, D]), in one kernel."""
    t, d = out.shape
    r = a.shape[0]
    _mm_drop_add[(triton.cdiv(t, 64), triton.cdiv(d, 64))](g, a, out, seed, t, d, r, p, 1.0 / (1.0 - p),
                                                           BT=64, BK=64, RP=_r_pad(r), num_warps=4)


def swiglu_raw(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a joined [.., 2 I] tensor, outside autograd: SwiGLUFunction's joined
    forward, and down_proj's recompute in lora_group's backward (the same bits)."""
    joined = gate_up.contiguous()
    cols = joined.shape[-1] // 2
    y = joined.new_empty((*joined.shape[:-1], cols))
    n = y.numel()
    _swiglu_fwd[_elementwise_grid(n, SwiGLUFunction.BLOCK)](joined, joined[..., cols:], y, n, cols, 2 * cols,
                                                            BLOCK=SwiGLUFunction.BLOCK)
    return y


def swiglu_joined(gate_up: torch.Tensor, reuse: bool = False) -> torch.Tensor:
    """silu(gate) * up where gate_up = [gate | up] along the last dim (a fused gate/up output).
    `reuse`: gate_up is an intermediate nobody else reads after this; its gradient may be
    written over it in backward."""
    if fused_ok(gate_up):
        return SwiGLUFunction.apply(gate_up, None, reuse)
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_reference(gate, up)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, D] (rotate-half RoPE)."""
    if (fused_ok(x) and cos.dtype == x.dtype and x.dim() == 4 and cos.shape == (*x.shape[:2], x.shape[-1])
            and x.shape[-1] % 2 == 0):
        return RoPEFunction.apply(x, cos, sin)
    return rope_reference(x, cos, sin)
