"""Scanning a data file for `hivetune data`: records streamed past bad lines, the text views that
duplicate checks compare, and token lengths measured in batches.

Training (``formats.iter_records``) stops at the first bad line; the data tools keep going so one
run reports every problem. Both parse lines with ``formats.parse_jsonl_line``. JSONL is read one line at a time, so memory does not grow with the
file; a JSON array cannot be streamed with the standard library and is parsed whole.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from hivetune.data.formats import (ALPACA_PROMPT, ALPACA_PROMPT_INPUT, BOM, FORMAT_NAMES, chat_spans, decode_json_file,
                                   encode_record, is_json_array, json_type, map_record, open_data_file,
                                   parse_jsonl_line)
from hivetune.data.sources import DataSource, Part, as_source, data_parts
from hivetune.core.errors import UserError

# Records tokenised per call of the Rust tokenizer (it spreads a batch over the cores).
TOKENIZE_BATCH = 256
# TrainConfig.max_length, repeated so the data tools need not import torch (3-4 s); a test keeps them equal.
DEFAULT_MAX_LENGTH = 1024
_SPACE = re.compile(r"\s+")


@dataclass
class Line:
    """One non-blank line of a JSONL file (or one item of a JSON array)."""

    number: int  # line number, or item number in a JSON array (or row, in a converted part)
    raw: bytes | None  # the line as read (None for JSON array items)
    record: dict | None  # None when the line is not a JSON object
    error: str | None = None  # what is wrong with it, without the file:line prefix
    where: str = ""  # file:line (file: item N, file: row N) as messages name it
    unit: str = "line"  # what `number` counts: line, item (a JSON array), row (parquet, CSV, a Hub dataset)


def stream_lines(path: str | Path | DataSource, what: str = "data file", parts: list[Part] | None = None):
    """Yield a Line per non-blank line of every part of a data source (data.sources), each record
    mapped as training maps it (formats.map_record); bad lines carry an error instead of stopping
    the scan.

    Raises UserError only when the source as a whole is unusable: missing, empty, an unparseable
    JSON array, a file that cannot be converted.
    """
    source = as_source(path)
    for part in data_parts(source, what) if parts is None else parts:
        for line in _part_lines(part, what):
            line.where = part.where(line.number, array=line.raw is None)
            line.unit = "item" if line.raw is None else part.unit
            if line.record is not None:
                try:
                    line.record = map_record(line.record, source.columns, line.where)
                except UserError as e:
                    line.record, line.error = None, str(e).removeprefix(f"{line.where}: ")
            yield line


def _part_lines(part: Part, what: str):
    with open_data_file(part.path, what) as f:
        if is_json_array(f, part.path, what):
            yield from _array_lines(part.path, f.read())
            return
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield parse_line(number, raw)


def parse_line(number: int, raw: bytes) -> Line:
    if number == 1:
        raw = raw.removeprefix(BOM)  # a file's byte-order mark is no part of its first record
    record, error = parse_jsonl_line(raw)
    return Line(number, raw, record, error)


def _array_lines(path: Path, raw: bytes):
    data = decode_json_file(path, raw)
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON array of objects")
    for i, record in enumerate(data, start=1):
        if isinstance(record, dict):
            yield Line(i, None, record)
        else:
            yield Line(i, None, None, f"item {i}: expected a JSON object, got {json_type(record)}")


def check_format_name(fmt: str) -> str | None:
    """'auto' -> None (detect from the data); a known name -> itself; anything else -> UserError."""
    if fmt in (None, "", "auto"):
        return None
    if fmt not in FORMAT_NAMES:
        raise UserError(f"--format: expected auto, {', '.join(FORMAT_NAMES)}; got {fmt!r}")
    return fmt


# ---- text views ------------------------------------------------------------------------------

def empty_fields(record: dict, fmt: str) -> list[str]:
    """Names of the fields that are strings of only whitespace (chat: messages[i].content)."""

    def blank(value) -> bool:
        return isinstance(value, str) and not value.strip()

    if fmt == "alpaca":
        return [key for key in ("instruction", "output") if blank(record.get(key))]
    if fmt == "text":
        return ["text"] if blank(record.get("text")) else []
    messages = record.get("messages")
    if not isinstance(messages, list):
        return []
    return [f"messages[{i}].content" for i, m in enumerate(messages)
            if isinstance(m, dict) and blank(m.get("content"))]


def prompt_text(record: dict, fmt: str) -> str:
    """What the model is asked, for near duplicates: alpaca instruction + input (as synth does),
    chat the user turns (not the system prompt, which many examples share), text the text."""
    if fmt == "alpaca":
        return f"{record['instruction']}\n{record.get('input') or ''}"
    if fmt == "chat":
        return "\n".join(m["content"] for m in record["messages"] if m["role"] == "user")
    return record["text"]


def normalise(text: str) -> str:
    """Unicode NFKC, whitespace runs -> one space, stripped; case is kept (it matters in code)."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def exact_key(record: dict, fmt: str) -> int:
    """64-bit hash of the normalised prompt + response: equal keys are exact duplicates.

    Two different records collide with probability about n^2 / 2^65 (1e-7 for two million)."""
    if fmt == "alpaca":
        parts = [record["instruction"], record.get("input") or "", record["output"]]
    elif fmt == "chat":
        parts = [f"{m['role']}:{m['content']}" for m in record["messages"]]
    else:
        parts = [record["text"]]
    joined = "\x1f".join(normalise(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(joined.encode("utf-8"), digest_size=8).digest(), "little")


# ---- token lengths ---------------------------------------------------------------------------

def resolve_model(model: str | None) -> str:
    """The --model value's local path (a Hub id's snapshot), or the embedded SmolLM2 GGUF when none is given."""
    from hivetune.core.hub import model_path

    return str(model_path(model))


def _text_and_spans(record: dict, fmt: str, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The training text and the character spans of its loss targets, as encode_record makes them."""
    if fmt == "alpaca" and not getattr(tokenizer, "chat_template", None):
        template = ALPACA_PROMPT_INPUT if record.get("input") else ALPACA_PROMPT
        prompt = template.format(instruction=record["instruction"], input=record.get("input", ""))
        eos = tokenizer.eos_token or ""
        return prompt + record["output"] + eos, [(len(prompt), len(prompt) + len(record["output"]) + len(eos))]
    if fmt == "alpaca":
        from hivetune.data.formats import alpaca_messages

        return chat_spans(tokenizer, alpaca_messages(record))
    return chat_spans(tokenizer, record["messages"])


def token_lengths(records: list[dict], fmt: str, tokenizer) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of each record, untruncated, as training counts them:
    response = the loss targets of encode_record (with train_on_inputs off), prompt = the rest.

    One batched call into the Rust tokenizer per list; a target is a token that starts inside an
    assistant span, counted by bisecting the token start offsets (encode_record's rule, without
    building a mask)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: the reference path, one record at a time
        out = []
        for record in records:
            enc = encode_record(record, fmt, tokenizer, 1 << 62, train_on_inputs=False)
            n_target = sum(enc.mask)
            out.append((len(enc.ids) - n_target, n_target))
        return out
    if fmt == "text":
        eos = 1 if tokenizer.eos_token_id is not None else 0
        encodings = backend.encode_batch([r["text"] for r in records], add_special_tokens=True)
        return [(0, len(e.ids) + eos) for e in encodings]
    try:
        rendered = [_text_and_spans(r, fmt, tokenizer) for r in records]
    except UserError:
        raise
    except Exception as e:  # a chat template that raises on this data (e.g. role order rules)
        raise UserError(f"the chat template cannot render a record ({type(e).__name__}: {e})") from None
    encodings = backend.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    out = []
    for (_, spans), enc in zip(rendered, encodings):
        offsets = enc.offsets
        n_target = sum(bisect_left(offsets, b, key=_start) - bisect_left(offsets, a, key=_start) for a, b in spans)
        out.append((len(enc.ids) - n_target, n_target))
    return out


def _start(offset: tuple[int, int]) -> int:
    return offset[0]


def check_output_path(path: str | Path, force: bool, flag: str = "--out") -> Path:
    """An output file path: refused if it exists (unless force) or if its folder is missing."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag}: {path} is a directory, expected a file path")
    if path.exists() and not force:
        raise UserError(f"{flag}: {path} already exists (pass --force to overwrite it)")
    if not path.parent.is_dir():
        raise UserError(f"{flag}: folder {path.parent} does not exist")
    return path
