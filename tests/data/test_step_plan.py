"""The step plan: epochs cut into steps, the balanced order, StepPlan's flat arrays, and plans
pinned to digests (checkpoint.plan_hash) so that a run's steps, and so an old checkpoint's
resume, stay the same for the same seed, epochs and lengths."""

from __future__ import annotations

import hashlib
import json
import random
import statistics
from collections import Counter

import numpy as np
import pytest

from hivetune.checkpoint import plan_hash
from hivetune.data import step_plan
from hivetune.data.step_plan import StepPlan, even_totals, example_order, plan_steps


def pinned_lengths(n: int, k: int) -> list[int]:
    """Lengths 1-1013 with many ties (97 distinct values), from arithmetic only."""
    return [(i * 7919 + k * 104729) % 97 * 11 % 1013 + 1 for i in range(n)]


# (examples, per step, epochs, max_steps, seed, order) -> (steps, sha256 of the plan's compact
# JSON): the plans of lists of Python ints that plan_steps made before it held flat arrays.
PINNED = [
    ((37, 4, 2.5, 0, 3, "random"), 23, "4a7dc0698a8b38ba009e72061c55e201314e13d6649a63981c88a21014ad1e55"),
    ((10, 4, 1.0, 7, 1, "random"), 7, "17297ec5f8aedcc1f295e7f49112e537f1b3829af7266eda35125faed0887672"),
    ((1000, 8, 3.0, 0, 11, "random"), 375, "35df384c72bc909f89428c8ff71c1d4cc10d779a9b60f923c0f323bf840b7573"),
    ((200, 16, 2.0, 0, 4, "balanced"), 25, "b9b6c4a40d596f15ce9173cbc0bee252be5701d647bc331416cfe6ab3d137bea"),
    ((45, 8, 3.3, 0, 5, "balanced"), 18, "cffa10823ef62c78546b6333b03faaf52717b7e2a3950d9424fafc63a44cca2d"),
    ((40, 4, 1.0, 15, 2, "balanced"), 15, "44e47c97d91a4026bcce3a9ffda0cf9aa9f018e92b1cb270a5365d2618869123"),
    ((5000, 16, 1.5, 0, 7, "balanced"), 468, "68a477a9042f098804643485548fe08eb8a1ce2497f94f991a51e7b0847a373e"),
    ((300, 1, 1.0, 0, 9, "balanced"), 300, "e014370f6029a28a440c778551d8fb1d064ed4c915f58d5aef452e94abe0dda6"),
    ((5, 8, 3.0, 0, 6, "balanced"), 1, "cdbd1b52c64099381a2ac88597a33cea95c9643d2dddf46be1d4101cd27069e1"),
    ((2003, 12, 0.0, 400, 13, "balanced"), 400, "43f7f04104dcabec3699faa3a3696c8de7c012c3ee24acca7c997b5771ca4083"),
]


@pytest.mark.parametrize("config,n_steps,digest", PINNED, ids=[f"{c[0]}x{c[1]}-{c[5]}" for c, _, _ in PINNED])
def test_plan_is_pinned_to_its_digest(config, n_steps, digest):
    n, per_step, epochs, max_steps, seed, order = config
    lengths = pinned_lengths(n, seed) if order == "balanced" else None
    plan = plan_steps(n, per_step, epochs, max_steps, seed, lengths, order)
    assert isinstance(plan, StepPlan) and len(plan) == n_steps
    as_lists = plan.tolist()
    assert hashlib.sha256(json.dumps(as_lists, separators=(",", ":")).encode()).hexdigest() == digest
    assert plan_hash(plan) == plan_hash(as_lists) == digest  # a checkpoint's plan_sha256 resumes
    assert plan.flat.dtype == np.int32 and plan.flat.nbytes == 4 * n_steps * per_step


def test_even_totals_weighs_pairs_in_chunks_as_in_one_pass(monkeypatch):
    config, n_steps, digest = PINNED[6]  # 5,000 examples, 16 a step: 156 pairs a round in epoch 0
    n, per_step, epochs, max_steps, seed, order = config
    monkeypatch.setattr(step_plan, "PAIRS", 7)
    plan = plan_steps(n, per_step, epochs, max_steps, seed, pinned_lengths(n, seed), order)
    assert len(plan) == n_steps and plan_hash(plan) == digest


def test_plan_hash_joins_blocks_as_one_json_array():
    plan = plan_steps(9001, 1, 1.0, 0, seed=1)  # 9,001 steps: three blocks of 4,096 or fewer
    expected = hashlib.sha256(json.dumps(plan.tolist(), separators=(",", ":")).encode()).hexdigest()
    assert plan_hash(plan) == plan_hash(plan.tolist()) == expected
    assert plan_hash([]) == hashlib.sha256(b"[]").hexdigest()


def test_step_plan_reads_like_a_list_of_steps():
    plan = StepPlan(np.arange(12, dtype=np.int32), 3)
    assert len(plan) == 4 and plan[0] == [0, 1, 2] and plan[-1] == [9, 10, 11]
    assert type(plan[1][0]) is int
    assert plan[1:3] == [[3, 4, 5], [6, 7, 8]] and isinstance(plan[1:3], StepPlan)
    assert plan[::2].tolist() == [[0, 1, 2], [6, 7, 8]]
    assert list(plan) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]] == plan
    assert plan != [[0, 1, 2]] and plan != StepPlan(np.arange(12, dtype=np.int32), 4)
    assert [[plan[0][0]], *plan[1:]] == [[0], [3, 4, 5], [6, 7, 8], [9, 10, 11]]  # a plan cut by hand
    assert plan.remapped(np.arange(100, 112, dtype=np.int32))[2] == [106, 107, 108]
    with pytest.raises(IndexError, match="step 4 of a plan of 4 steps"):
        plan[4]
    with pytest.raises(ValueError, match="10 entries are not whole steps of 3"):
        StepPlan(np.arange(10), 3)


def test_plan_steps_is_deterministic_per_seed():
    a = plan_steps(20, 4, 3.0, 0, seed=7)
    assert a == plan_steps(20, 4, 3.0, 0, seed=7)
    assert a != plan_steps(20, 4, 3.0, 0, seed=8)
    assert example_order(20, 7, 0).tolist() != example_order(20, 7, 1).tolist()  # each epoch reshuffled


@pytest.mark.parametrize("n,per_step,epochs", [(10, 4, 2.0), (10, 3, 1.0), (7, 2, 3.0), (24, 8, 1.5),
                                               (5, 8, 1.0), (9, 4, 0.5)])
def test_plan_steps_walks_whole_epochs_without_dropping(n, per_step, epochs):
    steps = plan_steps(n, per_step, epochs, 0, seed=3)
    assert len(steps) == max(1, int(epochs * n) // per_step)
    assert all(len(s) == per_step for s in steps)
    flat = [i for s in steps for i in s]
    # the examples are consecutive epoch permutations, cut into steps (across epoch boundaries)
    epochs_needed = -(-len(flat) // n)
    stream = [i for e in range(epochs_needed) for i in example_order(n, 3, e).tolist()]
    assert flat == stream[: len(flat)]
    for e in range(len(flat) // n):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n))
    counts = Counter(flat)
    assert max(counts.values()) - min(counts.get(i, 0) for i in range(n)) <= 1  # no example skipped


def test_plan_steps_crosses_the_epoch_boundary():
    steps = plan_steps(10, 4, 2.0, 0, seed=0)
    assert len(steps) == 5
    assert steps[2] == example_order(10, 0, 0)[8:].tolist() + example_order(10, 0, 1)[:2].tolist()
    assert Counter(i for s in steps for i in s) == Counter({i: 2 for i in range(10)})


def test_plan_steps_max_steps_wins_over_epochs():
    steps = plan_steps(10, 4, 1.0, max_steps=7, seed=1)
    assert len(steps) == 7  # 28 examples: almost 3 epochs
    assert steps[:2] == plan_steps(10, 4, 1.0, 0, seed=1)
    assert plan_steps(10, 4, 100.0, max_steps=2, seed=1) == steps[:2]



def test_balanced_plan_deals_each_epochs_steps_to_even_token_counts():
    rng = random.Random(5)
    lengths = [rng.randint(10, 300) for _ in range(200)]
    drawn = plan_steps(200, 16, 2.0, 0, seed=4)
    steps = plan_steps(200, 16, 2.0, 0, seed=4, lengths=lengths, order="balanced")
    assert len(steps) == len(drawn) == 25 and all(len(s) == 16 and len(set(s)) == 16 for s in steps)
    # epoch 0 holds steps 0-11 whole, step 12 crosses into epoch 1, which holds steps 13-24 whole
    assert steps[12] == drawn[12]
    for window in (slice(0, 12), slice(13, 25)):
        assert sorted(i for s in steps[window] for i in s) == sorted(i for s in drawn[window] for i in s)
        assert steps[window] != drawn[window]
        totals = [sum(lengths[i] for i in s) for s in steps[window]]
        drawn_totals = [sum(lengths[i] for i in s) for s in drawn[window]]
        # one example from each of 16 strata of the sorted lengths: two steps differ by at most
        # the sum of the strata's spans, at most the longest minus the shortest example
        assert max(totals) - min(totals) <= max(lengths) - min(lengths)
        assert statistics.pstdev(totals) < statistics.pstdev(drawn_totals) / 4
        assert len(set(totals)) == 1  # here even_totals' swaps leave every step at the same total
    assert steps == plan_steps(200, 16, 2.0, 0, seed=4, lengths=lengths, order="balanced")
    assert steps != plan_steps(200, 16, 2.0, 0, seed=5, lengths=lengths, order="balanced")


def test_even_totals_swaps_within_a_place_until_no_swap_narrows_a_gap():
    lengths = [100, 90, 80, 70, 30, 20, 10, 0]
    steps = np.array([[0, 4], [1, 5], [2, 6], [3, 7]])  # totals 130, 110, 90, 70
    even = even_totals(steps, lengths).tolist()
    assert steps.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]  # not changed in place
    assert [sorted(place) for place in zip(*even)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [sum(lengths[i] for i in step) for step in even] == [100, 100, 100, 100]
    assert even == [[3, 4], [2, 5], [1, 6], [0, 7]]  # place 0 swapped in both pairs (ties: the first place)
    # a gap no swap narrows (each place's difference is the gap or more) stays
    assert even_totals(np.array([[0, 3], [1, 2]]), [10, 5, 4, 3]).tolist() == [[0, 3], [1, 2]]



def test_balanced_plan_alternates_long_and_short_within_a_step():
    lengths = list(range(1, 33))  # example i has i + 1 tokens
    step = plan_steps(32, 8, 1.0, 0, seed=0, lengths=lengths, order="balanced")[0]
    ranks = sorted(range(32), key=lambda i: -lengths[i])
    strata = [ranks.index(i) // 4 for i in step]  # 8 strata of 4 examples, 0 the longest
    assert strata == [0, 7, 1, 6, 2, 5, 3, 4]


def test_balanced_plan_with_max_steps_is_a_prefix():
    lengths = [(7 * i) % 97 + 3 for i in range(40)]
    full = plan_steps(40, 4, 1.0, 0, seed=2, lengths=lengths, order="balanced")
    assert plan_steps(40, 4, 1.0, max_steps=3, seed=2, lengths=lengths, order="balanced") == full[:3]
    longer = plan_steps(40, 4, 1.0, max_steps=15, seed=2, lengths=lengths, order="balanced")
    assert longer[:10] == full and len(longer) == 15
    with pytest.raises(ValueError, match="needs one length per example"):
        plan_steps(40, 4, 1.0, 0, seed=2, order="balanced")
    with pytest.raises(ValueError, match="no examples to plan"):
        plan_steps(0, 4, 1.0, 0, seed=2)
