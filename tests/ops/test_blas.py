"""ops.blas on the CPU: the reference path (torch) gives torch's own bits, for every form the
LoRA groups call (beta 0 / 1, a separate C, fp32 output from bf16 inputs), and the layouts the
cuBLASLt plans take or leave to torch. The cuBLASLt path itself: tests/gpu/test_cuda_blas.py."""

from __future__ import annotations

import torch

from hivetune.ops import blas
def test_reference_path_gives_torchs_bits():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=g), torch.randn(3, 5, generator=g)
    out = torch.randn(7, 3, generator=g)
    assert torch.equal(blas.gemm(a, b.t()), torch.mm(a, b.t()))
    assert torch.equal(blas.gemm(a, b.t(), alpha=0.5), torch.addmm(torch.zeros(7, 3), a, b.t(), beta=0, alpha=0.5))
    acc = out.clone()
    blas.gemm(a, b.t(), acc, 2.0, 1.0)
    assert torch.equal(acc, torch.addmm(out, a, b.t(), alpha=2.0))
    c = torch.randn(7, 3, generator=g)
    assert torch.equal(blas.gemm(a, b.t(), beta=1.0, c=c), torch.addmm(c, a, b.t()))
    # fp32 output from bf16 inputs: the exact products accumulated in fp32
    ab, bb = a.bfloat16(), b.bfloat16()
    got = blas.gemm(ab, bb.t(), out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, ab.float() @ bb.float().t())
    into = torch.ones(7, 3)
    blas.gemm(ab, bb.t(), into, 1.0, 1.0)
    assert torch.equal(into, torch.ones(7, 3).addmm(ab.float(), bb.float().t()))


def test_operand_layouts():
    bf = dict(dtype=torch.bfloat16)
    w = torch.empty(24, 40, **bf)
    assert blas._operand(w, 24, 40) == (blas._OP_N, 40)  # row-major, as stored
    assert blas._operand(w.t(), 40, 24) == (blas._OP_T, 40)  # a transposed view: no copy
    assert blas._operand(w[:, 8:32], 24, 24) == (blas._OP_N, 40)  # a column slice keeps its row stride
    assert blas._operand(torch.empty(24, 20, **bf)[:, :8], 24, 8) is None  # 40-byte rows: not 16-byte aligned
    assert blas._operand(torch.empty(4, 6, 8, **bf).permute(2, 0, 1)[0], 4, 6) is None  # neither layout
    assert blas._alignment(0x1000) == 256 and blas._alignment(0x1040) == 64 and blas._alignment(0x1002) == 2
