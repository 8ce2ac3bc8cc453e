"""LoRA dropout with its mask drawn from a seed inside Triton kernels, never stored: the seeded
dropout (Philox, 16 random bits an element: _keep_eighths, which the norm and in-matmul kernels
share), the hashed dropout of swiglu_dropped (a hash of seed and flat index: _hashed_keep) and
the masked add of a stored mask. The masks are redrawn in backward from the same seed.
"""

from __future__ import annotations

import torch

from hivetune.ops.triton_util import elementwise_grid, fused_ok, kernels, triton


@kernels
def _define_kernels():
    """The Triton kernels: defined at the first fused call, not at import (triton_util.kernels)."""
    global triton, tl, _keep_eighths, _dropout_piece, _seeded_dropout, _mix32, _hashed_keep, _hashed_dropout
    global _masked_add
    import triton
    import triton.language as tl

    @triton.jit
    def _keep_eighths(SEED, groups, thr):
        """The dropout's keep masks of 128-element groups, as 8 pieces of 16: element
        e = 128 g + 16 q + j (j < 16) is kept when the 16-bit half q % 2 of
        randint4x(seed, 16 g + j)[q // 2] is >= thr (= round(p 65536): see keep_threshold).
        One Philox draw covers 8 elements: the mask's random bits are most of these kernels' work
        (W2's down_proj ran ~3x its memory time drawing 32 bits per element), and each piece
        comes out in the layout of a [.., 16] tile, so a kernel loads x by 16 columns and never
        reshuffles the mask. groups: [N] group indices."""
        offsets = groups[:, None] * 16 + tl.arange(0, 16)[None, :]
        u0, u1, u2, u3 = tl.randint4x(tl.load(SEED), offsets)
        return (((u0 & 0xFFFF).to(tl.int32) >= thr), ((u0 >> 16).to(tl.int32) >= thr),
                ((u1 & 0xFFFF).to(tl.int32) >= thr), ((u1 >> 16).to(tl.int32) >= thr),
                ((u2 & 0xFFFF).to(tl.int32) >= thr), ((u2 >> 16).to(tl.int32) >= thr),
                ((u3 & 0xFFFF).to(tl.int32) >= thr), ((u3 >> 16).to(tl.int32) >= thr))

    @triton.jit
    def _dropout_piece(OUT, X, e, n, keep, scale, ADD: tl.constexpr):
        m = e < n
        y = tl.where(keep, tl.load(X + e, mask=m, other=0.0).to(tl.float32) * scale, 0.0)
        if ADD:
            y += tl.load(OUT + e, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + e, y.to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _seeded_dropout(OUT, X, SEED, n, thr, scale, ADD: tl.constexpr, NG: tl.constexpr):
        """OUT = X * keep * scale, or with ADD, OUT += X * keep * scale (the dropout's backward,
        which draws the mask again: it is never stored). NG groups of 128 a program."""
        groups = tl.program_id(0) * NG + tl.arange(0, NG)
        k0, k1, k2, k3, k4, k5, k6, k7 = _keep_eighths(SEED, groups, thr)
        e = groups[:, None].to(tl.int64) * 128 + tl.arange(0, 16)[None, :]
        _dropout_piece(OUT, X, e, n, k0, scale, ADD)
        _dropout_piece(OUT, X, e + 16, n, k1, scale, ADD)
        _dropout_piece(OUT, X, e + 32, n, k2, scale, ADD)
        _dropout_piece(OUT, X, e + 48, n, k3, scale, ADD)
        _dropout_piece(OUT, X, e + 64, n, k4, scale, ADD)
        _dropout_piece(OUT, X, e + 80, n, k5, scale, ADD)
        _dropout_piece(OUT, X, e + 96, n, k6, scale, ADD)
        _dropout_piece(OUT, X, e + 112, n, k7, scale, ADD)

    # The hashed mask (swiglu_dropped): a hash of (seed, flat element index) lets a kernel read
    # and write contiguous blocks; _keep_eighths' Philox pieces tie it to [.., 16] tiles 128
    # elements apart, 1.7x the plain SwiGLU kernel's time at W1's width (docs/log.md).

    @triton.jit
    def _mix32(x):
        """lowbias32 (C. Wellons' 32-bit integer hash: two multiplies, three xor-shifts)."""
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return x

    @triton.jit
    def _hashed_keep(SEED, i, thr):
        """Keep element i (flat, < 2^31) where the high 16 bits of hash(i + hash(seed)) >= thr."""
        x = _mix32(i.to(tl.uint32) + _mix32(tl.load(SEED).to(tl.uint32)))
        return (x >> 16).to(tl.int32) >= thr

    @triton.jit
    def _hashed_dropout(X, OUT, SEED, n, thr, scale, BLOCK: tl.constexpr):
        """OUT = X * keep * scale with _hashed_keep's mask (dropout_hashed: the tests' oracle)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + i, tl.where(_hashed_keep(SEED, i, thr), x * scale, 0.0).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _masked_add(OUT, T, M, n, keep, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        o = tl.load(OUT + i, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(T + i, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(M + i, mask=mask, other=0).to(tl.float32)
        tl.store(OUT + i, (o + t * m * keep).to(OUT.dtype.element_ty), mask=mask)


def seeded_dropout_ok(x: torch.Tensor) -> bool:
    """Whether dropout can draw its mask from a seed in the Triton kernels (contiguous, fewer
    than 2^31 elements: the Philox offsets are int32)."""
    return fused_ok(x) and x.is_contiguous() and x.numel() < 2**31


def new_dropout_seed(device, n: int = 1) -> torch.Tensor:
    """A seed for _seeded_dropout (n of them), drawn from torch's CUDA generator (so
    torch.manual_seed and the checkpointed RNG state decide it, and CUDA graphs draw a new one at
    each replay)."""
    return torch.randint(0, 2**31 - 1, (n,), device=device, dtype=torch.int64)


SEEDED_GROUPS = 16  # 128-element groups a program of _seeded_dropout: 2,048 elements


def keep_threshold(p: float) -> tuple[int, float]:
    """(thr, scale) of the seeded dropout: an element is dropped when its 16 random bits are
    below thr = round(p 65536), so the dropout probability is thr / 65536 (p to within 2^-17:
    0.05 -> 0.0500031), and kept elements are scaled by 1 / (1 - thr / 65536)."""
    thr = min(65535, max(0, round(p * 65536)))
    return thr, 65536.0 / (65536 - thr)


def _seeded_launch(out: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, p: float, add: bool) -> None:
    n = out.numel()
    thr, scale = keep_threshold(p)
    _seeded_dropout[elementwise_grid(n, 128 * SEEDED_GROUPS)](out, x, seed, n, thr, scale, ADD=add,
                                                               NG=SEEDED_GROUPS)


def dropout_seeded(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p) with the mask of `seed` (contiguous x; seeded_dropout_ok; p as keep_threshold
    rounds it)."""
    y = torch.empty_like(x)
    _seeded_launch(y, x, seed, p, add=False)
    return y


def seeded_masked_add_(out: torch.Tensor, t: torch.Tensor, seed: torch.Tensor, p: float) -> None:
    """out += t * keep / (1 - p) with dropout_seeded's mask for `seed` (contiguous, one shape)."""
    _seeded_launch(out, t, seed, p, add=True)


def dropout_hashed(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """x * keep / (1 - p) with swiglu_dropped's mask (a hash of seed and flat index; contiguous x,
    fewer than 2^31 elements): the oracle of that mask in tests."""
    out = torch.empty_like(x)
    n = x.numel()
    thr, scale = keep_threshold(p)
    _hashed_dropout[elementwise_grid(n, 1024)](x, out, seed, n, thr, scale, BLOCK=1024)
    return out


def masked_add_(out: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, keep: float) -> None:
    """out += t * mask * keep in one kernel (contiguous tensors of one shape; mask bool)."""
    n = out.numel()
    _masked_add[elementwise_grid(n, 1024)](out, t, mask.view(torch.uint8), n, keep, BLOCK=1024)
