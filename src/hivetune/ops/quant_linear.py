"""y = x W^T + b for a frozen W kept quantized (ops.nf4, ops.int8, ops.gguf_blocks): the
reference path, plain PyTorch on any device. Forward dequantizes W into the compute dtype, runs
the matmul and drops W; backward dequantizes it again for dx = g W. Nothing of W is saved for
backward (it is frozen: no weight gradient), so at most one layer's dequantized weight is alive
at a time, the dequantization workspace plan.memory counts. (The joined LoRA groups of training,
ops.lora_group, take the dequantization as a callable and run the same way a group at a time.)

x's dtype (the autocast dtype under autocast) is the compute dtype; the dequantized values are
computed in fp32 and cast once, so the result equals F.linear on the dequantized weight.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


class DequantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, weight_of: Callable, dtype: torch.dtype):
        ctx.weight_of, ctx.dtype, ctx.x_dtype = weight_of, dtype, x.dtype
        w = weight_of(dtype)
        return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        w = ctx.weight_of(ctx.dtype)
        return (g.to(ctx.dtype) @ w).to(ctx.x_dtype), None, None, None


def dequant_linear(x: torch.Tensor, weight_of: Callable[[torch.dtype], torch.Tensor],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out]; weight_of(dtype) gives the dequantized [out, in] weight."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        return DequantLinear.apply(x, bias, weight_of, dtype)
