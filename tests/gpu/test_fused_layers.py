"""The decoder with the fused Triton RMSNorm / RoPE / SwiGLU (ops.norm, rope, swiglu) against the
same decoder on the PyTorch references (the config key fused_ops: false), bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch

from hivetune.ops import triton_util
from hivetune.ops.loss import target_loss_sum

from conftest import bf16_loss_and_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or triton_util.triton is None,
                                reason="needs a CUDA GPU with Triton")


def test_decoder_fused_layers_match_references(monkeypatch, lora_model_and_batch):
    model, batch = lora_model_and_batch
    fused_loss, fused_grads = bf16_loss_and_grads(model, batch)
    monkeypatch.setattr(triton_util, "_FUSED_OPS", False)
    ref_loss, ref_grads = bf16_loss_and_grads(model, batch)
    assert fused_loss == pytest.approx(ref_loss, rel=2e-3)
    assert torch.nn.functional.cosine_similarity(fused_grads, ref_grads, dim=0).item() > 0.999
    assert ((fused_grads - ref_grads).norm() / ref_grads.norm()).item() < 3e-2


@pytest.mark.parametrize("ignore", [None, -100])
def test_triton_ce_chunks_match_the_pytorch_chunks(monkeypatch, ignore):
    """The Triton softmax-gradient kernel (several chunks, a vocabulary that is not a multiple of
    its block, ignored rows) against the PyTorch chunk on the same bf16 logits."""
    from hivetune.ops.fused_ce import fused_target_loss_sum, triton_ce_ok

    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, 500, 64, generator=gen) * 2).to("cuda", torch.bfloat16)
    head = (torch.randn(9001, 64, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    index = torch.arange(3, 500, 2, device="cuda")
    targets = torch.randint(0, 9001, (index.numel(),), generator=gen).to("cuda")
    if ignore is not None:
        targets[::7] = ignore
    assert triton_ce_ok(hidden, head)
    out = {}
    for name in ("triton", "pytorch"):
        if name == "pytorch":
            monkeypatch.setattr(triton_util, "_FUSED_OPS", False)
        h = hidden.clone().requires_grad_()
        loss = fused_target_loss_sum(h, head, index, targets, chunk_bytes=9001 * 4 * 60, ignore_index=ignore)
        (loss * 0.5).backward()
        out[name] = (loss.item(), h.grad.float())
    assert out["triton"][0] == pytest.approx(out["pytorch"][0], rel=1e-5)
    torch.testing.assert_close(out["triton"][1], out["pytorch"][1], rtol=1e-2, atol=1e-4)
    if ignore is not None:
        rows = index[::7]
        assert out["triton"][1].flatten(0, 1)[rows].abs().max().item() == 0.0
