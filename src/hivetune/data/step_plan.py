"""The step plan: which examples each optimizer step takes, a pure function of (examples, seed,
epochs, batch_order), so that a resumed run rebuilds it and starts at its N-th step.

A plan is held as one flat integer array, examples_per_step consecutive entries a step (StepPlan):
4 bytes an example drawn (int32 below 2**31 examples), not lists of Python ints (~90 bytes). The
epoch permutations are random.Random(seed * 1_000_003 + epoch).shuffle of an array('i'), and the
balanced order's strata random.Random(f"balanced:{seed}:{epoch}") shuffles: the same draws, so the
same steps, as a plan of Python lists; sorting and evening out the steps' totals run on numpy
arrays, a few of them one epoch long at a time (tests/data/test_step_plan.py pins plans to digests).
"""

from __future__ import annotations

import operator
import random
from array import array
from collections.abc import Sequence

import numpy as np

from hivetune.core.errors import UserError

BLOCK = 4096  # steps turned into lists at a time (iterating, hashing)
PAIRS = 1024  # pairs of steps even_totals weighs at a time (its temporaries: ~30 bytes an example of them)


class StepPlan(Sequence):
    """Steps of `width` examples each over one flat integer array: step i is
    flat[i * width:(i + 1) * width]. A step reads as a list of ints, a slice as a StepPlan, and a
    plan equals a list of lists holding the same steps."""

    def __init__(self, flat: np.ndarray, width: int):
        if width < 1 or flat.ndim != 1 or len(flat) % width:
            raise ValueError(f"StepPlan: {len(flat)} entries are not whole steps of {width}")
        self.flat, self.width = flat, width

    def __len__(self) -> int:
        return len(self.flat) // self.width

    def __getitem__(self, key):
        if isinstance(key, slice):
            return StepPlan(self.rows()[key].reshape(-1), self.width)
        i = operator.index(key)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"step {key} of a plan of {len(self)} steps")
        return self.flat[i * self.width:(i + 1) * self.width].tolist()

    def __iter__(self):
        rows = self.rows()
        for start in range(0, len(rows), BLOCK):
            yield from rows[start:start + BLOCK].tolist()

    def __eq__(self, other) -> bool:
        if isinstance(other, StepPlan):
            return self.width == other.width and np.array_equal(self.flat, other.flat)
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"StepPlan({len(self)} steps of {self.width} examples)"

    def rows(self) -> np.ndarray:
        """The plan as a (steps, width) view."""
        return self.flat.reshape(-1, self.width)

    def tolist(self) -> list[list[int]]:
        return self.rows().tolist()

    def remapped(self, ids: np.ndarray) -> StepPlan:
        """The same plan with each entry e replaced by ids[e] (positions among the training
        examples -> ids in the dataset)."""
        return StepPlan(ids[self.flat], self.width)


def id_dtype(n: int):
    """The smallest integer type that holds ids below n: int32, or int64 past 2**31 - 1."""
    return np.int32 if n <= np.iinfo(np.int32).max else np.int64


def shuffled_range(n: int, rng: random.Random) -> np.ndarray:
    """range(n) shuffled by rng.shuffle (the permutation a list would get) in a typed array."""
    dtype = id_dtype(n)
    ids = array("i" if dtype == np.int32 else "q", range(n))
    rng.shuffle(ids)
    return np.frombuffer(ids, dtype=np.dtype(f"i{ids.itemsize}"))


def example_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(n) that depends only on (seed, epoch): deterministic data order."""
    return shuffled_range(n, random.Random(seed * 1_000_003 + epoch))


def plan_steps(n_examples: int, examples_per_step: int, epochs: float, max_steps: int, seed: int,
               lengths=None, order: str = "random") -> StepPlan:
    """The steps, each examples_per_step example indices, drawn from consecutive epoch permutations.

    Steps may cross an epoch boundary so that no example is dropped between epochs; a trailing
    partial step is dropped so every step sees exactly examples_per_step examples.

    order="balanced" (config batch_order; needs `lengths`): the steps that lie whole inside one
    epoch take the same examples, redealt by balanced_window so that every step holds about the
    same number of tokens. A step that crosses an epoch boundary keeps its draw. The plan of the
    whole epochs is made before max_steps cuts it, so a shorter run's steps are a prefix.
    """
    per_step, n = examples_per_step, n_examples
    total = max_steps if max_steps > 0 else max(1, int(epochs * n) // per_step)
    if n < 1:
        raise ValueError("plan_steps: no examples to plan")
    if order == "balanced" and (lengths is None or len(lengths) != n):
        raise ValueError("plan_steps: order='balanced' needs one length per example")
    drawn = total * per_step
    n_epochs = -(-drawn // n)  # the epochs the steps reach into
    if order == "balanced":  # every step that ends inside an epoch reached
        drawn = n_epochs * n // per_step * per_step
    flat = np.empty(drawn, dtype=id_dtype(n))
    for e in range(n_epochs):
        start = e * n
        flat[start:start + n] = example_order(n, seed, e)[:max(0, min(n, drawn - start))]
    if order == "balanced":
        rows, lengths = flat.reshape(-1, per_step), np.asarray(lengths)
        for e in range(n_epochs):
            first = -(-e * n // per_step)  # the first step that starts inside epoch e
            end = (e + 1) * n // per_step  # past the last step that ends inside it
            if end - first > 1:
                rows[first:end] = balanced_window(rows[first:end], lengths, seed, e)
        flat = flat[:total * per_step].copy() if drawn > total * per_step else flat
    return StepPlan(flat, per_step)


def balanced_window(steps: np.ndarray, lengths, seed: int, epoch: int) -> np.ndarray:
    """The examples of these W steps ((W, n) ids, one epoch's) redealt so that every step holds
    about the same number of tokens, and still at random: sorted by length (ties in their drawn
    order, itself random), cut into n strata of W consecutive examples, each stratum shuffled,
    step j taking the j-th example of each; then even_totals swaps examples of one stratum between
    the heaviest and the lightest step. A step's examples alternate long and short (strata 0, n-1,
    1, n-2, ...), so that the micro-batches and ranks it is cut into are near even too. W2's data
    (1,500 examples, 16 a step, 2 ranks): the larger rank share holds 1,449 +- 116 tokens a step at
    random, 1,448-1,453 balanced (1,430-1,474 dealt without the swaps)."""
    w, per_step = steps.shape
    drawn = steps.reshape(-1)
    lengths = np.asarray(lengths)
    by_length = np.argsort(-lengths[drawn], kind="stable")  # longest first, ties as drawn
    strata = drawn[by_length].reshape(per_step, w)
    del by_length
    rng = random.Random(f"balanced:{seed}:{epoch}")
    code = "i" if strata.dtype.itemsize == 4 else "q"
    for k in range(per_step):
        stratum = array(code, strata[k].tobytes())
        rng.shuffle(stratum)
        strata[k] = np.frombuffer(stratum, dtype=strata.dtype)
    turns = [k // 2 if k % 2 == 0 else per_step - 1 - k // 2 for k in range(per_step)]
    dealt = np.ascontiguousarray(strata[turns].T)
    del strata
    return even_totals(dealt, lengths)


def even_totals(steps: np.ndarray, lengths, rounds: int = 8) -> np.ndarray:
    """These steps ((W, n) ids) with examples at one place swapped between steps (each keeps one
    example of each place's stratum) to even their token totals: each round pairs the heaviest step
    with the lightest, the second heaviest with the second lightest, and so on (ties by position),
    and swaps in each pair the place that leaves the two totals nearest each other (the first such
    place), if any swap narrows their gap. At most `rounds` rounds (fewer once one swaps nothing);
    deterministic. The pairs of a round are disjoint, so a round is a few passes over arrays, PAIRS
    pairs at a time."""
    steps = np.array(steps, order="C")
    sizes = np.asarray(lengths)[steps]  # int32 for a DatasetIndex's lengths; totals in int64
    totals = sizes.sum(axis=1, dtype=np.int64)
    half = len(steps) // 2
    for _ in range(rounds):
        order = np.argsort(totals, kind="stable")
        swapped = False
        for start in range(0, half, PAIRS):
            lo, hi = order[start:min(half, start + PAIRS)], order[::-1][start:min(half, start + PAIRS)]
            gap = (totals[hi] - totals[lo])[:, None]
            d = (sizes[hi] - sizes[lo]).astype(np.int64)
            usable = (d > 0) & (d < gap)
            # |gap - 2d| of each usable swap; argmin takes the first place of the smallest
            k = np.where(usable, np.abs(gap - 2 * d), np.iinfo(np.int64).max).argmin(axis=1)
            pairs = np.flatnonzero(usable.any(axis=1))
            if not len(pairs):
                continue
            h, l, k = hi[pairs], lo[pairs], k[pairs]
            steps[h, k], steps[l, k] = steps[l, k], steps[h, k]
            sizes[h, k], sizes[l, k] = sizes[l, k], sizes[h, k]
            moved = d[pairs, k]
            totals[h] -= moved
            totals[l] += moved
            swapped = True
        if not swapped:
            break
    return steps


def data_plan(data, per_step: int, epochs: float, max_steps: int, seed: int, val_split: float,
              order: str) -> tuple[StepPlan, int, array]:
    """(the step plan over the training examples, as ids into `data`; their count; the validation
    ids): what a run holds for its data plan, in flat integer arrays (data.step_plan)."""
    lengths = np.asarray(data.lengths)
    if val_split <= 0:
        return plan_steps(len(data), per_step, epochs, max_steps, seed, lengths, order), len(data), array("i")
    train_ids, val_ids = split_validation(len(data), val_split, seed)
    positions = np.frombuffer(train_ids, dtype=np.dtype(f"i{train_ids.itemsize}"))
    steps = plan_steps(len(positions), per_step, epochs, max_steps, seed, lengths[positions], order)
    return steps.remapped(positions), len(positions), val_ids


def split_validation(n: int, fraction: float, seed: int) -> tuple[array, array]:
    """(train ids, validation ids), each sorted in a typed array: a seeded random `fraction` of
    range(n) held out, at least one."""
    code = "i" if id_dtype(n) == np.int32 else "q"
    if fraction <= 0:
        return array(code, range(n)), array(code)
    k = max(1, round(fraction * n))
    if k >= n:
        raise UserError(f"val_split: {fraction:g} of {n} examples leaves none to train on")
    order = shuffled_range(n, random.Random(seed * 1_000_003 + 7919))
    return array(code, np.sort(order[k:]).tobytes()), array(code, np.sort(order[:k]).tobytes())
