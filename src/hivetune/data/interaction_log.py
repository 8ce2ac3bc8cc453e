"""The interaction log that `hivetune serve` writes and `data curate` / `data pairs` read.

One JSON record per line (JSONL), two kinds:

    {"type": "exchange", "id": "ex-3f2a...", "time": "2026-11-29T07:30:00.123Z", "model": "v0003",
     "messages": [{"role": "user", "content": "..."}], "answer": "...", "latency_s": 0.41,
     "prompt_tokens": 12, "completion_tokens": 30}
    {"type": "feedback", "id": "ex-3f2a...", "time": "...", "rating": 1, "correction": "..."}

``messages`` is the request's conversation (without the answer); ``rating`` is +1 or -1;
``correction`` (optional, may be null) is the answer the user wanted instead. Later feedback on
the same exchange replaces earlier feedback.

Each record is appended as one whole line in a single ``write`` on a file opened with
``O_APPEND``, and flushed to the OS. A process killed mid-write can leave at most its last
line cut short: a writer that opens the file first ends such a line with a newline, and the
reader counts lines that do not parse and skips them, so a kill never stops the reader.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path


def new_exchange_id() -> str:
    return "ex-" + uuid.uuid4().hex


def utc_now() -> str:
    """The current time as ISO 8601 UTC with milliseconds, e.g. 2026-11-29T07:30:00.123Z."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


class InteractionLog:
    """Appends records to one JSONL file; safe to share between threads of one process."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._end_cut_line()

    def _end_cut_line(self) -> None:
        """A line cut short by a kill gets its newline, so the next record starts a line of its own."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                os.write(self._fd, b"\n")

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        with self._lock:
            written = os.write(self._fd, line)
            while written < len(line):  # a short write (signal, full pipe): finish the same line
                written += os.write(self._fd, line[written:])

    def exchange(self, model: str, messages: list[dict], answer: str, latency_s: float, prompt_tokens: int,
                 completion_tokens: int, exchange_id: str | None = None, **extra) -> str:
        exchange_id = exchange_id or new_exchange_id()
        self.append({"type": "exchange", "id": exchange_id, "time": utc_now(), "model": model, "messages": messages,
                     "answer": answer, "latency_s": round(latency_s, 4), "prompt_tokens": prompt_tokens,
                     "completion_tokens": completion_tokens, **extra})
        return exchange_id

    def feedback(self, exchange_id: str, rating: int, correction: str | None = None) -> None:
        self.append({"type": "feedback", "id": exchange_id, "time": utc_now(), "rating": rating,
                     "correction": correction})

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class Exchange:
    id: str
    time: str
    model: str
    messages: list[dict]
    answer: str
    rating: int | None = None
    correction: str | None = None
    source: str = ""  # FILE:LINE of the exchange record
    record: dict = field(default_factory=dict)


@dataclass
class LogContents:
    exchanges: dict[str, Exchange]  # by id, in the order first seen
    broken_lines: int = 0  # lines that do not parse (a cut last line) or are not a record
    orphan_feedback: int = 0  # feedback for an exchange id not in these logs


def read_logs(paths: list[str | Path]) -> LogContents:
    """Every exchange of these logs with its latest feedback joined in."""
    out = LogContents({})
    feedback: list[tuple[dict, str]] = []
    for path in paths:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    out.broken_lines += 1
                    continue
                kind = rec.get("type") if isinstance(rec, dict) else None
                where = f"{path}:{number}"
                if kind == "exchange" and isinstance(rec.get("id"), str) and isinstance(rec.get("messages"), list) \
                        and isinstance(rec.get("answer"), str):
                    out.exchanges.setdefault(rec["id"], Exchange(
                        rec["id"], str(rec.get("time", "")), str(rec.get("model", "")), rec["messages"],
                        rec["answer"], source=where, record=rec))
                elif kind == "feedback" and isinstance(rec.get("id"), str) and rec.get("rating") in (1, -1):
                    feedback.append((rec, where))
                else:
                    out.broken_lines += 1
    for rec, _ in feedback:  # after all exchanges: feedback may sit in a later file than its exchange
        ex = out.exchanges.get(rec["id"])
        if ex is None:
            out.orphan_feedback += 1
            continue
        ex.rating = rec["rating"]
        correction = rec.get("correction")
        ex.correction = correction if isinstance(correction, str) and correction.strip() else None
    return out
