"""Per-row absmax int8, the weight format of LLM.int8 (Dettmers et al. 2022) without its
fp16 outlier columns: each output row of a frozen weight [out, in] keeps its absmax and its
values rounded to -127..127.

    absmax_r = max |w_r|;  q_r = round(w_r * (127 / absmax_r))   (int8; a row of zeros stays 0)
    w_r ~ q_r * absmax_r / 127                                   (fp32, then one cast)

Storage: 1 byte a weight + 4 bytes a row. The reference here is plain PyTorch (any device);
the frozen linear (ops.quant_linear) dequantizes one layer at a time.
"""

from __future__ import annotations

import torch


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] int8, absmax [out] fp32) of a 2-D weight of any float dtype (taken in fp32)."""
    w = w.detach().float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    q = torch.round(w * scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, absmax


def dequantize(q: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """[out, in] in `dtype`: q * absmax / 127 in fp32, then one cast (into `out` where given)."""
    if out is not None and out.dtype == torch.float32:
        return torch.div(q.float() * absmax[:, None], 127.0, out=out)  # no fp32 copy to cast
    values = q.float() * absmax[:, None] / 127.0
    return values.to(dtype) if out is None else out.copy_(values)
