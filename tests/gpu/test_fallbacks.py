"""Each fast path against its forced reference fallback on a CUDA GPU (hivetune.core.fallbacks):
flash varlen attention vs SDPA, fused vs foreach AdamW, fused vs reference LM-head CE, bf16 vs
the fp16 fallback. CUDA graphs vs eager are in test_graphs.py. Skips without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from hivetune.core import fallbacks
from hivetune.core.config import load_config
from hivetune.core.device import resolve_precision
from hivetune.core.fallbacks import FORCE_ENV
from hivetune.ops import attention
from hivetune.ops.adamw import adamw
from hivetune.ops.attention import probe_varlen, varlen_usable
from hivetune.ops.fused_ce import fused_target_loss_sum, triton_ce_ok
from hivetune.ops.loss import target_loss_sum
from hivetune.ops.preference import fused_target_logprobs, target_logprobs
from hivetune.train.loop import fit
from hivetune.train.setup import setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(fallbacks, "NOTED", {})
    monkeypatch.setattr(attention, "_VARLEN_OK", {})
    monkeypatch.delenv(FORCE_ENV, raising=False)


def losses_of(model_dir, data, out, **kw):
    values = {"model": str(model_dir), "data": str(data), "output_dir": str(out), "eval_prompts": 0,
              "batch_size": 4, "max_steps": 6, "lr": 5e-3, "warmup_steps": 0, "lora": {"r": 4, "alpha": 8},
              "device": "cuda", "precision": "bf16", "cuda_graphs": False}
    values.update(kw)
    run = setup(load_config(None, values))
    fit(run, progress=False)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()], run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_probe_passes_on_this_gpu(dtype):
    assert probe_varlen(GPU, dtype) == ""
    assert varlen_usable(GPU, dtype) is True
    assert fallbacks.NOTED == {}


def test_varlen_training_matches_the_forced_sdpa_fallback(tiny_model_dir, alpaca_file, tmp_path, monkeypatch, capsys):
    fast, _ = losses_of(tiny_model_dir, alpaca_file, tmp_path / "fast")
    assert varlen_usable(GPU, torch.bfloat16) and capsys.readouterr().err.count("hivetune: note:") == 0
    monkeypatch.setenv(FORCE_ENV, "varlen")
    ref, _ = losses_of(tiny_model_dir, alpaca_file, tmp_path / "ref")
    assert capsys.readouterr().err.count("hivetune: note: flash varlen attention unavailable") == 1
    assert fast == pytest.approx(ref, rel=1e-2)
    assert fast[-1] < fast[0]


def test_fused_adamw_matches_foreach_on_the_gpu(monkeypatch):
    def steps(fused: bool):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 32, generator=gen).to(GPU)),
                  torch.nn.Parameter(torch.randn(32, 8, generator=gen).to(GPU))]
        opt = adamw(params, 1e-2, 0.01, fused=fused)
        assert bool(opt.defaults["fused"]) is fused
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(GPU)
            opt.step()
        return [p.detach().cpu() for p in params]

    fast = steps(True)
    monkeypatch.setenv(FORCE_ENV, "fused_adamw")
    params = [torch.nn.Parameter(torch.zeros(4, device=GPU))]
    assert not adamw(params, 1e-2, 0.0, fused=True).defaults["fused"]  # forced: the fallback
    monkeypatch.delenv(FORCE_ENV)
    for a, b in zip(fast, steps(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("kind", ["loss", "logprobs"])
def test_fused_ce_matches_the_reference_on_the_gpu(kind, softcap):
    """The Triton CE (summed loss, and per-token log-probs for DPO) against the PyTorch reference,
    with and without Gemma 2's final logit cap (logits of a few units: a cap of 1.5 binds)."""
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, 300, 64, generator=gen) * 2).to(GPU, torch.bfloat16)
    head = (torch.randn(1000, 64, generator=gen) * 0.1).to(GPU, torch.bfloat16)
    index = torch.arange(5, 300, 3, device=GPU)
    targets = torch.randint(0, 1000, (index.numel(),), generator=gen).to(GPU)
    weights = torch.linspace(-1, 1, index.numel(), device=GPU)  # a per-token upstream gradient
    pairs = {"loss": (("fused", fused_target_loss_sum), ("reference", target_loss_sum)),
             "logprobs": (("fused", fused_target_logprobs), ("reference", target_logprobs))}[kind]
    assert triton_ce_ok(hidden, head)
    out = {}
    for name, fn in pairs:
        h = hidden.clone().requires_grad_()
        value = fn(h, head, index, targets, softcap=softcap).float()
        (value if kind == "loss" else (value * weights).sum()).backward()
        out[name] = (value.detach(), h.grad.float().flatten())
    torch.testing.assert_close(out["fused"][0], out["reference"][0], rtol=1e-3, atol=1e-2)
    cosine = torch.nn.functional.cosine_similarity(out["fused"][1], out["reference"][1], dim=0).item()
    assert cosine > 0.999


def test_bf16_falls_back_to_fp16_and_tracks_it(tiny_model_dir, alpaca_file, tmp_path, monkeypatch, capsys):
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16: auto is fp16 already")
    assert resolve_precision("auto", GPU) == "bf16"
    bf16, _ = losses_of(tiny_model_dir, alpaca_file, tmp_path / "bf16", precision="auto")
    monkeypatch.setenv(FORCE_ENV, "gpu_bf16")
    capsys.readouterr()
    fp16, run = losses_of(tiny_model_dir, alpaca_file, tmp_path / "fp16", precision="auto")
    assert run.precision == "fp16" and run.scaler is not None
    assert capsys.readouterr().err.count(
        "hivetune: note: bf16 unavailable (HIVETUNE_REFERENCE asks for the reference); using fp16 with loss scaling") == 1
    assert bf16 == pytest.approx(fp16, rel=3e-2)  # each is within ~1e-2 of fp32 (test_cuda_train)
