"""Joined q/k/v and gate/up on a quantized base (nf4 through the Triton dequantization into one
buffer, int8 through PyTorch), bf16 on the GPU, against the layer-by-layer quantized path."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import bf16_loss_and_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("quant", ["nf4", "int8"])
@pytest.mark.parametrize("checkpointing", [False, True, 1], ids=["plain", "checkpointed", "first-layer-checkpointed"])
def test_joined_groups_on_a_quantized_base_match_layer_by_layer(quant, checkpointing):
    from hivetune.data.batch import collate_packed
    from hivetune.model.lora import LoRASpec, apply_lora, fuse_projections, lora_parameters
    from hivetune.model.quant import JoinedWeight
    from hivetune.workflows.workloads import qwen25_shape, random_model, workload_examples

    ref = random_model(qwen25_shape(4096, 256, 704, 2, 8, 2, True), "cuda", torch.bfloat16, base_quant=quant)
    torch.manual_seed(0)
    apply_lora(ref, LoRASpec(r=8, alpha=16, dropout=0.0))
    with torch.no_grad():
        for p in lora_parameters(ref):
            p.normal_(0, 0.02)
    ref.gradient_checkpointing = bool(checkpointing)
    ref.checkpoint_layers = 0 if checkpointing is True else int(checkpointing)
    batch = collate_packed(workload_examples(6, 4096, cap=0, seed=1), pad_id=0).to("cuda")
    fused = copy.deepcopy(ref)
    assert fuse_projections(fused) == 4
    qkv = fused.model.layers[0].self_attn.qkv
    assert isinstance(qkv.weight, JoinedWeight) and qkv.keep_weight == bool(checkpointing)
    assert fused.model.layers[1].self_attn.qkv.keep_weight == (checkpointing is True)  # checkpointed layers only

    ref_loss, ref_grads = bf16_loss_and_grads(ref, batch)
    fused_loss, fused_grads = bf16_loss_and_grads(fused, batch)
    assert fused_loss == pytest.approx(ref_loss, rel=2e-3)
    assert torch.nn.functional.cosine_similarity(fused_grads, ref_grads, dim=0).item() > 0.999
    assert ((fused_grads - ref_grads).norm() / ref_grads.norm()).item() < 3e-2
