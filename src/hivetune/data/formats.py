"""Read alpaca / chat / text records and turn them into token ids with a loss mask.

Records stream from JSONL (one object per line) or a JSON array file; parquet, CSV, JSONL.gz,
folders and Hub datasets arrive as JSONL parts (``data.sources``). A record is mapped as it is
read: renamed columns (``data_columns``), a ShareGPT conversation (``conversations`` of
``from`` / ``value``) as chat messages. Every problem is reported as ``file:line: what is wrong``
(a UserError), so the user can jump to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.data.sources import DataSource, Part, as_source, data_parts

ROLES = ("system", "user", "assistant")
# ShareGPT's speaker names (`from`) -> chat roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "model": "assistant", "chatgpt": "assistant", "bard": "assistant"}
FORMAT_NAMES = ("alpaca", "chat", "text")
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class Encoded:
    ids: list[int]
    mask: list[bool]  # True where the token is a loss target
    truncated: bool = False

    @property
    def n_targets(self) -> int:
        # Token t is predicted from position t-1, so the first token can never be a target.
        return sum(self.mask[1:])


def open_data_file(path: str | Path, what: str = "data file"):
    """Open for binary reading, or raise the one-line UserError the CLI turns into exit 2."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, expected a JSONL or JSON file")
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found") from None
    except OSError as e:
        raise UserError(f"{path}: unreadable {what} ({e.strerror})") from None


# A UTF-8 byte-order mark: Windows editors (Notepad, Excel's CSV-to-JSON exports) start files with
# it. JSON forbids it, yet it carries no text: every reader here skips it.
BOM = b"\xef\xbb\xbf"


def starts_with_bom(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(BOM)) == BOM
    except OSError:
        return False


def json_type(value) -> str:
    """JSON's name for a parsed value's type: object, array, string, number, true/false, null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number"}
    return names.get(type(value), type(value).__name__)


def is_json_array(f, path: Path, what: str = "data file") -> bool:
    """True when the first non-blank byte is '[' (a JSON array), False for JSONL; the file is
    rewound. An all-blank file (a byte-order mark aside) is an error."""
    head, first = b"", True
    while not head:
        chunk = f.read(1 << 16)
        if not chunk:
            break
        head = (chunk.removeprefix(BOM) if first else chunk).lstrip()
        first = False
    f.seek(0)
    if not head:
        raise UserError(f"{path}: {what} is empty")
    return head.startswith(b"[")


def parse_jsonl_line(raw: bytes) -> tuple[dict | None, str | None]:
    """One JSONL line -> (record, None), or (None, what is wrong with it) without a file:line prefix.

    The one parser of JSONL lines: training stops at the first error (``iter_records``), the data
    tools collect them (``scan.parse_line``). The record must be a JSON object; the decoding is
    parse_json_line's."""
    record, error = parse_json_line(raw)
    if error is None and not isinstance(record, dict):
        return None, f"expected a JSON object, got {json_type(record)}"
    return record, error


def parse_json_line(raw: bytes) -> tuple[object, str | None]:
    """One line's JSON value of any type -> (value, None), or (None, what is wrong with it): the
    decoding of parse_jsonl_line, and of `data collect`'s log lines that hold a bare message
    array. The line break is stripped first, so an error at the end of the line gets this line's
    column. A leading byte-order mark (BOM) is skipped. Hostile input gets a message, never an
    exception: bytes that are not UTF-8, nesting deeper than MAX_NESTING, integers longer than
    Python converts (4300 digits)."""
    try:
        text = raw.rstrip(b"\r\n").removeprefix(BOM).decode("utf-8")
        if _nested_too_deeply(text):
            raise RecursionError
        return json.loads(text), None
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte {e.start})"
    except json.JSONDecodeError as e:
        return None, f"malformed JSON ({_json_error(e)})"
    except RecursionError:
        return None, "malformed JSON (nested too deeply)"
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        return None, f"malformed JSON ({str(e).split(':')[0]})"


MAX_NESTING = 500  # below Python's recursion limit, so the answer does not depend on the caller's stack


def _nested_too_deeply(text: str) -> bool:
    """Whether arrays / objects nest deeper than MAX_NESTING (brackets inside strings aside).
    json.loads's own RecursionError comes at a depth that depends on how deep the caller's stack
    is, so two callers of this parser disagreed on a line nested ~990 deep (hypothesis found it)."""
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _json_error(e: json.JSONDecodeError) -> str:
    """'Expecting value at column 32' ('Unterminated string starting at' ends in 'at' already)."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def iter_records(path: str | Path, columns: dict | None = None, part: Part | None = None):
    """Yield (line_number, byte_offset, record) from JSONL, or (item, None, record) from a JSON
    array; each record mapped (map_record). `part` names the file in messages (default: `path`)."""
    path = Path(path)
    part = part or Part(path, str(path))
    with open_data_file(path) as f:
        if is_json_array(f, path):
            for item, _, record in _iter_json_array(path, f.read()):
                yield item, None, map_record(record, columns, part.where(item, array=True))
            return
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            record, error = parse_jsonl_line(raw)
            if error:
                raise UserError(f"{part.where(lineno)}: {error}")
            yield lineno, start, map_record(record, columns, part.where(lineno))


def iter_source(source: str | Path | DataSource, parts: list[Part] | None = None):
    """Yield (part number, where, line, offset, record) over every part of a data source (`parts`:
    its data_parts, when the caller has them already)."""
    source = as_source(source)
    for number, part in enumerate(data_parts(source) if parts is None else parts):
        for line, offset, record in iter_records(part.path, source.columns, part):
            yield number, part.where(line, array=offset is None), line, offset, record


def map_record(record: dict, columns: dict | None, where: str) -> dict:
    """The record with the data's columns renamed to ours (columns: ours -> theirs) and a ShareGPT
    conversation as chat `messages`; a column named but absent is an error naming it."""
    if columns:
        record = dict(record)
        for ours, theirs in columns.items():
            if theirs not in record:
                raise UserError(f"{where}: no column {theirs!r} (data_columns.{ours}); "
                                f"the record has {field_names(record) or 'no fields'}")
            record[ours] = record.pop(theirs)
    if "conversations" in record and "messages" not in record:
        record = {**record, "messages": sharegpt_messages(record["conversations"], where)}
    return record


def field_names(record: dict, most: int = 8) -> str:
    """"'a', 'b', 'c'": a record's first field names, for messages (a table may have hundreds)."""
    names = ", ".join(repr(k) for k in list(record)[:most])
    return names + (f", ... ({len(record)} in all)" if len(record) > most else "")


def sharegpt_messages(turns, where: str) -> list[dict]:
    """ShareGPT turns ({"from": "human" | "gpt" | "system", "value": text}) as chat messages."""
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: field 'conversations' must be a non-empty list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise UserError(f"{where}: conversations[{i}] must be an object with from and value")
        role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise UserError(f"{where}: conversations[{i}] has unknown from {turn['from']!r} "
                            f"(expected {', '.join(SHAREGPT_ROLES)})")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def checked_records(source: str | Path | DataSource, fmt: str = "auto", setting: str | None = "format"):
    """Yield (where, line, offset, record, format) for each record of a data source (iter_source)."""
    for _, where, line, offset, record, chosen in checked_source(source, fmt, setting):
        yield where, line, offset, record, chosen


def checked_source(source: str | Path | DataSource, fmt: str = "auto", setting: str | None = "format",
                   parts: list[Part] | None = None):
    """Yield (part number, where, line, offset, record, format) for each record of a data source,
    each checked against `fmt`, or with "auto" against the format of the first record; every
    error names file:line. `setting`: the option a user sets the format with, named in the
    message when the first record's format cannot be told (None: the caller has none)."""
    chosen = None if fmt == "auto" else fmt
    for number, where, line, offset, record in iter_source(source, parts):
        if chosen is None:
            chosen = detect_format(record)
            if chosen is None:
                advice = (f"; set {setting} to one of {', '.join(FORMAT_NAMES)}, or name the record's columns "
                          f"({field_names(record)}) with data_columns" if setting else "")
                raise UserError(f"{where}: cannot tell the format (expected 'messages', 'instruction'+'output' "
                                f"or 'text'){advice}")
        check_record(record, chosen, where)
        yield number, where, line, offset, record, chosen


def decode_json_file(path: Path, raw: bytes):
    """A whole JSON document (a JSON array data file; a leading BOM skipped), or a file:line UserError."""
    skipped = len(BOM) if raw.startswith(BOM) else 0
    try:
        return json.loads(raw[skipped:].decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not valid UTF-8 (byte {e.start + skipped})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: malformed JSON ({_json_error(e)})") from None
    except RecursionError:
        raise UserError(f"{path}: malformed JSON (nested too deeply)") from None
    except ValueError as e:
        raise UserError(f"{path}: malformed JSON ({str(e).split(':')[0]})") from None


def _iter_json_array(path: Path, raw: bytes):
    data = decode_json_file(path, raw)
    if not isinstance(data, list) or not data:
        raise UserError(f"{path}: expected a non-empty JSON array of objects")
    for i, record in enumerate(data, start=1):
        if not isinstance(record, dict):
            raise UserError(f"{path}: item {i}: expected a JSON object, got {json_type(record)}")
        yield i, None, record


def read_line_at(path: Path, lineno: int, offset: int, columns: dict | None = None,
                 part: Part | None = None) -> dict:
    """Re-read one JSONL record by byte offset (checked again: the file may have changed), mapped
    as when it was indexed (map_record)."""
    where = (part or Part(path, str(path))).where(lineno)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            raw = f.readline()
    except FileNotFoundError:
        raise UserError(f"{path}: data file disappeared during the run") from None
    except OSError as e:
        raise UserError(f"{where}: record changed during the run ({e})") from None
    record, error = parse_jsonl_line(raw)
    if error:
        raise UserError(f"{where}: record changed during the run ({error})")
    return map_record(record, columns, where)


def detect_format(record: dict) -> str | None:
    if "chosen" in record and "rejected" in record:  # a preference pair: {prompt | messages, chosen, rejected}
        return "preference"
    if "messages" in record or "conversations" in record:  # ShareGPT's is mapped to messages when read
        return "chat"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    return None


def check_record(record: dict, fmt: str, where: str) -> None:
    """Raise a UserError naming `where` (file:line) if the record does not fit `fmt`."""

    def need_str(key, allow_empty=False):
        value = record.get(key)
        if key not in record:
            raise UserError(f"{where}: missing field {key!r} for {fmt} format")
        if not isinstance(value, str):
            raise UserError(f"{where}: field {key!r} must be a string, got {json_type(value)}")
        if not allow_empty and not value.strip():
            raise UserError(f"{where}: field {key!r} is empty")
        check_encodable(value, where, f"field {key!r}")

    if fmt == "preference":
        check_pair(record, where)
    elif fmt == "alpaca":
        need_str("instruction")
        need_str("output")
        if record.get("input") is not None:
            need_str("input", allow_empty=True)
    elif fmt == "text":
        need_str("text")
    elif fmt == "chat":
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: field 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise UserError(f"{where}: messages[{i}] must be an object with role and content")
            if m.get("role") not in ROLES:
                raise UserError(f"{where}: messages[{i}] has unknown role {m.get('role')!r} "
                                f"(expected {', '.join(ROLES)})")
            if not isinstance(m.get("content"), str):
                raise UserError(f"{where}: messages[{i}].content must be a string")
            check_encodable(m["content"], where, f"messages[{i}].content")
        if not any(m["role"] == "assistant" for m in messages):
            raise UserError(f"{where}: no assistant message to learn from")
    else:
        raise UserError(f"{where}: unknown format {fmt!r}")


def check_messages(messages, where: str, key: str = "messages") -> None:
    """A non-empty list of {role, content} objects with known roles and string contents."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: field {key!r} must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"{where}: {key}[{i}] must be an object with role and content")
        if m.get("role") not in ROLES:
            raise UserError(f"{where}: {key}[{i}] has unknown role {m.get('role')!r} (expected {', '.join(ROLES)})")
        if not isinstance(m.get("content"), str):
            raise UserError(f"{where}: {key}[{i}].content must be a string")
        check_encodable(m["content"], where, f"{key}[{i}].content")


def pair_answer_text(value) -> str:
    """A pair's chosen / rejected as one text: the string, or its assistant messages' contents."""
    return value if isinstance(value, str) else "\n".join(m["content"] for m in value)


def check_pair(record: dict, where: str) -> None:
    """A preference pair: 'prompt' (a string, or messages) or 'messages'; 'chosen' and 'rejected',
    each a non-empty string or a list of assistant messages, and not the same answer."""
    key = "prompt" if "prompt" in record else "messages" if "messages" in record else None
    if key is None:
        raise UserError(f"{where}: missing field 'prompt' (or 'messages') for preference format")
    prompt = record[key]
    if isinstance(prompt, str) and key == "prompt":
        if not prompt.strip():
            raise UserError(f"{where}: field 'prompt' is empty")
        check_encodable(prompt, where, "field 'prompt'")
    else:
        check_messages(prompt, where, key)
    for name in ("chosen", "rejected"):
        if name not in record:
            raise UserError(f"{where}: missing field {name!r} for preference format")
        value = record[name]
        if isinstance(value, list):
            check_messages(value, where, name)
            if any(m["role"] != "assistant" for m in value):
                raise UserError(f"{where}: field {name!r}: messages must all be assistant messages")
        elif isinstance(value, str):
            check_encodable(value, where, f"field {name!r}")
        else:
            raise UserError(f"{where}: field {name!r} must be a string or a list of assistant messages, "
                            f"got {json_type(value)}")
        if not pair_answer_text(value).strip():
            raise UserError(f"{where}: field {name!r} is empty")
    if pair_answer_text(record["chosen"]).strip() == pair_answer_text(record["rejected"]).strip():
        raise UserError(f"{where}: chosen and rejected are the same answer")


def check_encodable(text: str, where: str, what: str) -> None:
    """JSON's \\ud800 escapes decode to lone UTF-16 surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{where}: {what} holds an unpaired surrogate ({text[e.start]!r} at character "
                        f"{e.start}), which is not text") from None


def alpaca_messages(record: dict) -> list[dict]:
    user = record["instruction"]
    if record.get("input"):
        user = f"{user}\n\n{record['input']}"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The model's chat template, or a plain fallback.

    Templates come with the model (tokenizer_config.json, GGUF metadata): untrusted code.
    transformers renders them in jinja2's ImmutableSandboxedEnvironment, which refuses attribute
    access such as ``''.__class__`` (tested in tests/test_robust_input.py); anything a template
    raises (a sandbox violation, a syntax error, its own raise_exception) becomes a UserError."""
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as e:
            raise UserError(f"the model's chat template failed ({type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    text = "".join(f"### {m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages)
    return text + ("### Assistant:\n" if add_generation_prompt else "")


def chat_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Full conversation text and the character spans of the assistant turns (the targets).

    Each turn's span runs from the end of the prompt rendered up to it (with the generation
    prompt) to the end of the conversation rendered through it, so it includes the template's
    end-of-turn token: the model learns to stop.
    """
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(upto) and upto.startswith(prompt)):
            spans = []  # the template rewrites history (e.g. strips reasoning): last turn only
            break
        spans.append((len(prompt), len(upto)))
    if not spans:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = render_chat(tokenizer, messages[:last], add_generation_prompt=True)
        full = render_chat(tokenizer, messages[: last + 1], add_generation_prompt=False)
        if not full.startswith(prompt):
            raise UserError("the chat template does not render the prompt as a prefix of the conversation")
        spans = [(len(prompt), len(full))]
    return full, spans


def encode_record(record: dict, fmt: str, tokenizer, max_length: int, train_on_inputs: bool) -> Encoded:
    """Token ids and loss mask for one record (format already checked), cut to max_length tokens.

    Only a prefix of a long record is rendered and tokenised (``_encode_prefix``). Tokenised whole,
    a 100 MB line is tens of millions of tokens whose ids and offsets Python holds as objects
    (the test tokenizer: +770 MB and 11 s for 4 MB, so ~19 GB and minutes for 100 MB), all to
    keep max_length of them; and ``chat_spans`` renders a conversation once per assistant turn,
    so its time is quadratic in the turns (2000 short turns: 11 s; a 100 MB line holds millions).
    Cutting the text changes only the tokens next to the cut (a word cut in two), so a prefix is
    taken once its tokens run max_length + 64 past the max_length kept; otherwise 4 x the
    characters are tried. A record that is not cut is encoded exactly as a whole; a cut one gives
    the whole one's first max_length tokens (tests/test_robust_input.py), except under a template
    that rewrites history (chat_spans' last-turn rule then takes the last answer in the prefix)."""
    if fmt == "preference":
        raise UserError("a preference pair (prompt, chosen, rejected) trains with method dpo or orpo "
                        "(--method dpo), not sft")
    chars = 8 * (max_length + 32)  # ~2 x (max_length + 32) tokens at ~4 characters a token
    while True:
        ids, mask, cut = _encode_prefix(record, fmt, tokenizer, chars, train_on_inputs)
        if not cut or len(ids) >= 2 * max_length + 64:
            return Encoded(ids[:max_length], mask[:max_length], len(ids) > max_length)
        chars *= 4


# Characters a chat template adds around each message (ChatML's "<|im_start|>user\n" and
# "<|im_end|>\n" are 28): it only sizes the prefix tried first; encode_record widens a short one.
TURN_CHARS = 16


def clip_messages(messages: list[dict], chars: int) -> tuple[list[dict], bool]:
    """The first messages whose contents hold `chars` characters (each message counting
    TURN_CHARS more), the last one cut to fit; and whether anything was cut."""
    kept, room = [], chars
    for m in messages:
        if room <= 0:
            return kept, True
        if len(m["content"]) > room:
            return kept + [{**m, "content": m["content"][:room]}], True
        kept.append(m)
        room -= len(m["content"]) + TURN_CHARS
    return kept, False


def _encode_prefix(record: dict, fmt: str, tokenizer, chars: int,
                   train_on_inputs: bool) -> tuple[list[int], list[bool], bool]:
    """Ids and loss mask of the record with each field cut to `chars` characters (a conversation:
    its first `chars`, clip_messages), and whether anything was cut. Nothing cut: the whole record."""
    if fmt == "text":
        text = record["text"]
        ids = tokenizer(text[:chars], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and len(text) <= chars:
            ids = ids + [tokenizer.eos_token_id]
        return ids, [True] * len(ids), len(text) > chars
    if fmt == "alpaca" and not getattr(tokenizer, "chat_template", None):
        fields = [record["instruction"], record.get("input") or "", record["output"]]
        cut = any(len(f) > chars for f in fields)
        instruction, given, output = (f[:chars] for f in fields)
        template = ALPACA_PROMPT_INPUT if given else ALPACA_PROMPT
        prompt = template.format(instruction=instruction, input=given)
        eos = tokenizer.eos_token or ""
        text, spans = prompt + output + eos, [(len(prompt), len(prompt) + len(output) + len(eos))]
    else:
        messages, cut = clip_messages(alpaca_messages(record) if fmt == "alpaca" else record["messages"], chars)
        if any(m["role"] == "assistant" for m in messages):
            text, spans = chat_spans(tokenizer, messages)
        else:  # the answers start after the prefix: no target in it
            text, spans = render_chat(tokenizer, messages, add_generation_prompt=False), []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    # A token is a target when it starts inside an assistant span.
    mask = [train_on_inputs or any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask, cut
