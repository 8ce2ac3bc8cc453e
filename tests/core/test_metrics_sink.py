"""MetricsSink: metrics.jsonl lines as given; TensorBoard scalars read back from the event files."""

from __future__ import annotations

import json
import sys

import pytest

from hivetune.core.errors import UserError
from hivetune.core.metrics import MetricsSink, scalar_tags

RECORDS = [
    {"step": 1, "epoch": 0.5, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.75, "tokens_per_s": 150.0, "skipped_steps": 0},
    {"step": 2, "epoch": 1.0, "loss": None, "lr": 5e-4, "grad_norm": None, "tokens_per_s": 160.0, "skipped_steps": 1},
    {"step": 2, "val_loss": 2.25, "val_tokens": 300},
]


def test_scalar_tags():
    assert scalar_tags(RECORDS[0]) == [("train/epoch", 0.5), ("train/loss", 2.5), ("train/lr", 1e-3),
                                       ("train/grad_norm", 0.75), ("train/tokens_per_s", 150.0),
                                       ("train/skipped_steps", 0.0)]
    assert scalar_tags(RECORDS[1]) == [("train/epoch", 1.0), ("train/lr", 5e-4), ("train/tokens_per_s", 160.0),
                                       ("train/skipped_steps", 1.0)]  # nulls left out
    assert scalar_tags(RECORDS[2]) == [("val/loss", 2.25), ("val/tokens", 300.0)]
    assert scalar_tags({"step": 3, "loss": float("nan"), "flag": True, "name": "x"}) == []


def test_jsonl_only(tmp_path):
    with MetricsSink(tmp_path) as sink:
        for r in RECORDS:
            sink.write(r)
        assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0]) == RECORDS[0]  # flushed
    with MetricsSink(tmp_path) as sink:  # a resumed run appends
        sink.write({"step": 3, "loss": 2.0})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == RECORDS + [{"step": 3, "loss": 2.0}]
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'hivetune[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsSink(tmp_path, tensorboard=True) as sink:
        for r in RECORDS:
            sink.write(r)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert scalars == {
        "train/epoch": [(1, 0.5), (2, 1.0)], "train/loss": [(1, 2.5)],
        "train/lr": [(1, pytest.approx(1e-3)), (2, pytest.approx(5e-4))],
        "train/grad_norm": [(1, 0.75)], "train/tokens_per_s": [(1, 150.0), (2, 160.0)],
        "train/skipped_steps": [(1, 0.0), (2, 1.0)], "val/loss": [(2, 2.25)], "val/tokens": [(2, 300.0)],
    }
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboard" or m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError) as e:
        MetricsSink(tmp_path, tensorboard=True)
    assert str(e.value) == ("tensorboard: event files need the tensorboard package, which is not installed: "
                            "pip install 'hivetune[tensorboard]' (or pip install tensorboard)")
    assert not (tmp_path / "metrics.jsonl").exists()  # checked before anything is opened
