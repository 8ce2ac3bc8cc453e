"""Gradient checkpointing recomputes activations in backward: same LoRA gradients, same training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hivetune.model.decoder as decoder
from hivetune.model.lora import lora_parameters, lora_state_dict
from hivetune.ops.loss import target_loss_sum
from hivetune.train.loop import fit
from hivetune.train.setup import setup
from hivetune.train.step import micro_batches
from conftest import tiny_config as train_config


def tiny_config(model_dir: Path, data: Path, out: Path, **kw):
    """test_train's tiny run, one step long unless told otherwise."""
    return train_config(model_dir, data, out, **{"max_steps": 1, **kw})


@pytest.fixture
def checkpoint_calls(monkeypatch):
    """Counts the layers run through ops.recompute.checkpoint (so the flag is known to take effect)."""
    calls = []
    real = decoder.checkpoint

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(decoder, "checkpoint", counting)
    return calls


def lora_grads(run, seed: int = 0):
    """One micro-batch forward + backward in training mode; LoRA gradients by name."""
    run.model.train()
    for p in lora_parameters(run.model):
        p.grad = None
    batch = next(micro_batches(run, run.steps[0]))
    torch.manual_seed(seed)  # same LoRA dropout masks in both runs
    hidden = run.model(batch.input_ids, batch.position_ids, batch.layout)
    loss = target_loss_sum(hidden, run.model.lm_head.weight, batch.target_index, batch.target_ids)
    loss.backward()
    names = {id(p): n for n, p in run.model.named_parameters()}
    return loss.item(), {names[id(p)]: p.grad.clone() for p in lora_parameters(run.model)}


def randomize_lora(run):
    """Non-zero B, so the gradients of A are not trivially zero."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in lora_parameters(run.model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("dropout,packing", [(0.0, True), (0.0, False), (0.1, True)])
def test_checkpointing_gives_the_same_lora_grads(dropout, packing, tiny_model_dir, alpaca_file, tmp_path,
                                                 checkpoint_calls):
    results = []
    for ckpt in (False, True):
        cfg = tiny_config(tiny_model_dir, alpaca_file, tmp_path / f"run-{ckpt}", gradient_checkpointing=ckpt,
                          packing=packing, lora={"r": 4, "alpha": 8, "dropout": dropout})
        run = setup(cfg)
        assert run.model.gradient_checkpointing is ckpt
        randomize_lora(run)
        before = len(checkpoint_calls)
        results.append(lora_grads(run))
        assert len(checkpoint_calls) - before == (run.model.args.num_hidden_layers if ckpt else 0)
    (loss_plain, plain), (loss_ckpt, ckpt) = results
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    assert plain.keys() == ckpt.keys() and len(plain) == 2 * 7 * 2  # A and B, 7 targets, 2 layers
    for name, grad in plain.items():
        assert torch.allclose(grad, ckpt[name], atol=1e-6, rtol=0), name
    assert all(g.abs().max() > 1e-4 for g in plain.values())  # every LoRA matrix gets a real gradient


def test_checkpointing_the_first_layer_only_gives_the_same_lora_grads(tiny_model_dir, alpaca_file, tmp_path,
                                                                       checkpoint_calls):
    """checkpoint_layers 1 of 2: the first layer runs checkpointed, the last keeps its activations."""
    results = []
    for extra in ({}, {"gradient_checkpointing": True, "checkpoint_layers": 1}):
        cfg = tiny_config(tiny_model_dir, alpaca_file, tmp_path / f"run-{len(extra)}",
                          lora={"r": 4, "alpha": 8, "dropout": 0.1}, **extra)
        run = setup(cfg)
        randomize_lora(run)
        results.append(lora_grads(run))
    assert [layer.self_attn.layer_idx for layer in checkpoint_calls] == [0]
    (loss_plain, plain), (loss_part, part) = results
    assert loss_part == pytest.approx(loss_plain, rel=1e-6)
    for name, grad in plain.items():
        assert torch.allclose(grad, part[name], atol=1e-6, rtol=0), name


def test_checkpointing_is_off_outside_training(tiny_model_dir, alpaca_file, tmp_path, checkpoint_calls):
    run = setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / "run", gradient_checkpointing=True))
    batch = next(micro_batches(run, run.steps[0]))
    run.model.eval()
    with torch.no_grad():
        run.model(batch.input_ids, batch.position_ids, batch.layout)
    run.model.train()
    with torch.no_grad():
        run.model(batch.input_ids, batch.position_ids, batch.layout)
    assert checkpoint_calls == []


def test_training_steps_match_with_checkpointing(tiny_model_dir, alpaca_file, tmp_path, checkpoint_calls):
    adapters = []
    for ckpt in (False, True):
        run = setup(tiny_config(tiny_model_dir, alpaca_file, tmp_path / f"run-{ckpt}", gradient_checkpointing=ckpt,
                                max_steps=2, lora={"r": 4, "alpha": 8, "dropout": 0.1}))
        fit(run, progress=False)
        adapters.append(lora_state_dict(run.model))
    assert len(checkpoint_calls) == 2 * 2  # 2 steps x 2 layers, only in the checkpointed run
    plain, ckpt = adapters
    assert plain.keys() == ckpt.keys()
    for key, value in plain.items():
        assert torch.allclose(value, ckpt[key], atol=1e-6, rtol=0), key
    assert any(v.abs().max() > 0 for k, v in plain.items() if "lora_B" in k)  # B moved off zero
