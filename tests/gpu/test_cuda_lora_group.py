"""Joined q/k/v and gate/up projections with ops.lora_group, bf16 on the GPU, against the
layer-by-layer LoRALinear path; the joined SwiGLU and the strided RoPE against their references."""

from __future__ import annotations

import copy

import pytest
import torch

from hivetune.model.lora import fuse_projections, lora_parameters
from hivetune.ops import elementwise
from hivetune.ops.loss import target_loss_sum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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


@pytest.mark.skipif(elementwise.triton is None, reason="needs Triton")
def test_joined_swiglu_and_strided_rope_match_references():
    torch.manual_seed(0)
    gu = torch.randn(3, 5, 2 * 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = elementwise.swiglu_joined(gu)
    dy = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, gu, dy)
    gu_ref = gu.detach().clone().requires_grad_()
    y_ref = elementwise.swiglu_reference(*gu_ref.chunk(2, dim=-1))
    (grad_ref,) = torch.autograd.grad(y_ref, gu_ref, dy)
    assert torch.allclose(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(grad.float(), grad_ref.float(), atol=3e-2, rtol=3e-2)

    qkv = torch.randn(2, 7, (4 + 2 + 2) * 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = qkv.split([128, 64, 64], dim=-1)[0].view(2, 7, 4, 32)  # a strided view, read in place
    angles = torch.rand(2, 7, 16, device="cuda") * 6
    cos, sin = (torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16())
    out = elementwise.apply_rope(q, cos, sin)
    ref = elementwise.rope_reference(q.detach().contiguous(), cos, sin)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2)
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, dout)
    q2 = q.detach().contiguous().requires_grad_()
    (g_ref,) = torch.autograd.grad(elementwise.rope_reference(q2, cos, sin), q2, dout)
    assert torch.allclose(g[..., :128].view(2, 7, 4, 32).float(), g_ref.float(), atol=3e-2)
    assert g[..., 128:].abs().max().item() == 0


@pytest.mark.skipif(elementwise.triton is None, reason="needs Triton")
def test_masked_add_matches_torch():
    torch.manual_seed(0)
    out = torch.randn(37, 129, device="cuda", dtype=torch.bfloat16)
    t = torch.randn_like(out)
    mask = torch.rand(out.shape, device="cuda") > 0.3
    want = (out.float() + t.float() * mask * (1 / 0.7)).bfloat16()
    elementwise.masked_add_(out, t, mask, 1 / 0.7)
    assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=1e-2)
