"""Periodic checkpoints by default (every save_every_minutes of training and at the end), and an
exception in a training step: the last completed step saved, one line naming the cause and the
command that resumes, a non-zero exit; the resumed run ends as an unbroken one."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from hivetune.checkpoint import SaveSchedule, TrainingFailed, checkpoint_folders, verify_checkpoint
from hivetune.cli import main
from hivetune.core.config import TrainConfig
from hivetune.core.fileio import LOCK_NAME
from hivetune.train import loop
from test_resume import data  # noqa: F401 (fixture)


def args(model_dir, data_path, out, *extra):
    return ["train", "--model", str(model_dir), "--data", str(data_path), "--output", str(out), "--quiet",
            "--precision", "fp32", "--device", "cpu", "--threads", "1", "--max-steps", "6", "--batch-size", "4",
            "--lora-dropout", "0.1", "--lr", "1e-2", "--warmup-steps", "0", "--set", "eval_prompts=0", *extra]


def numbers(out) -> list[tuple]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in rows]


def test_schedule_counts_steps_minutes_and_the_end():
    now = [0.0]
    cfg = SimpleNamespace(save_every=0, save_every_minutes=10)
    s = SaveSchedule(cfg, total_steps=100, clock=lambda: now[0])
    assert TrainConfig().save_every_minutes == 10 and s.enabled
    now[0] = 599.0
    assert not s.due(1)
    now[0] = 600.0
    assert s.due(2)  # ten minutes since the start
    now[0] = 1199.0
    assert not s.due(3)  # the minutes start again at each save
    assert s.due(100)  # the end
    steps = SaveSchedule(SimpleNamespace(save_every=4, save_every_minutes=10), 10, clock=lambda: now[0])
    assert [d for d in range(1, 11) if steps.due(d)] == [4, 8, 10]
    many = SaveSchedule(SimpleNamespace(save_every=0, save_every_minutes=10), 10, one_process=False,
                        clock=lambda: now[0])
    now[0] += 10_000
    assert many.enabled is False and not many.due(5) and not many.due(10)  # torchrun: steps only
    off = SaveSchedule(SimpleNamespace(save_every=0, save_every_minutes=0), 10, clock=lambda: now[0])
    assert not off.enabled and not off.due(10)


def test_a_default_run_writes_a_checkpoint_at_the_end(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert main(args(tiny_model_dir, data, out)) == 0
    assert [f.name for f in checkpoint_folders(out / "checkpoints")] == ["step-000006"]
    assert verify_checkpoint(out / "checkpoints" / "step-000006") == ""


def test_an_exception_in_a_step_saves_the_last_step_and_resumes(tiny_model_dir, data, tmp_path, capsys,
                                                               monkeypatch):
    ref = tmp_path / "ref"
    assert main(args(tiny_model_dir, data, ref)) == 0
    out = tmp_path / "run"
    real = loop.accumulate_step

    def failing(run, ids, n_targets, micro_step, counters, step=None):
        if step == 4:  # the fifth step: steps 1-4 are done
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")
        return real(run, ids, n_targets, micro_step, counters, step)

    monkeypatch.setattr(loop, "accumulate_step", failing)
    capsys.readouterr()
    assert main(args(tiny_model_dir, data, out)) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hivetune: error: training failed after step 4 (RuntimeError: CUDA error: an illegal memory access was "
        f"encountered); saved the checkpoint of step 4; resume with: hivetune train --resume {out}"]
    assert [f.name for f in checkpoint_folders(out / "checkpoints")] == ["step-000004"]
    assert not (out / LOCK_NAME).exists() and not (out / "adapter").exists()
    assert [row[0] for row in numbers(out)] == [1, 2, 3, 4]
    monkeypatch.setattr(loop, "accumulate_step", real)
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    tensors = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    expected = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
    assert tensors.keys() == expected.keys() and all((tensors[k] == expected[k]).all() for k in tensors)
    assert numbers(out) == numbers(ref)


def test_an_exception_before_any_step_names_the_last_checkpoint(tiny_model_dir, data, tmp_path, capsys,
                                                               monkeypatch):
    out = tmp_path / "run"

    def failing(*a, **k):
        raise RuntimeError("driver error")

    monkeypatch.setattr(loop, "accumulate_step", failing)
    capsys.readouterr()
    assert main(args(tiny_model_dir, data, out)) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hivetune: error: training failed after step 0 (RuntimeError: driver error); no checkpoint was written; "
        f"resume with: hivetune train --resume {out}"]
    with pytest.raises(TrainingFailed) as e:  # --debug: the traceback, the cause chained
        main(["--debug", *args(tiny_model_dir, data, tmp_path / "run2")])
    assert isinstance(e.value.__cause__, RuntimeError) and str(e.value.__cause__) == "driver error"
