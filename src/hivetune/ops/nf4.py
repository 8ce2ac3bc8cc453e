"""4-bit NormalFloat (NF4) with double-quantized scales, QLoRA's storage of a frozen weight
(Dettmers et al. 2023, "QLoRA", sections 2-3), in bitsandbytes' layout:

    w (flat, n values) in blocks of 64:   absmax_b = max |w| over block b
    code_i = nearest NF4 value to w_i / absmax_b     (w_i * (1 / absmax_b), 16 levels, ties low)
    packed [n / 2] uint8: element 2j in the high nibble, element 2j + 1 in the low one

    absmax itself (fp32, n / 64 values) is quantized again (double quantization):
    offset = mean(absmax);  blocks of 256 of (absmax - offset):  absmax2_c = max |.| over block c
    q8_b = nearest value of the signed 8-bit dynamic map (DYNAMIC_MAP) to (absmax_b - offset) / absmax2_c

    dequantize:  absmax_b = DYNAMIC_MAP[q8_b] * absmax2_c + offset;  w_i = NF4[code_i] * absmax_b

All arithmetic is fp32 (products, then one cast to the compute dtype), so a dequantized weight
equals bitsandbytes' dequantize_4bit bit for bit (tests/ops/test_quant_formats.py). Storage:
0.5 byte a weight + 1 byte a 64-block + 8 bytes a 256 x 64 block: ~4.13 bits a weight.

`dequantize_parts` makes the whole [out, in] weight, which the frozen linear (ops.quant_linear)
does one layer at a time: on a GPU in bf16 / fp16 with Triton (ops.triton_util.fused_ok) one
kernel reads the packed bytes and scales and writes the weight (`_dequant_kernel`); elsewhere the
plain PyTorch reference, `dequantize_reference`, whose intermediates take ~12 bytes a weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hivetune.ops.triton_util import fused_ok, kernels, triton

BLOCK = 64  # weights per absmax
DQ_BLOCK = 256  # absmax values per second-level scale

# The 16 NF4 levels: quantiles of N(0, 1) normalised to [-1, 1], with an exact 0 (QLoRA's
# appendix E; the values as published with bitsandbytes).
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic tree map of the 8-bit optimizers paper (Dettmers et al. 2022,
    section 2.2), 256 sorted fp32 values in [-1, 1]: for each exponent e = 0..6, the 2^e
    midpoints of 2^e + 1 points evenly spaced over [0.1, 1], times 10^(e - 6), with both signs
    (254 values), plus 0 and 1."""
    values: list[float] = []
    for e in range(7):
        points = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)
        mids = (points[:-1] + points[1:]) / 2.0
        scale = 10.0 ** (e - 6)
        values += (scale * mids).tolist() + (-scale * mids).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


DYNAMIC_MAP = dynamic_map()


_TABLES: dict = {}  # device -> (NF4 levels, dynamic map) in fp32 on it


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookup tables on `device`, made once (no host-to-device copy inside a CUDA graph)."""
    if device not in _TABLES:
        _TABLES[device] = (torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device), DYNAMIC_MAP.to(device))
    return _TABLES[device]


@dataclass
class NF4Weight:
    """A frozen weight in NF4: `packed` [n / 2] uint8, `q_absmax` [n / 64] uint8, `absmax2`
    [ceil(n / 64 / 256)] fp32, `offset` [] fp32, and the weight's shape."""

    packed: torch.Tensor
    q_absmax: torch.Tensor
    absmax2: torch.Tensor
    offset: torch.Tensor
    shape: tuple[int, ...]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed, "q_absmax": self.q_absmax, "absmax2": self.absmax2, "offset": self.offset}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def nearest_index(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted `levels` to each x (fp32), ties to the lower one:
    x is compared with the fp32 midpoints between neighbours (a value above midpoint i goes up)."""
    mids = ((levels[:-1].double() + levels[1:].double()) / 2).float()
    return torch.bucketize(x, mids.to(x.device), right=False)


def blockwise_absmax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax per block [nb], x scaled into [-1, 1] per block [nb, block]); x flat fp32, padded
    with zeros to whole blocks. A block of zeros scales by 0 (its values stay 0)."""
    n = x.numel()
    blocks = -(-n // block)
    x = torch.nn.functional.pad(x, (0, blocks * block - n)).view(blocks, block)
    absmax = x.abs().amax(dim=1)
    inverse = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    return absmax, x * inverse[:, None]


def quantize(w: torch.Tensor) -> NF4Weight:
    """NF4 with double-quantized absmax of a weight of any shape and float dtype (taken in
    fp32), on its own device. The element count must be even."""
    n = w.numel()
    if n % 2:
        raise ValueError(f"NF4 packs two values a byte: {n} elements")
    absmax, scaled = blockwise_absmax(w.detach().reshape(-1).float(), BLOCK)
    levels, dmap = _tables(w.device)
    codes = nearest_index(scaled.reshape(-1)[:n], levels).to(torch.uint8)
    packed = (codes[0::2] << 4) | codes[1::2]
    offset = absmax.mean()
    absmax2, scaled2 = blockwise_absmax(absmax - offset, DQ_BLOCK)
    q_absmax = nearest_index(scaled2.reshape(-1)[:absmax.numel()], dmap).to(torch.uint8)
    return NF4Weight(packed, q_absmax, absmax2, offset, tuple(w.shape))


def absmax_of(q_absmax: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The fp32 first-level scales from their 8-bit codes: DYNAMIC_MAP[q] * absmax2 + offset."""
    nb = q_absmax.numel()
    scales = absmax2.repeat_interleave(DQ_BLOCK)[:nb]
    return _tables(q_absmax.device)[1][q_absmax.int()] * scales + offset


def dequantize(q: NF4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [shape] in `dtype`: NF4[code] * absmax in fp32, then one cast."""
    return dequantize_parts(q.packed, q.q_absmax, q.absmax2, q.offset, q.shape, dtype)


def dequantize_parts(packed, q_absmax, absmax2, offset, shape, dtype=torch.float32, out=None) -> torch.Tensor:
    """dequantize() from the stored tensors (a module's buffers): the Triton kernel where
    fused_ok takes the output dtype on this device, else the PyTorch reference. `out`: a
    contiguous tensor of `shape` and `dtype` to write into (a row slice of a joined weight)."""
    if dtype in (torch.bfloat16, torch.float16) and fused_ok(packed.new_empty(0, dtype=dtype)):
        return dequantize_triton(packed, q_absmax, absmax2, offset, shape, dtype, out)
    w = dequantize_reference(packed, q_absmax, absmax2, offset, shape, dtype)
    return w if out is None else out.copy_(w)


def dequantize_reference(packed, q_absmax, absmax2, offset, shape, dtype=torch.float32) -> torch.Tensor:
    """The plain PyTorch dequantization, any device and dtype."""
    n = packed.numel() * 2
    levels = _tables(packed.device)[0]
    codes = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(-1).int()
    absmax = absmax_of(q_absmax, absmax2, offset)
    values = levels[codes]
    blocks = n // BLOCK
    head = (values[:blocks * BLOCK].view(blocks, BLOCK) * absmax[:blocks, None]).reshape(-1)
    if blocks * BLOCK < n:  # a last, partial block
        head = torch.cat([head, values[blocks * BLOCK:] * absmax[blocks]])
    return head.view(shape).to(dtype)


# ------------------------------------------------------------------ Triton

BYTES_PER_PROGRAM = 1024  # packed bytes a program reads (2,048 weights)


def dequantize_triton(packed, q_absmax, absmax2, offset, shape, dtype, out=None) -> torch.Tensor:
    """dequantize_reference in one kernel: each program reads BYTES_PER_PROGRAM packed bytes and
    their scales, and writes the 2 x as many weights in `dtype` (into `out` where given: contiguous,
    of `shape`). The scales' mul and add stay two roundings (no fused multiply-add), so the values
    equal the reference's bit for bit."""
    levels, dmap = _tables(packed.device)
    n_bytes = packed.numel()
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    elif not out.is_contiguous() or out.dtype != dtype or out.numel() != 2 * n_bytes:
        raise ValueError(f"nf4: out must be contiguous {dtype} of {2 * n_bytes} values")
    grid = (triton.cdiv(n_bytes, BYTES_PER_PROGRAM),)
    _dequant_kernel[grid](packed, q_absmax, absmax2, offset, levels, dmap, out, n_bytes,
                          BYTES=BYTES_PER_PROGRAM, enable_fp_fusion=False)
    return out


@kernels
def _define_kernels():
    """The Triton kernels (ops.kernels.nf4): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, BLOCK_C, DQ_BLOCK_C, _dequant_kernel
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.nf4 import BLOCK_C, DQ_BLOCK_C, _dequant_kernel

    assert (BLOCK_C, DQ_BLOCK_C) == (BLOCK, DQ_BLOCK), "ops.kernels.nf4's block sizes"
