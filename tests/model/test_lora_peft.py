"""Our LoRA against PEFT: an adapter we save loads with ``peft.PeftModel.from_pretrained`` onto
the transformers model and gives our logits; plus adapter round trip, target errors, dtypes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from hivetune.core.errors import UserError
from hivetune.model.load import load_model
from hivetune.model.lora import (DEFAULT_TARGETS, LoRALinear, LoRASpec, apply_lora, load_adapter,
                                 lora_modules, lora_parameters, lora_state_dict, save_adapter)

peft = pytest.importorskip("peft")

TOL = 1e-4
VOCAB = 256


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A tiny random llama saved with save_pretrained (safetensors)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                      max_position_embeddings=512, rope_theta=10000.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / p.shape[1] ** 0.5)
    folder = tmp_path_factory.mktemp("lora_base")
    model.save_pretrained(folder)
    return folder


def randomize_lora_(model, seed: int) -> None:
    """Non-zero B (PEFT and we both init B = 0, which would make any comparison trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) / math.sqrt(m.in_features))
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.5)


def ids_of(length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


CASES = {
    "default": LoRASpec(r=4, alpha=8, dropout=0.0),
    "rslora_subset": LoRASpec(r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj", "down_proj"),
                              rslora=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_saved_adapter_matches_peft(case, base_folder, tmp_path):
    spec = CASES[case]
    ours = load_model(base_folder, torch.float32, "cpu").eval()
    wrapped = apply_lora(ours, spec)
    assert len(wrapped) == 2 * len(spec.targets)  # every target in both layers
    randomize_lora_(ours, seed=1)
    adapter = tmp_path / "adapter"
    save_adapter(ours, spec, adapter, base_model_path=str(base_folder))

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["use_rslora"] == spec.rslora
    assert sorted(cfg["target_modules"]) == sorted(spec.targets)
    keys = set(load_file(str(adapter / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * len(wrapped)

    hf = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    hf_base_logits = None
    ids = ids_of(48, seed=2)
    with torch.no_grad():
        hf_base_logits = hf(ids).logits
    peft_model = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    expected_scaling = 8 / (math.sqrt(4) if spec.rslora else 4)
    peft_layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert peft_layer.scaling["default"] == pytest.approx(expected_scaling)
    assert ours.model.layers[0].self_attn.q_proj.scaling == pytest.approx(expected_scaling)

    with torch.no_grad():
        ref = peft_model(ids).logits
        got = ours.logits(ours(ids))
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    print(f"lora {case}: max|ref logit| {scale:.3f} max abs diff {diff:.3g}")
    assert diff <= TOL * max(1.0, scale)
    # the adapter really changes the output, so the comparison is not trivial
    assert (ref - hf_base_logits).abs().max().item() > 100 * TOL * max(1.0, scale)


def test_load_adapter_round_trip_is_bitwise(base_folder, tmp_path):
    spec = CASES["rslora_subset"]
    ours = load_model(base_folder)
    apply_lora(ours, spec)
    randomize_lora_(ours, seed=3)
    save_adapter(ours, spec, tmp_path, base_model_path=str(base_folder))

    fresh = load_model(base_folder)
    loaded_spec = load_adapter(fresh, tmp_path)
    assert (loaded_spec.r, loaded_spec.alpha, loaded_spec.rslora) == (4, 8.0, True)
    assert sorted(loaded_spec.targets) == sorted(spec.targets)
    a, b = lora_state_dict(ours), lora_state_dict(fresh)
    assert a.keys() == b.keys() and len(a) == 12
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ids = ids_of(20, seed=4)
    with torch.no_grad():
        assert torch.equal(ours.logits(ours(ids)), fresh.logits(fresh(ids)))


def test_unknown_target_lists_valid_names(base_folder):
    model = load_model(base_folder)
    with pytest.raises(UserError) as info:
        apply_lora(model, LoRASpec(r=4, alpha=8, targets=("q_proj", "qkv_proj", "lm_head")))
    assert str(info.value) == (
        "lora.targets: qkv_proj, lm_head matches no module "
        "(valid: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)")
    assert not lora_modules(model)  # nothing was wrapped before the error


def test_trainable_params_and_dtypes_bf16(base_folder):
    model = load_model(base_folder, torch.bfloat16, "cpu")
    apply_lora(model, LoRASpec(r=4, alpha=8, dropout=0.0))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable, "no trainable parameters"
    assert all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in trainable), trainable
    assert len(trainable) == 2 * 2 * len(DEFAULT_TARGETS)
    assert {id(p) for p in lora_parameters(model)} == {id(p) for p in model.parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert p.dtype == torch.float32, n
        else:
            assert p.dtype == torch.bfloat16, n
            assert not p.requires_grad, n
    for _, m in lora_modules(model):
        assert isinstance(m, LoRALinear) and m.base_layer.weight.dtype == torch.bfloat16
    # gradients reach only the LoRA weights; B = 0 at init, so A's grad is 0 but B's is not
    ids = ids_of(16, seed=5)
    loss = model.logits(model(ids)).logsumexp(-1).mean()
    loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, n
        else:
            assert p.grad is None, n
    assert model.model.layers[0].self_attn.q_proj.lora_B.weight.grad.abs().max() > 0


@pytest.mark.parametrize("stage_size", [1, 7, 64, 10_000])
def test_through_stage_fills_each_tensor_in_order(stage_size):
    """lora.through_stage (to_host's chunked copy through a pinned stage): any stage size, chunks
    that straddle tensors, empty tensors among them; every host tensor gets its own values."""
    from hivetune.model.lora import through_stage

    g = torch.Generator().manual_seed(0)
    sizes = [0, 5, 64, 0, 3, 130, 1, 0]
    source = [torch.randn(n, generator=g) for n in sizes]
    pieces = [torch.full((n,), float("nan")) for n in sizes]
    through_stage(torch.cat(source), pieces, torch.empty(stage_size))
    assert all(torch.equal(p, s) for p, s in zip(pieces, source))
