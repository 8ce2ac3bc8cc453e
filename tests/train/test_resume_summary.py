"""The summary covers the whole run across resumes: the time and tokens of every part, also
when the last part had only the final adapter to write."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hivetune.checkpoint import STATE
from hivetune.cli import main
from hivetune.train.loop import TrainingStopped, fit
from hivetune.train.setup import setup
from test_resume import data, run_cfg  # noqa: F401 (fixture)


def saved_counters(out, step: int) -> dict:
    state = torch.load(out / "checkpoints" / f"step-{step:06d}" / STATE, weights_only=True)
    return state["counters"]


def test_a_resume_with_only_the_adapter_left_reports_the_whole_run(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))  # 6 steps, a checkpoint every 2
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=6)  # the last checkpoint written, killed before the adapter
    part = saved_counters(out, 6)
    tokens = sum(run.data.lengths[i] for step in run.steps for i in step)
    assert part["run_tokens"] == tokens and part["run_seconds"] > 0
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["train_seconds"] >= round(part["run_seconds"], 2) > 0
    tps, secs = summary["tokens_per_s"], summary["train_seconds"]
    rounding = tps * 0.005 + secs * 0.05  # summary.json rounds seconds to 0.01 and tokens/s to 0.1
    assert abs(tps * secs - tokens) <= rounding + 0.01 * tokens
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("trained"))
    printed = re.match(r"trained 6 steps in ([0-9.]+) s  \(([0-9,]+) tokens/s", line)
    assert printed, line  # the printed line rounds the unrounded figures, summary.json its own way
    assert abs(float(printed[1]) - summary["train_seconds"]) <= 0.051
    assert abs(int(printed[2].replace(",", "")) - summary["tokens_per_s"]) <= 0.51


def test_each_part_adds_its_time_and_tokens(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)  # the checkpoint of step 2 holds part 1's first 2 steps
    first = saved_counters(out, 2)
    run = setup(run_cfg(tiny_model_dir, data, out))
    assert run.counters["run_seconds"] == first["run_seconds"]
    result = fit(run, progress=False)
    tokens = sum(run.data.lengths[i] for step in run.steps for i in step)
    last = saved_counters(out, 6)
    assert last["run_tokens"] == tokens  # steps 1-2 from part 1, 3-6 from part 2: each once
    assert last["run_seconds"] > first["run_seconds"]
    assert result.seconds >= last["run_seconds"]
    assert result.tokens_per_s * result.seconds == pytest.approx(tokens, rel=1e-6)
