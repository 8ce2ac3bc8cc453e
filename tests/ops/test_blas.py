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


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA device 0: gemm's cached-plan path, without a GPU."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return 0


def test_the_cached_plan_call_passes_each_operand_in_cublaslts_order(monkeypatch):
    """The call gemm makes for a cached plan, against a stand-in for cublasLtMatmul: cuBLAS's A is
    our b, its B our a; alpha and beta as C floats; the plan's handle, layouts and algorithm; the
    stream's workspace. One plan per shape, layout and pointer alignment."""
    calls, made = [], []

    class Lib:
        def matmul(self, *args):
            calls.append(args)
            return 0

    class Plan:
        shared = False

        def __init__(self, aligns):
            self.handle, self.desc, self.a_layout, self.b_layout, self.d_layout, self.algo_ref = (
                object() for _ in range(6))
            made.append((self, aligns))

    monkeypatch.setattr(blas, "_LIB", Lib())
    monkeypatch.setattr(blas, "_PLANS", {})
    monkeypatch.setattr(blas, "_plan", lambda lib, a, b, out, aligns, shared=True: Plan(aligns))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    workspace = torch.empty(16, dtype=torch.uint8)
    monkeypatch.setitem(blas._WORKSPACES, 77, workspace)
    bf = dict(dtype=torch.bfloat16)
    a, b = torch.randn(8, 16, **bf).as_subclass(_FakeCuda), torch.randn(24, 16, **bf).as_subclass(_FakeCuda)
    out, c = torch.empty(8, 24, **bf).as_subclass(_FakeCuda), torch.randn(8, 24, **bf).as_subclass(_FakeCuda)
    assert blas.gemm(a, b.t(), out, 0.5, 1.0, c=c) is out
    blas.gemm(a, b.t(), out, 0.5, 1.0, c=c)
    assert len(made) == 1 and len(calls) == 2 and calls[0] == calls[1]
    plan, aligns = made[0]
    got = calls[0]
    assert got[0] is plan.handle and got[1] is plan.desc and got[12] is plan.algo_ref
    assert got[2]._obj.value == 0.5 and got[7]._obj.value == 1.0
    assert got[3:7] == (b.data_ptr(), plan.b_layout, a.data_ptr(), plan.a_layout)
    assert got[8:12] == (c.data_ptr(), plan.d_layout, out.data_ptr(), plan.d_layout)
    assert got[13:] == (workspace.data_ptr(), blas.WORKSPACE_BYTES, 77)
    assert aligns == tuple(blas._alignment(p) for p in (a.data_ptr(), b.data_ptr(), out.data_ptr() | c.data_ptr()))
    # a view 2 bytes into its storage: a plan of its own, told the alignment
    shifted = torch.randn(8, 17, **bf)[:, 1:].as_subclass(_FakeCuda)
    blas.gemm(shifted, b.t(), out)
    assert len(made) == 2 and made[1][1][0] == 2 and calls[2][7]._obj.value == 0.0
    assert blas._scalar(0.25) is blas._SCALARS[0.25] and blas._SCALARS.get(0.5) is got[2]
