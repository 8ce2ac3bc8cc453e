"""GGUF K-quant blocks from float weights in numpy: Q4_K and Q6_K, which the `gguf` package only
dequantizes (it quantizes Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0). For tests and benchmarks that need
real K-quant blocks of a weight (a llama.cpp-like Q4_K_M base built in memory).

The layouts are ggml's (ggml-common.h, as ops.gguf_blocks reads them); the scales are plain
min / max ones, not llama.cpp's searched scales (make_qkx2_quants, make_qx_quants), so the
error is a little larger than llama-quantize's but within the format's step:

    Q4_K  per sub-block of 32: lo = min(x, 0), scale = (max(x) - lo) / 15; d = max scale / 63,
          dmin = max(-lo) / 63 (as f16), 6-bit sc = round(scale / d), m = round(-lo / dmin); then
          q = round((x + dmin m) / (d sc)) in 0..15 under the stored (rounded) scales
    Q6_K  per sub-block of 16: scale = x[argmax |x|] / -32 (ggml's sign choice); d = the
          scale of largest magnitude / -128 (as f16), int8 sc = round(scale / d); then
          q = round(x / (d sc)) + 32 in 0..63
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _nearest(x: np.ndarray) -> np.ndarray:
    """Round half away from zero, as ggml's nearest_int (llama.cpp's quantizers)."""
    return np.trunc(x + np.copysign(np.float32(0.5), x)).astype(np.int32)


def _superblocks(w: np.ndarray) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"K-quants need [rows, cols] with cols a multiple of {QK_K}; got {w.shape}")
    return w.reshape(-1, QK_K)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the f16 bytes [n, 2], their value as fp32 [n, 1])."""
    h = x.astype(np.float16).reshape(-1, 1)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _safe_inverse(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(x == 0, np.float32(0), np.float32(1) / np.where(x == 0, 1, x)).astype(np.float32)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 144] uint8 Q4_K blocks."""
    rows = w.shape[0]
    x = _superblocks(w).reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0)  # [n, 8]: ggml's mins are never above zero
    scale = (x.max(axis=2) - lo) / np.float32(15)
    max_scale, max_min = scale.max(axis=1, keepdims=True), (-lo).max(axis=1, keepdims=True)
    d_bytes, d = _f16(max_scale / 63)
    dmin_bytes, dmin = _f16(max_min / 63)
    sc = np.clip(_nearest(scale * _safe_inverse(d)), 0, 63)  # against the stored (f16) d and dmin
    mn = np.clip(_nearest(-lo * _safe_inverse(dmin)), 0, 63)
    step = (d * sc.astype(np.float32))[..., None]  # the stored scales, as the dequantizer computes them
    offset = (dmin * mn.astype(np.float32))[..., None]
    q = np.clip(_nearest((x + offset) * _safe_inverse(step)), 0, 15).astype(np.uint8)
    q = np.where(step == 0, 0, q).reshape(-1, 4, 2, 32)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # each 32 B: one sub-block low, the next high
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate([
        (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    return np.concatenate([d_bytes, dmin_bytes, scales, nibbles], axis=1).reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 210] uint8 Q6_K blocks."""
    rows = w.shape[0]
    x = _superblocks(w).reshape(-1, 16, 16)
    at = np.abs(x).argmax(axis=2)[..., None]
    scale = np.take_along_axis(x, at, axis=2)[..., 0] / np.float32(-32)  # [n, 16]
    largest = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)
    d_bytes, d = _f16(largest / -128)
    sc = np.clip(_nearest(scale * _safe_inverse(d)), -128, 127)  # against the stored (f16) d
    step = (d * sc.astype(np.float32))[..., None]
    q = np.clip(_nearest(x * _safe_inverse(step)) + 32, 0, 63).astype(np.uint8)
    q = np.where(step == 0, 32, q).reshape(-1, 2, 4, 32)  # two halves of 128, each 4 quarters of 32
    low, high = q & 15, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           d_bytes], axis=1).reshape(rows, -1)


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """[rows, cols] float -> [rows, row bytes] uint8 blocks of ggml type `qtype`: Q4_K (12) and
    Q6_K (14) here, the rest by the gguf package's quantizer."""
    if qtype == 12:
        return quantize_q4_k(w)
    if qtype == 14:
        return quantize_q6_k(w)
    import gguf  # optional dependency (the gguf extra), imported where used
    from gguf.quants import quantize as gguf_quantize

    return gguf_quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType(qtype))
