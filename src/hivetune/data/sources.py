"""Where training data comes from: a file, a folder of files, or a Hub dataset id, as JSONL parts.

Every reader downstream reads JSONL by byte offsets (``formats.read_line_at``), so a 10 GB file
trains with a few integers a record in memory. A source becomes a list of ``Part``s, each a file
those readers take:

- ``.jsonl`` and ``.json`` (a JSON array: parsed whole, as before): the file itself;
- ``.jsonl.gz`` / ``.json.gz``: decompressed, line for line, into a copy in the cache;
- ``.parquet``: streamed one record batch of a row group at a time (pyarrow) into a JSONL copy;
- ``.csv``: streamed row by row (the csv module, a header row naming the columns) into a copy;
- a folder: its files of those kinds, sorted by path (subfolders included);
- ``ORG/NAME[@REVISION]`` that is no local path: the dataset repo from the Hub cache (fetched when
  online), its `config` and `split` chosen and streamed by the ``datasets`` library into a copy.

A copy lives in HIVETUNE_CACHE/data/, keyed by the source file's path, size and mtime, so a run
that resumes or a second command reads it without converting again; it costs the disk of the
data as JSONL. Messages name the source (``train.parquet: row 12``), never the copy.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.core.fileio import cache_dir, file_cache_folder
from hivetune.core.hub import hub_snapshot, split_hub_id

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".csv")
PARQUET_BATCH_ROWS = 1024  # rows per record batch read from a row group: memory stays ~1k rows


@dataclass(frozen=True)
class DataSource:
    """What --data names, with the options that choose and map its records."""

    spec: str
    columns: dict = field(default_factory=dict, hash=False, compare=False)  # our field -> the data's column
    split: str = ""  # a Hub dataset's split (default: train)
    config: str = ""  # a Hub dataset's configuration (default: its only or default one)

    def __str__(self) -> str:
        return self.spec


@dataclass(frozen=True)
class Part:
    """One readable JSONL / JSON file of a source, and what messages call it."""

    path: Path  # the file read (the source file, or its JSONL copy in the cache)
    label: str  # the source file as the user knows it
    unit: str = "line"  # "line": label:N; "row": label: row N (parquet, CSV, a Hub dataset)

    def where(self, number: int, array: bool = False) -> str:
        if array:
            return f"{self.label}: item {number}"
        return f"{self.label}:{number}" if self.unit == "line" else f"{self.label}: {self.unit} {number}"


def as_source(source: str | Path | DataSource) -> DataSource:
    return source if isinstance(source, DataSource) else DataSource(str(source))


def source_exists(source: str | Path | DataSource) -> bool:
    """A local path that exists, or a name of the Hub's shape (resolved when read)."""
    spec = as_source(source).spec
    return Path(spec).exists() or split_hub_id(spec) is not None


def data_parts(source: str | Path | DataSource, what: str = "data file") -> list[Part]:
    """The source as JSONL / JSON parts, converting (once, into the cache) what is not JSONL."""
    source = as_source(source)
    path = Path(source.spec)
    if not path.exists() and split_hub_id(source.spec) is not None:
        return [hub_dataset_part(source)]
    if (source.split or source.config) and not path.is_dir():
        raise UserError(f"{path}: data_split and data_config choose within a Hub dataset or a folder of one")
    if path.is_dir():
        if source.split or source.config:
            return [folder_dataset_part(path, source, label=str(path))]
        files = sorted(p for p in path.rglob("*") if p.is_file() and data_suffix(p)
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError(f"{path}: no data files in this folder ({', '.join(SUFFIXES)})")
        return [file_part(p) for p in files]
    if not path.exists():
        hint = " (a Hub dataset id is ORG/NAME)" if "/" not in source.spec and not path.suffix else ""
        raise UserError(f"{path}: {what} not found{hint}")
    return [file_part(path)]


def data_suffix(path: Path) -> str:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), "")


def file_part(path: Path) -> Part:
    suffix = data_suffix(path)
    if suffix in (".jsonl.gz", ".json.gz"):
        return Part(converted(path, "gz", lambda out: gunzip_into(path, out)), str(path))
    if suffix == ".parquet":
        return Part(converted(path, "parquet", lambda out: parquet_into(path, out)), str(path), "row")
    if suffix == ".csv":
        return Part(converted(path, "csv", lambda out: csv_into(path, out)), str(path), "row")
    return Part(path, str(path))  # JSONL / JSON (any other name is read as JSONL or a JSON array)


def converted(path: Path, kind: str, write) -> Path:
    """The JSONL copy of `path` in the cache, written by write(out) when missing."""
    try:
        folder = file_cache_folder(path, "data")
    except OSError as e:
        raise UserError(f"{path}: unreadable data file ({e.strerror})") from None
    return converted_at(folder / f"{kind}.jsonl", str(path), write)


def converted_at(target: Path, label: str, write) -> Path:
    """write(out) into a temp file renamed to `target` when complete; a failure leaves nothing."""
    if target.is_file():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            write(out)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{label}: cannot write its JSONL copy to {target.parent} ({e.strerror or e}); "
                        "set HIVETUNE_CACHE to a writable folder") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def gunzip_into(path: Path, out) -> None:
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                out.write(chunk)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # not gzip, cut short, corrupt
        raise UserError(f"{path}: not a readable gzip file ({e or type(e).__name__})") from None


def write_record(out, record: dict) -> None:
    """One record as a JSONL line; values JSON has no type for (dates, bytes) as their text."""
    out.write(json.dumps(record, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass") + b"\n")


def parquet_into(path: Path, out) -> None:
    # Function-local: pyarrow (~100 MB installed) only when a parquet file is read.
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading parquet needs pyarrow, a hivetune dependency: pip install pyarrow") from None
    try:
        reader = pq.ParquetFile(path)
        for group in range(reader.num_row_groups):
            for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group]):
                for record in batch.to_pylist():
                    write_record(out, record)
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None


def csv_into(path: Path, out) -> None:
    import csv

    csv.field_size_limit(2**31 - 1)  # a text field of a training table may hold a whole document (default: 128 KiB)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f)
            header = next(rows, None)
            if not header:
                raise UserError(f"{path}: data file is empty")
            for number, row in enumerate(rows, start=1):
                if len(row) != len(header):
                    raise UserError(f"{path}: row {number}: {len(row)} values for {len(header)} columns "
                                    f"({', '.join(header)})")
                write_record(out, dict(zip(header, row)))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not valid UTF-8 (byte {e.start})") from None
    except csv.Error as e:
        raise UserError(f"{path}: malformed CSV ({e})") from None


def hub_dataset_part(source: DataSource) -> Part:
    """A Hub dataset id: its repo from the Hub cache (core.hub), then folder_dataset_part."""
    repo, revision = split_hub_id(source.spec)
    folder = hub_snapshot(repo, revision, repo_type="dataset")
    return folder_dataset_part(folder, source, label=source.spec)


def folder_dataset_part(folder: Path, source: DataSource, label: str) -> Part:
    """The `config` / `split` of a dataset folder (the Hub's layout: README configs, data/train-*),
    as the ``datasets`` library chooses them, streamed (no Arrow copy) into a JSONL copy."""
    split = source.split or "train"
    key = hashlib.sha256(f"{folder.resolve()}|{source.config}|{split}".encode()).hexdigest()[:16]
    stamp = max((p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()), default=0)
    target = cache_dir() / "data" / f"hub-{key}-{stamp}" / f"{split}.jsonl"
    what = f"{label} (split {split}{', config ' + source.config if source.config else ''})"

    def write(out) -> None:
        for record in stream_dataset(folder, source.config, split, what):
            write_record(out, record)

    part = converted_at(target, what, write)
    return Part(part, what, "row")


def stream_dataset(folder: Path, config: str, split: str, what: str):
    """Records of one split of a local dataset folder through datasets.load_dataset(streaming=True)."""
    # Function-local: datasets (and pyarrow, pandas under it) only for Hub datasets.
    try:
        import datasets
    except ImportError:
        raise UserError(f"{what}: Hub datasets need datasets, a hivetune dependency: pip install datasets") from None
    try:
        stream = datasets.load_dataset(str(folder), name=config or None, split=split, streaming=True)
        yield from stream
    except UserError:
        raise
    except (ValueError, KeyError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{what}: datasets cannot load it ({text})") from None


def is_hub_dataset(spec: str) -> bool:
    return bool(spec) and not Path(spec).exists() and split_hub_id(spec) is not None


def train_source(cfg) -> DataSource:
    """A TrainConfig's `data` with its columns, split and config (empty: the shipped dataset)."""
    from hivetune.core.embedded import default_train_data

    if not cfg.data:
        return DataSource(str(default_train_data()))
    return DataSource(cfg.data, dict(cfg.data_columns), cfg.data_split, cfg.data_config)


def held_out_source(spec: str, cfg=None) -> DataSource:
    """Held-out data (val_data, eval --data): a Hub dataset's test split, with cfg's columns and config."""
    columns = dict(cfg.data_columns) if cfg is not None else {}
    config = cfg.data_config if cfg is not None and is_hub_dataset(spec) else ""
    return DataSource(spec, columns, "test" if is_hub_dataset(spec) else "", config)
