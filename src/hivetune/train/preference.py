"""Preference tuning's side of the loop (method dpo / orpo): the micro-batch step beside
train.step.forward_backward, its per-step rewards for metrics.jsonl, its validation loss, and the
reference model.

One micro-batch of P pairs: the reference's summed log-probs under no_grad (DPO only), then the
policy's forward, loss and backward. The loss of a step is the mean over its pairs: each
micro-batch's summed pair losses are divided by the step's pair count (the dataset's n_targets
are 1 a pair), so accumulation gives the gradient of one big batch, as the SFT step does.

The reference model is the policy's base with LoRA switched off (no second copy of the weights):
``reference_policy(run)`` is the context manager under which the model computes it. A run may set
``run.preference_reference`` to another factory ``model -> context manager`` (a reference that is
the adapter the run started from: swap its LoRA weights in on enter and back on exit); it is
entered once a micro-batch, under no_grad.
"""

from __future__ import annotations

import torch

from hivetune.core.embedded import DEFAULT_DATA_DIR
from hivetune.data.pairs import PAIR_FILES, PairBatch, collate_pairs
from hivetune.data.sources import DataSource
from hivetune.model.lora import lora_enabled
from hivetune.ops.compile_ahead import first_pass, trained
from hivetune.ops.lora_aside import join_aside
from hivetune.ops.lora_casts import given_seeds
from hivetune.ops.preference import (dpo_loss, fused_target_logprobs, orpo_loss, sequence_sums,
                                     target_logprobs)
from hivetune.parallel import distributed
from hivetune.train.step import autocast, pass_counters

STAT_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def preference_sources(cfg, data_path, val_path):
    """Train and held-out sources of a preference run: empty data is the shipped pair set."""
    if cfg.data:
        return data_path, val_path
    held_out = val_path if cfg.val_data else DataSource(str(DEFAULT_DATA_DIR / PAIR_FILES[1]))
    return DataSource(str(DEFAULT_DATA_DIR / PAIR_FILES[0])), held_out


def reference_policy(run):
    """The context manager under which run.model computes the reference log-probs."""
    factory = getattr(run, "preference_reference", None)
    return factory(run.model) if factory is not None else lora_enabled(run.model, False)


def collate(run, pairs) -> PairBatch:
    return collate_pairs(pairs, run.pad_id, shared=run.cfg.preference.shared_prompt)


def sequence_logprobs(run, batch: PairBatch, module=None) -> torch.Tensor:
    """Summed log-probs [P, 2] (chosen, rejected) of a micro-batch under the model as it is now:
    the fused per-token path, or the reference path (plain logits) with shared_prompt false."""
    model = run.model
    hidden = (module or model)(batch.input_ids, batch.position_ids, batch.layout)
    logprobs = fused_target_logprobs if run.cfg.preference.shared_prompt else target_logprobs
    tokens = logprobs(hidden, model.lm_head.weight, batch.target_index, batch.target_ids, softcap=model.args.final_logit_softcapping)
    return sequence_sums(tokens, batch.target_seq, batch.seq_tokens.shape[0]).view(-1, 2)


def pair_losses(run, batch: PairBatch, module=None):
    """(per-pair losses [P], chosen rewards [P], rejected rewards [P]) of a micro-batch."""
    pc = run.cfg.preference
    with autocast(run):
        if run.cfg.method == "orpo":
            means = sequence_logprobs(run, batch, module) / batch.seq_tokens.view(-1, 2)
            return orpo_loss(means[:, 0], means[:, 1], pc.orpo_lambda)
        with torch.no_grad(), reference_policy(run):
            ref = sequence_logprobs(run, batch, module)
        pi = sequence_logprobs(run, batch, module)
    return dpo_loss(pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], pc.beta, pc.loss, pc.label_smoothing)


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sums over the pairs of the chosen reward, the rejected one, the margin and chosen > rejected
    (each pair's times its weight where `weights` [P] are given: a graph's pad pairs weigh 0)."""
    per_pair = torch.stack([chosen, rejected, chosen - rejected, (chosen > rejected).to(chosen.dtype)])
    return (per_pair * weights if weights is not None else per_pair).sum(dim=1)


class PreferenceStep:
    """fit's per-micro-batch call for dpo / orpo: ``(batch on the host, the step's pair count) ->
    detached loss``; it sums the step's reward statistics until step_stats takes them."""

    def __init__(self, run):
        self.run = run
        self.stats = torch.zeros(4, device=run.device)

    def __call__(self, batch: PairBatch, n_pairs: int) -> torch.Tensor:
        return self.body(batch.to(self.run.device), n_pairs)

    def body(self, batch: PairBatch, n_pairs, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Forward, loss and backward of a micro-batch on the device; `n_pairs` the step's pair
        count (a device scalar in a graph), `weights` [P] each pair's weight in the loss and the
        reward sums (train.pair_graph's pad pairs: 0), None: all 1. The process's first call
        compiles its missing Triton kernels in parallel first (ops.compile_ahead)."""
        return first_pass(lambda: self._body(batch, n_pairs, weights), lambda: trained(self.run.model),
                          keep=(self.stats,), counters=pass_counters(self.run))

    def _body(self, batch: PairBatch, n_pairs, weights: torch.Tensor | None) -> torch.Tensor:
        run = self.run
        with given_seeds(batch.dropout_seeds):  # the reference forward (LoRA off) draws none
            losses, chosen, rejected = pair_losses(run, batch, run.module)
        loss = (losses * weights if weights is not None else losses).sum() / n_pairs
        scaled = loss * run.parallel.world if run.strategy == "fsdp" else loss  # as step.forward_backward
        try:
            (run.scaler.scale(scaled) if run.scaler else scaled).backward()
        finally:
            join_aside()
        self.stats.add_(pair_stats(chosen, rejected, weights).float())  # in place: a graph adds into it
        return loss.detach()

    def step_stats(self, n_pairs: int) -> dict:
        """The step's mean rewards (device tensors; the loop's writer reads them), and a fresh sum."""
        stats = self.stats.clone()
        self.stats.zero_()
        if self.run.parallel.enabled:  # every rank calls this each step: its pairs' sums, summed over ranks
            stats = distributed.sum_across(self.run.parallel, stats)
        return dict(zip(STAT_KEYS, (stats / n_pairs).unbind()))


@torch.no_grad()
def preference_validation_loss(run) -> tuple[float, int]:
    """Mean pair loss over the validation pairs (dropout off), and the pair count."""
    data, ids = run.val
    ids = run.parallel.shard(ids)
    forward = run.module if run.strategy == "fsdp" else run.model
    was_training = run.model.training
    run.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    for start in range(0, len(ids), run.cfg.batch_size):
        batch = collate(run, [data.example(i) for i in ids[start:start + run.cfg.batch_size]]).to(run.device)
        total += pair_losses(run, batch, forward)[0].sum().double()
    run.model.train(was_training)
    n = len(ids)
    if run.parallel.enabled:
        both = distributed.sum_across(run.parallel, torch.stack([total, total.new_tensor(float(n))]))
        total, n = both[0], int(both[1])
    return float(total) / max(n, 1), n
