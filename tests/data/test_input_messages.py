"""Input as users write it: a UTF-8 byte-order mark is accepted by `data validate` and `train`
(and said in validate's report); a null field, a JSON array's items and non-object records
are named as they are."""

from __future__ import annotations

import json

import pytest

from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.data.formats import BOM, checked_records

RECORDS = [{"instruction": f"Say {w}", "output": f"{w}."} for w in ("one", "two", "three", "four")]


def jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_validate_accepts_a_bom_and_says_so(tmp_path, capsys):
    for name, body in (("bom.jsonl", jsonl_bytes(RECORDS)), ("bom.json", json.dumps(RECORDS).encode())):
        path = tmp_path / name
        path.write_bytes(BOM + body)
        assert main(["data", "validate", str(path)]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[:2] == [f"{path}: 4 records, format alpaca",
                           "  starts with a UTF-8 byte-order mark: accepted (skipped when read)"]
        assert out[-1] == "clean"
        assert [r["output"] for *_, r, _ in checked_records(path)] == ["one.", "two.", "three.", "four."]


def test_train_accepts_a_bom(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + jsonl_bytes(RECORDS * 2))
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(path), "--output", str(out), "--quiet",
                 "--device", "cpu", "--precision", "fp32", "--threads", "1", "--max-steps", "1",
                 "--set", "eval_prompts=0"]) == 0, capsys.readouterr().err
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_a_null_field_is_said_to_be_null(tmp_path, capsys):
    path = tmp_path / "null.jsonl"
    path.write_bytes(jsonl_bytes(RECORDS[:1] + [{"instruction": "a", "output": None}]))
    with pytest.raises(UserError) as e:
        list(checked_records(path))
    assert str(e.value) == f"{path}:2: field 'output' must be a string, got null"
    assert main(["data", "validate", str(path)]) == 1
    assert f"    {path}:2: field 'output' must be a string, got null" in capsys.readouterr().out.splitlines()


def test_json_array_duplicates_are_items_not_lines(tmp_path, capsys):
    path = tmp_path / "dup.json"
    path.write_text(json.dumps([RECORDS[0], RECORDS[1], RECORDS[0], {"instruction": "x", "output": 3}]))
    assert main(["data", "validate", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"    {path}: item 3: duplicate of item 1" in out
    assert f"    {path}: item 4: field 'output' must be a string, got number" in out


@pytest.mark.parametrize("body, message", [
    ("[1, 2]\n", "{p}: item 1: expected a JSON object, got number"),
    ('[{"instruction": "a", "output": "b"}, ["x"]]', "{p}: item 2: expected a JSON object, got array"),
    ('[{"instruction": "a", "output": "b"}, {"instruction": "a"}]', "{p}: item 2: missing field 'output' for "
                                                                     "alpaca format"),
    ('"text"\n{"text": "a"}\n', "{p}:1: expected a JSON object, got string"),
    ("null\n", "{p}:1: expected a JSON object, got null"),
])
def test_train_names_the_record_that_is_not_an_object(body, message, tiny_model_dir, tmp_path, capsys):
    path = tmp_path / ("data.json" if body.startswith("[") else "data.jsonl")
    path.write_text(body)
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(path), "--output", str(tmp_path / "run"),
                 "--quiet", "--device", "cpu", "--max-steps", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"hivetune: error: {message.format(p=path)}"]
    assert not (tmp_path / "run").exists()


def test_split_drops_the_bom_from_the_records_it_copies(tmp_path):
    from hivetune.data.split import split_file

    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM + jsonl_bytes(RECORDS))
    split_file(path, 0.5, 0, tmp_path / "train.jsonl", tmp_path / "heldout.jsonl")
    written = (tmp_path / "train.jsonl").read_bytes() + (tmp_path / "heldout.jsonl").read_bytes()
    assert BOM not in written
    assert sorted(written.splitlines()) == sorted(jsonl_bytes(RECORDS).splitlines())
