"""Robust run folders: one trainer per folder (a lock naming the holder's pid, a dead holder's
lock taken over), a full or read-only disk while checkpointing (one line, earlier checkpoints
intact, no half-written folder, resumable), adapter folders replaced whole (a kill or an error
mid-write leaves the old adapter or the new one, and the next run clears the leftovers), and
--resume accepting only threads / device."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from hivetune import checkpoint as ckpt
from hivetune.core import fileio
from hivetune.checkpoint import checkpoint_folders, verify_checkpoint
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.core.fileio import LOCK_NAME, check_writable, hold_run_lock, release_run_lock
from hivetune.train.loop import TrainingStopped, fit
from hivetune.train.setup import setup
from test_resume import assert_bitwise_equal, data, metric_rows, reference, run_cfg  # noqa: F401 (fixtures)


def cli_args(model_dir, data_path, out, *extra):
    return ["train", "--model", str(model_dir), "--data", str(data_path), "--output", str(out), "--quiet",
            "--precision", "fp32", "--device", "cpu", "--threads", "1", "--max-steps", "2", "--batch-size", "4",
            "--set", "eval_prompts=0", *extra]


# ---------------------------------------------------------------------------------- the run lock

@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of a run folder (with a config.yaml, as a live trainer's)."""
    procs = []

    def start(folder: Path) -> subprocess.Popen:
        code = (f"import sys, time; from hivetune.core.fileio import hold_run_lock; hold_run_lock({str(folder)!r}); "
                f"print('locked', flush=True); time.sleep(120)")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_second_trainer_is_refused_naming_the_holder(tiny_model_dir, data, holder, tmp_path, capsys):
    out = tmp_path / "run"
    args = cli_args(tiny_model_dir, data, out)
    assert main(args) == 0  # a finished run with the same config: a second `train` would go on with it
    release_run_lock(out)  # as when that process exits
    capsys.readouterr()
    config = (out / "config.yaml").read_bytes()
    proc = holder(out)
    busy = (f"hivetune: error: output_dir: {out} is in use by another hivetune train (pid {proc.pid}); wait for "
            f"it to finish or stop it, or choose another output")
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [busy]
    assert main(["train", "--resume", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [busy]
    assert (out / "config.yaml").read_bytes() == config
    assert (out / LOCK_NAME).read_text() == f"{proc.pid}\n"


def test_a_dead_holders_lock_is_taken_over(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(cli_args(tiny_model_dir, data, out)) == 0
    release_run_lock(out)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (out / LOCK_NAME).write_text(f"{dead_pid}\n")  # a trainer that was SIGKILLed: its kernel lock is gone
    assert hold_run_lock(out) == dead_pid
    assert (out / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    assert hold_run_lock(out) is None  # idempotent in the process that holds it
    release_run_lock(out)
    # end to end: a new `train` on the folder (same config) goes on from the dead holder's run
    (out / LOCK_NAME).write_text(f"{dead_pid}\n")
    (out / "summary.json").unlink()  # as if it died before the end; no checkpoint: starts again at step 0
    assert main(cli_args(tiny_model_dir, data, out)) == 0
    assert [r["step"] for r in metric_rows(out)] == [1, 2]


def test_lock_without_kernel_locks_falls_back_to_the_pid(tmp_path, monkeypatch):
    """A file system without fcntl locks (ENOLCK): a live pid in the file refuses, a dead one does not."""
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fileio.fcntl, "lockf", no_locks)
    live = tmp_path / "live"
    live.mkdir()
    (live / LOCK_NAME).write_text(f"{os.getppid()}\n")
    with pytest.raises(UserError) as e:
        hold_run_lock(live)
    assert f"(pid {os.getppid()})" in str(e.value)
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / LOCK_NAME).write_text("999999999\n")
    assert hold_run_lock(stale) == 999999999
    release_run_lock(stale)


# ---------------------------------------------------------------------------------- adapter folders

# A process writing a two-file folder with write_folder_atomically, killed (os._exit: no clean-up
# runs) after the first file of the new folder, after the first rename, or after the second.
KILLED_WRITER = r"""
import os, sys
from pathlib import Path
from hivetune.core import fileio
folder, moment = Path(sys.argv[1]), sys.argv[2]
real_replace, renames = os.replace, []

def replace(src, dst):
    real_replace(src, dst)
    renames.append(dst)
    if (moment, len(renames)) in (("between_renames", 1), ("before_removing_old", 2)):
        os._exit(9)

os.replace = replace

def write(tmp):
    (tmp / "adapter_model.safetensors").write_bytes(b"new weights")
    if moment == "writing":
        os._exit(9)
    (tmp / "adapter_config.json").write_bytes(b"new config")

fileio.write_folder_atomically(folder, write)
"""
OLD = {"adapter_config.json": b"old config", "adapter_model.safetensors": b"old weights"}
NEW = {"adapter_config.json": b"new config", "adapter_model.safetensors": b"new weights"}


def folder_files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def folder_digests(folder: Path) -> dict:
    return {p.name: ckpt.sha256_file(p) for p in folder.iterdir()}


@pytest.mark.parametrize("moment,left_on_disk,recovered", [
    ("writing", {"adapter": OLD, ".adapter.tmp-PID": {"adapter_model.safetensors": b"new weights"}}, OLD),
    ("between_renames", {".adapter.old-PID": OLD, ".adapter.tmp-PID": NEW}, OLD),
    ("before_removing_old", {"adapter": NEW, ".adapter.old-PID": OLD}, NEW),
])
def test_a_folder_write_killed_at_any_moment_leaves_old_or_new(moment, left_on_disk, recovered, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    for name, content in OLD.items():
        (folder / name).write_bytes(content)
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(folder), moment], timeout=120)
    assert proc.returncode == 9
    names = {p.name.rsplit("-", 1)[0] + "-PID" if ".adapter." in p.name else p.name: p for p in tmp_path.iterdir()}
    assert {name: folder_files(path) for name, path in names.items()} == left_on_disk
    fileio.recover_folder(folder)  # what a resumed run does first (checkpoint.resume_run)
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"] and folder_files(folder) == recovered
    fileio.write_folder_atomically(folder, lambda tmp: (tmp / "adapter_model.safetensors").write_bytes(b"next"))
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]
    assert folder_files(folder) == {"adapter_model.safetensors": b"next"}


def test_an_adapter_write_that_fails_leaves_the_previous_adapter_whole(tiny_model_dir, data, tmp_path, monkeypatch):
    """The weights are written, then the config fails (a full disk): adapter/ keeps both old files.
    (A write file by file into adapter/ would leave the new weights beside the old config.)"""
    import torch

    from hivetune.train.run import save_adapter_all_ranks

    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out, max_steps=2))
    fit(run, progress=False)
    before = folder_digests(out / "adapter")
    with torch.no_grad():
        for p in run.model.parameters():
            if p.requires_grad:
                p.add_(1.0)

    def full_disk(path, payload):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(fileio, "atomic_write_bytes", full_disk)  # save_adapter's config write
    with pytest.raises(OSError):
        save_adapter_all_ranks(run, out / "adapter")
    assert folder_digests(out / "adapter") == before
    assert not [p.name for p in out.iterdir() if p.name.startswith(".adapter.")]  # no temp folder left
    monkeypatch.undo()
    save_adapter_all_ranks(run, out / "adapter")
    after = folder_digests(out / "adapter")
    assert after.keys() == before.keys() and after["adapter_model.safetensors"] != before["adapter_model.safetensors"]


def test_resume_puts_back_an_adapter_folder_killed_between_renames(tiny_model_dir, data, reference, tmp_path):
    """A kill between the renames of best_adapter/ and another inside adapter/'s temp folder
    (as the test above leaves them): the resumed run restores the one and clears the other."""
    import shutil

    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)
    aside = out / ".best_adapter.old-4242"  # renamed aside whole, the new one not yet renamed in
    aside.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(out / "checkpoints" / "step-000002" / name, aside / name)
    best = folder_digests(aside)
    (out / ".best_adapter.tmp-4242").mkdir()
    (out / ".adapter.tmp-4243").mkdir()  # killed while writing the new adapter's files
    (out / ".adapter.tmp-4243" / "adapter_model.safetensors").write_bytes(b"half")
    resumed = setup(run_cfg(tiny_model_dir, data, out))
    assert resumed.start_step == 2
    assert folder_digests(out / "best_adapter") == best
    assert not [p.name for p in out.iterdir() if p.name.startswith((".adapter.", ".best_adapter."))]
    fit(resumed, progress=False)
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert_bitwise_equal(load_file(str(out / "adapter" / "adapter_model.safetensors")), reference[0])


def test_killed_writing_the_adapter_after_the_last_checkpoint_resumes_to_the_adapter(tiny_model_dir, data, reference,
                                                                                     tmp_path):
    """Killed after the checkpoint of the last step, inside adapter/'s first write: the resumed run
    has no step left to train and writes the adapter (it stopped with an UnboundLocalError)."""
    import shutil

    out = tmp_path / "run"
    fit(setup(run_cfg(tiny_model_dir, data, out)), progress=False)  # save_every 2: step 6 is checkpointed
    shutil.rmtree(out / "adapter")
    (out / ".adapter.tmp-4244").mkdir()
    (out / ".adapter.tmp-4244" / "adapter_model.safetensors").write_bytes(b"half")
    resumed = setup(run_cfg(tiny_model_dir, data, out))
    assert resumed.start_step == len(resumed.steps) == 6
    result = fit(resumed, progress=False)
    assert result.steps == 6 and not result.stopped_early
    assert_bitwise_equal(load_file(str(out / "adapter" / "adapter_model.safetensors")), reference[0])
    assert not [p.name for p in out.iterdir() if p.name.startswith(".adapter.")]


# ---------------------------------------------------------------------------------- full / read-only disk

def fail_checkpoint_writes(monkeypatch, at_step: int, code: int) -> None:
    """Make the checkpoint of `at_step` fail with OSError(code) while writing trainer_state.pt."""
    real = ckpt.atomic_write_bytes

    def write(path, payload):
        if path.parent.name.startswith(f".step-{at_step:06d}.tmp"):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, payload)

    monkeypatch.setattr(ckpt, "atomic_write_bytes", write)


@pytest.mark.parametrize("code,name", [(errno.ENOSPC, "ENOSPC"), (errno.EROFS, "EROFS")])
def test_checkpoint_on_a_full_disk_keeps_the_last_one_and_resumes(code, name, tiny_model_dir, data, reference,
                                                                  tmp_path, monkeypatch):
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))
    fail_checkpoint_writes(monkeypatch, 4, code)
    with pytest.raises(UserError) as e:
        fit(run, progress=False)
    state = out / "checkpoints" / ".step-000004.tmp-{}".format(os.getpid()) / "trainer_state.pt"
    assert str(e.value) == (
        f"checkpoint of step 4: cannot write {state}: {os.strerror(code)} ({name}); the last checkpoint, "
        f"{out / 'checkpoints' / 'step-000002'}, is intact; make room, then resume with "
        f"hivetune train --resume {out}")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]  # no temp folder left
    assert verify_checkpoint(out / "checkpoints" / "step-000002") == ""
    monkeypatch.undo()
    resumed = setup(run_cfg(tiny_model_dir, data, out))
    assert resumed.start_step == 2
    fit(resumed, progress=False)
    assert_bitwise_equal(load_file(str(out / "adapter" / "adapter_model.safetensors")), reference[0])


def test_full_disk_through_the_cli_is_one_line(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    fail_checkpoint_writes(monkeypatch, 2, errno.ENOSPC)
    assert main(cli_args(tiny_model_dir, data, out, "--save-every", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hivetune: error: checkpoint of step 2: cannot write ")
    assert err[0].endswith("No space left on device (ENOSPC); no earlier checkpoint exists")
    assert list((out / "checkpoints").iterdir()) == []
    # any other write that hits a full disk (here the final summary) is one line too, not a traceback
    import hivetune.workflows.train_job as train_module

    def full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(train_module, "atomic_write_bytes", full)
    assert main(cli_args(tiny_model_dir, data, tmp_path / "run2", "--set", "save_every_minutes=0")) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hivetune: error: cannot write {tmp_path / 'run2' / 'summary.json'}: No space left on device (ENOSPC)"]


def test_read_only_output_is_refused_before_training(tmp_path, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == parent else real_access(p, mode))
    with pytest.raises(UserError) as e:
        check_writable(parent / "runs" / "a")
    assert str(e.value) == f"output_dir: cannot write in {parent} (no write permission)"
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError) as e:
        check_writable(tmp_path / "file" / "run")
    assert str(e.value) == f"output_dir: {tmp_path / 'file'} is a file, not a folder"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_through_the_cli(tiny_model_dir, data, tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert main(cli_args(tiny_model_dir, data, parent / "run")) == 2
    finally:
        parent.chmod(0o755)
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hivetune: error: output_dir: cannot write in {parent} (no write permission)"]
    assert list(parent.iterdir()) == []


# ---------------------------------------------------------------------------------- resume: runtime keys

def test_resume_may_change_threads_and_device_only(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=3)
    release_run_lock(out)
    saved = (out / "config.yaml").read_bytes()
    assert main(["train", "--resume", str(out), "--threads", "2", "--lr", "5e-3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hivetune: error: --resume: a resumed run keeps its config; these flags change it: lr: 0.01 -> 0.005"]
    cfg = ckpt.resume_config(out, None, {"threads": 2, "device": "cpu", "skip_doctor": True})
    assert (cfg.threads, cfg.device, cfg.skip_doctor, cfg.lr) == (2, "cpu", True, 0.01)
    assert main(["train", "--resume", str(out), "--threads", "2", "--device", "cpu", "--no-doctor", "--quiet"]) == 0
    assert [r["step"] for r in metric_rows(out)] == [1, 2, 3, 4, 5, 6]
    assert (out / "config.yaml").read_bytes() == saved  # checkpoints hash it: never rewritten
    assert yaml.safe_load(saved)["threads"] == 1


def test_same_output_with_other_threads_resumes(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    run = setup(run_cfg(tiny_model_dir, data, out))
    with pytest.raises(TrainingStopped):
        fit(run, progress=False, stop_after=2)
    resumed = setup(run_cfg(tiny_model_dir, data, out, threads=2))
    assert resumed.start_step == 2 and resumed.cfg.threads == 2
    with pytest.raises(UserError) as e:
        setup(run_cfg(tiny_model_dir, data, out, lr=5e-3))
    assert "lr: 0.01 -> 0.005" in str(e.value)


def test_manifest_names_outside_the_checkpoint_are_refused(tiny_model_dir, data, reference):
    folder = checkpoint_folders(reference[2] / "checkpoints")[-1]
    manifest = (folder / "manifest.json").read_text()
    try:
        bad = json.loads(manifest)
        bad["files"]["../../config.yaml"] = {"sha256": "0", "bytes": 1}
        (folder / "manifest.json").write_text(json.dumps(bad))
        assert verify_checkpoint(folder) == "manifest.json names '../../config.yaml' is not a plain name inside the folder"
    finally:
        (folder / "manifest.json").write_text(manifest)
    assert verify_checkpoint(folder) == ""


def test_confined_names():
    base = Path("/r")
    assert fileio.confined(base, "adapter_model.safetensors") == base / "adapter_model.safetensors"
    for bad in ("", ".", "..", "../x", "a/b", "/etc/passwd", "a\\b", "a\0b", 3):
        with pytest.raises(UserError):
            fileio.confined(base, bad)
