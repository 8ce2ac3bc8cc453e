"""The Triton kernels of ops.dropout (see ops.kernels)."""

import triton
import triton.language as tl


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


# The hashed mask (swiglu_dropped): a hash of (seed, flat element index) lets a kernel read
# and write contiguous blocks; _keep_eighths' Philox pieces tie it to [.., 16] tiles 128
# elements apart, 1.7x the plain SwiGLU kernel's time at W1's width (docs/log.md).


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
def _masked_add(OUT, T, M, n, keep, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    o = tl.load(OUT + i, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(T + i, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + i, mask=mask, other=0).to(tl.float32)
    tl.store(OUT + i, (o + t * m * keep).to(OUT.dtype.element_ty), mask=mask)
