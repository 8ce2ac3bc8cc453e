"""Run folders are hivetune's only when it marked them: a user's folder is refused untouched by
--output and --resume, a run folder of an earlier hivetune (no marker) still resumes, a foreign
config.yaml is named in the error, and .hivetune.lock never stays behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import ops_records, write_jsonl
from hivetune.checkpoint import existing_run
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.core.fileio import LOCK_NAME, RUN_MARKER


def cli_args(model_dir, data_path, out, *extra):
    return ["train", "--model", str(model_dir), "--data", str(data_path), "--output", str(out), "--quiet",
            "--precision", "fp32", "--device", "cpu", "--threads", "1", "--max-steps", "4", "--batch-size", "4",
            "--save-every", "2", "--set", "eval_prompts=0", *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", ops_records(16))


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def numbers(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in rows]


def user_folder(tmp_path: Path) -> Path:
    """The issue's folder: a config.yaml and a metrics.jsonl that hivetune did not write."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.yaml").write_text("{}\n")
    (d / "metrics.jsonl").write_text('{"mine":1}\n')
    return d


def test_a_users_folder_is_refused_by_output_and_resume(tiny_model_dir, data, tmp_path, capsys):
    d = user_folder(tmp_path)
    before = snapshot(d)
    why = (f"{d} holds files hivetune did not write (no {RUN_MARKER} marker, no checkpoint made from its "
           f"config.yaml): config.yaml, metrics.jsonl; it is not a run folder, nothing was changed; "
           f"choose another folder")
    assert main(cli_args(tiny_model_dir, data, d, "--max-steps", "1")) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"hivetune: error: output_dir: {why}"]
    assert main(["train", "--resume", str(d), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"hivetune: error: --resume: {why}"]
    assert snapshot(d) == before  # nothing written, not even a lock file


def test_a_plain_file_in_output_is_refused(tiny_model_dir, data, tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep.txt").write_text("precious")
    assert main(cli_args(tiny_model_dir, data, d)) == 2
    assert capsys.readouterr().err.strip() == (
        f"hivetune: error: output_dir: {d} holds files hivetune did not write (no {RUN_MARKER} marker): "
        f"keep.txt; it is not a run folder, nothing was changed; choose another folder")
    assert snapshot(d) == {"keep.txt": b"precious"}


def test_a_new_run_folder_is_marked_and_unlocked_at_the_end(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    assert main(cli_args(tiny_model_dir, data, out)) == 0
    assert json.loads((out / RUN_MARKER).read_text()) == {"tool": "hivetune", "format": 1}
    assert not (out / LOCK_NAME).exists()
    assert existing_run(out) is True
    # a second train with the same config goes on with it (a finished run with checkpoints)
    assert main(cli_args(tiny_model_dir, data, out)) == 0
    assert not (out / LOCK_NAME).exists()


def test_a_run_folder_without_the_marker_still_resumes(tiny_model_dir, data, tmp_path, capsys):
    """A run of an earlier hivetune: config.yaml, checkpoints/ and metrics.jsonl, no marker."""
    ref = tmp_path / "ref"
    assert main(cli_args(tiny_model_dir, data, ref)) == 0
    old = tmp_path / "old"
    assert main(cli_args(tiny_model_dir, data, old, "--max-steps", "4")) == 0
    for name in ("adapter", "summary.json", "checkpoints/step-000004", RUN_MARKER):
        shutil.rmtree(old / name) if (old / name).is_dir() else (old / name).unlink()
    lines = (old / "metrics.jsonl").read_text().splitlines()
    (old / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(old), "--quiet"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert (old / RUN_MARKER).is_file()
    assert numbers(old) == numbers(ref) and [row[0] for row in numbers(old)] == [1, 2, 3, 4]
    assert (old / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (ref / "adapter" / "adapter_model.safetensors").read_bytes()


def test_a_run_folder_without_marker_or_checkpoint_is_refused(tiny_model_dir, data, tmp_path, capsys):
    old = tmp_path / "old"
    assert main(cli_args(tiny_model_dir, data, old)) == 0
    shutil.rmtree(old / "checkpoints")
    (old / RUN_MARKER).unlink()
    before = snapshot(old)
    capsys.readouterr()
    assert main(["train", "--resume", str(old), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hivetune: error: --resume: {old} holds files hivetune did not write (no {RUN_MARKER} marker, no "
        f"checkpoint made from its config.yaml): adapter, config.yaml, metrics.jsonl, summary.json; it is not a "
        f"run folder, nothing was changed; choose another folder")
    assert snapshot(old) == before


def test_a_foreign_config_yaml_is_named_and_the_lock_released(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(cli_args(tiny_model_dir, data, out)) == 0
    config = out / "config.yaml"
    values = yaml.safe_load(config.read_text())
    values["user"] = "me"
    config.write_text(yaml.safe_dump(values))
    capsys.readouterr()
    assert main(cli_args(tiny_model_dir, data, out)) == 2
    assert capsys.readouterr().err.strip() == f"hivetune: error: {config}: user: unknown key"
    assert not (out / LOCK_NAME).exists()
    assert main(["train", "--resume", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == f"hivetune: error: {config}: user: unknown key"
    assert not (out / LOCK_NAME).exists()


def test_a_marker_of_a_newer_format_or_not_hivetunes_is_refused(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.yaml").write_text("{}\n")
    (d / RUN_MARKER).write_text('{"tool": "hivetune", "format": 2}')
    with pytest.raises(UserError) as e:
        existing_run(d)
    assert str(e.value) == (f"output_dir: {d} is a run folder of a newer hivetune (format 2; this one reads 1); "
                            f"upgrade hivetune or choose another folder")
    (d / RUN_MARKER).write_text("hello")
    with pytest.raises(UserError, match=r"\.hivetune-run: not a hivetune run marker"):
        existing_run(d)


def test_an_empty_or_only_marked_folder_is_new(tmp_path):
    d = tmp_path / "d"
    assert existing_run(d) is False
    d.mkdir()
    assert existing_run(d) is False
    (d / RUN_MARKER).write_text('{"tool": "hivetune", "format": 1}')
    (d / LOCK_NAME).write_text("123\n")
    assert existing_run(d) is False


def test_a_folder_left_by_a_kill_while_writing_config_or_marker_is_new(tiny_model_dir, data, tmp_path):
    """Killed inside atomic_write_with: the marker (or nothing) and a .NAME.tmp-PID of the marker or
    config.yaml. The folder is new, the temp file goes, and train writes its run there."""
    d = tmp_path / "d"
    d.mkdir()
    (d / RUN_MARKER).write_text('{"tool": "hivetune", "format": 1}')
    (d / ".config.yaml.tmp-12104").write_text("model: half written")
    assert existing_run(d) is False
    assert sorted(p.name for p in d.iterdir()) == [RUN_MARKER]
    (d / RUN_MARKER).unlink()
    (d / f".{RUN_MARKER}.tmp-7").write_text('{"tool": "hiv')
    assert existing_run(d) is False
    assert list(d.iterdir()) == []
    (d / RUN_MARKER).write_text('{"tool": "hivetune", "format": 1}')
    (d / ".config.yaml.tmp-3").write_text("x")
    assert main(cli_args(tiny_model_dir, data, d)) == 0
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == [RUN_MARKER]
    assert (d / "adapter").is_dir()


def test_a_temp_looking_file_beside_other_files_is_not_removed(tmp_path):
    """Only hivetune's own temp names, and only in a folder holding nothing else, are cleared."""
    d = tmp_path / "d"
    d.mkdir()
    (d / RUN_MARKER).write_text('{"tool": "hivetune", "format": 1}')
    (d / ".config.yaml.tmp-5").write_text("x")
    (d / ".config.yaml.tmp-notes").write_text("mine")
    with pytest.raises(UserError) as e:
        existing_run(d)
    assert str(e.value) == (f"output_dir: {d} holds a run marker but no config.yaml: .config.yaml.tmp-notes; "
                            f"it is not a run folder, nothing was changed; choose another folder")
    assert sorted(p.name for p in d.iterdir()) == sorted([RUN_MARKER, ".config.yaml.tmp-5", ".config.yaml.tmp-notes"])
