"""Causal self-attention for three batch layouts, each on plain SDPA (the reference path).

Layouts:
- ``None``: every row is one sequence (right padding is harmless: a padded key sits after
  every real query, so the causal mask already hides it).
- ``Packed(cu_seqlens)``: one row holds several examples back to back; attention must not
  cross an example boundary. Reference: a block-diagonal causal mask for SDPA.
- ``Masked(mask)``: an explicit boolean mask [B, 1, Q, K] (True = attend), used by batched
  generation with left padding and a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Packed:
    """Examples packed along the sequence axis of a batch of one row.

    ``cu_seqlens`` holds the cumulative example lengths [0, l0, l0+l1, ..., T] (int32),
    ``max_seqlen`` the longest example (a Python int, so no host sync is needed).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    lengths: tuple[int, ...] = ()  # segment lengths on the host (incl. a trailing pad segment)

    def block_causal_mask(self, total: int) -> torch.Tensor:
        """[1, 1, T, T] bool: query i sees key j iff same example and j <= i."""
        device = self.cu_seqlens.device
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        example = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        if example.numel() < total:  # trailing pad tokens get their own segment
            example = torch.cat([example, example.new_full((total - example.numel(),), -1)])
        pos = torch.arange(total, device=device)
        same = example[:, None] == example[None, :]
        return (same & (pos[None, :] <= pos[:, None]))[None, None]


@dataclass
class Masked:
    mask: torch.Tensor  # [B, 1, Q, K] bool, True where the query may attend to the key


def padded_view_attention(q, k, v, lengths: tuple[int, ...]) -> torch.Tensor:
    """Packed [1, H, T, D] -> [E, H, Lmax, D] padded view -> causal SDPA -> back to packed.

    The linear layers keep the packed row (no pad tokens through the matmuls); attention runs
    as one batched causal call, which on the CPU beats both a block-diagonal mask ((sum L)^2
    work) and one call per example (E small kernels). Pads sit after each example's last
    token, so the causal mask already hides them from every real query.
    """
    gather, scatter = _padded_indices(lengths, q.device)
    e, width = len(lengths), max(lengths)

    def to_padded(x):  # [1, H, T, D] -> [E, H, Lmax, D]
        return x[0].index_select(1, gather).view(x.shape[1], e, width, x.shape[3]).transpose(0, 1)

    dtype = q.dtype
    if q.device.type == "cpu" and dtype != torch.float32:
        # The CPU flash kernel's bf16 backward is ~3x slower than its fp32 one (measured on
        # [8, 9, 100, 64]: 29 ms vs 10 ms a layer); the casts cost far less.
        q, k, v = q.float(), k.float(), v.float()
    with torch.autocast(q.device.type, enabled=False):  # else autocast casts back to bf16
        out = F.scaled_dot_product_attention(to_padded(q), to_padded(k), to_padded(v), is_causal=True).to(dtype)
    out = out.transpose(0, 1).reshape(q.shape[1], e * width, q.shape[3]).index_select(1, scatter)
    return out[None]


_INDEX_CACHE: dict = {}


def _padded_indices(lengths: tuple[int, ...], device):
    """gather[E*Lmax]: packed position for each padded slot (pads repeat the example's first
    token); scatter[T]: padded slot of each packed position. Cached per micro-batch shape: the
    32 layers of one step reuse them."""
    key = (lengths, str(device))
    hit = _INDEX_CACHE.get(key)
    if hit is None:
        width = max(lengths)
        gather, scatter, start = [], [], 0
        for e, n in enumerate(lengths):
            gather += list(range(start, start + n)) + [start] * (width - n)
            scatter += range(e * width, e * width + n)
            start += n
        hit = (torch.tensor(gather, device=device), torch.tensor(scatter, device=device))
        if len(_INDEX_CACHE) > 64:
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = hit
    return hit


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout=None) -> torch.Tensor:
    """q: [B, H, Q, D]; k, v: [B, KVH, K, D] with H a multiple of KVH (GQA). Returns [B, H, Q, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        # enable_gqa avoids materialising repeated K/V on the kernels that support it; the
        # math path on CPU does the same repeat internally, so the result is identical.
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if layout is None:
        q_len, k_len = q.shape[2], k.shape[2]
        if q_len == k_len or q_len == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1)
        # Queries are the last q_len positions of k_len (a chunk on top of a KV cache): SDPA's
        # is_causal aligns the mask top-left, so build the bottom-right aligned one here.
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if isinstance(layout, Packed):
        if layout.lengths and sum(layout.lengths) == q.shape[2]:
            return padded_view_attention(q, k, v, layout.lengths)
        mask = layout.block_causal_mask(q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if isinstance(layout, Masked):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask)
    raise TypeError(f"unknown attention layout {type(layout).__name__}")
