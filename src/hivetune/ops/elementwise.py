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


import torch

from hivetune.core.fastpath import env, forced, note_fallback

try:  # Triton is optional: CPUs, ROCm builds without it, old GPUs take the references
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


_HALF = (torch.bfloat16, torch.float16)


def fused_ok(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take this tensor (else the PyTorch reference runs).
    HIVETUNE_FUSED_OPS=0, or HIVETUNE_REFERENCE=fused_layers (or all), forces the references."""
    if x.dtype not in _HALF or not (x.is_cuda or env("TRITON_INTERPRET") == "1"):
        return False
    if env("HIVETUNE_FUSED_OPS", "1") == "0" or forced("fused_layers"):
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
    def _masked_add(OUT, T, M, n, keep, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        o = tl.load(OUT + i, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(T + i, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(M + i, mask=mask, other=0).to(tl.float32)
        tl.store(OUT + i, (o + t * m * keep).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _keep_eighths(SEED, groups, thr):
        """The dropout's keep masks of 128-element groups, as 8 pieces of 16: element
        e = 128 g + 16 q + j (j < 16) is kept when the 16-bit half q % 2 of
        randint4x(seed, 16 g + j)[q // 2] is >= thr (= round(p 65536): see keep_threshold).
        One Philox draw covers 8 elements: the mask's random bits are most of these kernels' work
        (W2's down_proj ran ~3x its memory time drawing 32 bits per element), and each piece
        comes out in the layout of a [.., 16] tile, so a kernel loads x by 16 columns and never
        reshuffles the mask. groups: [N] group indices."""
        offsets = groups[:, None] * 16 + tl.arange(0, 16)[None, :]
        u0, u1, u2, u3 = tl.randint4x(tl.load(SEED), offsets)
        return (((u0 & 0xFFFF).to(tl.int32) >= thr), ((u0 >> 16).to(tl.int32) >= thr),
                ((u1 & 0xFFFF).to(tl.int32) >= thr), ((u1 >> 16).to(tl.int32) >= thr),
                ((u2 & 0xFFFF).to(tl.int32) >= thr), ((u2 >> 16).to(tl.int32) >= thr),
                ((u3 & 0xFFFF).to(tl.int32) >= thr), ((u3 >> 16).to(tl.int32) >= thr))

    @triton.jit
    def _dropout_piece(OUT, X, e, n, keep, scale, ADD: tl.constexpr):
        m = e < n
        y = tl.where(keep, tl.load(X + e, mask=m, other=0.0).to(tl.float32) * scale, 0.0)
        if ADD:
            y += tl.load(OUT + e, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + e, y.to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _seeded_dropout(OUT, X, SEED, n, thr, scale, ADD: tl.constexpr, NG: tl.constexpr):
        """OUT = X * keep * scale, or with ADD, OUT += X * keep * scale (the dropout's backward,
        which draws the mask again: it is never stored). NG groups of 128 a program."""
        groups = tl.program_id(0) * NG + tl.arange(0, NG)
        k0, k1, k2, k3, k4, k5, k6, k7 = _keep_eighths(SEED, groups, thr)
        e = groups[:, None].to(tl.int64) * 128 + tl.arange(0, 16)[None, :]
        _dropout_piece(OUT, X, e, n, k0, scale, ADD)
        _dropout_piece(OUT, X, e + 16, n, k1, scale, ADD)
        _dropout_piece(OUT, X, e + 32, n, k2, scale, ADD)
        _dropout_piece(OUT, X, e + 48, n, k3, scale, ADD)
        _dropout_piece(OUT, X, e + 64, n, k4, scale, ADD)
        _dropout_piece(OUT, X, e + 80, n, k5, scale, ADD)
        _dropout_piece(OUT, X, e + 96, n, k6, scale, ADD)
        _dropout_piece(OUT, X, e + 112, n, k7, scale, ADD)

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

    # SwiGLU with down_proj's LoRA dropout of its output in the same pass. Its mask is a hash of
    # (seed, flat element index) (_hashed_keep), not _keep_eighths' Philox pieces: those tie a
    # kernel to [.., 16] tiles 128 elements apart, and at W1's width SwiGLU then took 1.7x its
    # plain kernel's time (bench/fused_sweep.py at 705b78b: 24 against 14 us); with a hash it
    # reads and writes contiguous blocks like _swiglu_fwd.

    @triton.jit
    def _mix32(x):
        """lowbias32 (C. Wellons' 32-bit integer hash: two multiplies, three xor-shifts)."""
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return x

    @triton.jit
    def _hashed_keep(SEED, i, thr):
        """Keep element i (flat, < 2^31) where the high 16 bits of hash(i + hash(seed)) >= thr."""
        x = _mix32(i.to(tl.uint32) + _mix32(tl.load(SEED).to(tl.uint32)))
        return (x >> 16).to(tl.int32) >= thr

    @triton.jit
    def _hashed_dropout(X, OUT, SEED, n, thr, scale, BLOCK: tl.constexpr):
        """OUT = X * keep * scale with _hashed_keep's mask (dropout_hashed: the tests' oracle)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + i, tl.where(_hashed_keep(SEED, i, thr), x * scale, 0.0).to(OUT.dtype.element_ty), mask=m)

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


if triton is not None:
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


# Launch shapes of the norm / SwiGLU kernels with the dropout (bench/fused_sweep.py times others).
NORM_DROP_WARPS = 0  # 0: by the row's width
SWIGLU_DROP_BLOCK = 1024  # elements a program
SWIGLU_DROP_WARPS = 4


def _norm_drop_warps(gp: int) -> int:
    return NORM_DROP_WARPS or min(8, max(1, gp // 2))


def _norm_drop_launch(x2, weight, eps, seed, p, write_y: bool, room: int = 0):
    n = x2.shape[1]
    yd = torch.empty_like(x2)
    y = x2.new_empty((x2.shape[0], n + room))[:, :n] if write_y else yd
    rstd = torch.empty(x2.shape[0] if write_y else 1, dtype=torch.float32, device=x2.device)
    thr, scale = keep_threshold(p)
    gp = triton.next_power_of_2(n // 128)
    _rms_norm_drop_fwd[(x2.shape[0],)](x2, weight, y, yd, rstd, seed, n, y.stride(0), eps, thr, scale, GP=gp,
                                       WRITE_Y=write_y, num_warps=_norm_drop_warps(gp))
    return y, yd, rstd


class RMSNormDropFunction(torch.autograd.Function):
    """(rms_norm(x), dropout_seeded(rms_norm(x), seed, p), x) in one kernel each way (see
    rms_norm_dropped). Saves what RMSNormFunction saves (x and 1/rms) and the seed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, seed: torch.Tensor, p: float, room: int):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros read
        x2 = x.reshape(-1, x.shape[-1])
        y, yd, rstd = _norm_drop_launch(x2, weight, eps, seed, p, True, room)
        ctx.save_for_backward(x2, weight, rstd, seed)
        ctx.p, ctx.x_shape = p, x.shape
        return y.view(x.shape), yd.view(x.shape), x  # x as it is: autograd hands its gradient here

    @staticmethod
    def backward(ctx, dy, dyd, dr):
        x2, weight, rstd, seed = ctx.saved_tensors
        n = x2.shape[1]
        dx = torch.empty_like(x2)
        if dy is None:
            dy = torch.zeros_like(x2)
        thr, scale = keep_threshold(ctx.p)
        gp = triton.next_power_of_2(n // 128)
        dyd, dr = (t.reshape(x2.shape).contiguous() if t is not None else None for t in (dyd, dr))
        dy = dy.reshape(x2.shape)
        if dy.stride(1) != 1:  # rows may lie apart (a wide LoRA group's gradient), not elements
            dy = dy.contiguous()
        _rms_norm_drop_bwd[(x2.shape[0],)](dy, dyd if dyd is not None else dy, dr if dr is not None else dy, x2,
                                           weight, rstd, dx, seed, n, dy.stride(0), thr, scale, GP=gp,
                                           HAS_DYD=dyd is not None, HAS_DR=dr is not None,
                                           num_warps=_norm_drop_warps(gp))
        return dx.view(ctx.x_shape), None, None, None, None, None


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


def _swiglu_drop_launch(joined, seed, p, write_y: bool):
    cols = joined.shape[-1] // 2
    yd = joined.new_empty((*joined.shape[:-1], cols))
    y = joined.new_empty(yd.shape) if write_y else yd
    n = yd.numel()
    thr, scale = keep_threshold(p)
    _swiglu_drop_fwd[_elementwise_grid(n, SWIGLU_DROP_BLOCK)](joined, joined[..., cols:], y, yd, seed, n, cols, 2 * cols,
                                                              thr, scale, BLOCK=SWIGLU_DROP_BLOCK, WRITE_Y=write_y,
                                                              num_warps=SWIGLU_DROP_WARPS)
    return y, yd


def dropout_hashed(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p) with swiglu_dropped's mask (a hash of seed and flat index; contiguous x,
    fewer than 2^31 elements): the oracle of that mask in tests."""
    out = torch.empty_like(x)
    n = x.numel()
    thr, scale = keep_threshold(p)
    _hashed_dropout[_elementwise_grid(n, 1024)](x, out, seed, n, thr, scale, BLOCK=1024)
    return out


class SwiGLUDropFunction(torch.autograd.Function):
    """(silu(gate) * up, its dropout_hashed copy) of a joined [.., 2 I] gate/up output, in one
    kernel each way (see swiglu_dropped). Saves what the joined SwiGLUFunction saves, and the seed."""

    @staticmethod
    def forward(ctx, joined: torch.Tensor, seed: torch.Tensor, p: float, reuse: bool):
        ctx.set_materialize_grads(False)
        y, yd = _swiglu_drop_launch(joined, seed, p, True)
        ctx.save_for_backward(joined, seed)
        ctx.p, ctx.reuse = p, reuse
        return y, yd

    @staticmethod
    def backward(ctx, dy, dyd):
        joined, seed = ctx.saved_tensors
        cols = joined.shape[-1] // 2
        dy = dy.contiguous() if dy is not None else torch.zeros(joined.shape[:-1] + (cols,), dtype=joined.dtype,
                                                                  device=joined.device)
        dyd = dyd.contiguous() if dyd is not None else None
        n = dy.numel()
        thr, scale = keep_threshold(ctx.p)
        dgu = joined if ctx.reuse else torch.empty_like(joined)  # each element read, then written
        _swiglu_drop_bwd[_elementwise_grid(n, SWIGLU_DROP_BLOCK)](dy, dyd if dyd is not None else dy, joined,
                                                                  joined[..., cols:], dgu, dgu[..., cols:], seed, n,
                                                                  cols, 2 * cols, thr, scale if dyd is not None else 0.0,
                                                                  BLOCK=SWIGLU_DROP_BLOCK, num_warps=SWIGLU_DROP_WARPS)
        return dgu, None, None, None


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
    """Whether rope_qkv takes a joined q/k/v output [B, T, W] and cos [B, T, D]; not with
    HIVETUNE_REFERENCE=rope_qkv (split, RoPE of q and of k, a copy of v, as before)."""
    return (fused_ok(joined) and joined.dim() == 3 and joined.is_contiguous() and cos.dtype == joined.dtype
            and cos.shape == (*joined.shape[:2], cos.shape[-1]) and cos.shape[-1] % 2 == 0
            and not forced("rope_qkv"))


def rope_qkv(joined: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int):
    """(RoPE(q), RoPE(k), v) of a joined q/k/v projection [B, T, (hq + 2 hk) D], each contiguous
    [B, T, heads, D]: one kernel each way where the split, two RoPE kernels and v's copy (and in
    backward two RoPE kernels and a cat) ran before."""
    return RoPEQKVFunction.apply(joined, cos, sin, hq, hk)


# ---------------------------------------------------------------- functional wrappers

def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm takes the Triton kernel (whose output is the same bits in and out of
    autocast, so a backward may recompute it)."""
    return fused_ok(x) and weight.dtype == x.dtype and not weight.requires_grad and x.shape[-1] <= 65536


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if rms_norm_fused(x, weight):
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_dropped_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm_dropped takes x: the Triton norm (rms_norm_fused), the seeded dropout's
    conditions, rows of a multiple of 128 columns (the mask's groups then stay within a row).
    HIVETUNE_REFERENCE=norm_dropout: never (the norm, then dropout_seeded, as before)."""
    return (rms_norm_fused(x, weight) and seeded_dropout_ok(x) and x.shape[-1] % 128 == 0
            and not forced("norm_dropout"))


def rms_norm_dropped(x: torch.Tensor, weight: torch.Tensor, eps: float, seed: torch.Tensor, p: float,
                     room: int = 0):
    """(y, yd, x'): y = rms_norm(x), yd = dropout_seeded(y, seed, p), and x' = x for the residual
    add that bypasses the norm, whose gradient the norm's backward then adds in its own kernel
    (no add by autograd). For a LoRA group reading y in its base matmul and yd in its A matmul
    (lora.FusedProjections.normed): against rms_norm then dropout_seeded, one kernel and one
    read of y less forward, and backward the dropout's masked add and the residual's add ride in
    the norm's backward kernel. rms_norm_dropped_ok(x, weight) must hold.
    `room`: y's rows lie that many elements further apart, the columns after each row left to
    the caller (a wide LoRA group writes its A matmul's output there: ops.lora_group)."""
    return RMSNormDropFunction.apply(x, weight, eps, seed, p, room)


def rms_norm_dropped_only(x: torch.Tensor, weight: torch.Tensor, eps: float, seed: torch.Tensor,
                          p: float) -> torch.Tensor:
    """rms_norm_dropped's yd alone, outside autograd (the same bits): a LoRA group's backward
    recomputes its dropped input from the norm's input with it."""
    x2 = x.reshape(-1, x.shape[-1])
    return _norm_drop_launch(x2, weight, eps, seed, p, False)[1].view(x.shape)


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


def new_dropout_seed(device, n: int = 1) -> torch.Tensor:
    """A seed for _seeded_dropout (n of them), drawn from torch's CUDA generator (so
    torch.manual_seed and the checkpointed RNG state decide it, and CUDA graphs draw a new one at
    each replay)."""
    return torch.randint(0, 2**31 - 1, (n,), device=device, dtype=torch.int64)


SEEDED_GROUPS = 16  # 128-element groups a program of _seeded_dropout: 2,048 elements


def keep_threshold(p: float) -> tuple[int, float]:
    """(thr, scale) of the seeded dropout: an element is dropped when its 16 random bits are
    below thr = round(p 65536), so the dropout probability is thr / 65536 (p to within 2^-17:
    0.05 -> 0.0500031), and kept elements are scaled by 1 / (1 - thr / 65536)."""
    thr = min(65535, max(0, round(p * 65536)))
    return thr, 65536.0 / (65536 - thr)


def _seeded_launch(out: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, p: float, add: bool) -> None:
    n = out.numel()
    thr, scale = keep_threshold(p)
    _seeded_dropout[_elementwise_grid(n, 128 * SEEDED_GROUPS)](out, x, seed, n, thr, scale, ADD=add,
                                                               NG=SEEDED_GROUPS)


def dropout_seeded(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p) with the mask of `seed` (contiguous x; seeded_dropout_ok; p as keep_threshold
    rounds it)."""
    y = torch.empty_like(x)
    _seeded_launch(y, x, seed, p, add=False)
    return y


def seeded_masked_add_(out: torch.Tensor, t: torch.Tensor, seed: torch.Tensor, p: float) -> None:
    """out += t * keep / (1 - p) with dropout_seeded's mask for `seed` (contiguous, one shape)."""
    _seeded_launch(out, t, seed, p, add=True)


# ---- the LoRA A matmuls with the seeded dropout inside (ops.lora_group) ----
# x [T, D] is never dropped into a tensor of its own: each kernel draws the keep mask of the
# tile it loads (dropout_seeded's mask, element for element). Per LoRA group that saves, against
# dropout_seeded + cuBLAS, the dropped input's write and its reads (forward, A's gradient) and
# the [T, D] product that the masked add read back.

# Where the kernels beat dropout_seeded + cuBLAS (GPU us per group, forward + A's gradient +
# masked add, H200, 16-bit masks, bench/drop_matmul_speed.py at 4dc46f6 with the best splits of
# its sweep): W2 down (d 18944, R 32) 395 -> 340, W2 o (d 3584, R 32) 88 -> 79, W1 down (d 4864,
# R 8) 68 -> 62; but not on W1's 896-wide inputs (27 -> 32-34: cuBLAS + one elementwise pass are
# faster there) nor with more rows of A (W2 gate/up R 64: 89 -> 100; q/k/v R 96: 93 -> 133; the
# forward's [T, R] accumulator grows with R).
DROP_MM_MIN_D = 2048
DROP_MM_MAX_R = 32


def drop_matmul_shape(d: int, r: int) -> bool:
    """Whether the in-matmul dropout kernels are chosen for inputs d wide and A of r rows."""
    return d % 128 == 0 and d >= DROP_MM_MIN_D and r <= DROP_MM_MAX_R and not forced("dropout_matmul")


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
    bench/drop_matmul_speed.py --sweep on an H200 (8 splits of 64-row blocks at W2's ~3,000
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


def swiglu_dropped_ok(gate_up: torch.Tensor) -> bool:
    """Whether swiglu_dropped takes a joined gate/up output (the Triton SwiGLU, the seeded
    dropout's conditions); not with HIVETUNE_REFERENCE=swiglu_dropout (SwiGLU apart from the
    down_proj group's dropout: dropout_seeded or the in-matmul kernels, as before)."""
    return (fused_ok(gate_up) and gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0
            and gate_up.numel() < 2**31 and not forced("swiglu_dropout"))


def swiglu_dropped(gate_up: torch.Tensor, seed: torch.Tensor, p: float, reuse: bool = False):
    """(h, hd): h = silu(gate) * up of a joined gate/up output, hd = dropout_hashed(h, seed, p),
    for down_proj's LoRA group reading h in its base matmul and hd in its A matmul
    (model.decoder.MLP). Its backward takes both gradients: the dropout's masked add rides in
    SwiGLU's backward kernel. `reuse` as swiglu_joined's."""
    return SwiGLUDropFunction.apply(gate_up, seed, p, reuse)


def swiglu_dropped_only(gate_up: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """swiglu_dropped's hd alone, outside autograd (the same bits): down_proj's group recomputes
    its dropped input from the gate/up output with it."""
    return _swiglu_drop_launch(gate_up, seed, p, False)[1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, D] (rotate-half RoPE)."""
    if (fused_ok(x) and cos.dtype == x.dtype and x.dim() == 4 and cos.shape == (*x.shape[:2], x.shape[-1])
            and x.shape[-1] % 2 == 0):
        return RoPEFunction.apply(x, cos, sin)
    return rope_reference(x, cos, sin)
