"""The Triton kernels of ops.nf4 (see ops.kernels)."""

import triton
import triton.language as tl


# ops.nf4's BLOCK (weights per absmax) and DQ_BLOCK (absmax values per second-level scale), which
# its kernel loading checks; a jitted kernel reads module globals only as constexpr values.
BLOCK_C, DQ_BLOCK_C = tl.constexpr(64), tl.constexpr(256)


@triton.jit
def _dequant_kernel(packed, q_absmax, absmax2, offset, levels, dmap, out, n_bytes, BYTES: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)  # packed byte index
    mask = j < n_bytes
    byte = tl.load(packed + j, mask=mask, other=0).to(tl.int32)
    hi = tl.load(levels + (byte >> 4))  # weight 2j
    lo = tl.load(levels + (byte & 15))  # weight 2j + 1
    block = j // (BLOCK_C // 2)  # the 64-block of both
    q = tl.load(q_absmax + block, mask=mask, other=0).to(tl.int32)
    scale = tl.load(dmap + q) * tl.load(absmax2 + block // DQ_BLOCK_C, mask=mask, other=0.0)
    scale = scale + tl.load(offset)
    values = tl.join(hi * scale, lo * scale)  # [BYTES, 2]: weights 2j, 2j + 1
    index = tl.join(2 * j, 2 * j + 1)
    tl.store(out + index, values.to(out.dtype.element_ty), mask=tl.join(mask, mask))
