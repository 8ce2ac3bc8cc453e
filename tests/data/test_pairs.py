"""Preference pairs: detection, rendering, micro-batches, `data pairs` from interaction logs,
`data validate` on pairs, and the shipped pair set's generator."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import write_jsonl
from hivetune.cli import main
from hivetune.core.embedded import DEFAULT_DATA_DIR
from hivetune.data.formats import detect_format
from hivetune.data.interaction_log import InteractionLog
from hivetune.data.pairs import (PAIR_FILES, collate_pairs, default_pair_records, encode_pair, pair_texts,
                                 write_default_pairs)
from hivetune.data.validate import validate_file
from hivetune.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def test_detects_preference_before_chat():
    assert detect_format({"messages": [], "chosen": "a", "rejected": "b"}) == "preference"
    assert detect_format({"prompt": "q", "chosen": "a", "rejected": "b"}) == "preference"
    assert detect_format({"messages": []}) == "chat"


def test_pair_renders_with_chat_template(tokenizer):
    text_form = {"prompt": "How?", "chosen": "Like this.", "rejected": "No."}
    chat_form = {"messages": [{"role": "user", "content": "How?"}],
                 "chosen": [{"role": "assistant", "content": "Like this."}], "rejected": "No."}
    assert pair_texts(text_form, tokenizer) == pair_texts(chat_form, tokenizer) == (
        "<|im_start|>user\nHow?<|im_end|>\n<|im_start|>assistant\n", "Like this.<|im_end|>\n", "No.<|im_end|>\n")


def test_truncation_keeps_prompt_end_and_cuts_answers(tokenizer):
    record = {"prompt": "restart nginx " * 40, "chosen": "systemctl restart nginx " * 20, "rejected": "no"}
    full, cut = encode_pair(record, tokenizer, 1 << 30), encode_pair(record, tokenizer, 64)
    assert cut.truncated and not full.truncated
    assert cut.prompt == full.prompt[-32:] and cut.chosen == full.chosen[:32] and cut.rejected == full.rejected


def test_shared_row_layout(tokenizer):
    pairs = [encode_pair({"prompt": f"q{i}", "chosen": "yes it is", "rejected": "no"}, tokenizer, 256) for i in range(2)]
    b = collate_pairs(pairs)
    e = pairs[0]
    p, c, r = len(e.prompt), len(e.chosen), len(e.rejected)
    assert b.input_ids[0, :len(e)].tolist() == e.prompt + e.chosen + e.rejected
    assert b.position_ids[0, :len(e)].tolist() == list(range(p + c)) + list(range(p, p + r))
    # the first token of each answer is predicted at the prompt's last token
    assert b.target_index[:c + 1].tolist() == [p - 1] + list(range(p, p + c - 1)) + [p - 1]
    assert b.target_seq.tolist()[:c + r] == [0] * c + [1] * r and b.seq_tokens.tolist()[:2] == [c, r]
    assert b.layout.mask.shape == (1, 1, b.n_tokens, b.n_tokens)


def write_log(path):
    log = InteractionLog(path)
    q = [{"role": "user", "content": "How do I list GPUs?"}]
    bad = log.exchange("v1", q, "Use ls.", 0.1, 5, 3)
    log.feedback(bad, -1, "$ nvidia-smi -L")
    same = log.exchange("v1", q, "Use lspci.", 0.1, 5, 3)
    log.feedback(same, -1, " Use lspci. ")
    nothing = log.exchange("v1", q, "Use rocm-smi.", 0.1, 5, 3)
    log.feedback(nothing, -1)
    good = log.exchange("v1", q, "$ nvidia-smi -L", 0.1, 5, 3)
    log.feedback(good, 1, "unused")
    log.close()
    with open(path, "a") as f:
        f.write('{"type": "exch')  # a line cut by a kill
    return bad


def test_data_pairs_from_feedback(tmp_path, capsys):
    bad = write_log(tmp_path / "log.jsonl")
    out = tmp_path / "pairs.jsonl"
    assert main(["data", "pairs", str(tmp_path / "log.jsonl"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{out}: 1 pairs from 3 exchanges rated bad (of 4); skipped: 1 without a correction, "
        f"1 whose correction is the answer; 1 unreadable lines")
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["messages"] == [{"role": "user", "content": "How do I list GPUs?"}]
    assert (record["chosen"], record["rejected"], record["id"]) == ("$ nvidia-smi -L", "Use ls.", bad)
    assert record["source"] == f"{tmp_path / 'log.jsonl'}:1"
    assert validate_file(out).problems == 0
    assert main(["data", "pairs", str(tmp_path / "log.jsonl"), "--out", str(out)]) == 2  # exists: --force


def test_data_pairs_missing_log_is_one_line(tmp_path, capsys):
    assert main(["data", "pairs", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"hivetune: error: {tmp_path / 'nope.jsonl'}: interaction log not found"


def test_validate_reports_bad_pairs_with_file_line(tmp_path, tiny_model_dir):
    good = {"prompt": "How do I restart nginx?", "chosen": "systemctl restart nginx", "rejected": "reboot"}
    records = [good, {"prompt": "q", "chosen": "same", "rejected": "same"}, {"prompt": "q", "chosen": "a"},
               {"prompt": "q", "chosen": "  ", "rejected": "b"}, dict(good),
               {"prompt": "long " * 300, "chosen": "a", "rejected": "b"}]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    report = validate_file(path, model=str(tiny_model_dir), max_length=128)
    assert report.format == "preference"
    assert report.listed["schema"] == [f"{path}:2: chosen and rejected are the same answer",
                                       f"{path}:3: missing field 'rejected' for preference format",
                                       f"{path}:4: field 'chosen' is empty"]
    assert report.listed["duplicate"] == [f"{path}:5: duplicate of line 1"]
    assert len(report.listed["too_long"]) == 1 and report.listed["too_long"][0].startswith(f"{path}:6: ")


def test_shipped_pairs_are_the_generators_output(tmp_path):
    for name in ("train.jsonl", "heldout.jsonl"):
        shutil.copy(DEFAULT_DATA_DIR / name, tmp_path / name)
    write_default_pairs(tmp_path)
    for name in PAIR_FILES:
        assert (tmp_path / name).read_bytes() == (DEFAULT_DATA_DIR / name).read_bytes(), name
    records = [json.loads(line) for line in (DEFAULT_DATA_DIR / "heldout.jsonl").read_text().splitlines()]
    pairs = default_pair_records(records)
    assert [p["chosen"] for p in pairs] == [r["output"] for r in records]
    by_output = {r["output"]: r["category"] for r in records}
    assert all(by_output[p["rejected"]] != p["category"] for p in pairs)  # another category's answer
    assert validate_file(DEFAULT_DATA_DIR / PAIR_FILES[0]).counts["schema"] == 0
