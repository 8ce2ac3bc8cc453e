"""Dequantization of GGUF (ggml) quantized blocks in plain PyTorch, any device: the frozen
weights of a GGUF base kept as the file stores them (base_quant keep).

A weight [rows, cols] is stored row by row, each row cols / QK blocks of `nbytes` bytes, here
as a uint8 tensor [rows, cols / QK * nbytes]. The block layouts (ggml-common.h), f16 = IEEE
half, all arithmetic in fp32 in the order ggml's reference dequantizers use, so the values
equal the `gguf` package's `gguf.quants.dequantize` bit for bit (tests/ops/test_quant_formats.py):

    Q4_0  32 weights, 18 B: f16 d, 16 B nibbles         y = d (q - 8); low nibbles first half
    Q4_1  32 weights, 20 B: f16 d, f16 m, 16 B nibbles  y = d q + m
    Q5_0  32 weights, 22 B: f16 d, 4 B qh, 16 B nibbles  y = d (q - 16); q = nibble | fifth bit,
          bit j of qh (a little-endian uint32) the fifth bit of weight j
    Q5_1  32 weights, 24 B: f16 d, f16 m, 4 B qh, 16 B nibbles
                                                         y = d q + m (q as Q5_0's)
    Q8_0  32 weights, 34 B: f16 d, 32 int8              y = d q
    Q4_K  256 weights, 144 B: f16 d, f16 dmin, 12 B of 6-bit (scale, min) for 8 sub-blocks of
          32, 128 B nibbles (each 32 B: low nibbles one sub-block, high ones the next)
                                                         y = (d sc) q - (dmin m)
    Q5_K  256 weights, 176 B: as Q4_K plus 32 B of fifth bits before the nibbles (bit i of
          byte l: weight l of sub-block i)
    Q6_K  256 weights, 210 B: 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales (one per
          16 weights), f16 d at the end                  y = (d sc) (q - 32)

On a GPU in bf16 / fp16 with Triton (ops.triton_util.fused_ok) one kernel per call reads the
blocks and writes the weight (`_dequant_kernel`, one constexpr branch per type, the same fp32
operations in the same order); elsewhere the PyTorch reference (`dequantize_reference`).
"""

from __future__ import annotations

import torch

from hivetune.ops.triton_util import fused_ok, kernels, triton

# ggml type id -> (name, weights per block, bytes per block)
BLOCK_TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
SUPPORTED = tuple(name for name, _, _ in BLOCK_TYPES.values())


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] fp32 (little-endian halves)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """[n, k] bytes, read in chunks of `chunk` bytes: each chunk's low nibbles, then its high
    ones -> [n, 2 k] values 0..15 (uint8)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, chunk)
    return torch.cat((q & 15, q >> 4), dim=2).reshape(n, -1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> (scale, min) [n, 8] as 6-bit integers: sub-blocks 0-3 in the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 with their
    top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 6) << 4)), dim=1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 6) << 4)), dim=1)
    return sc, mn


def _q4_0(b):
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 16).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:], 16).float() + m


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's 4 bytes of fifth bits and 16 bytes of nibbles -> [n, 32] values 0..31:
    bit j % 8 of qh byte j // 8 is the fifth bit of weight j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).view(1, 1, 8)
    high = ((qh.unsqueeze(2) >> shifts) & 1).reshape(-1, 32)
    return _nibbles(qs, 16) | (high << 4)


def _q5_0(b):
    d = _f16(b[:, :2])
    q = _five_bits(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _five_bits(b[:, 4:8], b[:, 8:]).float() + m


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _k_scales(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    return (d * sc.float())[..., None], (dmin * mn.float())[..., None]


def _q4_k(b):
    d, dm = _k_scales(b)
    q = _nibbles(b[:, 16:], 32).reshape(-1, 8, 32).float()
    return (d * q - dm).reshape(-1, 256)


def _q5_k(b):
    d, dm = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    q = (_nibbles(b[:, 48:], 32).reshape(-1, 8, 32) | (high << 4)).float()
    return (d * q - dm).reshape(-1, 256)


def _q6_k(b):
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64).reshape(n, 8, 32)  # per 128-half: ql[l], ql[l+32] low, then high
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


_DEQUANT = {2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 12: _q4_k, 13: _q5_k, 14: _q6_k}


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one row of `cols` weights."""
    _, qk, nbytes = BLOCK_TYPES[qtype]
    return cols // qk * nbytes


def dequantize(raw: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """raw [rows, row_bytes] uint8 -> [rows, cols] in `dtype` (computed in fp32, one cast): the
    Triton kernel where fused_ok takes `dtype` on raw's device, else the reference."""
    if dtype in (torch.bfloat16, torch.float16) and fused_ok(raw.new_empty(0, dtype=dtype)):
        return dequantize_triton(raw, qtype, cols, dtype)
    return dequantize_reference(raw, qtype, cols, dtype)


def dequantize_reference(raw: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The plain PyTorch dequantization, any device and dtype."""
    _, qk, nbytes = BLOCK_TYPES[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(rows * (cols // qk), nbytes)
    return _DEQUANT[qtype](blocks).reshape(rows, cols).to(dtype)


# ------------------------------------------------------------------ Triton

WEIGHTS_PER_PROGRAM = 2048


def dequantize_triton(raw: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_reference in one kernel: each program writes WEIGHTS_PER_PROGRAM weights, each
    reading its block's bytes and scales (gathers that stay in cache: a block's weights are
    neighbours). No fused multiply-add, so the fp32 values equal the reference's bit for bit."""
    _, qk, nbytes = BLOCK_TYPES[qtype]
    rows = raw.shape[0]
    out = torch.empty((rows, cols), dtype=dtype, device=raw.device)
    n = rows * cols
    _dequant_kernel[(triton.cdiv(n, WEIGHTS_PER_PROGRAM),)](raw, out, n, KIND=qtype, QK=qk, NBYTES=nbytes,
                                                           BLOCK=WEIGHTS_PER_PROGRAM, enable_fp_fusion=False)
    return out


@kernels
def _define_kernels():
    """The Triton kernels (ops.kernels.gguf_blocks): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, _half, _u8, _dequant_kernel
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.gguf_blocks import _half, _u8, _dequant_kernel
