"""The Triton kernels of ops.host_embedding (see ops.kernels)."""

import triton
import triton.language as tl


@triton.jit
def _gather_rows(TABLE, IDS, OUT, D, BLOCK: tl.constexpr):
    """OUT[i] = TABLE[IDS[i]]: one program a row, BLOCK columns at a time."""
    row = tl.program_id(0)
    src = tl.load(IDS + row).to(tl.int64) * D
    dst = row.to(tl.int64) * D
    cols = tl.arange(0, BLOCK)
    for c in range(0, D, BLOCK):
        inside = c + cols < D
        tl.store(OUT + dst + c + cols, tl.load(TABLE + src + c + cols, mask=inside), mask=inside)
