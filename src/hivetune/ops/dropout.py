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
    """The Triton kernels (ops.kernels.dropout): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, _keep_eighths, _dropout_piece, _seeded_dropout, _mix32, _hashed_keep, _hashed_dropout
    global _masked_add
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.dropout import (_keep_eighths, _dropout_piece, _seeded_dropout, _mix32, _hashed_keep, _hashed_dropout, _masked_add)


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
