"""The same code on a CUDA GPU: parity with the CPU, training in bf16 / fp16, generation."""

from __future__ import annotations

import json

import pytest
import torch

from hivetune.config import load_config
from hivetune.generate import greedy_ids
from hivetune.model.load import load_model
from hivetune.train import fit, setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_losses(model_dir, data, out, **kw):
    values = {"model": str(model_dir), "data": str(data), "output_dir": str(out), "eval_prompts": 0,
              "batch_size": 4, "max_steps": 6, "lr": 5e-3, "warmup_steps": 0, "lora": {"r": 4, "alpha": 8}}
    values.update(kw)
    run = setup(load_config(None, values))
    fit(run, progress=False)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()], run


def test_cuda_fp32_matches_cpu_fp32(tiny_model_dir, alpaca_file, tmp_path):
    cpu, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "cpu", device="cpu", precision="fp32")
    gpu, run = run_losses(tiny_model_dir, alpaca_file, tmp_path / "gpu", device="cuda", precision="fp32")
    assert run.device.type == "cuda"
    # The first loss is one forward pass: only reduction order differs. Later steps compound
    # those differences through AdamW at lr 5e-3 (measured on an H200: 1.7e-3 relative by step 3).
    assert gpu[0] == pytest.approx(cpu[0], rel=1e-5)
    assert gpu == pytest.approx(cpu, rel=5e-3)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_half_precision_tracks_fp32(precision, tiny_model_dir, alpaca_file, tmp_path):
    ref, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "ref", device="cuda", precision="fp32")
    half, run = run_losses(tiny_model_dir, alpaca_file, tmp_path / precision, device="cuda", precision=precision)
    assert run.model.model.layers[0].mlp.up_proj.base_layer.weight.dtype == {"bf16": torch.bfloat16,
                                                                             "fp16": torch.float16}[precision]
    assert run.model.model.layers[0].mlp.up_proj.lora_A.weight.dtype == torch.float32
    assert half == pytest.approx(ref, rel=2e-2)
    assert half[-1] < half[0]


def test_cuda_packed_equals_padded_losses_bf16(tiny_model_dir, alpaca_file, tmp_path):
    packed, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "packed", device="cuda", precision="bf16")
    padded, _ = run_losses(tiny_model_dir, alpaca_file, tmp_path / "padded", device="cuda", precision="bf16",
                           packing=False)
    assert packed == pytest.approx(padded, rel=1e-2)


def test_cuda_generation_equals_cpu(tiny_model_dir):
    cpu = load_model(tiny_model_dir)
    gpu = load_model(tiny_model_dir, device="cuda")
    prompts = [[1, 5, 9, 33, 70], [1, 2, 3]]
    assert greedy_ids(gpu, prompts, 8, set()) == greedy_ids(cpu, prompts, 8, set())
