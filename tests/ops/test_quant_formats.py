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

F16_FIELDS = {2: [0], 3: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}


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


@pytest.mark.parametrize("qtype", sorted(gguf_blocks.BLOCK_TYPES))
def test_gguf_blocks_equal_gguf_package(qtype):
    import gguf
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType(qtype)
    rows, cols = 6, 512
    if qtype in (2, 3, 8):  # gguf quantizes these: real blocks from data
        data = np.random.default_rng(qtype).standard_normal((rows, cols)).astype(np.float32)
        raw = quantize(data, kind)
    else:  # K-quants: built by hand
        raw = random_blocks(qtype, rows, cols, qtype)
    expected = dequantize(raw, kind)
    ours = gguf_blocks.dequantize(torch.from_numpy(np.ascontiguousarray(raw)), qtype, cols)
    assert ours.shape == (rows, cols)
    assert np.array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32))
    assert gguf_blocks.row_bytes(qtype, cols) == raw.shape[1]


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
