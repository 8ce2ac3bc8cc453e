"""ops.offload (activation_offload) on the CPU, in its test mode (plain CPU tensors stand in for
the pinned host copies): loss and LoRA gradients bit for bit those of no offload, the pack hook's
choices, the planner's numbers, the config key's checks. tests/gpu/test_cuda_offload.py runs CUDA."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from hivetune.data.batch import collate_packed
from hivetune.data.formats import Encoded
from hivetune.model.config import ModelArgs
from hivetune.model.decoder import CausalLM
from hivetune.model.lora import LoRASpec, apply_lora, fuse_projections, lora_parameters
from hivetune.ops import offload as offload_module
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.offload import ActivationOffload, peak_resident_layers, prefetch_lead, prefetch_trigger


def tiny_lora_model(dropout: float, dtype=torch.float32, layers: int = 4) -> CausalLM:
    args = ModelArgs(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                     tie_word_embeddings=False)
    torch.manual_seed(0)
    model = CausalLM(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    apply_lora(model, LoRASpec(r=4, alpha=8, dropout=dropout))
    for p in lora_parameters(model):  # B nonzero, so every gradient path carries signal
        torch.nn.init.normal_(p, std=0.1)
    model = model.to(dtype)
    for p in lora_parameters(model):
        p.data = p.data.float()  # LoRA in fp32, the base in `dtype`, as train keeps them
    fuse_projections(model)  # the training path: joined groups, the CastCache
    return model.train()


def packed_batch():
    rng = random.Random(0)
    return collate_packed([Encoded([rng.randrange(300) for _ in range(n)], [False] * (n // 3) + [True] * (n - n // 3),
                                   False) for n in (37, 60, 23)])


def loss_and_grads(model, batch):
    torch.manual_seed(3)  # the same dropout masks (or seeds) in every run
    model.zero_grad(set_to_none=True)
    hidden = model(batch.input_ids, batch.position_ids, batch.layout)
    loss = fused_target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in lora_parameters(model)]


def assert_bitwise(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert len(grads_a) == len(grads_b) == 2 * 7 * 4
    for i, (x, y) in enumerate(zip(grads_a, grads_b)):
        assert torch.equal(x, y), i
    assert all(g.abs().sum() > 0 for g in grads_a)


# fp32: the reference SwiGLU / RMSNorm and torch.native_dropout's saved masks; "standin": bf16
# through plan.measure's stand-ins of the GPU path (Triton RMSNorm / SwiGLU, the seeded dropout
# whose groups keep their `source`: the gate|up output saved by SwiGLU and by down_proj).
@pytest.mark.parametrize("path", ["fp32", "standin"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_offload_is_bitwise_and_dedupes(path, dropout):
    from hivetune.plan.measure import fused_layers_standin

    model = tiny_lora_model(dropout, torch.bfloat16 if path == "standin" else torch.float32)
    batch = packed_batch()
    with fused_layers_standin() if path == "standin" else contextlib.nullcontext():
        plain = loss_and_grads(model, batch)
        model.activation_offload = offload = ActivationOffload(model, 2, threshold=0, cpu_test=True)
        moved = loss_and_grads(model, batch)
        again = loss_and_grads(model, batch)  # the second pass reuses the first one's host chunks
    assert_bitwise(plain, moved)
    assert_bitwise(plain, again)
    stats = offload.stats
    assert stats["copies"] > 0 and stats["late"] == 0  # every tensor came back through a prefetch
    assert stats["saved"] > stats["copies"]  # storages saved twice in a layer were copied once
    assert offload.host_bytes == 16 << 20 and len(offload.arena.free) == 1  # one chunk, reused


def test_unpack_before_prefetch_copies_there(monkeypatch):
    model = tiny_lora_model(0.0)
    batch = packed_batch()
    plain = loss_and_grads(model, batch)
    model.activation_offload = offload = ActivationOffload(model, 3, threshold=0, cpu_test=True)
    monkeypatch.setattr(offload_module._Pass, "prefetch", lambda self, j: None)
    assert_bitwise(plain, loss_and_grads(model, batch))
    assert offload.stats["late"] == offload.stats["copies"] > 0


def test_offload_changes_the_result_when_copies_are_lost(monkeypatch):
    """The bitwise tests can fail: host copies that are never written (zeros: an earlier test's
    freed chunk may hold this very model's activations) give other gradients."""
    model = tiny_lora_model(0.0)
    batch = packed_batch()
    plain = loss_and_grads(model, batch)
    model.activation_offload = ActivationOffload(model, 2, threshold=0, cpu_test=True)

    def lose(self):
        for handle, _ in self.saving.values():
            handle.host.zero_()
        self.saving.clear()

    monkeypatch.setattr(offload_module._Pass, "_copy_out", lose)
    loss, grads = loss_and_grads(model, batch)
    assert not all(torch.equal(a, b) for a, b in zip(plain[1], grads))


def test_pack_skips_parameters_small_and_shared_tensors_and_dedupes():
    model = tiny_lora_model(0.0)
    offload = ActivationOffload(model, 1, threshold=1024, cpu_test=True)
    shared = torch.randn(64, 64)
    x = torch.randn(32, 64)
    passing = offload.begin(x, (shared,))
    passing.index = 0
    weight = model.model.layers[0].self_attn.qkv.weight  # a fused base weight (q_proj's is a view of it)
    a_buf = model.lora_casts.kinds[0].a_buf if hasattr(model.lora_casts.kinds[0], "a_buf") else None
    kept = [weight, model.model.layers[0].self_attn.q_proj.base_layer.weight, lora_parameters(model)[0],
            torch.randn(8, 8), shared]
    for t in kept:
        packed = passing.pack(t)
        assert isinstance(packed, torch.Tensor) and packed.data_ptr() == t.data_ptr() and packed.grad_fn is None
    assert a_buf is None  # no forward ran: the cast buffers are allocated by the first one
    with torch.no_grad():
        assert offload.begin(x) is None  # no_grad: nothing to offload
    model(torch.tensor([[1, 2, 3]]))  # a training forward allocates the CastCache's buffers
    cast_buf = model.lora_casts.kinds[0].a_buf
    assert isinstance(offload.begin(x).pack(cast_buf[0]), torch.Tensor)  # a CastCache slice stays
    big = x.clone().requires_grad_()
    y = big * 2  # an output with a grad_fn
    packs = [passing.pack(t) for t in (y, y.view(2, 16, 64), y[3:], y)]
    assert offload.stats["saved"] == 4 and offload.stats["copies"] == 1  # one storage, one copy
    assert len({id(p[0]) for p in packs}) == 1
    passing._copy_out()
    assert packs[2][2] == 3 * 64 and tuple(packs[2][3]) == (29, 64)  # storage offset and size kept
    for packed, t in zip(packs, (y, y.view(2, 16, 64), y[3:], y)):
        out = passing.unpack(packed)
        assert torch.equal(out, t.detach()) and out.stride() == t.stride() and out.data_ptr() != t.data_ptr()
    assert offload.stats["late"] == 1  # one layer's copy, fetched back once for all four views


def test_offload_needs_cuda_outside_the_test_mode():
    model = tiny_lora_model(0.0)
    with pytest.raises(ValueError, match="CUDA"):
        ActivationOffload(model, 2)
    with pytest.raises(ValueError, match="1..4"):
        ActivationOffload(model, 5, cpu_test=True)


def test_prefetch_schedule():
    """Layer i comes back when backward reaches layer min(L - 1, i + lead); the GPU then holds at
    most lead + 1 layers of the window: under the L - N of the start of backward up to N = L / 2
    (lead N), L - N + 1 beyond (lead L - N)."""
    assert [prefetch_trigger(i, 8, 28) for i in (0, 7)] == [8, 15]
    assert prefetch_trigger(3, 3, 4) == 3
    assert peak_resident_layers(8, 28) == 20
    assert peak_resident_layers(14, 28) == 15
    assert peak_resident_layers(2, 4) == 3
    assert peak_resident_layers(4, 4) == 3
    # beyond half the layers the lead shrinks to L - N (at least 2): every further offloaded layer
    # lowers the peak (with a lead of N, offloading all 24 layers brought all 24 back at once)
    assert [peak_resident_layers(n, 24) for n in (8, 12, 13, 16, 20, 23, 24)] == [16, 13, 12, 9, 5, 3, 3]
    assert [prefetch_lead(n, 24) for n in (12, 13, 20, 24)] == [12, 11, 4, 2]
    # a few layers: the copies still lead by 4 layers where the window fits beside the rest
    assert [prefetch_lead(n, 28) for n in (1, 3, 5)] == [4, 4, 5]
    assert [prefetch_trigger(i, 2, 28) for i in (0, 1)] == [4, 5]
    assert [peak_resident_layers(n, 28) for n in (0, 1, 2)] == [28, 27, 26]
    assert prefetch_lead(1, 4) == 2 and peak_resident_layers(1, 4) == 3  # a shallow model: a shorter lead


def test_smaller_micro_batches_offload_fewer_layers():
    """layers_for: the fewest first layers whose offload keeps (resident layers x tokens) within
    the largest micro-batch's with N offloaded; N without a known largest micro-batch or above it."""
    offload = ActivationOffload(tiny_lora_model(0.0, layers=8), 3, cpu_test=True)
    assert offload.layers_for(100) == 3  # max_tokens unknown
    offload.max_tokens = 1000  # budget: peak_resident_layers(3, 8) = 5 layers x 1000 tokens
    assert [offload.layers_for(t) for t in (1000, 999, 834, 833, 715, 714, 625, 1)] == [3, 3, 3, 2, 2, 1, 0, 0]
    assert offload.layers_for(1001) == 3


def test_scaled_offload_is_bitwise():
    """A micro-batch under the planned largest offloads fewer layers, with the same bits."""
    model = tiny_lora_model(0.2)
    batch = packed_batch()
    plain = loss_and_grads(model, batch)
    model.activation_offload = offload = ActivationOffload(model, 2, threshold=0, cpu_test=True)
    offload.max_tokens = batch.n_tokens  # budget 3 resident layers x T: one offloaded layer keeps 3
    assert offload.layers_for(batch.n_tokens - 1) == 1
    offload.max_tokens = batch.n_tokens + 1
    assert_bitwise(plain, loss_and_grads(model, batch))
    assert offload.stats["passes"] == 1 and offload.stats["layers"] == 1
    assert offload.stats["copies"] > 0 and offload.stats["late"] == 0
    offload.max_tokens = 4 * batch.n_tokens  # all 4 layers' activations fit the budget: none moves
    copies = offload.stats["copies"]
    assert_bitwise(plain, loss_and_grads(model, batch))
    assert offload.stats["passes"] == 2 and offload.stats["layers"] == 1 and offload.stats["copies"] == copies


def test_offloaded_bytes_match_the_planner():
    """The bytes the pack hook moves (threshold 0: every saved storage of N layers) against
    plan.memory's offloaded_bytes, on the GPU path's saved set (varlen attention and the Triton
    layers stood in on the CPU), with the seeded dropout and without."""
    from hivetune.plan.measure import fused_layers_standin, varlen_standin
    from hivetune.plan.memory import MemoryConfig, offloaded_bytes

    for dropout in (0.0, 0.2):
        model = tiny_lora_model(dropout, torch.bfloat16)
        model.activation_offload = offload = ActivationOffload(model, 3, threshold=0, cpu_test=True)
        batch = packed_batch()
        with varlen_standin(), fused_layers_standin():
            loss_and_grads(model, batch)
        mc = MemoryConfig(precision="bf16", r=4, dropout=dropout, fused_layers=True, offload_layers=3)
        predicted = offloaded_bytes(model.args, mc, batch.input_ids.shape[1], threshold=0)
        # measured: + each layer's cu_seqlens and dropout seeds (a few bytes the planner leaves out)
        assert 0 <= offload.stats["bytes"] - predicted < 0.005 * predicted, (offload.stats["bytes"], predicted)


def test_planner_breakdown_with_offload():
    """W2 (Qwen2.5-7B shape, r 32 on all 7, bf16, the GPU path) at 3,426 tokens: offloading 8
    layers takes their large saved tensors (~104 KiB a token a layer; the first layer saves
    less) out of the activations into a host row, and the predicted peak under 24 GiB."""
    from hivetune.workflows.workloads import WORKLOADS
    from hivetune.plan.memory import (GIB, MemoryConfig, breakdown, first_layer_saving, layer_saved_bytes_per_token,
                                      offloaded_layer_bytes)

    args, tokens = WORKLOADS["W2"].args, 3426
    mc = MemoryConfig(precision="bf16", r=32, dropout=0.05, fused_layers=True)
    plain = breakdown(args, mc, tokens)
    off = breakdown(args, MemoryConfig(**{**mc.__dict__, "offload_layers": 8}), tokens)
    layer = offloaded_layer_bytes(args, mc, tokens)
    small = 2 * 4 + 4 * 28 + 2 * 32 * 7  # 1/rms x2, the log-sum-exp, xa of q/k/v, o, gate/up, down
    assert layer == (layer_saved_bytes_per_token(args, mc) - small) * tokens
    moved = 8 * layer - (first_layer_saving(args, mc) - 4) * tokens
    assert plain.parts["activations"] - off.parts["activations"] == moved
    assert off.host == {"pinned host (offload)": moved} and plain.host == {}
    assert off.parts["offloaded, fetched back"] == 0  # 8 < 28 / 2: the window stays under 20 layers
    assert 2.6 * GIB < moved < 2.8 * GIB and plain.total > 26.5 * GIB and off.reserved < 24 * GIB
    half = breakdown(args, MemoryConfig(**{**mc.__dict__, "offload_layers": 14}), tokens)
    assert half.parts["offloaded, fetched back"] == layer  # 15 layers at once against 14 kept
    ckpt = breakdown(args, MemoryConfig(**{**mc.__dict__, "offload_layers": 8, "gradient_checkpointing": True}),
                     tokens)
    assert ckpt.host == {}  # train turns it off with checkpointing


def test_config_key_checks(tiny_model_dir, alpaca_file, tmp_path, capsys):
    from hivetune.core.config import load_config
    from hivetune.core.errors import UserError
    from hivetune.train.setup import setup

    with pytest.raises(UserError, match=r"activation_offload: must be >= 0, got -1"):
        load_config(None, {"model": "m", "activation_offload": -1})
    values = {"model": str(tiny_model_dir), "data": str(alpaca_file), "output_dir": str(tmp_path / "run"),
              "eval_prompts": 0, "device": "cpu", "precision": "fp32", "max_steps": 1}
    with pytest.raises(UserError, match=r"activation_offload: 3 exceeds the model's 2 decoder layers"):
        setup(load_config(None, {**values, "activation_offload": 3}))
    with pytest.raises(UserError, match=r"checkpoint_layers: must be >= 0, got -1"):
        load_config(None, {"model": "m", "checkpoint_layers": -1})
    with pytest.raises(UserError, match=r"checkpoint_layers: 3 exceeds the model's 2 decoder layers \(checkpoint at most 2\)"):
        setup(load_config(None, {**values, "gradient_checkpointing": True, "checkpoint_layers": 3}))
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
    run = setup(load_config(None, {**values, "activation_offload": 2}))
    assert run.model.activation_offload is None
    assert "activation_offload off (CUDA only, this run is on cpu)" in capsys.readouterr().err


def test_reserved_host_memory_is_all_the_steps_take():
    """ActivationOffload.reserve with the planner's bytes (what train's setup does before the
    loop): two training passes then take no new host chunk."""
    from hivetune.plan.measure import fused_layers_standin, varlen_standin
    from hivetune.plan.memory import MemoryConfig, offloaded_bytes, offloaded_layer_bytes

    model = tiny_lora_model(0.2, torch.bfloat16)
    model.activation_offload = offload = ActivationOffload(model, 3, threshold=0, cpu_test=True)
    batch = packed_batch()
    mc = MemoryConfig(precision="bf16", r=4, dropout=0.2, fused_layers=True, offload_layers=3)
    t = batch.input_ids.shape[1]
    offload.reserve(offloaded_bytes(model.args, mc, t, threshold=0), offloaded_layer_bytes(model.args, mc, t, threshold=0))
    reserved = offload.host_bytes
    assert reserved >= offloaded_bytes(model.args, mc, t, threshold=0)
    with varlen_standin(), fused_layers_standin():
        loss_and_grads(model, batch)
        loss_and_grads(model, batch)
    assert offload.stats["passes"] == 2 and offload.host_bytes == reserved


def test_train_sizes_the_scaled_offload_for_one_process_only(tiny_model_dir, alpaca_file, tmp_path):
    """train.planned_memory gives the offload the step plan's largest micro-batch (so smaller
    ones offload fewer layers) in one process; under torchrun none (every step offloads N): an
    out-of-memory step cannot be redone on one rank alone."""
    import dataclasses

    from hivetune.parallel.distributed import Dist
    from hivetune.train.graph_plan import planned_micro_batches
    from hivetune.train.prepare import planned_memory
    from hivetune.train.setup import setup
    from conftest import tiny_config

    run = setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / "run", batch_size=2, max_steps=3))
    run.model.activation_offload = offload = ActivationOffload(run.model, 1, threshold=0, cpu_test=True)
    planned_memory(run)
    assert offload.max_tokens == max(t for t, _ in planned_micro_batches(run, start=0)) == 141
    two = dataclasses.replace(run, parallel=Dist(rank=0, world=2))
    planned_memory(two)
    assert offload.max_tokens is None and offload.layers_for(1) == 1
