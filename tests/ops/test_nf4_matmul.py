"""The NF4 dequantizing matmul (Triton) against its reference, the whole weight dequantized then
the matmul: on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1 with Triton installed (the
interpreter's bf16 tl.dot is broken there, so bf16 runs on GPUs only)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hivetune.ops import nf4, nf4_matmul, triton_util

RUNS_TRITON = triton_util.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not RUNS_TRITON, reason="needs Triton on a GPU (or TRITON_INTERPRET=1 with Triton installed)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(5, 96, 128), (70, 130, 192), (1, 64, 64), (129, 200, 320)]  # (tokens, out, in)


def weight(n: int, k: int, seed: int):
    torch.manual_seed(seed)
    q = nf4.quantize(torch.randn(n, k, device=DEVICE) * 0.05)
    parts = (q.packed, q.q_absmax, q.absmax2, q.offset)
    return parts, nf4.dequantize_reference(*parts, (n, k))


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp32_kernels_equal_the_dequantized_matmul(m, n, k):
    """The interpreter's exact check of the kernels' arithmetic. On a GPU the kernels run in bf16 /
    fp16 only (fused_ok sends fp32 to the reference), and Triton cannot lay out the fp32
    input-gradient tile there (an illegal shared layout on an H200)."""
    if DEVICE == "cuda":
        pytest.skip("fp32 takes the reference on GPUs; the half-precision test covers the kernels there")
    parts, w = weight(n, k, m)
    x, g, b = (torch.randn(m, k, device=DEVICE), torch.randn(m, n, device=DEVICE), torch.randn(n, device=DEVICE))
    tol = 1e-5
    torch.testing.assert_close(nf4_matmul.matmul(x, *parts, n, b), x @ w.T + b, rtol=0, atol=tol)
    torch.testing.assert_close(nf4_matmul.input_grad(g, *parts, k), g @ w, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_half_forward_and_input_grad_within_half_noise(m, n, k, dtype):
    if dtype == torch.bfloat16 and DEVICE != "cuda":
        pytest.skip("the Triton interpreter's bf16 tl.dot is broken")
    parts, _ = weight(n, k, m + 1)
    w = nf4.dequantize_reference(*parts, (n, k), dtype)  # the weights the kernels see, bit for bit
    x = torch.randn(2, m, k, device=DEVICE, dtype=dtype, requires_grad=True)
    bias = torch.randn(n, device=DEVICE, dtype=dtype)
    assert nf4_matmul.fused_matmul_ok(x, k)
    y = nf4_matmul.nf4_linear(x, *parts, (n, k), bias)
    x64 = x.detach().double().requires_grad_(True)
    y64 = F.linear(x64, w.double(), bias.double())
    eps = torch.finfo(dtype).eps
    assert y.dtype == dtype and (y.double() - y64).abs().max() <= 4 * eps * y64.abs().max()
    g = torch.randn_like(y)
    y.backward(g)
    y64.backward(g.double())
    assert (x.grad.double() - x64.grad).abs().max() <= 4 * eps * x64.grad.abs().max()


def test_in_features_off_the_block_take_the_reference():
    x = torch.randn(3, 96, device=DEVICE, dtype=torch.float16)
    assert not nf4_matmul.fused_matmul_ok(x, 96)
    parts, _ = weight(32, 96, 0)
    w = nf4.dequantize_parts(*parts, (32, 96), torch.float16)
    assert torch.equal(nf4_matmul.nf4_linear(x, *parts, (32, 96)), F.linear(x, w))
