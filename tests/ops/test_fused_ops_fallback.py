"""The fused RMSNorm / RoPE / SwiGLU kernels fall back to PyTorch with one note line."""

import torch

from hivetune.core import fallbacks
from hivetune.ops import triton_util


def test_fused_layers_fall_back_with_one_note(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets a CPU tensor ask for the Triton path
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert not triton_util.fused_ok(x.float())  # fp32: always the reference, no note
    monkeypatch.setattr(fallbacks, "NOTED", {})
    monkeypatch.setenv(fallbacks.FORCE_ENV, "fused_layers")
    assert not triton_util.fused_ok(x) and not triton_util.fused_ok(x)
    assert capsys.readouterr().err.splitlines() == [
        "hivetune: note: fused RMSNorm / RoPE / SwiGLU unavailable (asked for the reference); using PyTorch ops"]
    monkeypatch.delenv(fallbacks.FORCE_ENV)
    monkeypatch.setattr(fallbacks, "NOTED", {})
    monkeypatch.setattr(triton_util, "triton", None)
    assert not triton_util.fused_ok(x)
    assert capsys.readouterr().err.splitlines() == [
        "hivetune: note: fused RMSNorm / RoPE / SwiGLU unavailable (Triton is not installed); using PyTorch ops"]
    assert "fused_layers" in fallbacks.PATHS
