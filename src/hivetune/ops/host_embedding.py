"""The frozen input embedding kept in pinned host memory (train's host_embeddings).

Why: LoRA never trains the input embedding, and a forward reads only the rows of its tokens.
W2 (Qwen2.5-7B, untied: 152,064 x 3,584 bf16) holds 1.02 GiB of GPU memory for a table of which
a micro-batch reads ~3,000 rows (~21 MB). Pinned host memory is mapped into the GPU's address
space (UVA), so a Triton kernel gathers those rows straight over PCIe: 0.44 ms for 3,000 rows
on an H200 (49 GB/s, docs/log.md), under 0.3% of a W2 step; no host thread, no copy
stream, and it runs inside CUDA graphs like any other kernel.

A twin of the model (train.twin) keeps its table on the GPU (``pinned=False``): the kernel and
its specialisation are the same, and pinning W2's table takes ~1.4 s of a fresh process that the
twin would spend before its kernels go to the compile workers.

Not for tied embeddings (the LM head reads the whole table every step) nor without Triton;
`move_embeddings` then leaves the table where it is and says why, once.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hivetune.core.fallbacks import note_fallback
from hivetune.ops.triton_util import kernels, load_kernels, triton


@kernels
def _define_kernels():
    """The Triton kernels (ops.kernels.host_embedding): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, _gather_rows
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.host_embedding import _gather_rows


class HostEmbedding(nn.Module):
    """nn.Embedding's forward over a frozen table in pinned host memory, for ids on a GPU
    (`pinned` False: the table stays where it is, read by the same kernel)."""

    def __init__(self, weight: torch.Tensor, pinned: bool = True):
        super().__init__()
        table = weight.detach()
        if pinned:
            table = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
            table.copy_(weight.detach())  # one copy straight into pinned memory (no pageable staging)
        self.weight = nn.Parameter(table, requires_grad=False)
        self.num_embeddings, self.embedding_dim = self.weight.shape
        load_kernels()  # its forward launches _gather_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if not ids.is_cuda:
            return nn.functional.embedding(input_ids, self.weight)
        out = torch.empty((ids.numel(), self.embedding_dim), dtype=self.weight.dtype, device=ids.device)
        if ids.numel():
            _gather_rows[(ids.numel(),)](self.weight, ids.contiguous(), out, self.embedding_dim, BLOCK=1024)
        return out.view(*input_ids.shape, self.embedding_dim)


def move_embeddings(model: nn.Module, pinned: bool = True) -> str | None:
    """Put the model's input embedding in pinned host memory (HostEmbedding); returns why not, or
    None when it moved. The table's GPU memory is freed (the caller's empty_cache returns it).
    `pinned` False: a HostEmbedding over the table where it is (a twin's: the module's doc)."""
    body = model.model
    embed = body.embed_tokens
    if isinstance(embed, HostEmbedding):
        return None
    weight = embed.weight
    reason = None
    if not weight.is_cuda:
        reason = "the model is not on a GPU"
    elif triton is None:
        reason = "Triton is not installed"
    elif model.lm_head.weight is weight:
        reason = "the embedding is tied to the LM head, which reads the whole table"
    elif weight.requires_grad:
        reason = "the embedding is trained"
    if reason:
        note_fallback("host_embeddings", "input embedding in host memory", reason, "the table on the GPU")
        return reason
    body.embed_tokens = HostEmbedding(weight, pinned)
    return None
