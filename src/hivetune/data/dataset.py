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
from array import array
from collections.abc import Iterator
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


def to_json(index: DatasetIndex) -> str:
    return json.dumps({"path": str(index.path), "format": index.format, "examples": len(index),
                       "tokens": index.total_tokens, "truncated": index.truncated})


def calibration_sequences(source, tokenizer, max_length: int, tokens: int) -> Iterator[list[int]]:
    """Token ids of the records of a data source (any `--data` source: a file, a folder, a Hub
    dataset id), as training renders them (prompt and answer), until `tokens` are given; errors
    name file:line."""
    given = 0
    for _, where, _, _, record, fmt in checked_source(source, "auto", setting=None):
        try:
            ids = encode_record(record, fmt, tokenizer, max_length, train_on_inputs=True).ids
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        yield ids
        given += len(ids)
        if given >= tokens:
            return
