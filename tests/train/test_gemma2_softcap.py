"""Gemma 2's final logit soft-cap in the training and held-out losses: on a tiny random Gemma 2
whose cap binds (conftest.tiny_gemma2_dir), one training micro-batch's loss and LoRA gradients
(train.step.forward_backward, fused and plain loss) and the validation loss equal transformers'
Gemma2ForCausalLM loss on the same labels, with the same LoRA through PEFT, to 1e-5 in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hivetune.model.lora import lora_modules, lora_parameters, save_adapter
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.loss import target_loss_sum
from hivetune.train.loop import validation_loss
from hivetune.train.setup import setup
from hivetune.train.step import forward_backward, micro_batches
from conftest import tiny_config


def gemma2_run(model_dir, data, out, **kw):
    run = setup(tiny_config(model_dir, data, out, **kw))
    assert run.model.args.final_logit_softcapping == 3.0
    with torch.no_grad():  # B non-zero: the LoRA changes the logits and every gradient carries signal
        generator = torch.Generator().manual_seed(3)
        for p in lora_parameters(run.model):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return run


def peft_model(run, model_dir, folder):
    """transformers' Gemma2ForCausalLM (eager attention) with the run's LoRA loaded through PEFT."""
    peft = pytest.importorskip("peft")
    save_adapter(run.model, run.spec, folder, base_model_path=str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    return peft.PeftModel.from_pretrained(hf, str(folder), is_trainable=True).eval()


def hf_loss_sum(hf, examples) -> torch.Tensor:
    """Sum over the examples' targets of transformers' CE (its loss is the mean over labels != -100)."""
    total = 0.0
    for e in examples:
        labels = [t if m and i > 0 else -100 for i, (t, m) in enumerate(zip(e.ids, e.mask))]
        out = hf(torch.tensor([e.ids]), labels=torch.tensor([labels]))
        total = total + out.loss * e.n_targets
    return total


def peft_grads(hf) -> dict[str, torch.Tensor]:
    """PEFT's LoRA gradients under hivetune's adapter names (lora.lora_state_dict's)."""
    return {n.replace(".default", ""): p.grad for n, p in hf.named_parameters() if "lora_" in n}


def our_grads(model) -> dict[str, torch.Tensor]:
    return {f"base_model.model.{name}.{part}.weight": getattr(m, part).weight.grad
            for name, m in lora_modules(model) for part in ("lora_A", "lora_B")}


@pytest.mark.parametrize("loss_fn", [fused_target_loss_sum, target_loss_sum])
def test_training_loss_and_lora_grads_match_transformers(tiny_gemma2_dir, alpaca_file, tmp_path, loss_fn):
    run = gemma2_run(tiny_gemma2_dir, alpaca_file, tmp_path / "run")
    ids = [0, 1, 2, 3]
    examples = [run.data.example(i) for i in ids]
    batch = next(micro_batches(run, ids))
    n_targets = sum(e.n_targets for e in examples)
    assert int(batch.target_ids.numel()) == n_targets and max(len(e.ids) for e in examples) > 8  # past the window
    loss = forward_backward(run, batch, n_targets, loss_fn)

    hf = peft_model(run, tiny_gemma2_dir, tmp_path / "adapter")
    want = hf_loss_sum(hf, examples) / n_targets
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=0)
    ours, theirs = our_grads(run.model), peft_grads(hf)
    assert sorted(ours) == sorted(theirs) and len(ours) > 0
    for name, g in ours.items():
        torch.testing.assert_close(g, theirs[name], atol=1e-6, rtol=1e-5, msg=name)
    assert max(float(g.abs().max()) for g in ours.values()) > 1e-3  # the gradients are not trivially zero

    # the cap has teeth: the same hidden states without it give another loss
    with torch.no_grad():
        hidden = run.model(batch.input_ids, batch.position_ids, batch.layout)
        uncapped = target_loss_sum(hidden, run.model.lm_head.weight, batch.target_index, batch.target_ids)
    assert abs(uncapped.item() / n_targets - want.item()) > 0.1


def test_validation_loss_matches_transformers(tiny_gemma2_dir, alpaca_file, tmp_path):
    run = gemma2_run(tiny_gemma2_dir, alpaca_file, tmp_path / "run", val_split=0.25)
    val_loss, n = validation_loss(run)
    data, ids = run.val
    examples = [data.example(i) for i in ids]
    assert n == sum(e.n_targets for e in examples) > 0
    with torch.no_grad():
        want = hf_loss_sum(peft_model(run, tiny_gemma2_dir, tmp_path / "adapter"), examples) / n
    assert val_loss == pytest.approx(want.item(), rel=1e-5, abs=0)
