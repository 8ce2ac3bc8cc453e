"""`hivetune chat`: an interactive conversation on stdin / stdout, greedy, with the chat template.

Works with any model `hivetune generate` takes: the embedded base, base + adapter, a merged HF
folder or a GGUF file (our exports included). Each line read is a user turn; the whole
conversation is rendered with the model's chat template each turn, oldest turns dropped when it
no longer fits the context. ``/exit`` (or end of input) ends it, ``/reset`` starts over.
"""

from __future__ import annotations

import sys
from typing import TextIO

from hivetune.core.errors import UserError
from hivetune.workflows.generate import greedy_ids, load_for_generation


def reply(net, tokenizer, messages: list[dict], max_new_tokens: int) -> str:
    """The model's greedy answer to the conversation so far (oldest turns dropped to fit)."""
    from hivetune.model.tokenizer import eos_ids

    ids = fit_conversation(net, tokenizer, messages, max_new_tokens)
    out = greedy_ids(net, [ids], max_new_tokens, eos_ids(tokenizer, net.args))[0]
    return tokenizer.decode(out, skip_special_tokens=True).strip()


def fit_conversation(net, tokenizer, messages: list[dict], max_new_tokens: int) -> list[int]:
    """The prompt tokens of the conversation with the chat template, oldest user / assistant pairs
    dropped until it leaves room for `max_new_tokens` (`hivetune chat` and `hivetune serve`)."""
    from hivetune.data.formats import render_chat

    limit = net.args.max_position_embeddings - max_new_tokens
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system):]
    while True:
        text = render_chat(tokenizer, system + turns, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit or len(turns) <= 1:
            break
        turns = turns[2:]  # drop the oldest user / assistant pair
    if len(ids) > limit:
        raise UserError(f"chat: the message is {len(ids)} tokens; the model's context holds "
                        f"{net.args.max_position_embeddings} with {max_new_tokens} new tokens")
    return ids


def chat(model: str = "", adapter: str = "", system: str = "", max_new_tokens: int = 256,
         device: str = "auto", precision: str = "auto", input: TextIO | None = None,
         output: TextIO | None = None) -> list[dict]:
    """Read user lines from `input`, write the answers to `output`; returns the conversation."""
    input = input or sys.stdin
    output = output or sys.stdout
    if max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens: must be > 0, got {max_new_tokens}")
    net, tokenizer = load_for_generation(model, adapter, device, precision)
    interactive = input.isatty()
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if interactive:
        output.write("hivetune chat: type a message; /reset starts over, /exit or Ctrl-D ends\n")
    while True:
        if interactive:
            output.write("> ")
            output.flush()
        line = input.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": text})
        answer = reply(net, tokenizer, messages, max_new_tokens)
        messages.append({"role": "assistant", "content": answer})
        output.write(answer + "\n")
        output.flush()
    return messages
