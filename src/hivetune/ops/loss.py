"""Cross-entropy on target positions only, in chunks (reference path).

Only the N target rows of the hidden states go through the LM head: logits are [N, V] instead
of [B*T, V] (for a 49k vocab and half the tokens being prompt that halves the head's FLOPs and
memory). Chunking bounds the fp32 logits to chunk_rows * V * 4 bytes at a time in forward.

With `softcap` (Gemma 2's final_logit_softcapping) the CE is taken over cap * tanh(logits / cap),
the logits the model runs with (``CausalLM.logits``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cap_logits(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """logits -> softcap * tanh(logits / softcap); unchanged for None."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def target_loss_sum(hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_index: torch.Tensor,
                    target_ids: torch.Tensor, chunk_rows: int = 4096, softcap: float | None = None) -> torch.Tensor:
    """Sum over targets of -log p(target) (fp32). hidden: [B, T, H]; index into the flat B*T."""
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk_rows):
        logits = cap_logits(F.linear(rows[start:start + chunk_rows], lm_head_weight).float(), softcap)
        total = total + F.cross_entropy(logits, target_ids[start:start + chunk_rows], reduction="sum")
    return total
