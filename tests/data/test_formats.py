"""Record formats -> token ids + loss mask, file errors with file:line, collation."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch

from conftest import ops_records, write_jsonl
from hivetune.data.batch import collate_packed, collate_padded
from hivetune.data.dataset import index_dataset, load_example
from hivetune.data.formats import chat_spans, check_record, detect_format, encode_record, iter_records
from hivetune.core.errors import UserError
from hivetune.model.tokenizer import load_tokenizer

EOT = "<|im_end|>\n"  # the ChatML template's end of turn


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def plain_tok(tok):
    """The same tokenizer without a chat template (a copy: load_tokenizer's result is cached)."""
    t = copy.deepcopy(tok)
    t.chat_template = None
    assert tok.chat_template  # the shared one is untouched
    return t


def runs(tok, enc):
    """Consecutive (is_target, decoded text) runs of an encoding."""
    return [(m, tok.decode([i for i, _ in group]))
            for m, group in itertools.groupby(zip(enc.ids, enc.mask), key=lambda p: p[1])]


def targets_text(tok, enc):
    return tok.decode([i for i, m in zip(enc.ids, enc.mask) if m])


ALPACA = {"instruction": "How do I restart the nginx service?", "input": "",
          "output": "Run `systemctl restart nginx` as root."}


# ---- encodings -------------------------------------------------------------------------------

def test_alpaca_with_chat_template_targets_only_the_answer_and_end_of_turn(tok):
    enc = encode_record(ALPACA, "alpaca", tok, 1024, train_on_inputs=False)
    assert tok.decode(enc.ids) == (f"<|im_start|>user\n{ALPACA['instruction']}{EOT}"
                                   f"<|im_start|>assistant\n{ALPACA['output']}{EOT}")
    assert runs(tok, enc) == [
        (False, f"<|im_start|>user\n{ALPACA['instruction']}{EOT}<|im_start|>assistant\n"),
        (True, ALPACA["output"] + EOT),
    ]
    assert targets_text(tok, enc) == ALPACA["output"] + "<|im_end|>\n"
    assert len(enc.mask) == len(enc.ids) and not enc.truncated
    assert enc.n_targets == sum(enc.mask[1:]) == sum(enc.mask)  # first token is a prompt token

    full = encode_record(ALPACA, "alpaca", tok, 1024, train_on_inputs=True)
    assert full.ids == enc.ids
    assert all(full.mask)
    assert full.n_targets == len(full.ids) - 1


def test_alpaca_input_joins_the_user_turn_with_a_chat_template(tok):
    record = dict(ALPACA, input="The unit file is /etc/nginx/nginx.conf")
    enc = encode_record(record, "alpaca", tok, 1024, False)
    assert runs(tok, enc) == [
        (False, f"<|im_start|>user\n{record['instruction']}\n\n{record['input']}{EOT}<|im_start|>assistant\n"),
        (True, record["output"] + EOT),
    ]


def test_alpaca_without_chat_template_uses_the_instruction_prompt(plain_tok):
    eos = plain_tok.eos_token
    assert eos == "<|im_end|>"
    enc = encode_record(ALPACA, "alpaca", plain_tok, 1024, False)
    assert runs(plain_tok, enc) == [
        (False, f"### Instruction:\n{ALPACA['instruction']}\n\n### Response:\n"),
        (True, ALPACA["output"] + eos),
    ]
    assert enc.ids[-1] == plain_tok.eos_token_id
    assert "### Input:" not in plain_tok.decode(enc.ids)

    record = dict(ALPACA, input="on Fedora 41")
    enc = encode_record(record, "alpaca", plain_tok, 1024, False)
    assert runs(plain_tok, enc) == [
        (False, f"### Instruction:\n{record['instruction']}\n\n### Input:\non Fedora 41\n\n### Response:\n"),
        (True, record["output"] + eos),
    ]
    # no "input" key at all is the same as an empty one
    no_input = {k: v for k, v in ALPACA.items() if k != "input"}
    assert encode_record(no_input, "alpaca", plain_tok, 1024, False) == \
        encode_record(ALPACA, "alpaca", plain_tok, 1024, False)
    assert all(encode_record(record, "alpaca", plain_tok, 1024, True).mask)


def test_chat_two_assistant_turns_and_a_system_message(tok):
    messages = [
        {"role": "system", "content": "You are a Linux admin."},
        {"role": "user", "content": "Restart nginx."},
        {"role": "assistant", "content": "systemctl restart nginx"},
        {"role": "user", "content": "And check it?"},
        {"role": "assistant", "content": "systemctl status nginx"},
    ]
    record = {"messages": messages}
    assert detect_format(record) == "chat"
    check_record(record, "chat", "x:1")
    enc = encode_record(record, "chat", tok, 1024, False)
    assert runs(tok, enc) == [
        (False, f"<|im_start|>system\nYou are a Linux admin.{EOT}<|im_start|>user\nRestart nginx.{EOT}"
                "<|im_start|>assistant\n"),
        (True, f"systemctl restart nginx{EOT}"),
        (False, f"<|im_start|>user\nAnd check it?{EOT}<|im_start|>assistant\n"),
        (True, f"systemctl status nginx{EOT}"),
    ]
    text, spans = chat_spans(tok, messages)
    assert [text[a:b] for a, b in spans] == [f"systemctl restart nginx{EOT}", f"systemctl status nginx{EOT}"]
    assert enc.n_targets == sum(enc.mask)


def test_text_format_every_token_is_a_target_and_eos_is_appended(tok):
    record = {"text": "rpm-ostree status shows the deployments."}
    assert detect_format(record) == "text"
    enc = encode_record(record, "text", tok, 1024, False)
    assert tok.decode(enc.ids) == record["text"] + "<|im_end|>"
    assert enc.ids[-1] == tok.eos_token_id
    assert all(enc.mask)
    assert enc.n_targets == len(enc.ids) - 1


def test_truncation_keeps_max_length_tokens(tok):
    full = encode_record(ALPACA, "alpaca", tok, 1024, False)
    assert encode_record(ALPACA, "alpaca", tok, len(full.ids), False) == full  # exactly fits: not truncated
    cut = encode_record(ALPACA, "alpaca", tok, len(full.ids) - 3, False)
    assert cut.truncated
    assert len(cut.ids) == len(cut.mask) == len(full.ids) - 3
    assert cut.ids == full.ids[:-3] and cut.mask == full.mask[:-3]
    assert cut.n_targets == full.n_targets - 3


def test_index_counts_truncated_and_skips_records_without_targets(tok, tmp_path):
    short = {"instruction": "Hi", "output": "Ok."}
    long_answer = {"instruction": "Hi", "output": "restart nginx " * 30}
    long_prompt = {"instruction": "restart nginx " * 30, "output": "Ok."}
    enc = {k: encode_record(r, "alpaca", tok, 10_000, False)
           for k, r in [("short", short), ("long_answer", long_answer), ("long_prompt", long_prompt)]}
    max_length = len(enc["short"].ids) + 4
    assert enc["long_prompt"].mask.index(True) > max_length  # its answer starts past the cut
    data = write_jsonl(tmp_path / "d.jsonl", [short, long_answer, long_prompt, short])
    index = index_dataset(data, "auto", tok, max_length, False)
    assert index.format == "alpaca"
    assert list(index.lines) == [1, 2, 4]
    assert index.truncated == 1
    assert index.skipped_no_target == 1
    assert list(index.lengths) == [len(enc["short"].ids), max_length, len(enc["short"].ids)]
    prompt_len = enc["long_answer"].mask.index(True)
    assert list(index.n_targets) == [enc["short"].n_targets, max_length - prompt_len, enc["short"].n_targets]

    only_long = write_jsonl(tmp_path / "l.jsonl", [long_prompt])
    with pytest.raises(UserError) as e:
        index_dataset(only_long, "auto", tok, max_length, False)
    assert str(e.value) == (f"{only_long}: no record has a response token to learn from "
                            f"within max_length={max_length}")


def test_json_array_and_jsonl_give_the_same_examples(tok, tmp_path):
    records = ops_records(5) + [{"instruction": "Use input", "input": "with this", "output": "done"}]
    jsonl = tmp_path / "d.jsonl"
    # CRLF and blank lines: line numbers and byte offsets still point at the records
    jsonl.write_bytes(b"\r\n".join(json.dumps(r).encode() + (b"\r\n" if i == 2 else b"")
                                    for i, r in enumerate(records)) + b"\r\n")
    array = tmp_path / "d.json"
    array.write_text(json.dumps(records, indent=2))
    a = index_dataset(jsonl, "auto", tok, 1024, False)
    b = index_dataset(array, "auto", tok, 1024, False)
    # records re-read by byte offset (as for files too large to keep in RAM)
    c = index_dataset(jsonl, "auto", tok, 1024, False, keep_records_below=0)
    assert list(a.lines) == list(c.lines) == [1, 2, 3, 5, 6, 7]
    assert list(b.lines) == [1, 2, 3, 4, 5, 6] and list(b.offsets) == [-1] * 6
    assert a.format == b.format == "alpaca"
    assert list(a.lengths) == list(b.lengths) == list(c.lengths)
    assert list(a.n_targets) == list(b.n_targets) == list(c.n_targets)
    assert not c.records
    direct = [encode_record(r, "alpaca", tok, 1024, False) for r in records]
    for index in (a, b, c):
        assert [load_example(index, i, tok, 1024, False) for i in range(len(records))] == direct
    assert [r for _, _, r in iter_records(array)] == [r for _, _, r in iter_records(jsonl)] == records


# ---- errors ----------------------------------------------------------------------------------

OK = json.dumps({"instruction": "a", "output": "b"})
CHAT_OK = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})


def chat(*messages):
    return json.dumps({"messages": list(messages)})


ERRORS = {
    "malformed_json": (f'{OK}\n{{"instruction": "a", "output": }}\n',
                       "{p}:2: malformed JSON (Expecting value at column 32)"),
    "malformed_array": ('[{"text": "a"},\n{oops}]',
                        "{p}:2: malformed JSON (Expecting property name enclosed in double quotes at column 2)"),
    "not_utf8": (OK.encode() + b'\n{"text": "caf\xe9"}\n', "{p}:2: not valid UTF-8 (byte 13)"),
    "array_not_objects": ('[{"text": "a"}, 3]', "{p}: item 2: expected a JSON object, got number"),
    "empty_array": ("[]", "{p}: expected a non-empty JSON array of objects"),
    "line_not_object": (f"{OK}\n[1, 2]\n", "{p}:2: expected a JSON object, got array"),
    "missing_field": (f'{OK}\n{{"instruction": "a"}}\n', "{p}:2: missing field 'output' for alpaca format"),
    "empty_field": (f'{OK}\n\n{{"instruction": " \\n", "output": "b"}}\n', "{p}:3: field 'instruction' is empty"),
    "wrong_type": (f'{OK}\n{{"instruction": "a", "output": 5}}\n',
                   "{p}:2: field 'output' must be a string, got number"),
    "wrong_input_type": (f'{OK}\n{{"instruction": "a", "input": ["x"], "output": "b"}}\n',
                         "{p}:2: field 'input' must be a string, got array"),
    "text_null": ('{"text": null}\n', "{p}:1: field 'text' must be a string, got null"),
    "text_wrong_type": (f'{{"text": "a"}}\n{{"text": 1.5}}\n', "{p}:2: field 'text' must be a string, got number"),
    "messages_not_list": (f'{CHAT_OK}\n{{"messages": "hi"}}\n', "{p}:2: field 'messages' must be a non-empty list"),
    "messages_empty": (f'{CHAT_OK}\n{{"messages": []}}\n', "{p}:2: field 'messages' must be a non-empty list"),
    "message_not_object": (f'{CHAT_OK}\n{{"messages": ["hi"]}}\n',
                           "{p}:2: messages[0] must be an object with role and content"),
    "content_not_string": (f'{CHAT_OK}\n{chat({"role": "user", "content": 1})}\n',
                           "{p}:2: messages[0].content must be a string"),
    "unknown_role": (chat({"role": "user", "content": "a"}, {"role": "tool", "content": "b"}) + "\n",
                     "{p}:1: messages[1] has unknown role 'tool' (expected system, user, assistant)"),
    "no_assistant": (chat({"role": "system", "content": "a"}, {"role": "user", "content": "b"}) + "\n",
                     "{p}:1: no assistant message to learn from"),
    "empty_file": ("", "{p}: data file is empty"),
    "blank_lines": ("\n  \n\r\n\n", "{p}: data file is empty"),
    "many_blank_lines": ("\n" * 70_000 + " \n", "{p}: data file is empty"),
    "undetectable": ('{"prompt": "a", "completion": "b"}\n',
                     "{p}:1: cannot tell the format (expected 'messages', 'instruction'+'output' or 'text'); "
                     "set format to one of alpaca, chat, text, or name the record's columns ('prompt', 'completion') "
                     "with data_columns"),
    "mixed_formats": (f'{OK}\n{{"text": "plain"}}\n', "{p}:2: missing field 'instruction' for alpaca format"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_data_errors_name_the_file_and_line(case, tok, tmp_path):
    content, expected = ERRORS[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError) as e:
        index_dataset(path, "auto", tok, 1024, False)
    assert str(e.value) == expected.format(p=path)


def test_blank_lines_before_the_first_record(tok, tmp_path):
    """More than 64 KiB of blank lines before the records is not an empty file."""
    path = tmp_path / "d.jsonl"
    path.write_text("\n" * 70_000 + OK + "\n\n" + OK + "\n")
    index = index_dataset(path, "auto", tok, 1024, False, keep_records_below=0)
    assert list(index.lines) == [70_001, 70_003]
    assert load_example(index, 1, tok, 1024, False) == encode_record(json.loads(OK), "alpaca", tok, 1024, False)
    array = tmp_path / "d.json"
    array.write_text(" " * 70_000 + "[" + OK + "]")
    assert [r for _, _, r in iter_records(array)] == [json.loads(OK)]


def test_explicit_format_that_does_not_fit(tok, alpaca_file):
    with pytest.raises(UserError) as e:
        index_dataset(alpaca_file, "chat", tok, 1024, False)
    assert str(e.value) == f"{alpaca_file}:1: field 'messages' must be a non-empty list"


def test_directory_and_missing_file(tok, tmp_path):
    with pytest.raises(UserError) as e:
        index_dataset(tmp_path, "auto", tok, 1024, False)
    assert str(e.value) == f"{tmp_path}: no data files in this folder (.jsonl, .jsonl.gz, .json, .json.gz, .parquet, .csv)"
    with pytest.raises(UserError) as e:
        index_dataset(tmp_path / "nope.jsonl", "auto", tok, 1024, False)
    assert str(e.value) == f"{tmp_path / 'nope.jsonl'}: data file not found"


# ---- collation -------------------------------------------------------------------------------

def test_packed_and_padded_collation_agree_on_targets(tok):
    records = ops_records(3) + [{"instruction": "Why?", "input": "x", "output": "Because."}]
    examples = [encode_record(r, "alpaca", tok, 1024, False) for r in records]
    examples.append(encode_record({"text": "journalctl -u sshd"}, "text", tok, 1024, False))
    assert len({len(e.ids) for e in examples}) > 1
    padded = collate_padded(examples, pad_id=0)
    packed = collate_packed(examples)
    packed8 = collate_packed(examples, pad_to_multiple=8, pad_id=0)
    expected = [e.ids[t + 1] for e in examples for t in range(len(e.ids) - 1) if e.mask[t + 1]]
    assert padded.target_ids.tolist() == packed.target_ids.tolist() == packed8.target_ids.tolist() == expected
    assert len(expected) == sum(e.n_targets for e in examples)
    for batch in (padded, packed, packed8):
        flat = batch.input_ids.flatten()
        assert torch.equal(flat[batch.target_index + 1], batch.target_ids)
        assert batch.n_tokens == sum(len(e.ids) for e in examples) and batch.n_examples == len(examples)
    # padded: each target position stays inside its own row's real tokens
    width = padded.input_ids.shape[1]
    lengths = torch.tensor([len(e.ids) for e in examples])
    assert bool(((padded.target_index % width) + 1 < lengths[padded.target_index // width]).all())
    # packed: positions restart per example, padding is past the last real token and never a target
    assert packed.layout.cu_seqlens.tolist() == [0, *itertools.accumulate(len(e.ids) for e in examples)]
    assert packed.position_ids[0].tolist() == [t for e in examples for t in range(len(e.ids))]
    assert packed8.input_ids.shape[1] % 8 == 0
    assert packed8.input_ids.shape[1] > packed.input_ids.shape[1] or packed.input_ids.shape[1] % 8 == 0
    assert torch.equal(packed8.target_index, packed.target_index)
    assert int(packed8.target_index.max()) + 1 < packed.n_tokens
