"""report_to: the records of metrics.jsonl through MLflow (a local file store) and W&B (offline mode),
each read back; a tracker that is not installed is one line before any weight is read."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from hivetune.core.config import load_config
from hivetune.core.errors import UserError
from hivetune.core.metrics import MetricsSink, scalar_tags

RECORDS = [
    {"step": 1, "epoch": 0.5, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.75, "tokens_per_s": 150.0},
    {"step": 2, "epoch": 1.0, "loss": None, "lr": 5e-4, "grad_norm": None, "tokens_per_s": 160.0},
    {"step": 2, "val_loss": 2.25, "val_tokens": 300},
]
CONFIG = {"lr": 0.001, "lora": {"r": 4, "targets": ["q_proj", "v_proj"]}}


def expected_history() -> dict[str, list[tuple[int, float]]]:
    out: dict = {}
    for record in RECORDS:
        for tag, value in scalar_tags(record):
            out.setdefault(tag, []).append((record["step"], value))
    return out


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'hivetune[trackers]')")
    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return uri


def mlflow_history(uri: str) -> tuple[dict, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("hivetune").experiment_id])
    history = {tag: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, tag),
                                                      key=lambda m: (m.step, m.timestamp))]
               for tag in run.data.metrics}
    return history, run.data.params


def test_mlflow_file_store_gets_the_records(mlflow_store, tmp_path):
    with MetricsSink(tmp_path, report_to=["mlflow"], config=CONFIG) as sink:
        for record in RECORDS:
            sink.write(record)
    history, params = mlflow_history(mlflow_store)
    assert history == expected_history()
    assert params["lr"] == "0.001" and params["lora.r"] == "4" and params["lora.targets"] == '["q_proj", "v_proj"]'
    with MetricsSink(tmp_path, report_to=["mlflow"], config=CONFIG) as sink:  # a resumed run: the same MLflow run
        sink.write({"step": 3, "loss": 2.0})
    history, _ = mlflow_history(mlflow_store)
    assert history["train/loss"] == [(1, 2.5), (3, 2.0)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def wandb_records(path: Path) -> list:
    """The protobuf Records of an offline W&B run file: LevelDB's log format (a 7-byte file
    header, 32 KiB blocks of records with a 7-byte header each)."""
    from wandb.proto import wandb_internal_pb2

    data, records, index, pending = path.read_bytes(), [], 7, b""
    block = 32768
    while index + 7 <= len(data):
        if block - index % block < 7:  # the block's tail is padding
            index += block - index % block
            continue
        _, length, kind = struct.unpack("<IHB", data[index:index + 7])
        if kind == 0 and length == 0:
            index += block - index % block
            continue
        pending += data[index + 7:index + 7 + length]
        index += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(folder, wait_s: float = 60) -> list[dict]:
    """The history rows of the offline W&B run below `folder`, read once its exit record is in
    the file (W&B's service process writes it; at most `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        [path] = folder.rglob("run-*.wandb")
        records = wandb_records(path)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "exit" in kinds, f"{path}: no exit record after {wait_s} s: {kinds}"
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def test_wandb_offline_run_gets_the_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'hivetune[trackers]')")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-dir"), "WANDB_SILENT": "true",
                       "WANDB_PROJECT": "hivetune-test"}.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "wandb-dir").mkdir()
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    with MetricsSink(run_folder, report_to=["wandb"], config=CONFIG) as sink:
        for record in RECORDS:
            sink.write(record)
    rows = wandb_history(tmp_path / "wandb-dir")
    got: dict = {}
    for row in rows:
        for tag, value in row.items():
            if "/" in tag:
                got.setdefault(tag, []).append((row["step"], value))
    assert got == expected_history()
    assert json.loads((run_folder / "trackers.json").read_text())["wandb"]


def test_a_missing_tracker_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from hivetune.cli import main

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--output", str(out), "--report-to", "mlflow",
                 "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("hivetune: error: report_to: mlflow needs the mlflow package, which is not "
                                       "installed: pip install 'hivetune[trackers]' (or pip install mlflow)\n")
    assert not out.exists()


def test_report_to_names_are_checked():
    assert load_config(None, {"data": "x.jsonl", "report_to": "mlflow,wandb"}).report_to == ["mlflow", "wandb"]
    with pytest.raises(UserError) as e:
        load_config(None, {"data": "x.jsonl", "report_to": "mlflow,comet"})
    assert str(e.value) == "report_to: 'comet' is not one of tensorboard, mlflow, wandb"


def test_cli_train_reports_every_metrics_line(mlflow_store, tiny_model_dir, tmp_path):
    from conftest import ops_records, write_jsonl
    from hivetune.cli import main

    data = write_jsonl(tmp_path / "train.jsonl", ops_records(8))
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out),
                 "--max-steps", "3", "--batch-size", "2", "--precision", "fp32", "--device", "cpu", "--quiet",
                 "--report-to", "mlflow", "--set", "eval_prompts=0"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    history, params = mlflow_history(mlflow_store)
    assert [step for step, _ in history["train/loss"]] == [r["step"] for r in lines if r.get("loss") is not None]
    assert [v for _, v in history["train/loss"]] == pytest.approx([r["loss"] for r in lines if r.get("loss") is not None])
    assert params["report_to"] == '["mlflow"]'


def test_a_tracker_that_does_not_start_leaves_no_run_folder(tiny_model_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'hivetune[trackers]')")
    from conftest import ops_records, write_jsonl
    from hivetune.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://x")
    data = write_jsonl(tmp_path / "train.jsonl", ops_records(8))
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out),
                 "--report-to", "mlflow", "--device", "cpu", "--precision", "fp32", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hivetune: error: report_to: mlflow did not start (") and err.count("\n") == 1
    assert not out.exists()
