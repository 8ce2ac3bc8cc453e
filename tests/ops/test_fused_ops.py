"""Fused RMSNorm / RoPE / SwiGLU (Triton) against float64 references, and the fallbacks.

The Triton tests run on a CUDA GPU, or on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1 python -m pytest tests/ops/test_fused_ops.py`, Triton installed); the
CPU CI has no Triton and skips them. The oracle is float64 math on the same (rounded) inputs:
the fused output must be at least about as close to it as the bf16 / fp16 PyTorch reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from hivetune.ops import dropout as dropout_op
from hivetune.ops import lora_dropout, triton_util
from hivetune.ops import norm as norm_op
from hivetune.ops import rope as rope_op
from hivetune.ops import swiglu as swiglu_op

RUNS_TRITON = triton_util.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="needs Triton on a GPU (or TRITON_INTERPRET=1)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def forward_backward(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def check(fused_fn, ref_fn, inputs, dy):
    """Fused vs float64 no worse than ~the low-precision reference vs float64 (+ slack)."""
    # Triton's CPU interpreter converts to bf16 by truncation, not round-to-nearest as the GPU
    # does (measured: half the conversions differ), which doubles the forward error there.
    slack = 3.0 if inputs[0].dtype == torch.bfloat16 and not inputs[0].is_cuda else 1.5
    y, grads = forward_backward(fused_fn, inputs, dy)
    y_ref, grads_ref = forward_backward(ref_fn, inputs, dy)
    y64, grads64 = forward_backward(ref_fn, [t.double() for t in inputs], dy.double())
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert torch.isfinite(y).all()
    assert rel(y, y64) <= slack * rel(y_ref, y64) + 1e-4, (rel(y, y64), rel(y_ref, y64))
    for g, g_ref, g64 in zip(grads, grads_ref, grads64):
        if g64 is None:
            continue
        assert rel(g, g64) <= slack * rel(g_ref, g64) + 1e-4, (rel(g, g64), rel(g_ref, g64))
        assert rel(g, g64) < 2e-2


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 37, 96), (2, 5, 896), (1, 3, 7, 64)])  # q_norm-like 4-D too
def test_rms_norm_matches_float64(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.2 * torch.randn(shape[-1])).to(dtype).to(DEVICE)
    assert triton_util.fused_ok(x)
    check(lambda a: norm_op.rms_norm(a, w, 1e-6), lambda a: norm_op.rms_norm_reference(a, w.to(a.dtype), 1e-6), [x],
          torch.randn(shape, device=DEVICE))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("part", ["q", "k"])
def test_rms_norm_reads_heads_of_a_joined_projection_in_place(dtype, part):
    """A Qwen3 layer's q / k norm: [B, T, H, 128] views into the joined q/k/v output (rows 4,096
    apart, not one tensor of rows), 37 tokens x heads: rows not a multiple of a program's 16.
    The same values as on a contiguous copy, float64's accuracy both ways, nothing copied."""
    torch.manual_seed(4)
    b, t, heads, kv, d = 1, 37, 4, 2, 128
    joined = (torch.randn(b, t, (heads + 2 * kv) * d) * 3).to(dtype).to(DEVICE)
    q, k, _ = joined.split([heads * d, kv * d, kv * d], dim=-1)
    x = (q.view(b, t, heads, d) if part == "q" else k.view(b, t, kv, d))
    rows, h, stride_t, stride_h = norm_op.rows_of(x)
    assert rows.data_ptr() == x.data_ptr() and (h, stride_t, stride_h) == (x.shape[2], joined.shape[-1], d)
    w = (1 + 0.2 * torch.randn(d)).to(dtype).to(DEVICE)
    assert torch.equal(norm_op.rms_norm(x, w, 1e-6), norm_op.rms_norm(x.contiguous(), w, 1e-6))
    dy = torch.randn(x.shape, device=DEVICE)
    _, (g_copy,) = forward_backward(lambda a: norm_op.rms_norm(a, w, 1e-6), [x.contiguous()], dy)
    leaf = joined.detach().clone().requires_grad_(True)
    qv, kv_, _ = leaf.split([heads * d, kv * d, kv * d], dim=-1)
    view = qv.view(b, t, heads, d) if part == "q" else kv_.view(b, t, kv, d)
    norm_op.rms_norm(view, w, 1e-6).backward(dy.to(dtype))
    got = leaf.grad[..., :heads * d] if part == "q" else leaf.grad[..., heads * d:(heads + kv) * d]
    assert torch.equal(got.reshape(x.shape), g_copy)
    check(lambda a: norm_op.rms_norm(a, w, 1e-6), lambda a: norm_op.rms_norm_reference(a, w.to(a.dtype), 1e-6),
          [x], dy)


def test_rows_of_reads_in_place_where_the_layout_allows():
    """Rows folded into one stride (H 1), heads of a [B, T, H, D] view (H rows a token), else a copy."""
    x = torch.randn(2, 5, 24)
    rows, h, st, sh = norm_op.rows_of(x)
    assert rows.data_ptr() == x.data_ptr() and (h, st, sh) == (1, 24, 0)
    wide = torch.randn(2, 5, 3 * 64)
    q = wide[..., :128].view(2, 5, 2, 64)
    rows, h, st, sh = norm_op.rows_of(q)
    assert rows.data_ptr() == q.data_ptr() and (h, st, sh) == (2, 192, 64) and rows.shape == (10, 2, 64)
    t = torch.randn(5, 2, 24).transpose(0, 1)  # [2, 5, 24], its 5 rows 48 apart, the 2 blocks 24
    rows, h, st, sh = norm_op.rows_of(t)
    assert rows.data_ptr() == t.data_ptr() and (h, st, sh) == (5, 24, 48)
    c = torch.randn(24, 10).t()  # columns apart: a copy
    rows, h, st, sh = norm_op.rows_of(c)
    assert rows.data_ptr() != c.data_ptr() and (h, st, sh) == (1, 24, 0) and torch.equal(rows, c)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 41, 200), (3, 7, 1025)])
def test_swiglu_matches_float64(dtype, shape):
    torch.manual_seed(1)
    gate = (torch.randn(shape) * 2).to(dtype).to(DEVICE)
    up = torch.randn(shape).to(dtype).to(DEVICE)
    check(swiglu_op.swiglu, swiglu_op.swiglu_reference, [gate, up], torch.randn(shape, device=DEVICE))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dim", [(14, 64), (2, 64), (5, 18)])
def test_rope_matches_float64(dtype, heads, dim):
    torch.manual_seed(2)
    b, t = 2, 11
    x = torch.randn(b, t, heads, dim).to(dtype).to(DEVICE)
    pos = torch.randint(0, 500, (b, t))
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim))
    angles = pos[..., None].float() * inv
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    check(lambda a: rope_op.apply_rope(a, cos, sin), lambda a: rope_op.rope_reference(a, cos.to(a.dtype), sin.to(a.dtype)),
          [x], torch.randn(b, t, heads, dim, device=DEVICE))


def test_fallbacks_are_the_references(monkeypatch):
    """fp32, CPU, a trainable norm weight or fused_ops false take the plain PyTorch path."""
    torch.manual_seed(3)
    x = torch.randn(2, 4, 8)
    w = torch.randn(8)
    assert not triton_util.fused_ok(x)  # fp32
    assert torch.equal(norm_op.rms_norm(x, w, 1e-5), norm_op.rms_norm_reference(x, w, 1e-5))
    assert torch.equal(swiglu_op.swiglu(x, x * 2), swiglu_op.swiglu_reference(x, x * 2))
    xb = x.bfloat16()
    monkeypatch.setattr(triton_util, "_FUSED_OPS", True)
    triton_util.set_fused_ops(False)
    assert not triton_util.fused_ok(xb)
    triton_util.set_fused_ops(True)
    monkeypatch.setenv("HIVETUNE_REFERENCE", "varlen,fused_layers")
    assert not triton_util.fused_ok(xb)
    monkeypatch.delenv("HIVETUNE_REFERENCE")
    trainable = w.bfloat16().requires_grad_(True)
    out = norm_op.rms_norm(xb, trainable, 1e-5)
    assert out.grad_fn is not None and "RMSNormFunction" not in type(out.grad_fn).__name__


def keep_mask(shape, seed, p, dtype):
    """dropout_seeded's keep mask: the oracle for every kernel that draws it."""
    return dropout_op.dropout_seeded(torch.ones(shape, dtype=dtype, device=DEVICE), seed, p) != 0


def test_keep_threshold_rounds_p_to_16_bits():
    assert dropout_op.keep_threshold(0.25) == (16384, 65536 / 49152)
    thr, scale = dropout_op.keep_threshold(0.05)
    assert thr == 3277 and abs(thr / 65536 - 0.05) < 2**-17 and scale == 65536 / (65536 - 3277)
    assert dropout_op.keep_threshold(0.0) == (0, 1.0)


@needs_triton
def test_seeded_dropout_keeps_1_minus_p_in_every_piece_of_its_groups():
    """Each Philox draw gives 8 elements their 16 random bits (2 per 32-bit word): every one of
    the 8 pieces of a 128-element group keeps ~1 - p, the halves of one word disagree as often as
    independent draws would, and the kept values are x * scale exactly."""
    seed, p = torch.tensor([77], device=DEVICE), 0.05
    x = torch.randn(512, 384, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.float16)
    y = dropout_op.dropout_seeded(x, seed, p)
    keep = (y != 0).cpu().view(-1, 8, 16).double()  # [group, piece, j]
    rates = keep.mean((0, 2))
    assert ((rates - 0.95).abs() < 0.006).all(), rates
    lo, hi = keep[:, 0::2], keep[:, 1::2]  # the low and high halves of the same words
    both_dropped = ((1 - lo) * (1 - hi)).mean().item()
    assert abs(both_dropped - 0.05**2) < 0.0015
    thr, scale = dropout_op.keep_threshold(p)
    kept = y != 0
    assert torch.equal(y[kept], (x[kept].float() * scale).to(torch.float16))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 5, 384), (1, 37, 896), (3, 128)])  # 3, 7 and 1 mask groups a row
def test_rms_norm_dropped_is_the_norm_then_dropout_seeded(dtype, shape):
    """rms_norm_dropped gives rms_norm's output, dropout_seeded's dropped copy of it (the same
    mask and bits), and x itself; its backward takes the gradients of all three: the norm's
    gradient of dy + the dropout's backward of dyd, plus dr (the residual stream's), each as
    close to float64 math as the unfused ops are; unused outputs' gradients may be absent."""
    gen = torch.Generator().manual_seed(shape[-2])
    x = (torch.randn(shape, generator=gen) * 3).to(DEVICE, dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(DEVICE, dtype)
    seed, p = torch.tensor([99], device=DEVICE), 0.25
    assert norm_op.rms_norm_dropped_ok(x, w) and not norm_op.rms_norm_dropped_ok(x[..., :shape[-1] - 64].contiguous(), w[:-64])
    y, yd, same = norm_op.rms_norm_dropped(x, w, 1e-6, seed, p)
    plain = norm_op.rms_norm(x, w, 1e-6)
    assert same.data_ptr() == x.data_ptr() and torch.equal(same, x)
    assert (y != plain).float().mean().item() < 0.01 and rel(y, plain) < 1e-3  # rstd summed in another order
    assert torch.equal(yd, dropout_op.dropout_seeded(y, seed, p))
    assert torch.equal(norm_op.rms_norm_dropped_only(x, w, 1e-6, seed, p), yd)
    keep = keep_mask(shape, seed, p, torch.float64).double() / (1 - p)
    kept = keep_mask(shape, seed, p, torch.float64).float() * dropout_op.keep_threshold(p)[1]  # the unfused dropout
    dy, dyd, dr = (torch.randn(shape, generator=gen).to(DEVICE, dtype) for _ in range(3))
    slack = 3.0 if dtype == torch.bfloat16 and not x.is_cuda else 1.5

    def grad_of(fn, inputs):
        leaf = inputs.detach().clone().requires_grad_(True)
        fn(leaf).backward()
        return leaf.grad

    w64 = w.double()
    for with_dyd, with_dr in ((True, True), (True, False), (False, True)):
        def loss64(a):
            y64 = norm_op.rms_norm_reference(a, w64, 1e-6)
            return ((y64 * dy.double()).sum() + with_dyd * (y64 * keep * dyd.double()).sum()
                    + with_dr * (a * dr.double()).sum())

        def loss_fused(a):
            y_, yd_, x_ = norm_op.rms_norm_dropped(a, w, 1e-6, seed, p)
            total = (y_ * dy).float().sum()
            total = total + (yd_ * dyd).float().sum() if with_dyd else total
            return total + (x_ * dr).float().sum() if with_dr else total

        def loss_unfused(a):  # what the decoder ran before: norm, dropout, autograd's adds
            y_ = norm_op.rms_norm(a, w, 1e-6)
            total = (y_ * dy).float().sum()
            total = total + (y_.float() * kept * dyd.float()).sum() if with_dyd else total
            return total + (a * dr).float().sum() if with_dr else total

        dx64 = grad_of(loss64, x.double())
        dx, dx_ref = grad_of(loss_fused, x), grad_of(loss_unfused, x)
        assert dx.dtype == dtype and rel(dx, dx64) <= slack * rel(dx_ref, dx64) + 1e-4, (rel(dx, dx64), rel(dx_ref, dx64))


@needs_triton
def test_rms_norm_dropped_leaves_room_after_each_row():
    """room=k: y's rows lie n + k apart in one buffer (a wide LoRA group fills the k columns) with
    the bits of room=0, and a gradient with rows apart gives the dx of a contiguous one, bit for
    bit (the kernel reads it in place)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((3, 7, 384), generator=gen).to(DEVICE, torch.bfloat16)
    w = (1 + 0.2 * torch.randn(384, generator=gen)).to(DEVICE, torch.bfloat16)
    seed = torch.tensor([7], device=DEVICE)
    y0, yd0, _ = norm_op.rms_norm_dropped(x, w, 1e-6, seed, 0.1)
    y, yd, _ = norm_op.rms_norm_dropped(x, w, 1e-6, seed, 0.1, room=48)
    assert y.stride() == (7 * 432, 432, 1) and torch.equal(y, y0) and torch.equal(yd, yd0)
    wide = torch.randn((21, 432), generator=gen).to(DEVICE, torch.bfloat16)
    dxs = []
    for dy in (wide[:, :384].view(3, 7, 384), wide[:, :384].contiguous().view(3, 7, 384)):
        leaf = x.detach().clone().requires_grad_(True)
        y_, yd_, _ = norm_op.rms_norm_dropped(leaf, w, 1e-6, seed, 0.1, room=48)
        torch.autograd.backward([y_, yd_], [dy, torch.ones_like(yd_)])
        dxs.append(leaf.grad)
    assert dxs[0].abs().sum() > 0 and torch.equal(dxs[0], dxs[1])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 5, 2 * 384), (1, 37, 2 * 200)])  # rows in and off 128-element groups
def test_swiglu_dropped_is_swiglu_then_dropout_seeded(dtype, shape):
    """swiglu_dropped gives swiglu_joined's output and dropout_hashed's copy of it (the same bits);
    its backward takes both gradients, the dropout's drawn again from the seed, as close to
    float64 math as SwiGLU then the dropout; swiglu_dropped_only gives the copy alone."""
    gen = torch.Generator().manual_seed(shape[1])
    gu = (torch.randn(shape, generator=gen) * 2).to(DEVICE, dtype)
    seed, p = torch.tensor([5], device=DEVICE), 0.25
    assert swiglu_op.swiglu_dropped_ok(gu)
    h, hd = swiglu_op.swiglu_dropped(gu, seed, p)
    assert torch.equal(h, swiglu_op.swiglu_joined(gu)) and torch.equal(hd, dropout_op.dropout_hashed(h, seed, p))
    assert torch.equal(swiglu_op.swiglu_dropped_only(gu, seed, p), hd)
    cols = shape[-1] // 2
    mask = dropout_op.dropout_hashed(torch.ones(h.shape, dtype=torch.float64, device=DEVICE), seed, p) != 0
    keep, kept = mask.double() / (1 - p), mask.float() * dropout_op.keep_threshold(p)[1]
    dh, dhd = (torch.randn(h.shape, generator=gen).to(DEVICE, dtype) for _ in range(2))

    def grad_of(fn, inputs):
        leaf = inputs.detach().clone().requires_grad_(True)
        fn(leaf).backward()
        return leaf.grad

    def loss64(a):
        h64 = swiglu_op.swiglu_reference(a[..., :cols], a[..., cols:])
        return (h64 * dh.double()).sum() + (h64 * keep * dhd.double()).sum()

    def loss_fused(a):
        h_, hd_ = swiglu_op.swiglu_dropped(a, seed, p)
        return (h_ * dh).float().sum() + (hd_ * dhd).float().sum()

    def loss_unfused(a):
        h_ = swiglu_op.swiglu_joined(a)
        return (h_ * dh).float().sum() + (h_.float() * kept * dhd.float()).sum()

    slack = 3.0 if dtype == torch.bfloat16 and not gu.is_cuda else 1.5
    d64, d, d_ref = grad_of(loss64, gu.double()), grad_of(loss_fused, gu), grad_of(loss_unfused, gu)
    assert d.dtype == dtype and rel(d, d64) <= slack * rel(d_ref, d64) + 1e-4, (rel(d, d64), rel(d_ref, d64))


@needs_triton
@pytest.mark.parametrize("hq, hk, d", [(14, 2, 64), (4, 4, 32), (6, 2, 8)])
def test_rope_qkv_gives_the_split_rope_bits_both_ways(hq, hk, d):
    """rope_qkv on a joined q/k/v output: the bits of split, RoPE of q and of k, v's copy; its
    backward, the bits of their backward and the cat into the joined gradient."""
    gen = torch.Generator().manual_seed(hq)
    b, t = 2, 7
    joined = torch.randn(b, t, (hq + 2 * hk) * d, generator=gen).to(DEVICE, torch.bfloat16)
    angles = torch.randn(b, t, d // 2, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos().to(DEVICE, torch.bfloat16), angles.sin().to(DEVICE, torch.bfloat16)
    grads = [torch.randn(b, t, h, d, generator=gen).to(DEVICE, torch.bfloat16) for h in (hq, hk, hk)]
    assert rope_op.rope_qkv_ok(joined, cos)

    def run(fused):
        x = joined.detach().clone().requires_grad_(True)
        if fused:
            outs = rope_op.rope_qkv(x, cos, sin, hq, hk)
        else:
            q, k, v = x.split([hq * d, hk * d, hk * d], dim=-1)
            outs = (rope_op.apply_rope(q.reshape(b, t, hq, d), cos, sin), rope_op.apply_rope(k.reshape(b, t, hk, d), cos, sin),
                    v.contiguous().view(b, t, hk, d))
        torch.autograd.backward(outs, grads)
        return outs, x.grad

    outs, grad = run(True)
    ref_outs, ref_grad = run(False)
    assert all(o.is_contiguous() and o.shape == r.shape and torch.equal(o, r) for o, r in zip(outs, ref_outs))
    assert torch.equal(grad, ref_grad)
    assert not torch.equal(outs[0], joined[..., :hq * d].reshape(b, t, hq, d))  # it did rotate


@needs_triton
@pytest.mark.parametrize("hq, hk, d", [(16, 8, 128), (4, 4, 32), (6, 2, 8)])
def test_qk_norm_rope_matches_the_norms_then_rope_both_ways(hq, hk, d):
    """qk_norm_rope on a joined q/k/v output (Qwen3's q/k RMSNorms, then RoPE; one kernel each
    way): q and k within a bf16 rounding of split + rms_norm + apply_rope (the kernels one by one;
    1/rms is summed in another order), v a view of the joined tensor; the joined gradient
    likewise against theirs and the cat; both as close to float64 as they are."""
    gen = torch.Generator().manual_seed(hq + d)
    b, t = 2, 7
    joined = (3 * torch.randn(b, t, (hq + 2 * hk) * d, generator=gen)).to(DEVICE, torch.bfloat16)
    angles = torch.randn(b, t, d // 2, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos().to(DEVICE, torch.bfloat16), angles.sin().to(DEVICE, torch.bfloat16)
    grads = [torch.randn(b, t, h, d, generator=gen).to(DEVICE, torch.bfloat16) for h in (hq, hk, hk)]
    q_norm, k_norm = (torch.nn.Module() for _ in range(2))
    for norm, seed in ((q_norm, 1), (k_norm, 2)):
        norm.weight = (1 + 0.3 * torch.randn(d, generator=torch.Generator().manual_seed(seed))).to(DEVICE, torch.bfloat16)
        norm.eps = 1e-6
    assert rope_op.qk_norm_rope_ok(joined, cos, q_norm, k_norm)
    k_norm.eps = 1e-5
    assert not rope_op.qk_norm_rope_ok(joined, cos, q_norm, k_norm)
    k_norm.eps = 1e-6

    def run(how, dtype=torch.bfloat16):
        x = joined.detach().to(dtype).requires_grad_(True)
        c, s_ = cos.to(dtype), sin.to(dtype)
        if how == "fused":
            outs = rope_op.qk_norm_rope(x, c, s_, q_norm, k_norm, hq, hk)
        else:
            norm = norm_op.rms_norm if how == "kernels" else norm_op.rms_norm_reference
            rope = rope_op.apply_rope if how == "kernels" else rope_op.rope_reference
            q, k, v = x.split([hq * d, hk * d, hk * d], dim=-1)
            outs = tuple(rope(norm(z.reshape(b, t, -1, d), w.weight.to(dtype), 1e-6), c, s_)
                         for z, w in ((q, q_norm), (k, k_norm))) + (v.reshape(b, t, hk, d),)
        torch.autograd.backward(outs, [g.to(dtype) for g in grads])
        assert outs[2].data_ptr() == x.data_ptr() + (hq + hk) * d * x.element_size()  # v: a view of x
        return [o.detach() for o in outs], x.grad

    outs, grad = run("fused")
    ref_outs, ref_grad = run("kernels")
    outs64, grad64 = run("reference", torch.float64)
    assert torch.equal(outs[2], joined[..., (hq + hk) * d:].reshape(b, t, hk, d))
    for o, r in zip(outs[:2], ref_outs[:2]):
        assert o.is_contiguous() and o.shape == r.shape
        assert (o.float() - r.float()).abs().max() <= 2 * 2 ** -7 * r.float().abs().max()
        assert (o != r).float().mean() < 0.02
    assert grad.shape == joined.shape and (grad - ref_grad).float().norm() <= 1e-2 * ref_grad.float().norm()
    assert torch.equal(grad[..., (hq + hk) * d:], grads[2].reshape(b, t, -1))
    slack = 3.0 if not joined.is_cuda else 1.5
    for o, r, o64 in zip(outs[:2], ref_outs[:2], outs64[:2]):
        assert rel(o, o64) <= slack * rel(r, o64) + 1e-4, (rel(o, o64), rel(r, o64))
    assert rel(grad, grad64) <= slack * rel(ref_grad, grad64) + 1e-4, (rel(grad, grad64), rel(ref_grad, grad64))


@needs_triton
def test_hashed_dropout_keeps_1_minus_p_independently():
    """dropout_hashed (swiglu_dropped's mask): keeps ~1 - p of the elements in any stretch of
    them, neighbours' keeps uncorrelated, another seed another mask, kept values x * scale."""
    seed, p = torch.tensor([123], device=DEVICE), 0.05
    x = torch.randn(256, 1000, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    y = dropout_op.dropout_hashed(x, seed, p)
    keep = (y != 0).cpu().double()
    assert ((keep.view(-1, 16000).mean(1) - 0.95).abs() < 0.01).all()
    dropped = 1 - keep.flatten()
    assert abs((dropped[1:] * dropped[:-1]).mean().item() - 0.05**2) < 0.0015
    assert (y != 0).ne(dropout_op.dropout_hashed(x, seed + 1, p) != 0).double().mean().item() > 0.08
    thr, scale = dropout_op.keep_threshold(p)
    assert torch.equal(y[y != 0], (x[y != 0].float() * scale).to(torch.float16))


# bf16 under the CPU interpreter: its tl.dot on bf16 returns garbage (fp16 exercises the same code)
DOT_DTYPES = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@needs_triton
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("t, d, r", [(37, 512, 24), (130, 384, 8), (300, 128, 32)])
def test_dropout_matmuls_match_dropout_seeded_then_matmul(monkeypatch, dtype, t, d, r):
    """The LoRA A matmuls with the dropout inside (forward xa, A's gradient, dx's masked add) draw
    dropout_seeded's mask element for element and match float64 math with it; rows and columns
    off the tile grid, column splits of the forward (d 512), row splits of A's gradient (t 300),
    R padded to 16 / 32."""
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, d, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(r, d, generator=gen) * 0.1).to(DEVICE, dtype)
    g = torch.randn(t, r, generator=gen).to(DEVICE, dtype)
    out = torch.randn(t, d, generator=gen).to(DEVICE, dtype)
    seed, p = torch.tensor([4321 + t], device=DEVICE), 0.25
    monkeypatch.setattr(lora_dropout, "DROP_MM_MIN_D", 128)  # the kernels take any width; training, where they win
    assert lora_dropout.drop_matmul_ok(x, a)
    keep = keep_mask(x.shape, seed, p, dtype).double() / (1 - p)
    assert abs(keep.gt(0).double().mean().item() - 0.75) < 0.03
    xd = x.double() * keep
    xa = lora_dropout.drop_matmul(x, a, seed, p, 2.0)
    assert xa.dtype == dtype and rel(xa, 2.0 * xd @ a.double().t()) < 4e-3
    for bt, splits in ((64, 1), (16, 2)):  # the sweep's overrides of the split rules
        assert rel(lora_dropout.drop_matmul(x, a, seed, p, 2.0, bt=bt, splits=splits), 2.0 * xd @ a.double().t()) < 4e-3
    grad_a = lora_dropout.drop_matmul_grad(g, x, seed, p)
    assert grad_a.dtype == torch.float32 and grad_a.shape == (r, d)
    assert rel(grad_a, g.double().t() @ xd) < 1e-5  # fp32 accumulation of exact products
    assert rel(lora_dropout.drop_matmul_grad(g, x, seed, p, splits=1), g.double().t() @ xd) < 1e-5
    # into=: added to what is there, the bits of `into += product`, one split or several
    for splits in (1, None):
        before = torch.randn(r, d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        into = before.clone()
        assert lora_dropout.drop_matmul_grad(g, x, seed, p, splits=splits, into=into) is into
        assert torch.equal(into, before + lora_dropout.drop_matmul_grad(g, x, seed, p, splits=splits)), splits
    want = out.double() + (g.double() @ a.double()) * keep
    lora_dropout.matmul_drop_add_(out, g, a, seed, p)
    assert rel(out, want) < 4e-3
    # another seed, another mask
    assert not torch.equal(xa, lora_dropout.drop_matmul(x, a, seed + 1, p, 2.0))
    # the split kernels' last programs summed the partials and left their counters at zero
    counters = lora_dropout._COUNTERS[x.device]
    assert counters.abs().sum().item() == 0
    assert torch.equal(lora_dropout.drop_matmul(x, a, seed, p, 2.0, bt=16, splits=2), lora_dropout.drop_matmul(x, a, seed, p, 2.0, bt=16, splits=2))


def test_dropout_matmul_takes_what_its_kernels_can():
    x = torch.zeros(8, 2048, dtype=torch.float16, device=DEVICE)
    a = torch.zeros(16, 2048, dtype=torch.float16, device=DEVICE)
    usable = RUNS_TRITON
    assert lora_dropout.drop_matmul_ok(x, a) == usable
    assert not lora_dropout.drop_matmul_ok(x[:, :1920].contiguous(), a[:, :1920].contiguous())  # narrower: cuBLAS wins
    assert not lora_dropout.drop_matmul_ok(x.float(), a.float())  # fp32: cuBLAS's fp32 matmuls
    x2112 = torch.zeros(8, 2112, dtype=torch.float16, device=DEVICE)  # rows not in 128-column blocks
    assert not lora_dropout.drop_matmul_ok(x2112, torch.zeros(16, 2112, dtype=torch.float16, device=DEVICE))
    assert not lora_dropout.drop_matmul_ok(x, torch.zeros(lora_dropout.DROP_MM_MAX_R + 1, 2048, dtype=torch.float16, device=DEVICE))
    assert not lora_dropout.drop_matmul_ok(x.t(), a[:, :8].contiguous())  # not contiguous


@pytest.mark.skipif(triton_util.triton is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton, compiling (no GPU needed: it compiles for sm_90)")
@pytest.mark.parametrize("kernel, ints", [("_drop_mm", "cols_per_split"), ("_drop_mm_grad", "rows_per_split"),
                                          ("_mm_drop_add", "")])
def test_dropout_matmul_kernels_compile_for_hopper(kernel, ints):
    """Triton 3.6's lowering asserted on a tl.where over these tiles with 16-divisible sizes (the
    device's specialisation, not the CPU interpreter's): compile each kernel as the H100 would."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    triton_util.load_kernels()  # the kernels are defined at the first fused call
    fn = getattr(lora_dropout, kernel)
    names = list(fn.arg_names)
    pointers = {"X": "*bf16", "A": "*bf16", "G": "*bf16", "SEED": "*i64", "PART": "*fp32", "COUNT": "*i32",
                "OUT": "*fp32" if kernel == "_drop_mm_grad" else "*bf16"}
    sig = {n: pointers.get(n, "fp32" if n in ("p", "scale") else "constexpr" if n in ("BT", "RP", "ACC") else "i32")
           for n in names}
    divisible = [n for n in names if sig[n].startswith("*") or n in ("T", "D", ints)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    for bt, rp, acc in ((16, 32, False), (64, 128, True)):
        constants = {"BT": bt, "RP": rp, **({"ACC": acc} if "ACC" in names else {})}  # ACC: _drop_mm_grad's into=
        src = ASTSource(fn, sig, constants, attrs)
        compiled = triton_util.triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert ".entry" in compiled.asm["ptx"]
