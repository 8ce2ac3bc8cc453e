"""The joined LoRA groups (lora.fuse_projections) on a quantized base (nf4, int8, a GGUF's kept
blocks): each group dequantizes its members into one weight (model.quant.JoinedWeight) for one
matmul. The oracle is the layer-by-layer quantized path (LoRALinear on QuantLinear): loss and
every LoRA gradient to fp32 rounding on the CPU, with and without dropout and gradient
checkpointing; the dequantizations a step takes; training and resuming through train.setup."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from hivetune.model.lora import fuse_projections
from hivetune.model.quant import GGUFBlocks, JoinedWeight, QuantLinear, quantize_model, quantizes
from hivetune.ops import gguf_blocks, int8, nf4

sys.path.insert(0, str(Path(__file__).parents[1] / "ops"))
from test_lora_group import FixedMask, loss_and_grads, tiny, with_lora  # noqa: E402

QUANTS = ["nf4", "int8", "Q8_0", "Q4_0"]
REL = 1e-5


def keep_blocks(model: nn.Module, type_name: str) -> None:
    """Each decoder linear replaced by its GGUF blocks of `type_name` (base_quant keep)."""
    import gguf
    from gguf.quants import quantize

    qtype = int(gguf.GGMLQuantizationType[type_name])
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and quantizes(f"{name}.weight"):
            raw = quantize(module.weight.detach().numpy(), gguf.GGMLQuantizationType(qtype))
            blocks = GGUFBlocks(torch.from_numpy(np.ascontiguousarray(raw)), qtype, tuple(module.weight.shape))
            parent, _, short = name.rpartition(".")
            setattr(model.get_submodule(parent), short, QuantLinear.kept(blocks, module.bias))


def quantized(quant: str, model_type: str = "llama", bias: bool = False, dropout: float = 0.0):
    model = tiny(model_type, bias)
    if quant in ("nf4", "int8"):
        quantize_model(model, quant)
    else:
        keep_blocks(model, quant)
    return with_lora(model, dropout)


def assert_close_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(want) == 2 * 7 * 2
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= REL * want[name].abs().max().item(), (name, err)


ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("model_type,bias", [("llama", False), ("qwen2", True)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_joined_groups_match_layer_by_layer(quant, model_type, bias, checkpointing):
    ref = quantized(quant, model_type, bias)
    ref.gradient_checkpointing = checkpointing
    fused = copy.deepcopy(ref)
    assert fuse_projections(fused) == 4 and fused.lora_casts is not None
    qkv = fused.model.layers[0].self_attn.qkv
    assert qkv.quantized and qkv.keep_weight == checkpointing and isinstance(qkv.weight, JoinedWeight)
    loss_r, grads_r = loss_and_grads(ref, ids)
    loss_f, grads_f = loss_and_grads(fused, ids)
    assert abs(loss_f.item() - loss_r.item()) <= 1e-6 * abs(loss_r.item()), (loss_f, loss_r)
    assert_close_grads(grads_f, grads_r)


@pytest.mark.parametrize("quant", ["nf4", "Q8_0"])
def test_joined_groups_match_with_dropout(monkeypatch, quant):
    """Both paths draw one mask per group and per single layer, in the same order (as
    tests/ops/test_lora_group.py replays them)."""
    ref = quantized(quant, "qwen2", True, dropout=0.3)
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    fixed, masks = FixedMask(), []

    def native_dropout(x, p, train):
        m = fixed.mask(x, p)
        masks.append(m)
        return x * m / (1 - p), m

    monkeypatch.setattr(torch, "native_dropout", native_dropout)
    loss_f, grads_f = loss_and_grads(fused, ids)
    replay = iter(masks)
    monkeypatch.setattr(torch.nn.Dropout, "forward", lambda self, x: x * next(replay).view(x.shape) / (1 - self.p))
    loss_r, grads_r = loss_and_grads(ref, ids)
    assert len(masks) == 2 * 4
    assert abs(loss_f.item() - loss_r.item()) <= 1e-6 * abs(loss_r.item())
    assert_close_grads(grads_f, grads_r)


def test_checkpointing_keeps_the_weight_with_dropout():
    """Dropout under checkpointing: the recompute draws the same masks (torch's RNG state is
    restored), so the group that keeps its weight gives the gradients of the one that does not."""
    grads = []
    for checkpointing in (False, True):
        model = quantized("nf4", dropout=0.3)
        model.gradient_checkpointing = checkpointing
        fuse_projections(model)
        torch.manual_seed(9)
        grads.append(loss_and_grads(model, ids))
    assert grads[0][0].item() == grads[1][0].item()
    assert_close_grads(grads[1][1], grads[0][1])


class Counter(torch.utils._python_dispatch.TorchDispatchMode):
    """aten matmuls (mm, addmm, bmm) dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


def step_counts(model, monkeypatch) -> tuple[int, int, int]:
    """(dequantizations in forward, in backward, matmuls) of one forward + backward."""
    calls = []
    real = QuantLinear.dequantized
    monkeypatch.setattr(QuantLinear, "dequantized", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    counter = Counter()
    with counter:
        model.zero_grad(set_to_none=True)
        loss = model.logits(model(ids)).logsumexp(-1).mean()
        forward = len(calls)
        loss.backward()
    monkeypatch.setattr(QuantLinear, "dequantized", real)
    return forward, len(calls) - forward, counter.matmuls


@pytest.mark.parametrize("checkpointing", [False, True])
def test_dequantizations_and_matmuls_per_step(monkeypatch, checkpointing):
    """Per step on the 2-layer model (7 weights a layer; the first layer's q/k/v need no input
    gradient, so backward dequantizes 11): layer by layer 14 dequantizations in forward and 11
    in backward, where checkpointing's recompute adds 14; joined the same without
    checkpointing, and with it only the recompute's in backward (each group keeps its weight):
    28 instead of 39. Matmuls: q/k/v and gate/up as one base matmul each way, one A and one B
    matmul per group, 92 -> 70 a step (126 -> 90 with the recompute, which stops before the
    layer's output: neither down_proj's base matmul nor its B matmul runs again)."""
    ref = quantized("nf4")
    ref.gradient_checkpointing = checkpointing
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    f_ref, b_ref, mm_ref = step_counts(ref, monkeypatch)
    f_fused, b_fused, mm_fused = step_counts(fused, monkeypatch)
    assert (f_ref, b_ref, mm_ref) == ((14, 25, 126) if checkpointing else (14, 11, 92))
    assert (f_fused, b_fused, mm_fused) == ((14, 14, 90) if checkpointing else (14, 11, 70))


def test_only_checkpointed_layers_keep_their_dequantized_weights():
    """Under checkpoint_layers 1 of 2, the first layer's groups keep their weights for backward
    (its saved tensors live one layer at a time); the second layer's, whose activations wait
    for backward with the others', make them again there."""
    model = quantized("nf4")
    model.gradient_checkpointing, model.checkpoint_layers = True, 1
    fuse_projections(model)
    first, second = model.model.layers
    assert [first.self_attn.qkv.keep_weight, first.mlp.gate_up.keep_weight,
            first.self_attn.o_proj.keep_weight, first.mlp.down_proj.keep_weight] == [True] * 4
    assert [second.self_attn.qkv.keep_weight, second.mlp.gate_up.keep_weight,
            second.self_attn.o_proj.keep_weight, second.mlp.down_proj.keep_weight] == [False] * 4


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_weight_is_the_members_dequantized(quant, dtype):
    attn = quantized(quant).model.layers[0].self_attn
    bases = [attn.q_proj.base_layer, attn.k_proj.base_layer, attn.v_proj.base_layer]
    joined = JoinedWeight(bases)(dtype)
    assert joined.shape == (128, 64) and joined.dtype == dtype
    assert torch.equal(joined, torch.cat([b.dequantized(dtype) for b in bases]))


def test_dequantize_into_out_is_the_same_bits():
    w = torch.randn(48, 64) * 0.05
    q = nf4.quantize(w)
    out = torch.full((2, 48, 64), 7.0, dtype=torch.bfloat16)
    got = nf4.dequantize_parts(q.packed, q.q_absmax, q.absmax2, q.offset, q.shape, torch.bfloat16, out[1])
    assert got.data_ptr() == out[1].data_ptr() and torch.equal(out[1], nf4.dequantize(q, torch.bfloat16))
    assert torch.equal(out[0], torch.full((48, 64), 7.0, dtype=torch.bfloat16))
    qi, absmax = int8.quantize(w)
    into = torch.empty(48, 64, dtype=torch.bfloat16)
    assert int8.dequantize(qi, absmax, torch.bfloat16, into) is into
    assert torch.equal(into, int8.dequantize(qi, absmax, torch.bfloat16))
    into32 = torch.empty(48, 64)
    assert int8.dequantize(qi, absmax, torch.float32, into32) is into32
    assert torch.equal(into32, int8.dequantize(qi, absmax))


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_joined_groups_train_only_lora_and_save_only_lora(quant, tmp_path):
    """Joined on a quantized base under checkpointing: only A and B take gradients; three AdamW
    steps leave every packed buffer and bias bit for bit; the adapter holds A and B alone."""
    from safetensors.torch import load_file

    from hivetune.model.lora import LoRASpec, lora_parameters, lora_state_dict, save_adapter

    model = quantized(quant, "qwen2", True)
    model.gradient_checkpointing = True
    fuse_projections(model)
    frozen = {n: t.clone() for n, t in [*model.named_buffers(), *model.named_parameters()] if "lora_" not in n}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(model)} and len(trainable) == 28
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    before = {n: t.clone() for n, t in lora_state_dict(model).items()}
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    for _ in range(3):
        loss_and_grads(model, ids)
        opt.step()
    for name, t in [*model.named_buffers(), *model.named_parameters()]:
        if "lora_" not in name:
            assert t.grad is None and torch.equal(t, frozen.pop(name)), name
    assert not frozen
    after = lora_state_dict(model)
    assert all(not torch.equal(after[k], before[k]) for k in after)
    save_adapter(model, LoRASpec(r=4, alpha=8), tmp_path, "base")
    on_disk = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(on_disk) == sorted(after) and len(on_disk) == 28
    assert all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in on_disk)
    assert all(torch.equal(on_disk[k], after[k]) for k in after)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_on_nf4_follows_the_layer_by_layer_path(tiny_model_dir, tmp_path, monkeypatch, checkpointing):
    """train.setup joins the groups on an nf4 base (HIVETUNE_REFERENCE=fused_lora keeps them
    apart): 4 steps give the reference's losses to fp32 rounding and its adapter to 1e-3 of an
    Adam step."""
    from conftest import ops_records, write_jsonl
    from hivetune.core.config import load_config
    from hivetune.model.lora import lora_state_dict
    from hivetune.train.loop import fit
    from hivetune.train.setup import setup

    data = write_jsonl(tmp_path / "train.jsonl", ops_records(16))
    runs = {}
    for path in ("joined", "reference"):
        if path == "reference":
            monkeypatch.setenv("HIVETUNE_REFERENCE", "fused_lora")
        out = tmp_path / path
        cfg = load_config(None, {"model": str(tiny_model_dir), "data": str(data), "output_dir": str(out),
                                 "precision": "fp32", "device": "cpu", "base_quant": "nf4", "eval_prompts": 0,
                                 "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "batch_size": 4, "max_steps": 4,
                                 "lr": 1e-3, "warmup_steps": 0, "threads": 1, "seed": 7, "save_every": 0,
                                 "gradient_checkpointing": checkpointing})
        run = setup(cfg)
        assert (getattr(run.model, "lora_casts", None) is not None) == (path == "joined")
        fit(run, progress=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[path] = ([r["loss"] for r in rows if "loss" in r], lora_state_dict(run.model))
    (losses, joined), (want_losses, reference) = runs["joined"], runs["reference"]
    assert len(losses) == len(want_losses) == 4
    assert all(abs(a - b) <= REL * abs(b) for a, b in zip(losses, want_losses)), (losses, want_losses)
    assert joined.keys() == reference.keys()
    for key in reference:  # Adam's 1/sqrt(v) magnifies fp32 rounding on near-zero gradients:
        # the bound is 1e-3 of a step of lr (seen: 4.4e-8 on B at lr 1e-3)
        torch.testing.assert_close(joined[key], reference[key], rtol=REL, atol=1e-6)
