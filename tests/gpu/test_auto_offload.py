"""`--auto`'s offload pass on a real GPU (plan.auto.offload_fit; the choice itself is CPU-tested
in tests/plan/test_plan.py): where no micro-batch fits the memory as it is, auto moves the input
embedding to pinned host memory and offloads the fewest layers' activations that make the
largest micro-batch fit, and the run then trains under an allocator capped at that memory.

The model (hidden 512, 8 layers, untied, bf16) with 8 examples of 8,192 tokens a step is
activation-bound (the planner, on the CPU: 1.58 GiB for one example, 1.29 with 4 layers moved):
the budget is set halfway between the planner's peak for one example with nothing moved and its
peak with the embedding moved and half the layers offloaded, so no micro-batch fits as it is and
one example fits with some layers offloaded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hivetune.core.config import load_config
from hivetune.core.device import cap_memory
from hivetune.model.load import load_args
from hivetune.plan import auto_config
from hivetune.plan.memory import GIB, breakdown
from hivetune.plan.planner import memory_config
from hivetune.train.loop import fit
from hivetune.train.setup import setup

from conftest import CORPUS, build_tiny_model, build_tokenizer, write_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EXAMPLES, LENGTH, LAYERS = 8, 8192, 8


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("auto-offload-model")
    build_tokenizer(folder)
    build_tiny_model(folder, hidden_size=512, intermediate_size=2048, num_hidden_layers=LAYERS,
                     num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                     max_position_embeddings=LENGTH)
    text = " ".join(CORPUS) * 120  # ~19,500 tokens: every example is cut to LENGTH
    records = [{"instruction": f"Explain item {i}.", "input": "", "output": f"{i}: {text}"} for i in range(16)]
    return folder, write_jsonl(folder / "train.jsonl", records)


def config(model_and_data, out: Path, **kw):
    folder, data = model_and_data
    values = {"model": str(folder), "data": str(data), "output_dir": str(out), "device": "cuda", "precision": "bf16",
              "lora": {"r": 8, "alpha": 16, "dropout": 0.05}, "eval_prompts": 0, "batch_size": EXAMPLES,
              "grad_accum": 1, "max_steps": 2, "max_length": LENGTH, "lr": 1e-3, "warmup_steps": 0, "log_every": 1}
    values.update(kw)
    return load_config(None, values)


def test_auto_offloads_where_nothing_fits_and_the_run_fits_the_cap(model_and_data, tmp_path, capsys):
    cfg = config(model_and_data, tmp_path / "run")
    args = load_args(model_and_data[0])

    def peak(**changes) -> float:
        c = dataclasses.replace(cfg, **changes)
        return breakdown(args, memory_config(c, "bf16", False), LENGTH).total

    plain = peak(batch_size=1, grad_accum=EXAMPLES)
    moved = peak(batch_size=1, grad_accum=EXAMPLES, host_embeddings=True, activation_offload=LAYERS // 2)
    assert plain - moved > 0.2 * GIB, (moved, plain)  # activations dominate: offload makes room
    budget_gib = (plain + moved) / 2 / GIB
    chosen, why = auto_config(cfg, torch.device("cuda"), memory_gib=budget_gib)
    print(why)
    assert (chosen.batch_size, chosen.grad_accum, chosen.gradient_checkpointing) == (1, EXAMPLES, False)
    assert chosen.host_embeddings and 0 < chosen.activation_offload <= LAYERS // 2, why
    assert f"activation_offload={chosen.activation_offload}" in why

    run = setup(chosen)
    device = torch.device("cuda", torch.cuda.current_device())
    cap_memory(device, budget_gib)
    try:
        result = fit(run, progress=False)
        peak_bytes = torch.cuda.max_memory_allocated()
    finally:
        cap_memory(device, 0)
    print(f"budget {budget_gib:.3f} GiB, predicted {moved / GIB:.3f} GiB with {LAYERS // 2} layers moved and "
          f"{plain / GIB:.3f} with none; measured peak {peak_bytes / GIB:.3f} GiB allocated, "
          f"{chosen.activation_offload} layers offloaded")
    assert result.steps == 2 and result.final_loss == result.final_loss  # trained, finite loss
    assert peak_bytes <= budget_gib * GIB
    offload = run.model.activation_offload
    assert offload is not None and offload.stats["passes"] == 2 * EXAMPLES  # every micro-batch offloaded
    assert "CUDA out of memory" not in capsys.readouterr().err


def test_auto_sizes_to_what_this_process_may_hold(model_and_data, tmp_path):
    """Without memory_gib, auto plans in train.device_memory_bytes: a per-process fraction of a
    quarter of the GPU makes the budget a quarter (it planned in the whole device before)."""
    from hivetune.plan.gpus import device_memory_bytes

    cfg = config(model_and_data, tmp_path / "run")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_per_process_memory_fraction(0.25, device.index)
    try:
        room = device_memory_bytes(device)
        _, why = auto_config(cfg, device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device.index)
    total = torch.cuda.get_device_properties(device).total_memory
    assert room <= 0.25 * total + 1
    assert f" of {room / GIB:.1f} GiB at {LENGTH} tokens an example" in why, why
