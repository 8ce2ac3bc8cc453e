"""Held-out examples for `hivetune eval`: prompt/response records checked, rendered and encoded.

An ``EvalExample`` holds the prompt as training renders it (ending where the answer starts),
the reference answer, the commands a command hit looks for (``reference_commands``), and
training's encoding of the whole record (ids and loss mask), so that the eval's response loss
is the one training computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.data.formats import (ALPACA_PROMPT, ALPACA_PROMPT_INPUT, Encoded, alpaca_messages, checked_records,
                                   encode_record, render_chat)


@dataclass
class EvalExample:
    where: str  # file:line, for the report
    question: str  # the last user message
    reference: str  # the last assistant message
    commands: list[str]  # what a command hit looks for (see reference_commands)
    prompt_ids: list[int]  # the prompt as training renders it, ending where the answer starts
    encoded: Encoded  # the training encoding: ids and loss mask


def reference_commands(record: dict, reference: str, where: str) -> list[str]:
    """The record's ``command`` field (a string or a list of strings) when present, else the
    ``$ `` / ``>>> `` lines of the reference (``hivetune.data.synth.extract_commands``)."""
    from hivetune.data.synth import extract_commands

    value = record.get("command")
    if value is None:
        return extract_commands(reference)
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v.strip() for v in values):
        raise UserError(f"{where}: field 'command' must be a non-empty string or a list of them")
    return values


def prompt_text(record: dict, fmt: str, tokenizer) -> tuple[str, str, str]:
    """(prompt as the model sees it, last user message, reference answer), rendered as
    ``encode_record`` renders the part before the (last) answer."""
    if fmt == "alpaca" and not getattr(tokenizer, "chat_template", None):
        template = ALPACA_PROMPT_INPUT if record.get("input") else ALPACA_PROMPT
        prompt = template.format(instruction=record["instruction"], input=record.get("input", ""))
        return prompt, alpaca_messages(record)[0]["content"], record["output"]
    messages = alpaca_messages(record) if fmt == "alpaca" else record["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    question = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
    return render_chat(tokenizer, messages[:last], add_generation_prompt=True), question, messages[last]["content"]


def read_examples(path: Path, tokenizer, max_length: int, limit: int = 0) -> list[EvalExample]:
    """Check and encode the first `limit` (0: all) records; errors name file:line."""
    examples = []
    for where, _, _, record, fmt in checked_records(path, setting=None):
        if fmt == "text":
            raise UserError(f"{where}: eval needs prompt/response records (alpaca or chat), not text")
        prompt, question, reference = prompt_text(record, fmt, tokenizer)
        try:
            encoded = encode_record(record, fmt, tokenizer, max_length, train_on_inputs=False)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        examples.append(EvalExample(where, question, reference, reference_commands(record, reference, where),
                                    tokenizer(prompt, add_special_tokens=False)["input_ids"], encoded))
        if len(examples) == limit:
            break
    return examples
