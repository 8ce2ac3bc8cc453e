"""The quantized-base formats against their references: NF4 against a plain implementation of
the published table and block scheme (and bitsandbytes where it imports), int8 per-row absmax,
GGUF blocks against the `gguf` package's dequantization, bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hivetune.ops import gguf_blocks, int8, nf4, triton_util

SHAPES = [(128, 256), (96, 320), (7, 192), (3, 64)]


# ------------------------------------------------------------------ NF4: a plain reference

def ref_nearest(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Nearest level by distance, ties to the lower index (argmin takes the first)."""
    return (x.double()[:, None] - levels.double()[None, :]).abs().argmin(dim=1)


def ref_nf4(w: torch.Tensor):
    """QLoRA's scheme written out: 64-blocks scaled by 1 / absmax, nearest NF4 level, two codes a
    byte (first high); absmax - mean in 256-blocks, nearest value of the dynamic map."""
    flat = w.reshape(-1).float()
    levels = torch.tensor(nf4.NF4_LEVELS)
    codes, absmax = [], []
    for start in range(0, flat.numel(), 64):
        block = flat[start:start + 64]
        m = block.abs().max()
        absmax.append(m)
        codes.append(ref_nearest(block * (1 / m), levels))
    codes = torch.cat(codes).to(torch.uint8)
    packed = codes[0::2] * 16 + codes[1::2]
    absmax = torch.stack(absmax)
    offset = absmax.mean()
    q8, absmax2 = [], []
    for start in range(0, absmax.numel(), 256):
        block = absmax[start:start + 256] - offset
        m = block.abs().max()
        absmax2.append(m)
        q8.append(ref_nearest(block * (1 / m), nf4.DYNAMIC_MAP))
    q8, absmax2 = torch.cat(q8).to(torch.uint8), torch.stack(absmax2)
    scales = torch.tensor([nf4.DYNAMIC_MAP[int(q)] * absmax2[i // 256] + offset for i, q in enumerate(q8)])
    values = torch.tensor([nf4.NF4_LEVELS[int(c)] for c in codes]) * scales.repeat_interleave(64)[:codes.numel()]
    return packed, q8, absmax2, offset, values.view(w.shape)


def test_dynamic_map_is_the_published_one():
    m = nf4.DYNAMIC_MAP
    assert m.numel() == 256 and torch.equal(m, m.sort().values)
    assert m[-1] == 1.0 and (m == 0).sum() == 1 and torch.equal(m[:127], -m[128:255].flip(0))
    # 10^0 * the midpoint of the last two of 65 points over [0.1, 1]; 10^-6 * (0.1 + 1) / 2
    assert abs(m[-2].item() - (0.1 + 63 * 0.9 / 64 + 1) / 2) < 1e-7
    assert abs(m[m > 0][0].item() - 5.5e-07) < 1e-13


@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_equals_plain_reference(shape):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * 0.02
    q = nf4.quantize(w)
    packed, q8, absmax2, offset, values = ref_nf4(w)
    assert torch.equal(q.packed, packed)
    assert torch.equal(q.q_absmax, q8)
    assert torch.equal(q.absmax2, absmax2) and torch.equal(q.offset, offset)
    assert torch.equal(nf4.dequantize(q), values)
    assert torch.equal(nf4.dequantize_reference(q.packed, q.q_absmax, q.absmax2, q.offset, shape, torch.bfloat16),
                       values.bfloat16())


def test_nf4_levels_round_trip_exactly():
    """A block whose values are absmax times the levels comes back unchanged."""
    levels = torch.tensor(nf4.NF4_LEVELS)
    w = torch.cat([levels * 0.5, levels.flip(0) * 0.5, levels * 0.5, levels * 0.5]).view(1, 64)
    q = nf4.quantize(w.repeat(4, 1))
    assert torch.equal(nf4.dequantize(q)[0], w[0])


def bnb_functional():
    try:
        import bitsandbytes.functional as F
    except Exception as e:  # not installed, or no library for this machine
        pytest.skip(f"bitsandbytes does not import here ({type(e).__name__}); the plain reference covers NF4")
    return F


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_nf4_equals_bitsandbytes(shape):
    """bitsandbytes' quantize_4bit (nf4, blocksize 64, compressed statistics) and dequantize_4bit.
    Its CPU library picks the second-level codes by an approximate search: where a code differs,
    ours must be the nearer value (the GPU kernels take the nearest, as ours does)."""
    F = bnb_functional()
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * 0.02
    qb, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    q = nf4.quantize(w)
    assert torch.equal(q.packed, qb.view(-1))
    assert torch.equal(q.absmax2, state.state2.absmax) and torch.equal(q.offset, state.offset)
    assert torch.equal(F.create_dynamic_map(signed=True), nf4.DYNAMIC_MAP)
    differ = (q.q_absmax != state.absmax).nonzero().view(-1)
    assert differ.numel() <= max(1, q.q_absmax.numel() // 100)
    absmax = w.reshape(-1, 64).abs().amax(1)
    for i in differ.tolist():
        x = (absmax[i] - q.offset) * (1 / q.absmax2[i // 256])
        ours, theirs = nf4.DYNAMIC_MAP[q.q_absmax[i].long()], nf4.DYNAMIC_MAP[state.absmax[i].long()]
        assert (x - ours).abs() < (x - theirs).abs()
    # dequantization of bitsandbytes' own state: equal bit for bit, fp32 and bf16
    ours = nf4.dequantize_parts(qb.view(-1), state.absmax, state.state2.absmax, state.offset, shape)
    assert torch.equal(ours, F.dequantize_4bit(qb, state))
    qh, sh = F.quantize_4bit(w.bfloat16(), blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(nf4.dequantize_reference(qh.view(-1), sh.absmax, sh.state2.absmax, sh.offset, shape,
                                                torch.bfloat16), F.dequantize_4bit(qh, sh))


RUNS_TRITON = triton_util.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.skipif(not RUNS_TRITON, reason="needs Triton on a GPU (or TRITON_INTERPRET=1 with Triton installed)")
@pytest.mark.parametrize("shape", SHAPES + [(3, 2064)])
def test_nf4_triton_dequant_equals_reference(shape):
    """fp32 bit for bit; bf16 / fp16 bit for bit on a GPU, within one step of the format under the
    interpreter (it converts by truncation, the GPU rounds to nearest as torch does)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(sum(shape))
    q = nf4.quantize(torch.randn(shape, device=device) * 0.02)
    parts = (q.packed, q.q_absmax, q.absmax2, q.offset, shape)
    assert torch.equal(nf4.dequantize_triton(*parts, torch.float32), nf4.dequantize_reference(*parts))
    for dtype in (torch.bfloat16, torch.float16):
        fast, ref = nf4.dequantize_parts(*parts, dtype), nf4.dequantize_reference(*parts, dtype)
        if device == "cuda":
            assert torch.equal(fast, ref)
        else:
            step = torch.finfo(dtype).eps * ref.float().abs()
            assert ((fast.float() - ref.float()).abs() <= step).all()


def test_nf4_odd_count_is_refused():
    with pytest.raises(ValueError, match="two values a byte"):
        nf4.quantize(torch.ones(3, 3))


# ------------------------------------------------------------------ int8

def test_int8_per_row_absmax():
    torch.manual_seed(0)
    w = torch.randn(33, 70)
    w[5] = 0
    q, absmax = int8.quantize(w)
    assert q.dtype == torch.int8 and absmax.shape == (33,)
    assert torch.equal(absmax, w.abs().amax(1))
    assert torch.equal(q.abs().amax(1)[absmax > 0], torch.full((32,), 127, dtype=torch.int8))
    back = int8.dequantize(q, absmax)
    assert torch.equal(back, q.float() * absmax[:, None] / 127)
    assert torch.equal(back[5], torch.zeros(70))
    assert ((back - w).abs() <= absmax[:, None] / 254 + 1e-7).all()  # half a step at most


# ------------------------------------------------------------------ GGUF blocks

F16_FIELDS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}


def random_blocks(qtype: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random block bytes with finite f16 scales in their places (ggml-common.h layouts)."""
    rng = np.random.default_rng(seed)
    _, qk, nbytes = gguf_blocks.BLOCK_TYPES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // qk * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)
    for at in F16_FIELDS[qtype]:
        halves = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return raw


GGUF_QUANTIZES = (2, 3, 6, 7, 8)  # the gguf package quantizes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
GGUF_SOURCES = [(t, "random") for t in sorted(gguf_blocks.BLOCK_TYPES)] + [(t, "data") for t in GGUF_QUANTIZES]


@pytest.mark.parametrize("qtype,source", GGUF_SOURCES)
def test_gguf_blocks_equal_gguf_package(qtype, source):
    """Random bytes (every bit pattern, finite f16 scales) and, where the gguf package quantizes
    the type, real blocks of data."""
    import gguf
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType(qtype)
    rows, cols = 6, 512
    if source == "data":
        data = np.random.default_rng(qtype).standard_normal((rows, cols)).astype(np.float32)
        raw = quantize(data, kind)
    else:
        raw = random_blocks(qtype, rows, cols, qtype)
    expected = dequantize(raw, kind)
    ours = gguf_blocks.dequantize(torch.from_numpy(np.ascontiguousarray(raw)), qtype, cols)
    assert ours.shape == (rows, cols)
    assert np.array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32))
    assert gguf_blocks.row_bytes(qtype, cols) == raw.shape[1]


def test_q5_0_fifth_bits_are_ggml_layout():
    """One hand-made Q5_0 block: d 1, nibbles q % 16 (weights 0-15 low, 16-31 high), the fifth
    bit of weight j bit j of the little-endian uint32 qh -> y = q - 16 for q = 0..31 reversed."""
    q = np.arange(32)[::-1]
    qh = np.uint32(sum(int(v >> 4) << j for j, v in enumerate(q))).reshape(1).view(np.uint8)
    nibbles = ((q[:16] & 15) | ((q[16:] & 15) << 4)).astype(np.uint8)
    block = np.concatenate([np.float16(1).reshape(1).view(np.uint8), qh, nibbles])
    ours = gguf_blocks.dequantize(torch.from_numpy(block).view(1, 22), 6, 32)
    assert ours.tolist() == [[float(v - 16) for v in q]]


@pytest.mark.skipif(not RUNS_TRITON, reason="needs Triton on a GPU (or TRITON_INTERPRET=1 with Triton installed)")
@pytest.mark.parametrize("qtype", sorted(gguf_blocks.BLOCK_TYPES))
def test_gguf_triton_dequant_equals_reference(qtype):
    """As the NF4 kernel's test: fp32 bit for bit, half types bit for bit on a GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, cols = 5, 768
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, qtype + 100)).to(device)
    assert torch.equal(gguf_blocks.dequantize_triton(raw, qtype, cols, torch.float32),
                       gguf_blocks.dequantize_reference(raw, qtype, cols))
    for dtype in (torch.bfloat16, torch.float16):
        fast, ref = gguf_blocks.dequantize(raw, qtype, cols, dtype), gguf_blocks.dequantize_reference(raw, qtype, cols, dtype)
        if device == "cuda":
            assert torch.equal(fast, ref)
        else:
            step = torch.finfo(dtype).eps * ref.float().abs()
            assert ((fast.float() - ref.float()).abs() <= step).all()


# ------------------------------------------------------------------ K-quant blocks from data

def k_quant_inputs() -> np.ndarray:
    """Rows of several kinds: normal weights, an offset row (all positive), a wide-range row,
    a constant row and a zero row."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((8, 1024)) * 0.02).astype(np.float32)
    w[1] = np.abs(w[1]) + 0.01
    w[2] *= 50
    w[3] = 0.25
    w[4] = 0
    w[5, ::97] = 0.3  # outliers
    return w


@pytest.mark.parametrize("qtype", [12, 14])
def test_k_quantizer_blocks_dequantize_within_the_step(qtype):
    """gguf_quantize's Q4_K / Q6_K blocks: gguf.quants.dequantize of them equals ops.gguf_blocks'
    bit for bit and lies within the format's step of the input, sub-block by sub-block. Q4_K (32
    weights, 4 bits over [min(x, 0), max]): half a step plus the 6-bit rounding of scale and min
    (half a d times 15 levels, half a dmin); Q6_K (16 weights, 6 bits over +-absmax): a step plus
    the int8 scale's rounding (half a d times 32 levels)."""
    import gguf
    from gguf.quants import dequantize

    from hivetune.ops import gguf_quantize

    w = k_quant_inputs()
    raw = gguf_quantize.quantize(w, qtype)
    assert raw.shape == (8, gguf_blocks.row_bytes(qtype, 1024)) and raw.dtype == np.uint8
    back = dequantize(raw, gguf.GGMLQuantizationType(qtype))
    ours = gguf_blocks.dequantize(torch.from_numpy(raw), qtype, 1024)
    assert np.array_equal(ours.numpy().view(np.uint32), back.view(np.uint32))
    blocks = raw.reshape(-1, gguf_blocks.BLOCK_TYPES[qtype][2])
    if qtype == 12:
        d, dmin = (blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32) for at in (0, 2))
        x = w.reshape(-1, 8, 32)
        lo = np.minimum(x.min(axis=2), 0)
        step = (x.max(axis=2) - lo) / 15
        bound = 0.5 * step + 7.5 * d + 0.5 * dmin
    else:
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        x = w.reshape(-1, 16, 16)
        step = np.abs(x).max(axis=2) / 32
        bound = step + 16 * np.abs(d)  # d is negative when the largest scale is (ggml's sign choice)
    err = np.abs(back.reshape(x.shape) - x).max(axis=2)
    assert (err <= bound * (1 + 1e-3) + 1e-7).all()
    assert np.array_equal(back[3:5], w[3:5]) if qtype == 14 else np.abs(back[3:5] - w[3:5]).max() < 1e-3
    # rounding to the nearest level: a mean error near a quarter step (uniform rounding error)
    normal = np.r_[0, 5:8]
    mean_err = np.abs(back - w)[normal].mean()
    assert mean_err < 0.3 * step.reshape(8, -1)[normal].mean()


def test_k_quantizer_needs_whole_superblocks():
    from hivetune.ops import gguf_quantize

    with pytest.raises(ValueError, match="cols a multiple of 256"):
        gguf_quantize.quantize_q4_k(np.zeros((2, 896), dtype=np.float32))
