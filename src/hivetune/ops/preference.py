"""Preference losses (DPO with its sigmoid / IPO / label-smoothed forms, ORPO) over sequence
log-probs, the sequence log-probs from the fused LM head, and the attention mask of a row that
holds [prompt, chosen, rejected].

Sequence log-probs without the [N, V] logits: the LM head is frozen, so for each target row
(hidden h, target t) with logp = -CE(h W^T, t) the only gradient needed is

    d logp / d h = (onehot(t) - softmax(h W^T)) W                         [H]

computed chunk by chunk in forward, as ops.fused_ce does for the summed loss; backward scales
each saved row by the upstream gradient of its logp (the loss is a function of per-sequence sums,
so rows of one sequence share that gradient). Memory: one chunk of logits plus an [N, H] gradient.
The plain reference is ``target_logprobs``: the full logits and log_softmax. With `softcap`
(Gemma 2) the log-probs are of the capped logits cap * tanh(logits / cap), as ops.fused_ce.

Losses, per pair (pi: the policy's summed log-probs, ref: the reference model's; beta; eps):

    z = beta * ((pi_c - pi_r) - (ref_c - ref_r))
    sigmoid:  -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)              (DPO; cDPO for eps > 0)
    ipo:      (z / beta - 1 / (2 beta))^2                                  (IPO)
    rewards:  beta (pi_c - ref_c), beta (pi_r - ref_r)

    ORPO, with mean token log-probs l_c, l_r and odds(l) = l - log(1 - exp(l)):
    -l_c - lambda * log sigmoid(odds(l_c) - odds(l_r)); rewards lambda l_c, lambda l_r
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hivetune.ops import blas
from hivetune.ops.fused_ce import CHUNK_BYTES, ce_rows, chunk_ce, chunk_rows_for, triton_ce_ok
from hivetune.ops.loss import cap_logits


class FusedTargetLogprobs(torch.autograd.Function):
    """rows [N, H], frozen head [V, H], targets [N] -> log p(target) per row [N] (fp32)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
                softcap: float | None = None):
        dtype = weight.dtype
        need_grad = ctx.needs_input_grad[0]
        grad_rows = torch.empty(rows.shape, dtype=dtype, device=rows.device) if need_grad else None
        row_loss = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        ctx.rows_dtype = rows.dtype
        with torch.autocast(rows.device.type, enabled=False):
            h_all = rows.to(dtype)
            if triton_ce_ok(rows, weight):
                _triton_rows(h_all, weight, targets, chunk_rows, row_loss, grad_rows, softcap)
            else:
                for start in range(0, rows.shape[0], chunk_rows):
                    h, t = h_all[start:start + chunk_rows], targets[start:start + chunk_rows]
                    loss, dlogits = chunk_ce((h @ weight.t()).float(), t, softcap, grad_rows is not None)
                    row_loss[start:start + chunk_rows] = loss
                    if grad_rows is not None:  # d CE / d logits = softmax - onehot (times the cap's factor)
                        grad_rows[start:start + chunk_rows] = dlogits.to(dtype) @ weight
                    del dlogits  # freed before the next chunk's logits
        ctx.save_for_backward(grad_rows)
        return -row_loss

    @staticmethod
    def backward(ctx, grad_logp):
        (grad_rows,) = ctx.saved_tensors
        if grad_rows is None:
            return None, None, None, None, None
        # d logp / d h = -(d CE / d h); each row scaled by its own upstream gradient
        return (grad_rows * (-grad_logp)[:, None].to(grad_rows.dtype)).to(ctx.rows_dtype), None, None, None, None


def _triton_rows(h_all, weight, targets, chunk_rows, row_loss, grad_rows, softcap) -> None:
    """The fused CE's Triton chunk loop, keeping each row's loss (ops.fused_ce._ce_rows)."""
    vocab = weight.shape[0]
    buf = h_all.new_empty((min(chunk_rows, h_all.shape[0]), vocab))
    for start in range(0, h_all.shape[0], chunk_rows):
        h = h_all[start:start + chunk_rows]
        logits = buf[:h.shape[0]]
        blas.gemm(h, weight.t(), logits)
        ce_rows(logits, targets[start:start + chunk_rows], row_loss[start:], -1, softcap)
        if grad_rows is not None:
            blas.gemm(logits, weight, grad_rows[start:start + chunk_rows])


def fused_target_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_index: torch.Tensor,
                          target_ids: torch.Tensor, chunk_bytes: int = CHUNK_BYTES,
                          softcap: float | None = None) -> torch.Tensor:
    """log p(target) [N] at the flat target positions of hidden [B, T, H], one chunk of logits alive
    (of softcap * tanh(logits / softcap) with softcap)."""
    if lm_head_weight.requires_grad:
        raise ValueError("fused_target_logprobs needs a frozen LM head; use target_logprobs")
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
    per = lm_head_weight.element_size() if triton_ce_ok(rows, lm_head_weight) else 4
    return FusedTargetLogprobs.apply(rows, lm_head_weight, target_ids,
                                     chunk_rows_for(lm_head_weight.shape[0], chunk_bytes, per), softcap)


def target_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_index: torch.Tensor,
                    target_ids: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """The reference: full logits of the target rows (capped with softcap), log_softmax, gather (fp32)."""
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index)
    logp = F.log_softmax(cap_logits(F.linear(rows, lm_head_weight).float(), softcap), dim=-1)
    return logp.gather(1, target_ids[:, None]).squeeze(1)


def sequence_sums(token_values: torch.Tensor, target_seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """Per-sequence sums [n_seqs] of per-target values [N] (target_seq: each target's sequence)."""
    return token_values.new_zeros(n_seqs).index_add(0, target_seq, token_values)


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta: float, loss: str = "sigmoid",
             label_smoothing: float = 0.0):
    """(per-pair losses [P], chosen rewards [P], rejected rewards [P]) from summed log-probs."""
    z = beta * ((pi_chosen - pi_rejected) - (ref_chosen - ref_rejected))
    if loss == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    elif loss == "ipo":
        losses = (z / beta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss!r}")
    return losses, beta * (pi_chosen - ref_chosen).detach(), beta * (pi_rejected - ref_rejected).detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler's split at -ln 2)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(mean_chosen, mean_rejected, orpo_lambda: float):
    """(per-pair losses [P], chosen rewards, rejected rewards) from mean token log-probs."""
    log_odds = (mean_chosen - log1mexp(mean_chosen)) - (mean_rejected - log1mexp(mean_rejected))
    losses = -mean_chosen - orpo_lambda * F.logsigmoid(log_odds)
    return losses, orpo_lambda * mean_chosen.detach(), orpo_lambda * mean_rejected.detach()


def shared_prompt_mask(pair: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] bool attention mask of a packed row of pairs: `pair` [T] each token's pair (-1 for
    padding), `part` [T] 0 prompt / 1 chosen / 2 rejected. Query i sees key j iff j <= i, same pair,
    and j is a prompt token or of i's own answer; a padding token sees itself only."""
    t = pair.shape[0]
    pos = torch.arange(t, device=pair.device)
    same = (pair[:, None] == pair[None, :]) & (pair[:, None] >= 0)
    visible = same & (pos[None, :] <= pos[:, None]) & ((part[None, :] == 0) | (part[None, :] == part[:, None]))
    return (visible | torch.eye(t, dtype=torch.bool, device=pair.device))[None, None]
