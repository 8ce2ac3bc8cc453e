"""The fused RMSNorm / RoPE / SwiGLU kernels fall back to PyTorch with one note line."""

import torch

from hivetune.core import fastpath
from hivetune.ops import elementwise
def test_fused_layers_fall_back_with_one_note(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets a CPU tensor ask for the Triton path
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert not elementwise.fused_ok(x.float())  # fp32: always the reference, no note
    monkeypatch.setattr(fastpath, "NOTED", {})
    monkeypatch.setenv(fastpath.FORCE_ENV, "fused_layers")
    assert not elementwise.fused_ok(x) and not elementwise.fused_ok(x)
    assert capsys.readouterr().err.splitlines() == [
        "hivetune: note: fused RMSNorm / RoPE / SwiGLU unavailable (asked for the reference); using PyTorch ops"]
    monkeypatch.delenv(fastpath.FORCE_ENV)
    monkeypatch.setattr(fastpath, "NOTED", {})
    monkeypatch.setattr(elementwise, "triton", None)
    assert not elementwise.fused_ok(x)
    assert capsys.readouterr().err.splitlines() == [
        "hivetune: note: fused RMSNorm / RoPE / SwiGLU unavailable (Triton is not installed); using PyTorch ops"]
    assert "fused_layers" in fastpath.PATHS
