"""The config keys the ops take, set once by train setup: ops never read the config or the
environment for them."""

from __future__ import annotations

from hivetune.ops.attention import set_backend
from hivetune.ops.triton_util import set_fused_ops


def configure_ops(attention: str, fused_ops: bool) -> None:
    """TrainConfig.attention (auto | flash | sdpa) and TrainConfig.fused_ops (the Triton RMSNorm,
    RoPE, SwiGLU and seeded dropout, else their PyTorch references), for this process."""
    set_backend(attention)
    set_fused_ops(fused_ops)
