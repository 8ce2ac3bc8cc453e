"""The kill matrix: one run SIGKILLed at each stage (loading, mid-step, each stage of a checkpoint
write, pruning, the final adapter write), with a corrupt and a manifest-less newest checkpoint
between the attempts, and a run on a full disk; each resumed to the end gives the adapter of an
unbroken run, bit for bit, and metrics.jsonl with every step once.

The children are forked from test_kill_resume's fork server (torch imported once). Every stage is
reached by watching the run folder while HIVETUNE_TEST_SLOW_CHECKPOINT holds each stage open.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hivetune.checkpoint import MANIFEST, STATE, checkpoint_folders, verify_checkpoint
from test_kill_resume import (ForkServer, adapter_tensors, assert_bitwise_equal, data_file, metrics,  # noqa: F401
                              train_argv, wait_for)

STEPS = 12
SLOW = {"HIVETUNE_TEST_SLOW_CHECKPOINT": "0.3"}  # each stage of a checkpoint / adapter write held 0.3 s


@pytest.fixture(scope="module")
def forks(tiny_model_dir):
    server = ForkServer(tiny_model_dir)
    yield server
    server.close()


def argv(model_dir, data, out) -> list[str]:
    return train_argv(model_dir, data, out, STEPS, "--save-every", "2")


@pytest.fixture(scope="module")
def reference(forks, tiny_model_dir, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    assert forks.run(argv(tiny_model_dir, data_file, out), out.parent / "log") == 0
    return out


def temp_checkpoint(ckpts: Path, pid: int) -> Path | None:
    """The checkpoint process `pid` is writing (.step-NNNNNN.tmp-PID), if any."""
    if ckpts.is_dir():
        for p in ckpts.iterdir():
            if p.name.startswith(".step-") and p.name.endswith(f".tmp-{pid}"):
                return p
    return None


def holding(ckpts: Path, pid: int, *names: str, without: str | None = None) -> bool:
    tmp = temp_checkpoint(ckpts, pid)
    try:
        present = set(os.listdir(tmp)) if tmp is not None else set()
    except FileNotFoundError:
        return False
    return all(n in present for n in names) and (without is None or without not in present)


def pruning(ckpts: Path) -> bool:
    return ckpts.is_dir() and any(p.name.startswith(".trash-") for p in ckpts.iterdir())


def adapter_temp(out: Path, pid: int) -> bool:
    return (out / f".adapter.tmp-{pid}").is_dir()


@pytest.mark.slow
def test_kill_matrix_ends_bitwise_equal(forks, reference, tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    run_argv = argv(tiny_model_dir, data_file, out)
    stages = [
        ("loading", lambda pid: time.sleep(0.02) or True),
        ("mid-step", lambda pid: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text() != ""
         and temp_checkpoint(ckpts, pid) is None),
        ("checkpoint: adapter written", lambda pid: holding(ckpts, pid, "adapter_model.safetensors", without=STATE)),
        ("checkpoint: state written", lambda pid: holding(ckpts, pid, STATE, without=MANIFEST)),
        ("checkpoint: manifest written", lambda pid: holding(ckpts, pid, MANIFEST)),
        ("pruning", lambda pid: pruning(ckpts)),
        ("corrupt newest, then the final adapter write", lambda pid: adapter_temp(out, pid)),
    ]
    for attempt, (stage, reached) in enumerate(stages):
        log = tmp_path / f"log-{attempt}"
        if stage.startswith("corrupt"):
            newest = checkpoint_folders(ckpts)[-1]
            data = bytearray((newest / STATE).read_bytes())
            data[len(data) // 2] ^= 0xFF
            (newest / STATE).write_bytes(bytes(data))
        pid = forks.start(run_argv, log, SLOW)
        wait_for(lambda: reached(pid), timeout=120.0)
        os.kill(pid, signal.SIGKILL)
        rc = forks.wait(pid)
        assert rc == -signal.SIGKILL, f"{stage}: ended by itself (rc {rc}):\n{log.read_text()}"
        if stage.startswith("corrupt"):
            assert f"{newest}: {STATE} does not match its sha256 in manifest.json; using the previous checkpoint" \
                in log.read_text()
        # whatever the stage, every step-N folder left is complete
        assert all(not verify_checkpoint(f) for f in checkpoint_folders(ckpts)), stage

    newest = checkpoint_folders(ckpts)[-1]
    assert newest.name == f"step-{STEPS:06d}"  # killed in the final adapter write, after the last checkpoint
    (newest / MANIFEST).unlink()  # a manifest-less newest checkpoint: the one before it is used
    log = tmp_path / "log-final"
    assert forks.run(run_argv, log) == 0, log.read_text()
    assert f"{newest}: no manifest.json" in log.read_text()
    assert_bitwise_equal(adapter_tensors(out), adapter_tensors(reference))
    assert metrics(out) == metrics(reference)
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]
    assert not [p for p in out.iterdir() if p.name.startswith(".adapter")]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted at tmp_path/disk, or a skip naming why it cannot be."""
    disk = tmp_path / "disk"
    disk.mkdir()

    def mount(size: int, remount: bool = False) -> None:
        options = f"{'remount,' if remount else ''}size={size}"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): "
                        f"the full disk is left to test_robust_run's simulated ENOSPC")

    yield disk, mount
    subprocess.run(["umount", str(disk)], capture_output=True)


def disk_bytes(folder: Path) -> int:
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_full_disk_stops_with_one_line_and_resumes_bitwise_equal(forks, reference, tiny_model_dir, data_file,
                                                                 small_disk):
    disk, mount = small_disk
    checkpoint = disk_bytes(reference / "checkpoints" / f"step-{STEPS:06d}")
    # room for the run's small files and two and a half checkpoints: the third write fails (keep 2)
    mount(2 * checkpoint + checkpoint // 2 + 64 * 1024)
    out = disk / "run"
    run_argv = argv(tiny_model_dir, data_file, out)
    log = disk.parent / "log-full"
    assert forks.run(run_argv, log) == 2
    err = log.read_text().strip().splitlines()
    assert err == [f"hivetune: error: checkpoint of step 6: cannot write {out / 'checkpoints'}: No space left on "
                   f"device (ENOSPC); the last checkpoint, {out / 'checkpoints' / 'step-000004'}, is intact; make "
                   f"room, then resume with hivetune train --resume {out}"]
    assert [f.name for f in checkpoint_folders(out / "checkpoints")] == ["step-000002", "step-000004"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    mount(64 << 20, remount=True)  # room made
    log = disk.parent / "log-resume"
    assert forks.run(["train", "--resume", str(out), "--quiet"], log) == 0, log.read_text()
    assert_bitwise_equal(adapter_tensors(out), adapter_tensors(reference))
    assert metrics(out) == metrics(reference)
