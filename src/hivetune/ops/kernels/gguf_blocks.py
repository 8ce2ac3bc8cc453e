"""The Triton kernels of ops.gguf_blocks (see ops.kernels)."""

import triton
import triton.language as tl


@triton.jit
def _half(ptr, mask):
    """The little-endian half at ptr (a uint8 pointer tensor), as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _dequant_kernel(raw, out, n, KIND: tl.constexpr, QK: tl.constexpr, NBYTES: tl.constexpr,
                    BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # weight index
    mask = i < n
    e = (i % QK).to(tl.int32)  # place in its block
    b = raw + (i // QK) * NBYTES  # its block's first byte
    if KIND == 2 or KIND == 3:  # Q4_0, Q4_1: weights 0-15 low nibbles, 16-31 high ones
        head = 2 if KIND == 2 else 4
        q = ((_u8(b + head + e % 16, mask) >> (4 * (e // 16))) & 15).to(tl.float32)
        if KIND == 2:
            y = _half(b, mask) * (q - 8.0)
        else:
            y = _half(b, mask) * q + _half(b + 2, mask)
    elif KIND == 6 or KIND == 7:  # Q5_0, Q5_1: as Q4_0 / Q4_1 plus bit e of qh as the fifth bit
        qh = 2 if KIND == 6 else 4
        low = (_u8(b + qh + 4 + e % 16, mask) >> (4 * (e // 16))) & 15
        high = (_u8(b + qh + e // 8, mask) >> (e % 8)) & 1
        q = (low | (high << 4)).to(tl.float32)
        if KIND == 6:
            y = _half(b, mask) * (q - 16.0)
        else:
            y = _half(b, mask) * q + _half(b + 2, mask)
    elif KIND == 8:  # Q8_0
        q = tl.load(b + 2 + e, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        y = q * _half(b, mask)
    elif KIND == 12 or KIND == 13:  # Q4_K, Q5_K: 8 sub-blocks of 32, 6-bit scales and mins
        s = e // 32
        low = s < 4
        sc_lo = _u8(b + 4 + s, mask & low) & 63
        mn_lo = _u8(b + 8 + s, mask & low) & 63
        hi = tl.where(low, 0, s - 4)
        packed = _u8(b + 12 + hi, mask & ~low)
        sc_hi = (packed & 15) | ((_u8(b + 4 + hi, mask & ~low) >> 6) << 4)
        mn_hi = (packed >> 4) | ((_u8(b + 8 + hi, mask & ~low) >> 6) << 4)
        sc = tl.where(low, sc_lo, sc_hi).to(tl.float32)
        mn = tl.where(low, mn_lo, mn_hi).to(tl.float32)
        start = 16 if KIND == 12 else 48  # the nibbles; Q5_K's fifth bits before them
        q = (_u8(b + start + 32 * (s // 2) + e % 32, mask) >> (4 * (s % 2))) & 15
        if KIND == 13:
            q = q | (((_u8(b + 16 + e % 32, mask) >> s) & 1) << 4)
        y = (_half(b, mask) * sc) * q.to(tl.float32) - _half(b + 2, mask) * mn
    else:  # Q6_K: two halves of 128, each 4 quarters of 32 (low nibbles of ql, 2 bits of qh)
        half = e // 128
        t = (e % 128) // 32
        l = e % 32
        low = (_u8(b + 64 * half + l + 32 * (t % 2), mask) >> (4 * (t // 2))) & 15
        high = (_u8(b + 128 + 32 * half + l, mask) >> (2 * t)) & 3
        q = ((low | (high << 4)) - 32).to(tl.float32)
        sc = tl.load(b + 192 + e // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        y = (_half(b + 208, mask) * sc) * q
    tl.store(out + i, y.to(out.dtype.element_ty), mask=mask)
