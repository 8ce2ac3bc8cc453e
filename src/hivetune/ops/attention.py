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
        mask = layout.block_causal_mask(q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if isinstance(layout, Masked):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask)
    raise TypeError(f"unknown attention layout {type(layout).__name__}")
