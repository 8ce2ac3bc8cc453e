"""ops.launch on the GPU: direct launches of real Triton kernels give what Triton's own path
gives, for every specialization the key tells apart, inside a CUDA graph too; the model's fused
kernels give the same bits either way."""

from __future__ import annotations

import pytest
import torch

from hivetune.ops import elementwise, launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or elementwise.triton is None,
                                reason="needs a CUDA GPU with Triton")

if elementwise.triton is not None:
    import triton
    import triton.language as tl

    @launch.fast_launch
    @triton.jit
    def _axpy(X, Y, OUT, n, a, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        x = tl.load(X + i, mask=inside).to(tl.float32)
        y = tl.load(Y + i, mask=inside).to(tl.float32)
        tl.store(OUT + i, (a * x + y).to(OUT.dtype.element_ty), mask=inside)


def axpy(x, y, a, block=128):
    out = torch.empty_like(x)
    _axpy[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), a, BLOCK=block)
    return out


def counts():
    return launch.STATS["fast"], launch.STATS["triton"]


def test_every_specialization_gives_triton_s_result_and_repeats_go_direct(monkeypatch):
    """Aligned and misaligned views, lengths 1, 16k and 16k + 3, two block sizes, two dtypes:
    the first call of each takes Triton's path, the second the direct one; both equal a * x + y
    computed by torch."""
    monkeypatch.delenv("HIVETUNE_REFERENCE", raising=False)
    assert isinstance(_axpy, launch.FastLaunch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randn(5000, device="cuda", generator=gen)
    cases = [(buf[:4096], buf[:4096].flip(0), 128), (buf[1:4097], buf[:4096], 128),  # misaligned x
             (buf[:1], buf[2:3], 128), (buf[:4099], buf[1:4100], 128), (buf[:4096], buf[:4096], 256),
             (buf[:4096].bfloat16(), buf[:4096].bfloat16(), 128)]
    for x, y, block in cases:
        want = (0.5 * x.float() + y.float()).to(x.dtype)
        fast, slow = counts()
        first = axpy(x, y, 0.5, block)
        assert counts() == (fast, slow + 1)
        second = axpy(x, y, 0.5, block)
        assert counts() == (fast + 1, slow + 1)
        assert torch.equal(first, want) and torch.equal(second, want)
    x, y = buf[:4096], buf[1:4097]
    assert torch.equal(axpy(x, y, -2.0), (-2.0 * x + y))  # another float: the same kernel, direct
    assert counts()[0] == fast + 2


def test_the_reference_env_launches_through_triton(monkeypatch):
    monkeypatch.setenv("HIVETUNE_REFERENCE", "triton_launch")
    x = torch.arange(300, device="cuda", dtype=torch.float32)
    fast, slow = counts()
    for _ in range(3):
        assert torch.equal(axpy(x, x, 2.0), 3 * x)
    assert counts() == (fast, slow + 3)


def test_a_direct_launch_is_captured_and_replayed_in_a_cuda_graph(monkeypatch):
    monkeypatch.delenv("HIVETUNE_REFERENCE", raising=False)
    x, y = torch.ones(1024, device="cuda"), torch.zeros(1024, device="cuda")
    out = torch.empty_like(x)
    _axpy[(8,)](x, y, out, 1024, 3.0, BLOCK=128)  # Triton's path, outside the capture
    fast = counts()[0]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        _axpy[(8,)](x, y, out, 1024, 3.0, BLOCK=128)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    assert counts()[0] == fast + 1
    x.fill_(2.0)
    y.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_the_models_fused_kernels_give_the_same_bits_either_way(monkeypatch):
    """RMSNorm with the seeded dropout, the joined SwiGLU with dropout and the in-matmul LoRA
    dropout, forward and backward, on W2-like widths: twice with direct launches (the second
    call direct), once through Triton's path; all three bitwise equal."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(300, 2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = torch.rand(2048, device="cuda", generator=gen).bfloat16().requires_grad_()
    gate_up = torch.randn(300, 2 * 1024, device="cuda", generator=gen).bfloat16().requires_grad_()
    a = (torch.randn(32, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    seed = elementwise.new_dropout_seed(torch.device("cuda"))

    def run():
        outs = [*elementwise.rms_norm_dropped(x, w, 1e-6, seed, 0.1), *elementwise.swiglu_dropped(gate_up, seed, 0.1)]
        assert elementwise.drop_matmul_ok(x.detach(), a)
        outs.append(elementwise.drop_matmul(x.detach(), a, seed, 0.1, 2.0))
        loss = sum((o.float() * (k + 1)).sum() for k, o in enumerate(outs) if o.requires_grad)
        x.grad = w.grad = gate_up.grad = None
        loss.backward()
        return [o.detach().clone() for o in outs] + [x.grad.clone(), w.grad.clone(), gate_up.grad.clone()]

    monkeypatch.delenv("HIVETUNE_REFERENCE", raising=False)
    run()
    fast = counts()[0]
    direct = run()
    assert counts()[0] > fast
    monkeypatch.setenv("HIVETUNE_REFERENCE", "triton_launch")
    through = run()
    assert len(direct) == len(through) == 9
    for d, t in zip(direct, through):
        assert torch.equal(d, t)
