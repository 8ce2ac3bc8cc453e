"""Attention over a packed row of preference pairs [p_0, c_0, r_0, p_1, c_1, r_1, ...], each
prompt run once for both of its answers.

Query i may see key j iff both are of the same pair, j <= i, and j is a prompt token or of i's
own answer (ops.preference.shared_prompt_mask). Two paths:

- the reference (``Masked``, every device): that mask, dense [T, T], through SDPA. Its work is
  (sum of the pair lengths)^2 per head and layer, not the sum of their squares.
- flash (CUDA, aten's flash kernels): one varlen call whose query and key segments differ. Per
  pair, segment A is the prompt and the chosen answer, causal over themselves; segment B is the
  rejected answer's queries over the prompt's keys and its own, causal aligned bottom-right
  (flash's alignment where a segment has more keys than queries): rejected token i sees the p
  prompt keys and rejected keys 0..i. Queries stay in the row's order; K and V are gathered to
  [T + sum p] rows, the prompt's keys twice. The gather's backward adds each token's at most two
  gradient rows in a fixed order (deterministic; index_select's scatter-add is not).

A probe checks the flash path against the reference once per device and dtype; where it fails
(or HIVETUNE_REFERENCE=pairs) the reference path runs, with one line.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hivetune.core.fallbacks import FORCE_ENV, forced, isolated, note_fallback
from hivetune.ops.attention import FlashVarlen, Masked, has_flash_ops, probe_error, probe_verdict, varlen_supported
from hivetune.ops.preference import shared_prompt_mask

_PAIRS_OK: dict[tuple[str, torch.dtype], str] = {}  # (device, dtype) -> "" when the flash path works, else why not


@dataclass
class PairSegments:
    """The flash path's index tensors of one row of pairs.

    cu_q / cu_k [2P + 1] int32: query / key segment bounds (A_0, B_0, A_1, B_1, ...);
    key_index [T + sum p]: the row token behind each gathered key; first / second [T]: where each
    token's key lands in the gathered rows (second: its prompt copy in segment B, or one past the
    end for tokens gathered once).
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    key_index: torch.Tensor
    first: torch.Tensor
    second: torch.Tensor
    max_q: int
    max_k: int

    def to(self, device) -> "PairSegments":
        moved = (t.to(device, non_blocking=True) for t in (self.cu_q, self.cu_k, self.key_index, self.first, self.second))
        return PairSegments(*moved, self.max_q, self.max_k)


def pair_segments(lengths: list[tuple[int, int, int]]) -> PairSegments:
    """The segments of a row holding pairs of (prompt, chosen, rejected) lengths back to back."""
    cu_q, cu_k, key_index, first, second = [0], [0], [], [], []
    total_keys = sum(2 * p + c + r for p, c, r in lengths)
    start = 0
    for p, c, r in lengths:
        k0 = len(key_index)
        key_index += list(range(start, start + p + c)) + list(range(start, start + p)) + \
            list(range(start + p + c, start + p + c + r))
        first += list(range(k0, k0 + p + c)) + list(range(k0 + p + c + p, k0 + p + c + p + r))
        second += list(range(k0 + p + c, k0 + p + c + p)) + [total_keys] * (c + r)
        cu_q += [cu_q[-1] + p + c, cu_q[-1] + p + c + r]
        cu_k += [cu_k[-1] + p + c, cu_k[-1] + p + c + p + r]
        start += p + c + r
    max_q = max((max(p + c, r) for p, c, r in lengths), default=0)
    max_k = max((p + max(c, r) for p, c, r in lengths), default=0)
    i32 = torch.int32
    return PairSegments(torch.tensor(cu_q, dtype=i32), torch.tensor(cu_k, dtype=i32), torch.tensor(key_index),
                        torch.tensor(first), torch.tensor(second), max_q, max_k)


@dataclass
class SharedPrompt(Masked):
    """``Masked`` with the dense shared-prompt mask (the reference), plus the flash path's segments."""

    segments: PairSegments | None = None

    def fast_attention(self, q, k, v) -> torch.Tensor | None:
        """ops.attention.causal_attention's first try: the flash path's output, or None where it
        does not run (no segments, not CUDA, no flash kernels, the probe failed)."""
        if (self.segments is None or not has_flash_ops() or not varlen_supported(q)
                or not pairs_usable(q.device, q.dtype)):
            return None
        return flash_pair_attention(q, k, v, self.segments)


class KeyGather(torch.autograd.Function):
    """x [T, h, D] -> x[key_index]; backward: grad[first] + grad[second] (a zero row past the end)."""

    @staticmethod
    def forward(ctx, x, key_index, first, second):
        ctx.save_for_backward(first, second)
        return x.index_select(0, key_index)

    @staticmethod
    def backward(ctx, grad):
        first, second = ctx.saved_tensors
        grad = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
        return grad.index_select(0, first) + grad.index_select(0, second), None, None, None


def flash_pair_attention(q, k, v, segments: PairSegments) -> torch.Tensor:
    """q [1, T, H, D], k / v [1, T, KVH, D] -> [1, T, H, D] on aten's flash varlen kernels."""
    s = segments
    q0 = q.squeeze(0)
    k0 = KeyGather.apply(k.squeeze(0), s.key_index, s.first, s.second)
    v0 = KeyGather.apply(v.squeeze(0), s.key_index, s.first, s.second)
    return FlashVarlen.apply(q0, k0, v0, s.cu_q, s.cu_k, s.max_q, s.max_k)[None]


def pairs_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """The flash pair path, tried once per device and dtype against the dense-mask reference."""
    if forced("pairs"):
        note_fallback("pairs", "flash attention of preference rows", f"{FORCE_ENV} asks for the reference",
                      "SDPA with the shared-prompt mask")
        return False
    key = (str(device), dtype)
    if key not in _PAIRS_OK:
        _PAIRS_OK[key] = isolated(probe_pairs, device, dtype)
    why = _PAIRS_OK[key]
    if why:
        note_fallback("pairs", "flash attention of preference rows", why, "SDPA with the shared-prompt mask")
    return not why


def probe_pairs(device: torch.device, dtype: torch.dtype) -> str:
    """'' when the flash pair path runs here and agrees with the reference; else why not."""
    lengths = [(3, 4, 2), (5, 1, 6)]
    gen = torch.Generator().manual_seed(0)
    t = sum(map(sum, lengths))
    q, k, v = (torch.randn(1, t, h, 64, generator=gen) for h in (4, 2, 2))
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qd, kd, vd = (x.to(device, dtype).requires_grad_() for x in (q, k, v))
            out = flash_pair_attention(qd, kd, vd, pair_segments(lengths).to(device))
            out.float().square().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as e:  # no kernel for this GPU / dtype / build
        return probe_error(e)
    return probe_verdict(out, reference_pair_attention(q, k, v, lengths), (qd, kd, vd))


def row_parts(lengths: list[tuple[int, int, int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair [T], part [T]) of a row of pairs: each token's pair and 0 prompt / 1 chosen / 2 rejected."""
    pair, part = [], []
    for j, (p, c, r) in enumerate(lengths):
        pair += [j] * (p + c + r)
        part += [0] * p + [1] * c + [2] * r
    return torch.tensor(pair, device=device), torch.tensor(part, device=device)


def reference_pair_attention(q, k, v, lengths: list[tuple[int, int, int]]) -> torch.Tensor:
    """Attention of a row of pairs with the dense shared-prompt mask, in float32 at least: [1, T, H, D]."""
    groups = q.shape[2] // k.shape[2]
    qs, ks, vs = (x.to(torch.promote_types(x.dtype, torch.float32)).transpose(1, 2) for x in (q, k, v))
    ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
    mask = shared_prompt_mask(*row_parts(lengths, q.device))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(1, 2)
