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


def test_resized_products_and_their_scratch():
    """blas.preload's arithmetic: a recorded product at 1,472 tokens made at 1,216 (the token
    count changed wherever it stands, a leading dimension included; the ops, dtypes, other
    widths and alignments kept), and the bytes of its stored operands."""
    bf16, f32 = blas._CUDA_R_16BF, blas._CUDA_R_32F
    y = (1472, 384, 256, blas._OP_N, 256, blas._OP_T, 256, bf16, bf16, 384, (256, 256, 256))  # y = x W^T
    assert blas.resized(y, 1472, 1216) == (1216, 384, 256, blas._OP_N, 256, blas._OP_T, 256, bf16, bf16, 384,
                                           (256, 256, 256))
    assert blas.scratch_bytes(y) == (2 * 256 * 1472, 2 * 256 * 384, 2 * 384 * 1472)
    # dA += g_xa^T x: the tokens are k; xa^T is a transposed view (its leading dimension 48)
    d_a = (48, 256, 1472, blas._OP_T, 48, blas._OP_N, 256, bf16, f32, 256, (32, 256, 256))
    assert blas.resized(d_a, 1472, 1216) == (48, 256, 1216, blas._OP_T, 48, blas._OP_N, 256, bf16, f32, 256,
                                             (32, 256, 256))
    assert blas.scratch_bytes(d_a) == (2 * 48 * 1472, 2 * 256 * 1472, 4 * 256 * 48)
    # an operand stored with the tokens innermost: its leading dimension is the token count too
    t_in = (384, 256, 1472, blas._OP_N, 1472, blas._OP_N, 256, bf16, bf16, 256, (256, 256, 256))
    assert blas.resized(t_in, 1472, 1216)[:5] == (384, 256, 1216, blas._OP_N, 1216)
    assert blas.preload({(0, y)}, 1472, [1216]) == []  # no cuBLASLt here (no CUDA): nothing run
