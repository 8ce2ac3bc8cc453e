"""`hivetune data curate`: the interaction logs that `hivetune serve` writes, made into training data.

Each exchange of the logs (``interaction_log.read_logs``: the request's messages, the answer, its
latest rating and correction) goes through these steps; a record dropped at one is counted under
that step's reason and goes no further:

1. selection: rated +1 -> kept with its answer; with a correction (whatever the rating) -> kept
   with the correction as the answer; rated -1 without a correction -> dropped (bad); unrated ->
   dropped, or kept with its answer under keep_unrated;
2. invalid: messages that training's checks refuse (``formats.check_record``), an empty answer;
3. scrubbing: secrets and personal data in every message replaced by placeholders (data.scrub);
4. too long: more than max_length tokens (the model's tokenizer, prompt + answer as training
   counts them) or, without a model, characters (all messages' contents);
5. duplicates: a record whose key equals an earlier one's: first the exact text (every role and
   content as written), then the normalised text (``scan.exact_key``: NFKC, whitespace runs as
   one space), each against --train-data first (its records as chat messages) and then the
   records kept before it.

Then a replay share of --train-data is mixed in against forgetting: `replay` 0.3 makes 30% of the
output records earlier training records, k = round(replay * n / (1 - replay)) of them for n new
ones (at most the file's usable records), sampled with `seed`, and the whole list shuffled with
it. The output is chat JSONL ({"messages": [...]}), written atomically.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_bytes
from hivetune.data.dedupe import FirstSeen
from hivetune.data.formats import alpaca_messages, check_record, detect_format
from hivetune.data.interaction_log import read_logs
from hivetune.data.scan import check_output_path, exact_key, stream_lines
from hivetune.data.scrub import scrub

DEFAULT_TOKEN_LIMIT = 1024  # with --model and no --max-length: training's max_length default
KEPT = ("rated_good", "corrected", "unrated")
DROPPED = ("rated_bad", "unrated", "invalid", "too_long", "duplicate_train", "duplicate",
           "duplicate_normalised_train", "duplicate_normalised")
REASONS = {
    "rated_bad": "rated bad without a correction", "unrated": "unrated (--keep-unrated keeps them)",
    "invalid": "invalid messages or empty answer", "too_long": "longer than --max-length",
    "duplicate_train": "already in --train-data", "duplicate": "exact duplicate of a kept record",
    "duplicate_normalised_train": "in --train-data once normalised",
    "duplicate_normalised": "duplicate of a kept record once normalised",
}


@dataclass
class CurateResult:
    out: Path
    exchanges: int
    kept: Counter = field(default_factory=Counter)  # by KEPT reason
    dropped: Counter = field(default_factory=Counter)  # by DROPPED reason
    scrubbed: Counter = field(default_factory=Counter)  # replacements by kind (data.scrub)
    scrubbed_records: int = 0
    new: int = 0  # records from the logs in the output
    replayed: int = 0  # records from --train-data in the output
    replay_pool: int = 0  # usable records of --train-data
    replay: float = 0.0  # the share asked for
    broken_lines: int = 0
    orphan_feedback: int = 0
    length_unit: str = "characters"
    max_length: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def written(self) -> int:
        return self.new + self.replayed


def check_arguments(logs: list, out, train_data, replay: float, max_length: int | None, force: bool) -> Path:
    if not logs:
        raise UserError("data curate: name at least one interaction log")
    for log in logs:
        if not Path(log).is_file():
            raise UserError(f"{log}: interaction log not found")
    if not 0 <= replay < 1:
        raise UserError(f"--replay: expected a fraction in [0, 1), got {replay:g}")
    if replay > 0 and not train_data:
        raise UserError("--replay: needs --train-data FILE to take earlier records from")
    if train_data and not Path(train_data).exists():
        raise UserError(f"--train-data: {train_data} not found")
    if max_length is not None and max_length <= 0:
        raise UserError(f"--max-length: must be > 0, got {max_length}")
    return check_output_path(out, force)


def curate(logs: list[str | Path], out: str | Path, train_data: str | Path | None = None, replay: float = 0.0,
           max_length: int | None = None, model: str = "", seed: int = 0, force: bool = False,
           keep_unrated: bool = False) -> CurateResult:
    """Read, select, scrub, limit, deduplicate, mix in replay, write; see the module docstring."""
    out = check_arguments(logs, out, train_data, replay, max_length, force)
    contents = read_logs(list(logs))
    result = CurateResult(out, len(contents.exchanges), broken_lines=contents.broken_lines,
                          orphan_feedback=contents.orphan_feedback)
    train = read_train_records(train_data, result) if train_data else []
    records = []
    for ex in contents.exchanges.values():
        record = select(ex, keep_unrated, result)
        if record is not None:
            records.append(record)
    records = [scrub_record(r, result) for r in records]
    records = within_length(records, max_length, model, result)
    records = deduplicated(records, train, result)
    result.new = len(records)
    replayed = replay_sample(train, replay, len(records), seed, result)
    mixed = records + replayed
    random.Random(seed).shuffle(mixed)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in mixed)
    atomic_write_bytes(out, lines.encode("utf-8"))
    return result


def select(ex, keep_unrated: bool, result: CurateResult) -> dict | None:
    """The exchange as a chat record, or None (counted) when the selection or the checks drop it."""
    if ex.correction is not None:
        answer, reason = ex.correction, "corrected"
    elif ex.rating == 1:
        answer, reason = ex.answer, "rated_good"
    elif ex.rating == -1:
        result.dropped["rated_bad"] += 1
        return None
    elif keep_unrated:
        answer, reason = ex.answer, "unrated"
    else:
        result.dropped["unrated"] += 1
        return None
    messages = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m
                for m in ex.messages]
    record = {"messages": [*messages, {"role": "assistant", "content": answer}]}
    try:
        check_record(record, "chat", ex.source)
    except UserError:
        result.dropped["invalid"] += 1
        return None
    if not answer.strip() or not any(m["role"] == "user" for m in messages):
        result.dropped["invalid"] += 1
        return None
    result.kept[reason] += 1
    return record


def scrub_record(record: dict, result: CurateResult) -> dict:
    counts = Counter()
    messages = [{**m, "content": scrub(m["content"], counts)} for m in record["messages"]]
    if counts:
        result.scrubbed.update(counts)
        result.scrubbed_records += 1
    return {"messages": messages}


def within_length(records: list[dict], max_length: int | None, model: str, result: CurateResult) -> list[dict]:
    """The records of at most max_length tokens (with a model) or characters (without one)."""
    if model:
        from hivetune.data.scan import resolve_model, token_lengths
        from hivetune.model.tokenizer import load_tokenizer  # transformers: only with --model

        limit = max_length or DEFAULT_TOKEN_LIMIT
        tokenizer = load_tokenizer(resolve_model(model))
        lengths = [p + r for p, r in token_lengths(records, "chat", tokenizer)] if records else []
        result.length_unit = "tokens"
    else:
        limit = max_length or 0
        lengths = [sum(len(m["content"]) for m in r["messages"]) for r in records]
    result.max_length = limit
    if not limit:
        return records
    kept = [r for r, n in zip(records, lengths) if n <= limit]
    result.dropped["too_long"] += len(records) - len(kept)
    return kept


def raw_key(record: dict) -> int:
    """64-bit hash of the record's roles and contents exactly as written."""
    joined = "\x1f".join(f"{m['role']}:{m['content']}" for m in record["messages"])
    return int.from_bytes(hashlib.blake2b(joined.encode("utf-8"), digest_size=8).digest(), "little")


def deduplicated(records: list[dict], train: list[dict], result: CurateResult) -> list[dict]:
    """Records whose exact and normalised keys are new: not in --train-data, not kept before."""
    seen_train, seen = (FirstSeen(), FirstSeen()), (FirstSeen(), FirstSeen())
    for i, r in enumerate(train):
        seen_train[0].add(raw_key(r), i)
        seen_train[1].add(exact_key(r, "chat"), i)
    kept = []
    for i, r in enumerate(records):
        keys = (raw_key(r), exact_key(r, "chat"))
        reason = ("duplicate_train" if seen_train[0].first_line(keys[0]) is not None else
                  "duplicate" if seen[0].first_line(keys[0]) is not None else
                  "duplicate_normalised_train" if seen_train[1].first_line(keys[1]) is not None else
                  "duplicate_normalised" if seen[1].first_line(keys[1]) is not None else None)
        if reason:
            result.dropped[reason] += 1
            continue
        seen[0].add(keys[0], i)
        seen[1].add(keys[1], i)
        kept.append(r)
    return kept


def read_train_records(path, result: CurateResult) -> list[dict]:
    """--train-data's prompt/response records as chat records; text records and lines that do
    not parse or check are left out (counted in a note)."""
    records, unusable = [], 0
    for line in stream_lines(path, "--train-data"):
        record = line.record
        fmt = detect_format(record) if record is not None else None
        try:
            if fmt not in ("chat", "alpaca"):
                raise UserError("not a prompt/response record")
            check_record(record, fmt, line.where)
        except UserError:
            unusable += 1
            continue
        messages = alpaca_messages(record) if fmt == "alpaca" else record["messages"]
        records.append({"messages": [{"role": m["role"], "content": m["content"]} for m in messages]})
    if unusable:
        result.notes.append(f"--train-data: {unusable} records left out of dedup and replay (not alpaca or chat, "
                            f"or invalid)")
    result.replay_pool = len(records)
    return records


def replay_sample(train: list[dict], replay: float, new: int, seed: int, result: CurateResult) -> list[dict]:
    """round(replay * new / (1 - replay)) records of `train` drawn without replacement."""
    result.replay = replay
    if replay <= 0:
        return []
    want = round(replay * new / (1 - replay))
    k = min(want, len(train))
    if k < want:
        result.notes.append(f"--replay: {want} records wanted, --train-data has {len(train)}: all of them replayed")
    result.replayed = k
    return random.Random(seed).sample(train, k)


def format_curate(result: CurateResult) -> str:
    """What was kept, dropped (and why), scrubbed and replayed, as counts."""
    kept = sum(result.kept.values())
    dropped = sum(result.dropped.values())
    lines = [f"read {result.exchanges} exchanges"
             + (f" ({result.broken_lines} broken lines skipped)" if result.broken_lines else "")
             + (f" ({result.orphan_feedback} ratings for exchanges not in these logs)"
                if result.orphan_feedback else ""),
             f"selected {kept}: " + ", ".join(f"{result.kept[k]} {label}" for k, label in
                                              (("rated_good", "rated good"), ("corrected", "corrected"),
                                               ("unrated", "unrated")) if k != "unrated" or result.kept[k])]
    lines.append(f"dropped {dropped}" + (":" if dropped else ""))
    lines += [f"  {result.dropped[k]:>6}  {REASONS[k]}" for k in DROPPED if result.dropped[k]]
    if result.scrubbed:
        what = ", ".join(f"{n} {kind}" for kind, n in sorted(result.scrubbed.items()))
        lines.append(f"scrubbed {sum(result.scrubbed.values())} items in {result.scrubbed_records} records ({what})")
    if result.max_length:
        lines.append(f"length limit: {result.max_length} {result.length_unit}")
    if result.replay:
        share = result.replayed / result.written if result.written else 0.0
        lines.append(f"replay: {result.replayed} records from --train-data ({100 * share:.1f}% of the output)")
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"wrote {result.written} records ({result.new} new, {result.replayed} replayed) to {result.out}")
    return "\n".join(lines)
