"""`hivetune data collect`: turn a JSONL log of real interactions into training records.

Recognised log lines (one interaction each):

- OpenAI-style chat: ``{"messages": [..., {"role": "assistant", ...}]}``, or the messages of the
  request with the reply beside them: ``{"messages": [...], "choices": [{"message": {...}}]}``,
  ``{"messages": [...], "response": ...}``;
- request / response pairs: ``{"request": {"messages": [...]} or {"prompt": ...},
  "response": {"choices": [{"message": {...}}]} or {"choices": [{"text": ...}]} or {"content": ...}}``;
- llama-server ``/completion``: ``{"prompt": "...", "content": "..."}`` (also ``completion`` or
  ``response`` for the reply); a prompt already rendered with a chat template is kept as it is;
- chat transcripts: ShareGPT ``{"conversations": [{"from": "human", "value": ...}, ...]}``, a bare
  JSON list of messages, or a text transcript ``{"transcript": "User: ...\\nAssistant: ..."}``
  (also under ``text`` or ``conversation``) with ``User:`` / ``Assistant:`` / ``System:`` lines
  (``Human``, ``AI``, ``Bot`` and a leading ``###`` are accepted).

Roles human/gpt/bot/model/ai map to user/assistant; message content may be a string or a list of
``{"type": "text", "text": ...}`` parts. Each conversation must end with an assistant reply.

The records are written in FILE's format (chat ``messages`` for a new file): a chat file keeps
the whole conversation; an alpaca file takes single-turn ones (a system prompt is dropped, as
alpaca has no place for it). A record whose normalised prompt + response (``scan.exact_key``) is
already in FILE, or earlier in the log, is skipped as a duplicate; one that fails training's
checks is skipped as invalid. FILE is then rewritten whole through a temp file and a rename, so
a crash leaves the old or the new file, never half of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hivetune.data.dedupe import FirstSeen
from hivetune.data.formats import check_record, detect_format, parse_json_line
from hivetune.data.scan import empty_fields, exact_key, open_data_file, parse_line, stream_lines
from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_with

OUTPUT_FORMATS = ("chat", "alpaca")
ROLE_NAMES = {"user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
              "bot": "assistant", "model": "assistant", "ai": "assistant", "chatbot": "assistant"}
_TRANSCRIPT_TURN = re.compile(r"^(?:#+\s*)?(user|human|assistant|ai|bot|gpt|system)\s*:[ \t]?(.*)$", re.IGNORECASE)
# Reasons listed per kind of skip; beyond this they are only counted.
LISTED_SKIPS = 20


class NotAnInteraction(ValueError):
    """A log line that yields no training record; the message says why."""


@dataclass
class CollectResult:
    log: Path
    out: Path
    format: str
    lines: int = 0
    added: int = 0
    duplicate: int = 0
    invalid: int = 0
    reasons: list[str] = field(default_factory=list)  # the first invalid lines, as file:line: why


def collect_log(log: str | Path, out: str | Path, fmt: str = "auto") -> CollectResult:
    """Append the new, valid interactions of `log` to `out` (created if missing)."""
    log, out = Path(log), Path(out)
    if fmt not in ("auto", *OUTPUT_FORMATS):
        raise UserError(f"--format: expected auto, chat or alpaca; got {fmt!r}")
    with open_data_file(log, "log file"):
        pass
    if out.is_dir():
        raise UserError(f"--out: {out} is a directory, expected a JSONL file")
    if not out.parent.is_dir():
        raise UserError(f"--out: folder {out.parent} does not exist")
    if out.exists() and log.resolve() == out.resolve():
        raise UserError(f"{log}: the log cannot also be the output")
    seen = FirstSeen()
    existing = _read_existing(out, seen) if out.exists() else None
    if existing and fmt != "auto" and fmt != existing:
        raise UserError(f"--format {fmt}: {out} holds {existing} records")
    out_format = existing or ("chat" if fmt == "auto" else fmt)
    if out_format not in OUTPUT_FORMATS:
        raise UserError(f"{out}: holds {out_format} records; collect writes chat or alpaca prompt/response pairs")
    result = CollectResult(log, out, out_format)

    fd, new_lines = tempfile.mkstemp(prefix=f".{out.name}.new-", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as new_f:
            for number, raw in _log_lines(log):
                result.lines += 1
                try:
                    record = _to_record(_interaction(raw), out_format, f"{log}:{number}")
                except NotAnInteraction as e:
                    result.invalid += 1
                    if len(result.reasons) < LISTED_SKIPS:
                        result.reasons.append(f"{log}:{number}: {e}")
                    continue
                if seen.add(exact_key(record, out_format), number) is not None:
                    result.duplicate += 1
                    continue
                new_f.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
                result.added += 1
        if result.added:
            atomic_write_with(out, lambda tmp: _concatenate(out, Path(new_lines), Path(tmp)))
    finally:
        Path(new_lines).unlink(missing_ok=True)
    return result


def _read_existing(out: Path, seen: FirstSeen) -> str | None:
    """Remember the keys of FILE's records; return its format (None if it has no records yet).

    FILE must be clean JSONL: it is copied into the new file as it is."""
    fmt = None
    with open_data_file(out) as f:
        head = f.read(1 << 16).lstrip()
    if head.startswith(b"["):
        raise UserError(f"{out}: is a JSON array; collect appends to JSONL files")
    if not head:
        return None
    for line in stream_lines(out):
        where = f"{out}:{line.number}"
        if line.error:
            raise UserError(f"{where}: {line.error}")
        fmt = fmt or detect_format(line.record)
        if fmt is None:
            raise UserError(f"{where}: cannot tell the format of the existing file")
        check_record(line.record, fmt, where)
        seen.add(exact_key(line.record, fmt), line.number)
    return fmt


def _log_lines(log: Path):
    with open_data_file(log, "log file") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield number, raw


def _concatenate(out: Path, new_lines: Path, tmp: Path) -> None:
    with open(tmp, "wb") as dst:
        if out.exists():
            with open(out, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
            if dst.tell():
                with open(out, "rb") as src:
                    src.seek(-1, os.SEEK_END)
                    if src.read(1) != b"\n":
                        dst.write(b"\n")
        with open(new_lines, "rb") as src:
            shutil.copyfileobj(src, dst, 1 << 20)


# ---- reading one interaction -----------------------------------------------------------------

def _interaction(raw: bytes) -> list[dict]:
    """The conversation of one log line, ending with the assistant's reply."""
    stripped = raw.strip()
    if stripped.startswith(b"["):
        messages, error = parse_json_line(stripped)
        if error:
            raise NotAnInteraction(error)
        return _finish(_messages(messages))
    line = parse_line(0, raw)
    if line.error:
        raise NotAnInteraction(line.error)
    entry = line.record
    if isinstance(entry.get("request"), dict) and "response" in entry:
        return _finish(_prompt_messages(entry["request"]), _reply(entry["response"]))
    if isinstance(entry.get("messages"), list):
        reply = next((_reply(entry[k]) for k in ("choices", "response", "completion") if k in entry), None)
        return _finish(_messages(entry["messages"]), reply)
    if isinstance(entry.get("conversations"), list):
        return _finish(_messages(entry["conversations"]))
    if isinstance(entry.get("prompt"), str):
        reply = next((_reply(entry[k]) for k in ("content", "completion", "response", "choices") if k in entry), None)
        return _finish([{"role": "user", "content": entry["prompt"]}], reply)
    for key in ("transcript", "text", "conversation"):
        if isinstance(entry.get(key), str):
            return _finish(_transcript(entry[key]))
    raise NotAnInteraction("not a recognised interaction (expected messages, request/response, "
                           "prompt/content, conversations or a transcript)")


def _finish(messages: list[dict], reply: str | None = None) -> list[dict]:
    if reply is not None:
        messages = messages + [{"role": "assistant", "content": reply}]
    if not messages or messages[-1]["role"] != "assistant":
        raise NotAnInteraction("no assistant reply")
    if not any(m["role"] == "user" for m in messages):
        raise NotAnInteraction("no user message")
    return messages


def _prompt_messages(request: dict) -> list[dict]:
    if isinstance(request.get("messages"), list):
        return _messages(request["messages"])
    if isinstance(request.get("prompt"), str):
        return [{"role": "user", "content": request["prompt"]}]
    raise NotAnInteraction("request has neither messages nor a prompt")


def _messages(items) -> list[dict]:
    if not isinstance(items, list):
        raise NotAnInteraction("messages must be a list")
    out = []
    for i, m in enumerate(items):
        if not isinstance(m, dict):
            raise NotAnInteraction(f"messages[{i}] is not an object")
        role = m.get("role", m.get("from"))
        if not isinstance(role, str) or role.lower() not in ROLE_NAMES:
            raise NotAnInteraction(f"messages[{i}] has role {role!r} (tool and function turns are not collected)")
        content = _text(m.get("content", m.get("value")))
        if content is None:
            raise NotAnInteraction(f"messages[{i}] has no text content")
        out.append({"role": ROLE_NAMES[role.lower()], "content": content})
    return out


def _text(content) -> str | None:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                return None  # an image or audio part: not text training data
        return "".join(parts)
    return None


def _reply(response) -> str | None:
    """The assistant text of a response object: a string, OpenAI choices, llama-server content."""
    if isinstance(response, str):
        return response
    if isinstance(response, list):  # a bare choices list
        response = {"choices": response}
    if not isinstance(response, dict):
        raise NotAnInteraction("response is neither text nor an object")
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        if isinstance(choice.get("message"), dict):
            text = _text(choice["message"].get("content"))
        else:
            text = _text(choice.get("text"))
        if text is None:
            raise NotAnInteraction("the reply has no text (a tool call?)")
        return text
    for key in ("content", "response", "completion", "text"):
        if isinstance(response.get(key), str):
            return response[key]
    if isinstance(response.get("message"), dict):  # Ollama /api/chat
        text = _text(response["message"].get("content"))
        if text is not None:
            return text
    raise NotAnInteraction("cannot find the reply text in the response")


def _transcript(text: str) -> list[dict]:
    messages: list[dict] = []
    for row in text.splitlines():
        turn = _TRANSCRIPT_TURN.match(row)
        if turn:
            messages.append({"role": ROLE_NAMES[turn.group(1).lower()], "content": turn.group(2)})
        elif messages:
            messages[-1]["content"] += "\n" + row
        elif row.strip():
            raise NotAnInteraction("transcript text before the first 'User:' / 'Assistant:' line")
    for m in messages:
        m["content"] = m["content"].strip()
    return messages


def _to_record(messages: list[dict], fmt: str, where: str) -> dict:
    """The training record for a conversation, checked as training will check it."""
    if fmt == "alpaca":
        turns = [m for m in messages if m["role"] != "system"]
        if [m["role"] for m in turns] != ["user", "assistant"]:
            raise NotAnInteraction("multi-turn conversation; alpaca records hold one question and its answer "
                                   "(collect into a chat file to keep these)")
        record = {"instruction": turns[0]["content"], "input": "", "output": turns[1]["content"]}
    else:
        record = {"messages": messages}
    try:
        check_record(record, fmt, where)
    except UserError as e:
        raise NotAnInteraction(str(e).removeprefix(f"{where}: ")) from None
    empty = empty_fields(record, fmt)
    if empty:
        raise NotAnInteraction(f"empty {', '.join(empty)}")
    return record


def format_collect(result: CollectResult) -> str:
    lines = [f"{result.log}: {result.lines:,} interactions -> {result.out} ({result.format})",
             f"  added: {result.added:,}",
             f"  skipped, duplicate: {result.duplicate:,}",
             f"  skipped, invalid: {result.invalid:,}"]
    lines += [f"    {reason}" for reason in result.reasons]
    if result.invalid > len(result.reasons):
        lines.append(f"    ... and {result.invalid - len(result.reasons):,} more")
    return "\n".join(lines)
