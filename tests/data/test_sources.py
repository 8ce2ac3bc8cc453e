"""--data as JSONL.gz, parquet, CSV, a folder, a Hub dataset (offline, from a cache in the Hub's
layout); column mapping and ShareGPT; every bad input one line naming file and row."""

from __future__ import annotations

import csv
import gzip
import json

import pytest

from conftest import hub_cache_repo, ops_records, write_jsonl
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.data.dataset import index_dataset, load_example
from hivetune.data.formats import encode_record, iter_source
from hivetune.data.sources import DataSource, data_parts
from hivetune.model.tokenizer import load_tokenizer

RECORDS = ops_records(10)
NO_PYARROW = "pyarrow not installed (a dependency: pip install pyarrow)"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HIVETUNE_CACHE", str(tmp_path / "cache"))  # each test converts afresh


def write_parquet(path, records, row_group_size=4):
    pq = pytest.importorskip("pyarrow.parquet", reason=NO_PYARROW)
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def write_csv(path, records, fields=("instruction", "input", "output")):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(records)
    return path


def direct(tok, records, fmt="alpaca"):
    return [encode_record(r, fmt, tok, 1024, False) for r in records]


def examples(index, tok):
    return [load_example(index, i, tok, 1024, False) for i in range(len(index))]


def test_gz_parquet_csv_index_as_the_jsonl_does(tok, tmp_path):
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in RECORDS).encode()))
    array_gz = tmp_path / "d.json.gz"
    array_gz.write_bytes(gzip.compress(json.dumps(RECORDS, indent=1).encode()))
    sources = [gz, array_gz, write_parquet(tmp_path / "d.parquet", RECORDS), write_csv(tmp_path / "d.csv", RECORDS)]
    for path in sources:
        index = index_dataset(path, "auto", tok, 1024, False, keep_records_below=0)  # re-read by offset
        assert index.format == "alpaca" and bool(index.records) == (path == array_gz)  # an array is held whole
        assert examples(index, tok) == direct(tok, RECORDS)


def test_a_folder_is_its_files_in_order(tok, tmp_path):
    folder = tmp_path / "data"
    (folder / "more").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", RECORDS[:3])
    write_parquet(folder / "b.parquet", RECORDS[3:6])
    write_csv(folder / "more" / "c.csv", RECORDS[6:])
    (folder / "notes.txt").write_text("not data")
    index = index_dataset(folder, "auto", tok, 1024, False, keep_records_below=0)
    assert list(index.part_of) == [0] * 3 + [1] * 3 + [2] * 4
    assert examples(index, tok) == direct(tok, RECORDS)
    assert [where for _, where, *_ in iter_source(folder)][2:5] == [
        f"{folder / 'a.jsonl'}:3", f"{folder / 'b.parquet'}: row 1", f"{folder / 'b.parquet'}: row 2"]


def test_columns_map_the_datas_names_to_ours(tok, tmp_path):
    renamed = [{"question": r["instruction"], "input": "", "answer": r["output"]} for r in RECORDS]
    path = write_csv(tmp_path / "qa.csv", renamed, ("question", "input", "answer"))
    source = DataSource(str(path), {"instruction": "question", "output": "answer"})
    index = index_dataset(source, "auto", tok, 1024, False, keep_records_below=0)
    assert examples(index, tok) == direct(tok, RECORDS)
    with pytest.raises(UserError) as e:
        index_dataset(DataSource(str(path), {"output": "reply"}), "auto", tok, 1024, False)
    assert str(e.value) == (f"{path}: row 1: no column 'reply' (data_columns.output); the record has "
                            "'question', 'input', 'answer'")


def test_sharegpt_is_read_as_chat(tok, tmp_path):
    chats = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": r["instruction"]},
                                {"from": "gpt", "value": r["output"]}]} for r in RECORDS]
    index = index_dataset(write_jsonl(tmp_path / "sg.jsonl", chats), "auto", tok, 1024, False,
                          keep_records_below=0)
    as_messages = [{"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": r["instruction"]},
                                 {"role": "assistant", "content": r["output"]}]} for r in RECORDS]
    assert index.format == "chat"
    assert examples(index, tok) == direct(tok, as_messages, "chat")
    bad = write_jsonl(tmp_path / "bad.jsonl", [chats[0], {"conversations": [{"from": "robot", "value": "x"}]}])
    with pytest.raises(UserError) as e:
        index_dataset(bad, "auto", tok, 1024, False)
    assert str(e.value).startswith(f"{bad}:2: conversations[0] has unknown from 'robot' (expected system, human,")


@pytest.mark.parametrize("name, content, message", [
    ("d.csv", "instruction,output\nHow?,Like this.\nWhy?\n", "row 2: 1 values for 2 columns (instruction, output)"),
    ("d.jsonl.gz", None, "not a readable gzip file"),
    ("d.parquet", "PAR1 not really", "not a readable parquet file"),
])
def test_bad_files_are_one_line(name, content, message, tok, tmp_path):
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow", reason=NO_PYARROW)
    path = tmp_path / name
    path.write_bytes(b"\x1f\x8b not gzip" if content is None else content.encode())
    with pytest.raises(UserError) as e:
        index_dataset(path, "auto", tok, 1024, False)
    assert str(e.value).startswith(f"{path}: {message}")
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "cache").rglob("*.jsonl"))  # a failed conversion leaves no copy


def test_a_gz_line_is_named_by_its_line(tok, tmp_path):
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"text": "fine"}\n{"text": oops}\n'))
    with pytest.raises(UserError) as e:
        index_dataset(gz, "auto", tok, 1024, False)
    assert str(e.value) == f"{gz}:2: malformed JSON (Expecting value at column 10)"


# ---- Hub datasets ----------------------------------------------------------------------------

README = """---
configs:
- config_name: default
  data_files:
  - {split: train, path: data/train.jsonl}
  - {split: test, path: data/test.jsonl}
- config_name: renamed
  data_files:
  - {split: train, path: renamed/train.jsonl}
---
"""


@pytest.fixture
def hub_dataset(hub_cache, tmp_path):
    pytest.importorskip("datasets", reason="datasets not installed (a dependency: pip install datasets)")
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "renamed").mkdir()
    (repo / "README.md").write_text(README)
    write_jsonl(repo / "data" / "train.jsonl", RECORDS[:8])
    write_jsonl(repo / "data" / "test.jsonl", RECORDS[8:])
    write_jsonl(repo / "renamed" / "train.jsonl", [{"q": r["instruction"], "a": r["output"]} for r in RECORDS[:4]])
    return hub_cache_repo(hub_cache, "tiny-org/ops", repo, repo_type="dataset")


def test_a_hub_dataset_loads_offline_by_split_and_config(hub_dataset, tok):
    train = index_dataset("tiny-org/ops", "auto", tok, 1024, False)
    assert examples(train, tok) == direct(tok, RECORDS[:8])
    test = index_dataset(DataSource("tiny-org/ops", split="test"), "auto", tok, 1024, False)
    assert examples(test, tok) == direct(tok, RECORDS[8:])
    renamed = DataSource("tiny-org/ops", {"instruction": "q", "output": "a"}, config="renamed")
    assert examples(index_dataset(renamed, "auto", tok, 1024, False), tok) == direct(tok, RECORDS[:4])
    assert data_parts("tiny-org/ops")[0].label == "tiny-org/ops (split train)"


def test_hub_dataset_errors_are_one_line(hub_dataset, tok, tmp_path, capsys):
    with pytest.raises(UserError) as e:
        index_dataset(DataSource("tiny-org/ops", split="validation"), "auto", tok, 1024, False)
    assert str(e.value).startswith("tiny-org/ops (split validation): datasets cannot load it (")
    out = tmp_path / "run"
    assert main(["train", "--data", "tiny-org/not-cached", "--output", str(out), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "hivetune: error: tiny-org/not-cached: not in the Hugging Face cache and HF_HUB_OFFLINE is set; download "
        "it once online (hf download tiny-org/not-cached --repo-type dataset) or pass a local path\n")
    assert not out.exists()


def test_cli_trains_on_a_hub_dataset_with_mapped_columns(hub_dataset, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", "tiny-org/ops", "--data-config", "renamed",
                 "--set", "data.columns.instruction=q", "--set", "data.columns.output=a", "--output", str(out),
                 "--max-steps", "1", "--batch-size", "4", "--precision", "fp32", "--device", "cpu", "--quiet",
                 "--set", "eval_prompts=0"]) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    capsys.readouterr()
    assert main(["data", "validate", "tiny-org/ops", "--data-config", "renamed", "--columns", "instruction=q,output=a"]) == 0
    assert capsys.readouterr().out.startswith("tiny-org/ops: 4 records, format alpaca")


@pytest.mark.parametrize("args, message", [
    (["--data", "{bad_csv}"], "{bad_csv}: row 2: 1 values for 2 columns (instruction, output)"),
    (["--data", "{csv}", "--set", "data.columns.outptu=answer"],
     "data_columns.outptu: not a field hivetune reads (instruction, input, output, messages, text, conversations)"),
    (["--data", "{csv}", "--set", "data.columns.output=answer"],
     "{csv}: row 1: no column 'answer' (data_columns.output); the record has 'instruction', 'output'"),
    (["--data", "{csv}", "--data-split", "test"],
     "{csv}: data_split and data_config choose within a Hub dataset or a folder of one"),
    (["--data", "{csv}", "--report-to", "comet"], "report_to: 'comet' is not one of tensorboard, mlflow, wandb"),
])
def test_cli_bad_input_is_one_line_exit_2_nothing_written(args, message, tiny_model_dir, tmp_path, capsys):
    paths = {"csv": tmp_path / "ok.csv", "bad_csv": tmp_path / "bad.csv"}
    paths["csv"].write_text("instruction,output\nHow?,Like this.\n")
    paths["bad_csv"].write_text("instruction,output\nHow?,Like this.\nWhy?\n")
    out = tmp_path / "run"
    args = [a.format(**paths) for a in args]
    assert main(["train", "--model", str(tiny_model_dir), "--output", str(out), "--device", "cpu", *args]) == 2
    assert capsys.readouterr().err == f"hivetune: error: {message.format(**paths)}\n"
    assert not out.exists()


def test_a_hub_dataset_as_val_data_reads_its_test_split(hub_dataset, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", "tiny-org/ops", "--val-data", "tiny-org/ops",
                 "--output", str(out), "--max-steps", "1", "--batch-size", "4", "--precision", "fp32",
                 "--device", "cpu", "--quiet", "--set", "eval_prompts=0"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [val] = [r for r in records if "val_loss" in r]
    tok = load_tokenizer(str(tiny_model_dir))
    assert val["val_tokens"] == sum(e.n_targets for e in direct(tok, RECORDS[8:]))


def test_a_csv_field_may_hold_a_document(tok, tmp_path):
    long = {"instruction": "Summarise.", "input": "", "output": "word " * 40_000}  # 200,000 characters
    index = index_dataset(write_csv(tmp_path / "long.csv", [long]), "auto", tok, 64, False)
    assert index.truncated == 1 and list(index.lengths) == [64]
