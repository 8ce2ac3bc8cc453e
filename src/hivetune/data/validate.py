"""`hivetune data validate`: every problem of a data file in one streaming pass.

Problems, each reported as ``file:line: what``:

- schema: malformed JSON, not an object, unknown format, a field missing or of the wrong type
  (the same checks training makes, ``formats.check_record``);
- empty: a required text field (or a chat message) that is only whitespace;
- duplicate: the same normalised prompt + response as an earlier record (``scan.exact_key``; a
  preference pair: the same prompt, chosen and rejected);
- near duplicate: a prompt whose word 3-gram shingles are >= 0.8 Jaccard-similar to an earlier
  prompt's (synth's measure), within the bounded window of ``dedupe.NearDuplicateIndex``;
- too long: more than max_length tokens (a pair: its prompt and longer answer) with the model's
  tokenizer and chat template (only when
  a model or a max_length is given: loading a tokenizer costs seconds).

Memory: one line at a time, TOKENIZE_BATCH records waiting for the tokenizer, 16 bytes a record
for exact duplicates and the fixed near-duplicate index (about 27 MiB at most).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hivetune.data.dedupe import WINDOW, FirstSeen, NearDuplicateIndex
from hivetune.data.formats import FORMAT_NAMES, check_record, detect_format, field_names, starts_with_bom
from hivetune.data.scan import (DEFAULT_MAX_LENGTH, TOKENIZE_BATCH, Line, check_format_name, empty_fields,
                                exact_key, prompt_text, resolve_model, stream_lines, token_lengths)
from hivetune.data.pairs import pair_key, pair_lengths, pair_prompt
from hivetune.data.sources import DataSource, as_source, data_parts
from hivetune.data.synth import NEAR_DUPLICATE_THRESHOLD
from hivetune.core.errors import UserError

KINDS = ("schema", "empty", "duplicate", "near_duplicate", "too_long")
KIND_TITLES = {
    "schema": "schema errors",
    "empty": "empty fields",
    "duplicate": "exact duplicates (normalised prompt + response)",
    "near_duplicate": (f"near duplicates (prompt word 3-gram Jaccard >= {NEAR_DUPLICATE_THRESHOLD}, "
                       f"among the last {WINDOW:,} prompts)"),
    "too_long": "longer than max_length",
}
# Problems listed per kind; beyond this they are only counted.
LISTED_PER_KIND = 20


@dataclass
class ValidationReport:
    path: Path
    format: str | None = None
    records: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    listed: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KINDS})
    model: str | None = None  # tokenizer used for the length check, None when not checked
    max_length: int | None = None
    unit: str = "line"  # what at() numbers: line, item (a JSON array), row, record (several files)
    bom: bool = False  # the file starts with a UTF-8 byte-order mark (skipped)

    @property
    def problems(self) -> int:
        return sum(self.counts.values())

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def at(self, number: int) -> str:
        """'item 4' in a JSON array, 'line 4' in JSONL, 'row 4' in parquet / CSV, 'record 4' (counted
        over all files) in a folder."""
        return f"{self.unit} {number}"

    def add(self, kind: str, line: Line, message: str) -> None:
        self.counts[kind] += 1
        if len(self.listed[kind]) < LISTED_PER_KIND:
            self.listed[kind].append(f"{line.where}: {message.removeprefix(f'item {line.number}: ')}")


def validate_file(path: str | Path | DataSource, model: str | None = None, max_length: int | None = None,
                  fmt: str = "auto") -> ValidationReport:
    """Check every record of `path`; the length check runs when `model` or `max_length` is given
    (the other defaults to the embedded model / 1024). Raises UserError for unusable input."""
    source = as_source(path)
    path = Path(source.spec)
    chosen = check_format_name(fmt)
    tokenizer = None
    if model or max_length is not None:
        if max_length is None:
            max_length = DEFAULT_MAX_LENGTH
        if max_length <= 0:
            raise UserError(f"--max-length: must be > 0, got {max_length}")
        from hivetune.model.tokenizer import load_tokenizer

        model = resolve_model(model)
        tokenizer = load_tokenizer(model)
    report = ValidationReport(path, chosen, model=model if tokenizer else None, max_length=max_length,
                              bom=starts_with_bom(path))
    seen = FirstSeen()
    near = NearDuplicateIndex()
    pending: list[tuple[int, dict]] = []  # records waiting to be tokenised

    parts = data_parts(source)
    several = len(parts) > 1
    for line in stream_lines(source, parts=parts):
        report.records += 1
        number = report.records if several else line.number  # what duplicates are named by
        report.unit = "record" if several else line.unit
        where = line.where
        if line.error:
            report.add("schema", line, line.error)
            continue
        record = line.record
        if report.format is None:
            report.format = detect_format(record)
            if report.format is None:
                report.add("schema", line, "cannot tell the format (expected 'messages', "
                           f"'instruction'+'output' or 'text'); set --format to one of {', '.join(FORMAT_NAMES)}, "
                           f"or name the record's columns ({field_names(record)}) with --columns")
                continue
        try:
            check_record(record, report.format, where)
        except UserError as e:
            empty = empty_fields(record, report.format)
            if empty:
                report.add("empty", line, f"empty {', '.join(empty)}")
            else:
                report.add("schema", line, str(e).removeprefix(f"{where}: "))
            continue
        empty = empty_fields(record, report.format)
        if empty:
            report.add("empty", line, f"empty {', '.join(empty)}")
            continue
        pair = report.format == "preference"  # a pair's views: data.pairs
        earlier = seen.add(pair_key(record) if pair else exact_key(record, report.format), number)
        if earlier is not None:
            report.add("duplicate", line, f"duplicate of {report.at(earlier)}")
        match = near.check_and_add(pair_prompt(record) if pair else prompt_text(record, report.format), number)
        if match is not None and earlier is None:
            report.add("near_duplicate", line,
                       f"prompt is a near duplicate of {report.at(match[0])}'s (similarity {match[1]:.2f})")
        if tokenizer is not None:
            pending.append((line, record))
            if len(pending) >= TOKENIZE_BATCH:
                _check_lengths(report, pending, tokenizer)
    if tokenizer is not None and pending:
        _check_lengths(report, pending, tokenizer)
    return report


def _check_lengths(report: ValidationReport, pending: list[tuple[Line, dict]], tokenizer) -> None:
    records = [record for _, record in pending]
    lengths = pair_lengths(records, tokenizer) if report.format == "preference" else (
        token_lengths(records, report.format, tokenizer))
    for (line, _), (prompt, response) in zip(pending, lengths):
        if prompt + response > report.max_length:
            report.add("too_long", line, f"{prompt + response} tokens ({prompt} prompt + {response} response) "
                                           f"> max_length {report.max_length}")
    pending.clear()


def format_report(report: ValidationReport) -> str:
    lines = [f"{report.path}: {report.records:,} records, format {report.format or 'unknown'}"]
    if report.bom:
        lines.append("  starts with a UTF-8 byte-order mark: accepted (skipped when read)")
    for kind in KINDS:
        title = KIND_TITLES[kind]
        if kind == "too_long":
            if report.model is None:
                lines.append("  token lengths: not checked (give --model or --max-length)")
                continue
            title = f"longer than max_length {report.max_length} with {report.model}"
        lines.append(f"  {title}: {report.counts[kind]:,}")
        lines += [f"    {item}" for item in report.listed[kind]]
        if report.counts[kind] > len(report.listed[kind]):
            lines.append(f"    ... and {report.counts[kind] - len(report.listed[kind]):,} more")
    lines.append(f"{report.problems:,} problems" if report.problems else "clean")
    return "\n".join(lines)
