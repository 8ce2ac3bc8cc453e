"""The Triton kernels of ops.rope (see ops.kernels)."""

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
    c1, c2, s1, s2 = _cos_sin(COS, SIN, t, HALF, D_BLOCK)
    _rope_heads(QS, QD, t * Q_SRC, t * Q_DST, c1, c2, s1, s2, HQ, HALF, sign, True, HQ_BLOCK, D_BLOCK)
    _rope_heads(KS, KD, t * KV_SRC, t * KV_DST, c1, c2, s1, s2, HK, HALF, sign, True, HK_BLOCK, D_BLOCK)
    _rope_heads(VS, VD, t * KV_SRC, t * KV_DST, c1, c2, s1, s2, HK, HALF, sign, False, HK_BLOCK, D_BLOCK)


@triton.jit
def _head_offsets(heads, HALF, H_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
    """Offsets of the first halves of one token's `heads` heads of 2 HALF, and their mask."""
    h = tl.arange(0, H_BLOCK)[:, None]
    d = tl.arange(0, D_BLOCK)[None, :]
    return h * 2 * HALF + d, (h < heads) & (d < HALF)


@triton.jit
def _halves(X, at, mask, HALF):
    return (tl.load(X + at, mask=mask, other=0.0).to(tl.float32),
            tl.load(X + at + HALF, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _inv_rms(x1, x2, HALF, eps):
    return (1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps))[:, None]


@triton.jit
def _weight_halves(W, HALF, D_BLOCK: tl.constexpr):
    d = tl.arange(0, D_BLOCK)[None, :]
    return _halves(W, d, d < HALF, HALF)


@triton.jit
def _norm_rope_heads(SRC, DST, src_at, dst_at, W, c1, c2, s1, s2, heads, HALF, eps, H_BLOCK: tl.constexpr,
                     D_BLOCK: tl.constexpr):
    # one token's `heads` heads of 2 HALF: RMSNorm with weight W, rounded as ops.norm rounds (the
    # normalised row, then its product with W, in the output's dtype), then RoPE
    rows, mask = _head_offsets(heads, HALF, H_BLOCK, D_BLOCK)
    x1, x2 = _halves(SRC + src_at, rows, mask, HALF)
    rstd = _inv_rms(x1, x2, HALF, eps)
    w1, w2 = _weight_halves(W, HALF, D_BLOCK)
    ty = DST.dtype.element_ty
    n1 = (w1 * (x1 * rstd).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    n2 = (w2 * (x2 * rstd).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    y1, y2 = _rotate(n1, n2, c1, c2, s1, s2, 1)
    tl.store(DST + dst_at + rows, y1.to(ty), mask=mask)
    tl.store(DST + dst_at + rows + HALF, y2.to(ty), mask=mask)


@triton.jit
def _norm_rope_heads_bwd(DY, DX, X, dy_at, x_at, W, c1, c2, s1, s2, heads, HALF, eps, H_BLOCK: tl.constexpr,
                         D_BLOCK: tl.constexpr):
    # the gradient of _norm_rope_heads: dn = RoPE's transpose of dy (in dy's dtype, as ops.rope's
    # backward stores it), g = dn w, dx = r (g - xhat mean(g xhat)) with r recomputed from x
    rows, mask = _head_offsets(heads, HALF, H_BLOCK, D_BLOCK)
    dy1, dy2 = _halves(DY + dy_at, rows, mask, HALF)
    dn1, dn2 = _rotate(dy1, dy2, c1, c2, s1, s2, -1)
    ty = DX.dtype.element_ty
    w1, w2 = _weight_halves(W, HALF, D_BLOCK)
    g1 = dn1.to(ty).to(tl.float32) * w1
    g2 = dn2.to(ty).to(tl.float32) * w2
    x1, x2 = _halves(X + x_at, rows, mask, HALF)
    r = _inv_rms(x1, x2, HALF, eps)
    xh1 = x1 * r
    xh2 = x2 * r
    mean = ((tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1)) / (2 * HALF))[:, None]
    tl.store(DX + x_at + rows, (r * (g1 - xh1 * mean)).to(ty), mask=mask)
    tl.store(DX + x_at + rows + HALF, (r * (g2 - xh2 * mean)).to(ty), mask=mask)


@triton.jit
def _cos_sin(COS, SIN, t, HALF, D_BLOCK: tl.constexpr):
    """One token's cos and sin tables as halves (fp32)."""
    d = tl.arange(0, D_BLOCK)[None, :]
    c1, c2 = _halves(COS + t * 2 * HALF, d, d < HALF, HALF)
    s1, s2 = _halves(SIN + t * 2 * HALF, d, d < HALF, HALF)
    return c1, c2, s1, s2


@triton.jit(do_not_specialize=["eps"])
def _qk_norm_rope(X, Q, K, WQ, WK, COS, SIN, HQ, HK, HALF, X_STRIDE, eps, HQ_BLOCK: tl.constexpr,
                  HK_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
    """One token of a joined q/k/v projection X (token stride X_STRIDE): RoPE(RMSNorm(q)) into Q
    [T, HQ, 2 HALF] and RoPE(RMSNorm(k)) into K [T, HK, 2 HALF]."""
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(COS, SIN, t, HALF, D_BLOCK)
    _norm_rope_heads(X, Q, t * X_STRIDE, t * HQ * 2 * HALF, WQ, c1, c2, s1, s2, HQ, HALF, eps, HQ_BLOCK, D_BLOCK)
    _norm_rope_heads(X, K, t * X_STRIDE + HQ * 2 * HALF, t * HK * 2 * HALF, WK, c1, c2, s1, s2, HK, HALF, eps,
                     HK_BLOCK, D_BLOCK)


@triton.jit(do_not_specialize=["eps"])
def _qk_norm_rope_bwd(DQ, DK, DV, X, DX, WQ, WK, COS, SIN, HQ, HK, HALF, X_STRIDE, eps, HQ_BLOCK: tl.constexpr,
                      HK_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
    """One token of _qk_norm_rope's gradient: DQ, DK (contiguous [T, H, 2 HALF]) through RoPE and
    the norms, and DV copied, into the joined gradient DX (laid out as X)."""
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(COS, SIN, t, HALF, D_BLOCK)
    _norm_rope_heads_bwd(DQ, DX, X, t * HQ * 2 * HALF, t * X_STRIDE, WQ, c1, c2, s1, s2, HQ, HALF, eps,
                         HQ_BLOCK, D_BLOCK)
    _norm_rope_heads_bwd(DK, DX, X, t * HK * 2 * HALF, t * X_STRIDE + HQ * 2 * HALF, WK, c1, c2, s1, s2, HK, HALF,
                         eps, HK_BLOCK, D_BLOCK)
    _rope_heads(DV, DX, t * HK * 2 * HALF, t * X_STRIDE + (HQ + HK) * 2 * HALF, c1, c2, s1, s2, HK, HALF, 1,
                False, HK_BLOCK, D_BLOCK)
