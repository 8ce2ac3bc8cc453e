"""Joined q/k/v and gate/up projections with ops.lora_group, bf16 on the GPU, against the
layer-by-layer LoRALinear path; the joined SwiGLU and the strided RoPE against their references."""

from __future__ import annotations

import copy

import pytest
import torch

from hivetune.model.lora import fuse_projections, lora_parameters
from hivetune.ops import dropout as dropout_op
from hivetune.ops import lora_dropout, triton_util
from hivetune.ops import norm as norm_op
from hivetune.ops import rope as rope_op
from hivetune.ops import swiglu as swiglu_op
from hivetune.ops.loss import target_loss_sum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def dropout_model(lora_model_and_batch):
    """A copy of the fixture's model with LoRA dropout 0.1, joined groups, in training mode."""
    from hivetune.model.lora import LoRALinear

    ref, batch = lora_model_and_batch
    model = copy.deepcopy(ref)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.lora_dropout = torch.nn.Dropout(0.1)
    fuse_projections(model)
    model.train()
    return model, batch


def loss_grads_saved(model, batch):
    """(loss, LoRA gradients, bytes of the distinct storages saved for backward) of one bf16
    forward + backward with dropout seed 3."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for p in lora_parameters(model):
        p.grad = None
    torch.manual_seed(3)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model(batch.input_ids, batch.position_ids, batch.layout)
        loss = target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in lora_parameters(model)], sum(saved.values())


def test_joined_projections_match_layer_by_layer(lora_model_and_batch):
    ref, batch = lora_model_and_batch
    fused = copy.deepcopy(ref)
    fuse_projections(fused)

    def loss_and_grads(model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = model(batch.input_ids, batch.position_ids, batch.layout)
            loss = target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in lora_parameters(model)])

    ref_loss, ref_grads = loss_and_grads(ref)
    fused_loss, fused_grads = loss_and_grads(fused)
    assert all(p.grad.dtype == torch.float32 for p in lora_parameters(fused))
    assert fused_loss == pytest.approx(ref_loss, rel=2e-3)
    assert torch.nn.functional.cosine_similarity(fused_grads, ref_grads, dim=0).item() > 0.999
    assert ((fused_grads - ref_grads).norm() / ref_grads.norm()).item() < 3e-2


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_joined_swiglu_and_strided_rope_match_references():
    torch.manual_seed(0)
    gu = torch.randn(3, 5, 2 * 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = swiglu_op.swiglu_joined(gu)
    dy = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, gu, dy)
    gu_ref = gu.detach().clone().requires_grad_()
    y_ref = swiglu_op.swiglu_reference(*gu_ref.chunk(2, dim=-1))
    (grad_ref,) = torch.autograd.grad(y_ref, gu_ref, dy)
    assert torch.allclose(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(grad.float(), grad_ref.float(), atol=3e-2, rtol=3e-2)

    qkv = torch.randn(2, 7, (4 + 2 + 2) * 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = qkv.split([128, 64, 64], dim=-1)[0].view(2, 7, 4, 32)  # a strided view, read in place
    angles = torch.rand(2, 7, 16, device="cuda") * 6
    cos, sin = (torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16())
    out = rope_op.apply_rope(q, cos, sin)
    ref = rope_op.rope_reference(q.detach().contiguous(), cos, sin)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2)
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, dout)
    q2 = q.detach().contiguous().requires_grad_()
    (g_ref,) = torch.autograd.grad(rope_op.rope_reference(q2, cos, sin), q2, dout)
    assert torch.allclose(g[..., :128].view(2, 7, 4, 32).float(), g_ref.float(), atol=3e-2)
    assert g[..., 128:].abs().max().item() == 0


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_masked_add_matches_torch():
    torch.manual_seed(0)
    out = torch.randn(37, 129, device="cuda", dtype=torch.bfloat16)
    t = torch.randn_like(out)
    mask = torch.rand(out.shape, device="cuda") > 0.3
    want = (out.float() + t.float() * mask * (1 / 0.7)).bfloat16()
    dropout_op.masked_add_(out, t, mask, 1 / 0.7)
    assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_seeded_dropout_kernels_share_one_mask():
    seed = torch.tensor([1234], device="cuda")
    x = torch.randn(1000, 333, device="cuda", dtype=torch.bfloat16)
    y = dropout_op.dropout_seeded(x, seed, 0.25)
    keep = y != 0
    assert torch.equal(y, dropout_op.dropout_seeded(x, seed, 0.25))  # the same seed, the same mask
    assert not torch.equal(keep, dropout_op.dropout_seeded(x, seed + 1, 0.25) != 0)
    assert abs(keep.float().mean().item() - 0.75) < 0.01
    torch.testing.assert_close(y, (x.float() * keep / 0.75).bfloat16(), rtol=0, atol=0)
    out = torch.randn_like(x)
    t = torch.randn_like(x)
    want = (out.float() + t.float() * keep / 0.75).bfloat16()
    dropout_op.seeded_masked_add_(out, t, seed, 0.25)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
@pytest.mark.parametrize("in_matmul", [False, True])
def test_seeded_lora_group_matches_fp32_with_its_mask_and_recomputes_bit_for_bit(monkeypatch, in_matmul):
    """lora_group with the seeded dropout against fp32 math with the same mask; keeping the
    source (x recomputed from the gate/up output in backward, as down_proj does) gives the same
    bits as keeping the dropped input, and saves neither a mask nor a tensor of x's size. Both
    ways: dropout_seeded + cuBLAS, and the dropout inside the A matmuls (drop_matmul & co)."""
    from hivetune.ops.lora_group import lora_group

    monkeypatch.setattr(lora_dropout, "DROP_MM_MIN_D", 128 if in_matmul else 1 << 30)
    torch.manual_seed(0)
    n_tok, inter, out_dim, r, p, scale = 300, 256, 96, 8, 0.3, 2.0
    gate_up = torch.randn(n_tok, 2 * inter, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(out_dim, inter, device="cuda", dtype=torch.bfloat16) * 0.05
    a0 = torch.randn(r, inter, device="cuda") * 0.1
    b0 = torch.randn(out_dim, r, device="cuda") * 0.1
    dy = torch.randn(n_tok, out_dim, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([77], device="cuda")
    monkeypatch.setattr(dropout_op, "new_dropout_seed", lambda device, n=1: seed.clone())

    def run(source: bool):
        gu = gate_up.detach().clone().requires_grad_()
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        saved = []

        def pack(t):
            saved.append((t.shape, t.dtype))
            return t

        h = swiglu_op.swiglu_joined(gu)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = lora_group(h, weight, None, (out_dim,), p, scale, [a], [b],
                           (swiglu_op.swiglu_raw, gu) if source else None)
        y.backward(dy)
        return y.detach(), gu.grad, a.grad, b.grad, saved

    plain, kept = run(False), run(True)
    for u, v in zip(plain[:4], kept[:4]):
        assert torch.equal(u, v)
    assert (torch.Size([n_tok, inter]), torch.bfloat16) in plain[4]  # the dropped input
    assert all(shape != torch.Size([n_tok, inter]) for shape, _ in kept[4])
    assert all(dtype != torch.bool for _, dtype in kept[4] + plain[4])

    # fp32 reference with the kernel's mask
    h = swiglu_op.swiglu_raw(gate_up.detach())
    keep = (dropout_op.dropout_seeded(torch.ones_like(h), seed, p) != 0).float()
    hf = h.float().requires_grad_()
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    y_ref = hf @ weight.float().t() + scale * ((hf * keep / (1 - p)) @ a.t()) @ b.t()
    y_ref.backward(dy.float())
    torch.testing.assert_close(plain[0].float(), y_ref.detach(), rtol=2e-2, atol=2e-2)
    for got, want in ((plain[2], a.grad), (plain[3], b.grad)):
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() > 0.999


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_norm_sources_recompute_the_same_gradients_bit_for_bit(lora_model_and_batch, monkeypatch):
    """With dropout, q/k/v and gate/up keep the norm's input (RMSNorm.source) and recompute the
    norm in backward instead of saving its dropped output: the same loss and LoRA gradients,
    bit for bit, as saving it; and one [T, hidden] tensor less per norm among the saved ones
    (but the first layer's, whose input the norm itself does not keep: the embedding is frozen)."""
    from hivetune.model.decoder import RMSNorm

    model, batch = dropout_model(lora_model_and_batch)
    monkeypatch.setattr(norm_op, "rms_norm_dropped_ok", lambda x, w: False)  # the norm apart from the dropout

    loss, grads, saved = loss_grads_saved(model, batch)
    monkeypatch.setattr(RMSNorm, "source", lambda self, x: None)
    ref_loss, ref_grads, ref_saved = loss_grads_saved(model, batch)
    assert loss == ref_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    tokens, hidden = batch.input_ids.shape[1], model.args.hidden_size
    # 2 layers x 2 norms no longer save their dropped output, and layer 0's q/k/v keep the embedding output
    assert ref_saved - saved == 3 * tokens * hidden * 2


def test_flash_varlen_takes_grouped_heads_and_matches_sdpa():
    """FlashVarlen on K/V with fewer heads (GQA, no repeat) against SDPA per example in fp32."""
    from hivetune.ops.attention import FlashVarlen

    torch.manual_seed(0)
    lengths = (37, 5, 90)
    t = sum(lengths)
    q = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 37, 42, 132], dtype=torch.int32, device="cuda")
    out = FlashVarlen.apply(q, k, v, cu, cu, max(lengths), max(lengths))
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert dk.shape == k.shape and dv.shape == v.shape
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    outs, start = [], 0
    for n in lengths:
        qs = qf[start:start + n].transpose(0, 1)
        ks, vs = (x[start:start + n].transpose(0, 1).repeat_interleave(4, 0) for x in (kf, vf))
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    ref = torch.cat(outs)
    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    for got, want in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, err


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_split_dropout_matmuls_are_deterministic():
    """The split kernels' last program of a block sums every split's partial in split order:
    the same bits on every call (a partial read before its store landed would differ), and
    within fp32 rounding of the one-split result. W2's down_proj shape and W1's."""
    torch.manual_seed(0)
    seed, p = torch.tensor([99], device="cuda"), 0.05
    for t, d, r in ((3000, 18944, 32), (1600, 4864, 8)):
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(r, d, device="cuda", dtype=torch.bfloat16) * 0.02
        g = torch.randn(t, r, device="cuda", dtype=torch.bfloat16)
        xa = lora_dropout.drop_matmul(x, a, seed, p, 2.0)
        ga = lora_dropout.drop_matmul_grad(g, x, seed, p)
        for _ in range(20):
            assert torch.equal(lora_dropout.drop_matmul(x, a, seed, p, 2.0), xa)
            assert torch.equal(lora_dropout.drop_matmul_grad(g, x, seed, p), ga)
        torch.testing.assert_close(xa.float(), lora_dropout.drop_matmul(x, a, seed, p, 2.0, splits=1).float(),
                                   rtol=1e-2, atol=1e-2)
        # fp32 sums of 1,600-3,000 products in another order: ~1e-5 of the gradient's scale (~50)
        torch.testing.assert_close(ga, lora_dropout.drop_matmul_grad(g, x, seed, p, splits=1), rtol=1e-4, atol=2e-3)
        assert lora_dropout._COUNTERS[x.device].abs().sum().item() == 0


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
@pytest.mark.parametrize("in_matmul", [False, True])
@pytest.mark.parametrize("sizes", [(96,), (64, 32, 32)])
def test_grads_added_into_arena_match_autograd_accumulation(monkeypatch, in_matmul, sizes):
    """Two calls of lora_group accumulating: adding into the GradArena's views (cuBLAS's beta
    = 1 epilogue, drop_matmul_grad's into=) against autograd's add of fresh gradients, on the
    same seeds: equal to fp32 rounding, and every .grad still the arena's view."""
    from hivetune.ops import lora_grads
    from hivetune.ops import lora_group as lg
    from hivetune.ops.lora_group import lora_group

    monkeypatch.setattr(lora_dropout, "DROP_MM_MIN_D", 128 if in_matmul else 1 << 30)
    torch.manual_seed(0)
    n_tok, d, r, p = 300, 256, 8, 0.3
    weight = torch.randn(sum(sizes), d, device="cuda", dtype=torch.bfloat16) * 0.05
    a0 = [torch.randn(r, d, device="cuda") * 0.1 for _ in sizes]
    b0 = [torch.randn(o, r, device="cuda") * 0.1 for o in sizes]
    xs = [torch.randn(n_tok, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dys = [torch.randn(n_tok, sum(sizes), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    seeds = iter(torch.tensor([[11], [12], [11], [12]], device="cuda"))
    monkeypatch.setattr(dropout_op, "new_dropout_seed", lambda device, n=1: next(seeds))

    def run(arena: bool):
        a = [t.clone().requires_grad_() for t in a0]
        b = [t.clone().requires_grad_() for t in b0]
        grads = lora_grads.GradArena(a + b, None).grads if arena else None
        if arena:
            for t, g in zip(a + b, grads):
                t.grad = g
        for x, dy in zip(xs, dys):
            lora_group(x, weight, None, sizes, p, 2.0, a, b).backward(dy)
        assert not arena or all(t.grad is g for t, g in zip(a + b, grads))
        return [t.grad.clone() for t in a + b]

    real = lg.grads_into
    monkeypatch.setattr(lg, "grads_into", lambda *a: None)
    want = run(False)
    monkeypatch.setattr(lg, "grads_into", real)
    got = run(True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert w.abs().sum() > 0


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_kept_lora_inputs_give_the_recomputed_gradients_bit_for_bit(lora_model_and_batch):
    """lora_inputs keep (CastCache.keep_inputs): every group keeps its dropped input instead of
    recomputing it in backward; the same loss and LoRA gradients bit for bit, and the saved
    bytes grow by what plan.memory.keep_inputs_extra_bytes predicts."""
    from hivetune.plan.memory import MemoryConfig, keep_inputs_extra_bytes

    model, batch = dropout_model(lora_model_and_batch)

    def run(keep: bool):
        model.lora_casts.keep_inputs = keep
        return loss_grads_saved(model, batch)

    loss, grads, saved = run(False)
    kept_loss, kept_grads, kept_saved = run(True)
    assert loss == kept_loss
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads))
    mc = MemoryConfig(precision="bf16", r=model.lora_casts.kinds[0].r, dropout=0.1, fused_layers=True)
    assert kept_saved - saved == keep_inputs_extra_bytes(model.args, mc, batch.input_ids.shape[1])


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_norm_with_the_groups_dropout_matches_the_norm_then_the_dropout(lora_model_and_batch, monkeypatch):
    """q/k/v and gate/up read norm(x) and its dropped copy from one kernel (FusedProjections.normed,
    norm_op.rms_norm_dropped), whose backward also applies the dropout's mask and adds the
    residual stream's gradient: the loss and LoRA gradients of the norm, then dropout_seeded, then
    autograd's adds (rms_norm_dropped_ok false), to rounding: the masks are the same (one
    seed per group, drawn in the same order). Each of the 2 layers' 2 norms took the kernel."""
    model, batch = dropout_model(lora_model_and_batch)
    calls = []
    real = norm_op.rms_norm_dropped
    monkeypatch.setattr(norm_op, "rms_norm_dropped", lambda *a: calls.append(a[0].shape) or real(*a))
    loss, grads, saved = loss_grads_saved(model, batch)
    assert len(calls) == 4
    monkeypatch.setattr(norm_op, "rms_norm_dropped_ok", lambda x, w: False)
    ref_loss, ref_grads, ref_saved = loss_grads_saved(model, batch)
    assert len(calls) == 4
    assert loss == pytest.approx(ref_loss, rel=2e-3)
    flat, ref_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    assert ((flat - ref_flat).norm() / ref_flat.norm()).item() < 1e-2
    assert saved == ref_saved  # the same tensors kept: the norm's input and 1/rms, the groups' sources


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_wide_groups_match_the_addmm_of_the_update(lora_model_and_batch, monkeypatch):
    """On CUDA q/k/v and gate/up are stored wide ([W | Bd] per layer) and the norm leaves room for
    xa after each row: the base matmul adds the LoRA update and one backward matmul gives dx and
    d xa. The loss and LoRA gradients of the addmm path (wide_matrix declining), to
    rounding (one bf16 rounding of y fewer), the same tensors saved; all 4 groups ran wide."""
    from hivetune.ops import lora_group as lg
    model, batch = dropout_model(lora_model_and_batch)
    assert model.model.layers[0].mlp.gate_up.lora_cols == 2 * model.model.layers[0].mlp.gate_proj.lora_A.out_features
    used = []
    real = lg.wide_matrix
    monkeypatch.setattr(lg, "wide_matrix", lambda w, bd: used.append(real(w, bd) is not None) or real(w, bd))
    loss, grads, saved = loss_grads_saved(model, batch)
    assert used == [True] * 4
    monkeypatch.setattr(lg, "wide_matrix", lambda w, bd: None)
    ref_loss, ref_grads, ref_saved = loss_grads_saved(model, batch)
    assert len(used) == 4 and saved == ref_saved
    assert loss == pytest.approx(ref_loss, rel=2e-3)
    flat, ref_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    assert ((flat - ref_flat).norm() / ref_flat.norm()).item() < 1e-2


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_wide_groups_take_the_norms_dropout_where_the_in_matmul_kernels_would_suit(lora_model_and_batch, monkeypatch):
    """Groups whose shapes suit the in-matmul dropout kernels (DROP_MM_MIN_D lowered to the
    fixture's width) still take the norm's dropout kernel where they are wide (lora.drops_in_matmul),
    so that the update rides in the base matmul: all 4 groups normed and wide, none through the
    in-matmul kernels (o_proj, no group, takes them); with the in-matmul kernels chosen whatever
    the layout, the same model's groups take them. The
    losses agree to rounding (the masks are the same)."""
    from hivetune.model import lora as lora_model
    from hivetune.ops import lora_group as lg
    monkeypatch.setattr(lora_dropout, "DROP_MM_MIN_D", 128)
    model, batch = dropout_model(lora_model_and_batch)
    assert model.args.hidden_size % 128 == 0
    normed, wide, in_matmul = [], [], []
    real_norm, real_wide, real_drop = norm_op.rms_norm_dropped, lg.wide_matrix, lg.drop_matmul
    monkeypatch.setattr(norm_op, "rms_norm_dropped", lambda *a: normed.append(1) or real_norm(*a))
    monkeypatch.setattr(lg, "wide_matrix", lambda w, bd: wide.append(real_wide(w, bd) is not None) or real_wide(w, bd))
    r = model.model.layers[0].mlp.gate_proj.lora_A.out_features
    # each call's A rows: a group's n r, or o_proj's r (one layer, no group: in-matmul either way)
    monkeypatch.setattr(lg, "drop_matmul", lambda x, a, *rest: in_matmul.append(a.shape[0]) or real_drop(x, a, *rest))
    loss, _, _ = loss_grads_saved(model, batch)
    assert len(normed) == 4 and wide == [True] * 4 and in_matmul == [r] * 2
    monkeypatch.setattr(lora_model, "drops_in_matmul", lambda d, r, room: lora_dropout.drop_matmul_shape(d, r))
    ref_loss, _, _ = loss_grads_saved(model, batch)
    assert len(normed) == 4 and sorted(in_matmul[2:]) == sorted([3 * r, r, 2 * r] * 2)
    assert loss == pytest.approx(ref_loss, rel=2e-3)


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_rope_of_the_joined_qkv_matches_split_rope(lora_model_and_batch, monkeypatch):
    """The joined q/k/v output goes through RoPE and v's copy in one kernel (rope_op.rope_qkv):
    the loss of split + RoPE + copy (rope_qkv_ok false) bit for bit, and its LoRA
    gradients (flash attention's backward adds dq atomically, so to rounding)."""
    model, batch = dropout_model(lora_model_and_batch)
    calls = []
    real = rope_op.rope_qkv
    monkeypatch.setattr(rope_op, "rope_qkv", lambda *a: calls.append(1) or real(*a))
    loss, grads, saved = loss_grads_saved(model, batch)
    assert len(calls) == 2  # both layers
    monkeypatch.setattr(rope_op, "rope_qkv_ok", lambda joined, cos: False)
    ref_loss, ref_grads, ref_saved = loss_grads_saved(model, batch)
    assert len(calls) == 2
    assert loss == ref_loss and saved == ref_saved
    flat, ref_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    assert ((flat - ref_flat).norm() / ref_flat.norm()).item() < 1e-3


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_swiglu_with_down_projs_dropout_matches_swiglu_then_the_dropout(lora_model_and_batch, monkeypatch):
    """SwiGLU writes h and down_proj's dropped input in one kernel, and its backward applies the
    dropout's (swiglu_op.swiglu_dropped): the loss of SwiGLU then the same hashed mask applied
    by autograd ops bit for bit, its LoRA gradients to rounding, and the same tensors saved."""
    model, batch = dropout_model(lora_model_and_batch)
    calls = []
    real = swiglu_op.swiglu_dropped
    monkeypatch.setattr(swiglu_op, "swiglu_dropped", lambda *a, **k: calls.append(1) or real(*a, **k))
    loss, grads, saved = loss_grads_saved(model, batch)
    assert len(calls) == 2  # both layers

    def composed(joined, seed, p, reuse=False):
        h = swiglu_op.swiglu_joined(joined)
        keep = dropout_op.dropout_hashed(torch.ones(h.shape, dtype=torch.float32, device=h.device), seed, p)
        return h, (h.float() * keep).to(h.dtype)

    monkeypatch.setattr(swiglu_op, "swiglu_dropped", composed)
    ref_loss, ref_grads, _ = loss_grads_saved(model, batch)
    assert loss == ref_loss
    flat, ref_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    assert ((flat - ref_flat).norm() / ref_flat.norm()).item() < 1e-2
    monkeypatch.setattr(swiglu_op, "swiglu_dropped", real)
    monkeypatch.setattr(swiglu_op, "swiglu_dropped_ok", lambda gate_up: False)  # SwiGLU apart: the same tensors kept
    assert loss_grads_saved(model, batch)[2] == saved


@pytest.mark.skipif(triton_util.triton is None, reason="needs Triton")
def test_qk_norms_and_rope_of_the_joined_qkv_match_the_norms_then_rope(monkeypatch):
    """Qwen3's q/k norms and RoPE of the joined q/k/v output in one kernel each way
    (rope_op.qk_norm_rope): the loss of split + the two norms + RoPE (qk_norm_rope_ok false) to a
    bf16 rounding, its LoRA gradients to rounding, and no more saved for backward."""
    from hivetune.data.batch import collate_packed
    from hivetune.model.config import qwen3_shape
    from hivetune.model.lora import LoRASpec, apply_lora
    from hivetune.workflows.workloads import random_model, workload_examples

    model = random_model(qwen3_shape(4096, 256, 704, 2, 4, 2, 64, True), "cuda", torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1.0, 0.3)
    apply_lora(model, LoRASpec(r=8, alpha=16, dropout=0.1))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.02)
    fuse_projections(model)
    model.train()
    batch = collate_packed(workload_examples(6, 4096, cap=0, seed=1), pad_id=0).to("cuda")
    calls = []
    real = rope_op.qk_norm_rope
    monkeypatch.setattr(rope_op, "qk_norm_rope", lambda *a: calls.append(1) or real(*a))
    loss, grads, saved = loss_grads_saved(model, batch)
    assert len(calls) == 2  # both layers
    monkeypatch.setattr(rope_op, "qk_norm_rope_ok", lambda *a: False)
    ref_loss, ref_grads, ref_saved = loss_grads_saved(model, batch)
    assert len(calls) == 2
    assert loss == pytest.approx(ref_loss, rel=2e-3) and saved <= ref_saved
    flat, ref_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    assert ((flat - ref_flat).norm() / ref_flat.norm()).item() < 1e-2
