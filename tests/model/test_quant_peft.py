"""An adapter trained on an nf4 base is a PEFT adapter: PeftModel loads it onto the same base
with its decoder linears dequantized (what `export --format merged` merges into) and gives
hivetune's logits on the nf4 base: to 1e-4 in fp32. In bf16 the nf4 base gives exactly the
logits of its dequantized weights, and those stay within a small multiple of the noise that bf16
puts into PEFT's own logits (our decoder rounds in another order than transformers)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hivetune.model.load import load_model
from hivetune.model.lora import LoRASpec, apply_lora, save_adapter
from hivetune.model.quant import QuantLinear, dequantize_model, quantizes
from hivetune.ops import nf4

from test_lora_peft import base_folder, ids_of, randomize_lora_  # noqa: F401  (the tiny llama fixture)

peft = pytest.importorskip("peft")


def peft_logits(base_folder, adapter, ids, dtype):  # noqa: F811
    hf = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    with torch.no_grad():  # the same base, its decoder linears through NF4 and back (fp32)
        for name, p in hf.named_parameters():
            if quantizes(name):
                p.copy_(nf4.dequantize(nf4.quantize(p)))
        model = peft.PeftModel.from_pretrained(hf.to(dtype), str(adapter)).eval()
        return model(ids).logits.float()


def ours_logits(base_folder, adapter_out, ids, dtype, dense: bool = False):  # noqa: F811
    ours = load_model(base_folder, dtype, "cpu", base_quant="nf4").eval()
    assert sum(isinstance(m, QuantLinear) for m in ours.modules()) == 2 * 7
    spec = LoRASpec(r=4, alpha=8, dropout=0.0)
    apply_lora(ours, spec, param_dtype=torch.float32)
    randomize_lora_(ours, seed=5)
    if adapter_out is not None:
        save_adapter(ours, spec, adapter_out, base_model_path=str(base_folder))
    if dense:
        assert dequantize_model(ours, dtype) == 2 * 7
    with torch.no_grad():
        return ours.logits(ours(ids)).float()


def test_nf4_adapter_loads_in_peft_on_the_dequantized_base(base_folder, tmp_path):  # noqa: F811
    ids = ids_of(40, seed=6)
    adapter = tmp_path / "adapter"
    ours = ours_logits(base_folder, adapter, ids, torch.float32)
    ref = peft_logits(base_folder, adapter, ids, torch.float32)
    scale = max(1.0, ref.abs().max().item())
    assert (ours - ref).abs().max().item() <= 1e-4 * scale
    with torch.no_grad():  # NF4 really changed the weights: the base as stored is far off
        dense = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)(ids).logits
    assert (dense - ref).abs().max().item() > 1e-2 * scale

    ours_bf16 = ours_logits(base_folder, None, ids, torch.bfloat16)
    assert torch.equal(ours_bf16, ours_logits(base_folder, None, ids, torch.bfloat16, dense=True))
    noise = (peft_logits(base_folder, adapter, ids, torch.bfloat16) - ref).abs().mean().item()
    assert 0 < (ours_bf16 - ref).abs().mean().item() <= 3 * noise
