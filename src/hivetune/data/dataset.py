"""A dataset index that keeps only where each record lives and its lengths, not its tokens.

``index_dataset`` reads the source once (a file, a folder, a Hub dataset: ``data.sources``, each
part JSONL or a JSON array), checks and tokenises every record to learn its length and target
count (for step planning and loss normalisation), and drops the tokens. Batches re-read (by byte
offset) and re-tokenise their records on the fly, so RAM holds a few integers per example: typed
arrays of 24 bytes a record, 28 with several parts (a 10 GB JSONL of 1 KB records, 10 million
of them: ~240 MB), not Python lists (~100 bytes a record).
"""

from __future__ import annotations

import json
import random
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.data.formats import Encoded, checked_source, encode_record, read_line_at
from hivetune.data.sources import DataSource, Part, as_source, data_parts


@dataclass
class DatasetIndex:
    path: Path  # the source as given (a file, a folder, a Hub dataset id)
    format: str
    lines: array  # int64: line number (or array item, or row) of each kept record in its part
    offsets: array  # int64: byte offset of each kept JSONL line (-1 for JSON arrays)
    lengths: array  # int32: tokens after truncation
    n_targets: array  # int32: loss tokens after truncation
    truncated: int = 0  # records cut to max_length
    skipped_no_target: int = 0  # records left with no loss token after truncation
    records: dict = field(default_factory=dict, repr=False)  # example -> record, for small files
    parts: list[Part] = field(default_factory=list, repr=False)  # the source's JSONL / JSON files
    part_of: array = field(default_factory=lambda: array("i"), repr=False)  # each kept record's part (several parts only)
    columns: dict = field(default_factory=dict, repr=False)  # data_columns, applied again on re-reads
    encoding: tuple = field(default=(None, 0, False), repr=False)  # (tokenizer, max_length, train_on_inputs)

    def __len__(self) -> int:
        return len(self.lines)

    def example(self, i: int) -> Encoded:
        """Re-read and re-tokenise example i (same result as at indexing time)."""
        tokenizer, max_length, train_on_inputs = self.encoding
        return encode_record(read_record(self, i), self.format, tokenizer, max_length, train_on_inputs)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)


def index_dataset(path: str | Path | DataSource, fmt: str, tokenizer, max_length: int, train_on_inputs: bool,
                  keep_records_below: int = 64 << 20) -> DatasetIndex:
    """Check and measure every record; keep the records in RAM only for sources under 64 MiB."""
    source = as_source(path)
    parts = data_parts(source)
    keep = sum(part.path.stat().st_size for part in parts) < keep_records_below
    index = DatasetIndex(Path(source.spec), "" if fmt == "auto" else fmt, array("q"), array("q"), array("i"), array("i"),
                         encoding=(tokenizer, max_length, train_on_inputs), parts=parts, columns=source.columns)
    for number, where, line, offset, record, chosen in checked_source(source, fmt, parts=parts):
        index.format = chosen
        try:
            enc = encode_record(record, chosen, tokenizer, max_length, train_on_inputs)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        if enc.n_targets == 0:
            index.skipped_no_target += 1
            continue
        index.truncated += enc.truncated
        if keep or offset is None:
            index.records[len(index.lines)] = record
        index.lines.append(line)
        index.offsets.append(-1 if offset is None else offset)
        index.lengths.append(len(enc.ids))
        index.n_targets.append(enc.n_targets)
        if len(parts) > 1:
            index.part_of.append(number)
    if not index.lines:
        raise UserError(f"{source}: no record has a response token to learn from within max_length={max_length}")
    return index


def read_record(index: DatasetIndex, i: int) -> dict:
    if i in index.records:
        return index.records[i]
    part = index.parts[index.part_of[i] if index.part_of else 0]
    offset = index.offsets[i]
    return read_line_at(part.path, index.lines[i], None if offset < 0 else offset, index.columns, part)


def load_example(index: DatasetIndex, i: int, tokenizer, max_length: int, train_on_inputs: bool) -> Encoded:
    return encode_record(read_record(index, i), index.format, tokenizer, max_length, train_on_inputs)


@dataclass
class TokenizedExamples:
    """Examples already as token ids (benchmarks, tests): the same interface as DatasetIndex."""

    encoded: list[Encoded]
    format: str = "tokens"
    truncated: int = 0
    skipped_no_target: int = 0

    def __post_init__(self):
        self.lengths = [len(e.ids) for e in self.encoded]
        self.n_targets = [e.n_targets for e in self.encoded]

    def __len__(self) -> int:
        return len(self.encoded)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    def example(self, i: int) -> Encoded:
        return self.encoded[i]


def example_order(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(n) that depends only on (seed, epoch): deterministic data order."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def plan_steps(n_examples: int, examples_per_step: int, epochs: float, max_steps: int, seed: int,
               lengths: list[int] | None = None, order: str = "random"):
    """List of steps, each a list of example indices, drawn from consecutive epoch permutations.

    Steps may cross an epoch boundary so that no example is dropped between epochs; a trailing
    partial step is dropped so every step sees exactly examples_per_step examples.

    order="balanced" (config batch_order; needs `lengths`): the steps that lie whole inside one
    epoch take the same examples, redealt by balanced_window so that every step holds about the
    same number of tokens. A step that crosses an epoch boundary keeps its draw. The plan of the
    whole epochs is made before max_steps cuts it, so a shorter run's steps are a prefix.
    """
    if max_steps > 0:
        total = max_steps
    else:
        total = max(1, int(epochs * n_examples) // examples_per_step)
    steps, stream, epoch = [], [], 0
    while len(steps) < total:
        while len(stream) < examples_per_step:
            stream += example_order(n_examples, seed, epoch)
            epoch += 1
        steps.append(stream[:examples_per_step])
        stream = stream[examples_per_step:]
    if order != "balanced":
        return steps
    if lengths is None or len(lengths) != n_examples:
        raise ValueError("plan_steps: order='balanced' needs one length per example")
    # every epoch the plan reached: its whole steps, up to the last one the epoch holds
    while len(stream) >= examples_per_step:
        steps.append(stream[:examples_per_step])
        stream = stream[examples_per_step:]
    for e in range(epoch):
        first = -(-e * n_examples // examples_per_step)  # the first step that starts inside epoch e
        end = (e + 1) * n_examples // examples_per_step  # past the last step that ends inside it
        if end - first > 1:
            steps[first:end] = balanced_window(steps[first:end], lengths, seed, e)
    return steps[:total]


def balanced_window(steps: list[list[int]], lengths: list[int], seed: int, epoch: int) -> list[list[int]]:
    """The examples of these W steps (each of one epoch, n examples a step) redealt so that every
    step holds about the same number of tokens, and still at random: sorted by length (ties in
    their drawn order, itself random), cut into n strata of W consecutive examples, each stratum
    shuffled, step j taking the j-th example of each; then even_totals swaps examples of one
    stratum between the heaviest and the lightest step. A step's examples alternate long and short
    (strata 0, n-1, 1, n-2, ...), so that the micro-batches and ranks it is cut into are near even
    too. W2's data (1,500 examples, 16 a step, 2 ranks): the larger rank share holds 1,449 +- 116
    tokens a step at random, 1,448-1,453 balanced (1,430-1,474 dealt without the swaps)."""
    per_step, w = len(steps[0]), len(steps)
    drawn = [i for step in steps for i in step]
    by_length = sorted(range(len(drawn)), key=lambda k: (-lengths[drawn[k]], k))
    rng = random.Random(f"balanced:{seed}:{epoch}")
    strata = []
    for k in range(per_step):
        stratum = [drawn[j] for j in by_length[k * w:(k + 1) * w]]
        rng.shuffle(stratum)
        strata.append(stratum)
    turns = [k // 2 if k % 2 == 0 else per_step - 1 - k // 2 for k in range(per_step)]
    return even_totals([[strata[k][j] for k in turns] for j in range(w)], lengths)


def even_totals(steps: list[list[int]], lengths: list[int], rounds: int = 8) -> list[list[int]]:
    """These steps with examples at one place swapped between steps (each keeps one example of each
    place's stratum) to even their token totals: each round pairs the heaviest step with the
    lightest, the second heaviest with the second lightest, and so on, and swaps in each pair the
    place that leaves the two totals nearest each other, if any swap narrows their gap. At most
    `rounds` rounds (fewer once one swaps nothing); deterministic."""
    steps = [list(step) for step in steps]
    totals = [sum(lengths[i] for i in step) for step in steps]
    for _ in range(rounds):
        order = sorted(range(len(steps)), key=lambda j: (totals[j], j))
        swapped = False
        for lo, hi in zip(order[:len(order) // 2], reversed(order[len(order) // 2:])):
            gap, best = totals[hi] - totals[lo], None
            for k, (a, b) in enumerate(zip(steps[hi], steps[lo])):
                d = lengths[a] - lengths[b]
                if 0 < d < gap and (best is None or abs(gap - 2 * d) < abs(gap - 2 * best[1])):
                    best = (k, d)
            if best is not None:
                k, d = best
                steps[hi][k], steps[lo][k] = steps[lo][k], steps[hi][k]
                totals[hi] -= d
                totals[lo] += d
                swapped = True
        if not swapped:
            break
    return steps


def to_json(index: DatasetIndex) -> str:
    return json.dumps({"path": str(index.path), "format": index.format, "examples": len(index),
                       "tokens": index.total_tokens, "truncated": index.truncated})
