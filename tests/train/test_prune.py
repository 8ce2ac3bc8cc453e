"""Pruning keeps the newest keep_checkpoints loadable checkpoints: an incomplete one (no
manifest, a file cut short) is not counted, and goes only once a newer loadable one exists."""

from __future__ import annotations

import shutil

import pytest

from hivetune.checkpoint import MANIFEST, STATE, checkpoint_folders, incomplete, prune_checkpoints
from hivetune.train.loop import TrainingStopped, fit
from hivetune.train.setup import setup
from test_resume import data, run_cfg  # noqa: F401 (fixture)


def names(root) -> list[str]:
    return [f.name for f in checkpoint_folders(root)]


def test_an_off_grid_checkpoint_without_manifest_does_not_cost_the_valid_one(tiny_model_dir, data, tmp_path,
                                                                             capsys):
    """The issue's run: --save-every 2, stopped during step 7 (an off-grid step-000007 written),
    its manifest.json deleted, resumed: after the next save, step-000006 must still be there."""
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out, max_steps=10))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=7)
    root = out / "checkpoints"
    assert names(root) == ["step-000004", "step-000006"]
    shutil.copytree(root / "step-000006", root / "step-000007")  # as SIGINT during step 7 writes it
    (root / "step-000007" / MANIFEST).unlink()
    run = setup(run_cfg(tiny_model_dir, data, out, max_steps=10))
    assert run.start_step == 6
    assert f"{root / 'step-000007'}: no manifest.json" in capsys.readouterr().err
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=9)  # saves step 8, then stops as a kill would
    assert names(root) == ["step-000006", "step-000008"]


def fake_checkpoint(root, step: int, complete: bool = True):
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / STATE).write_bytes(b"s" * 10)
    (folder / "adapter_model.safetensors").write_bytes(b"a" * 20)
    if complete:
        (folder / MANIFEST).write_text(
            '{"files": {"%s": {"bytes": 10}, "adapter_model.safetensors": {"bytes": 20}}}' % STATE)
    return folder


def test_prune_counts_complete_checkpoints_only(tmp_path):
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 2)
    fake_checkpoint(root, 4)
    fake_checkpoint(root, 5, complete=False)
    cut = fake_checkpoint(root, 6)
    (cut / STATE).write_bytes(b"s")  # cut short
    assert incomplete(cut) == f"{STATE} is missing or of another size"
    prune_checkpoints(root, 2)
    assert names(root) == ["step-000002", "step-000004", "step-000005", "step-000006"]  # 4 is the newest good
    fake_checkpoint(root, 8)
    prune_checkpoints(root, 2)
    assert names(root) == ["step-000004", "step-000008"]
    fake_checkpoint(root, 9, complete=False)  # newer than every complete one: stays
    prune_checkpoints(root, 1)
    assert names(root) == ["step-000008", "step-000009"]
