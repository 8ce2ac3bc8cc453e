"""The decoder with the fused Triton RMSNorm / RoPE / SwiGLU (ops.elementwise) against the same
decoder on the PyTorch references (HIVETUNE_FUSED_OPS=0), bf16 on the GPU."""

from __future__ import annotations

import pytest
import torch

from hivetune.model.lora import lora_parameters
from hivetune.ops import elementwise
from hivetune.ops.loss import target_loss_sum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or elementwise.triton is None,
                                reason="needs a CUDA GPU with Triton")


def test_decoder_fused_layers_match_references(monkeypatch, lora_model_and_batch):
    model, batch = lora_model_and_batch

    def loss_and_grads():
        for p in lora_parameters(model):
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = model(batch.input_ids, batch.position_ids, batch.layout)
            loss = target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids)
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in lora_parameters(model)])

    fused_loss, fused_grads = loss_and_grads()
    monkeypatch.setenv("HIVETUNE_FUSED_OPS", "0")
    ref_loss, ref_grads = loss_and_grads()
    assert fused_loss == pytest.approx(ref_loss, rel=2e-3)
    assert torch.nn.functional.cosine_similarity(fused_grads, ref_grads, dim=0).item() > 0.999
    assert ((fused_grads - ref_grads).norm() / ref_grads.norm()).item() < 3e-2
