"""train.pair_graph's padding: a micro-batch of pairs padded to a graph's sizes gives the loss,
rewards and LoRA gradients of the unpadded one (pad pairs weigh 0), on the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from hivetune.data.pairs import EncodedPair, collate_pairs
from hivetune.model.lora import lora_parameters
from hivetune.train.pair_graph import (PairSizes, batch_pairs, pad_lengths, pad_pair_batch, pair_sizes,
                                       run_micro_batches)
from hivetune.train.preference import PreferenceStep, pair_losses
from test_preference import grads_of, pairs_file, pref_run  # noqa: F401 - the fixture


def test_pair_sizes_hold_every_micro_batch_and_a_pad_pair():
    a = [EncodedPair([1] * 5, [2] * 3, [3] * 4), EncodedPair([1] * 2, [2] * 6, [3] * 1)]
    b = [EncodedPair([1] * 9, [2] * 2, [3] * 2)]
    sizes = pair_sizes([a, b])
    assert sizes == PairSizes(3, 64, 64)  # 2 pairs + 1; 9 + 3 and 14 + 6, rounded up to 64
    for m in (a, b):
        pads = pad_lengths(m, sizes)
        assert len(m) + len(pads) == 3 and min(min(p) for p in pads) >= 1
        assert sum(len(e.prompt) for e in m) + sum(p for p, _, _ in pads) == 64
        assert sum(len(e.chosen) + len(e.rejected) for e in m) + sum(c + r for _, c, r in pads) == 64
    with pytest.raises(ValueError, match="does not fit the graph's"):
        pad_lengths(a + b, sizes)  # three pairs leave no room for a pad pair


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_padded_micro_batch_gives_the_unpadded_loss_rewards_and_grads(method, tiny_model_dir, pairs_file, tmp_path):
    run = pref_run(tiny_model_dir, pairs_file, tmp_path / "run", method=method)
    run.model.eval()
    pairs = [run.data.example(i) for i in range(5)]
    batch = collate_pairs(pairs, run.pad_id, shared=True)
    assert [(e.prompt, e.chosen, e.rejected) for e in batch_pairs(batch)] == \
        [(e.prompt, e.chosen, e.rejected) for e in pairs]
    sizes = pair_sizes([pairs])
    padded, weights = pad_pair_batch(batch, sizes, run.pad_id)
    assert padded.input_ids.shape == (1, sizes.tokens) and padded.target_ids.numel() == sizes.answer
    assert padded.n_examples == sizes.pairs and weights.tolist() == [1.0] * 5 + [0.0] * (sizes.pairs - 5)
    assert padded.segments.max_q == padded.segments.max_k == sizes.tokens

    losses, chosen, rejected = pair_losses(run, batch)
    want = grads_of(run, losses.sum() / 5)
    p_losses, p_chosen, p_rejected = pair_losses(run, padded)
    got = grads_of(run, (p_losses * weights).sum() / 5)
    torch.testing.assert_close(p_losses[:5], losses, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_chosen[:5], chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_rejected[:5], rejected, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert max(float(g.abs().max()) for g in want) > 1e-4


def test_preference_step_body_with_weights_sums_the_real_pairs_only(tiny_model_dir, pairs_file, tmp_path):
    """PreferenceStep.body (what the graph captures) on the padded batch: the eager call's loss and
    reward sums."""
    run = pref_run(tiny_model_dir, pairs_file, tmp_path / "run")
    run.model.eval()
    batch = collate_pairs([run.data.example(i) for i in range(4)], run.pad_id, shared=True)
    step = PreferenceStep(run)
    plain = step(batch, 4)
    plain_stats = step.step_stats(4)
    padded, weights = pad_pair_batch(batch, pair_sizes([batch_pairs(batch)]), run.pad_id)
    for p in lora_parameters(run.model):
        p.grad = None
    graphed_shape = step.body(padded, torch.tensor(4.0), weights)
    graphed_stats = step.step_stats(4)
    torch.testing.assert_close(graphed_shape, plain, atol=1e-6, rtol=1e-5)
    for key in plain_stats:
        torch.testing.assert_close(graphed_stats[key], plain_stats[key], atol=1e-6, rtol=1e-5)


def test_run_micro_batches_follow_the_step_plan(tiny_model_dir, pairs_file, tmp_path):
    run = pref_run(tiny_model_dir, pairs_file, tmp_path / "run", max_steps=0, epochs=1)
    micro = run_micro_batches(run)
    assert sum(len(m) for m in micro) == sum(len(s) for s in run.steps)
    assert max(len(m) for m in micro) <= run.cfg.batch_size
