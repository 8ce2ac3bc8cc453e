"""The HF + PEFT baseline on a quantized base: bitsandbytes loads the same model as NF4 (QLoRA's
recipe) and the Trainer runs on it, as `bench --set base_quant=nf4 --baseline hf-peft` does."""

from __future__ import annotations

import pytest
import torch

from hivetune.model.config import qwen25_shape
from hivetune.workflows.hf_baseline import baseline_missing, quantized_hf_model, random_hf_model, run_hf_job, workload_job
from hivetune.workflows.workloads import Workload

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

CPU = torch.device("cpu")
TINY = Workload("T", qwen25_shape(4096, 64, 128, 2, 4, 2, True), 16, 64, 1.0, 4, {"r": 4, "alpha": 8, "dropout": 0.0})


def test_bitsandbytes_loads_every_decoder_linear_as_nf4():
    model = quantized_hf_model(lambda: random_hf_model(TINY.args, CPU), CPU, "nf4")
    linears = {name: m for name, m in model.named_modules() if name.split(".")[-1].endswith("_proj")}
    assert len(linears) == 2 * 7
    for name, m in linears.items():
        assert isinstance(m, bnb.nn.Linear4bit), name
        assert m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested, name


def test_the_trainer_runs_on_the_nf4_base():
    job = workload_job(TINY, CPU, {"base_quant": "nf4"})
    record = run_hf_job(lambda: random_hf_model(TINY.args, CPU), job, CPU)
    assert record["config"] == "batch 2 x accum 2, fp32, sdpa, adamw_torch_fused, bitsandbytes 4-bit nf4, double quant"
    assert record["steps_run"] == 4 and torch.isfinite(torch.tensor(record["train_loss"]))


def test_a_missing_bitsandbytes_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "bitsandbytes" else real(name))
    assert baseline_missing("nf4") == "--baseline hf-peft needs bitsandbytes (pip install 'hivetune[dev]')"
    assert baseline_missing("none") == ""
