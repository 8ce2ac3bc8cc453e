"""`hivetune train` killed at random moments (SIGKILL) and resumed, again and again, ends with the
same adapter, bit for bit, as a run never interrupted; SIGINT / SIGTERM stop it cleanly.

A fresh `python -m hivetune` spends ~8 s importing torch and transformers on the 2-core CI
CPU, so a dozen kills would take minutes. The kills go to children forked from one process
that has done those imports and nothing else (no torch op, no tokenizer call: no thread pools
to inherit): each child runs `hivetune.cli.main(argv)` exactly as `python -m hivetune` does,
with its own stdout/stderr, and is killed by pid. One test runs the real `python -m hivetune`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hivetune.checkpoint import checkpoint_folders, verify_checkpoint

# The forking process: reads one JSON command a line, answers one JSON line.
#   {"run": argv, "log": path, "env": {...}} -> {"pid": pid}   (the child runs hivetune.cli.main)
#   {"wait": pid}                           -> {"returncode": rc}  (negative: killed by that signal)
FORK_SERVER = r"""
import json, os, signal, sys
import hivetune.cli, hivetune.train.loop, hivetune.checkpoint
from hivetune.model.tokenizer import load_tokenizer
load_tokenizer.__wrapped__(sys.argv[1])  # imports the lazy transformers modules; not cached
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if "wait" in cmd:
        _, status = os.waitpid(cmd["wait"], 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(0)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.environ.update(cmd["env"])
            code = hivetune.cli.main(cmd["run"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
"""


class ForkServer:
    def __init__(self, model_dir: Path):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER, str(model_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self._read() == {"ready": True}

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def start(self, argv: list[str], log: Path, env: dict | None = None) -> int:
        return self._ask({"run": argv, "log": str(log), "env": env or {}})["pid"]

    def wait(self, pid: int) -> int:
        return self._ask({"wait": pid})["returncode"]

    def run(self, argv: list[str], log: Path, env: dict | None = None) -> int:
        return self.wait(self.start(argv, log, env))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def forks(tiny_model_dir):
    server = ForkServer(tiny_model_dir)
    yield server
    server.close()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from conftest import ops_records, write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", ops_records(24))


def train_argv(model_dir: Path, data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--model", str(model_dir), "--data", str(data), "--output", str(out), "--max-steps", str(steps),
            "--batch-size", "2", "--lr", "1e-2", "--warmup-steps", "0", "--precision", "fp32", "--device", "cpu",
            "--threads", "1", "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--seed", "3",
            "--quiet", "--set", "eval_prompts=0", *extra]


def adapter_tensors(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def metrics(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in rows]


STEPS = 40  # more than a dozen short-lived attempts get through, even on a fast machine


@pytest.fixture(scope="module")
def reference(forks, tiny_model_dir, data_file, tmp_path_factory):
    """The same run, never interrupted."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert forks.run(train_argv(tiny_model_dir, data_file, out, STEPS, "--save-every", "1"), out.parent / "log") == 0
    return out


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def newest_step(ckpts: Path) -> int:
    """The newest complete checkpoint's step (0: none yet)."""
    folders = checkpoint_folders(ckpts)
    return int(folders[-1].name[5:]) if folders else 0


def writing(ckpts: Path, pid: int) -> bool:
    """Whether process `pid` has a checkpoint temp folder (.step-NNNNNN.tmp-PID) in `ckpts`."""
    return ckpts.is_dir() and any(p.name.endswith(f".tmp-{pid}") for p in ckpts.iterdir())


def test_sigkill_at_random_moments_then_resume_is_bitwise_equal(forks, reference, tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "run"
    argv = train_argv(tiny_model_dir, data_file, out, STEPS, "--save-every", "1")
    env = {"HIVETUNE_TEST_SLOW_CHECKPOINT": "0.02"}  # ~3 pauses per checkpoint: kills land in them
    ckpts = out / "checkpoints"
    rng = random.Random(1234)
    kills, mid_checkpoint, resumed_at = 0, 0, []
    for attempt in range(12):
        log = tmp_path / f"log-{attempt}"
        last = newest_step(ckpts)
        pid = forks.start(argv, log, env)
        if attempt % 4 == 0:  # any moment: loading, training, writing or pruning a checkpoint
            time.sleep(rng.uniform(0.1, 1.0))
        elif attempt % 4 == 2:  # soon after this process saved a step: progress on a slow machine too
            wait_for(lambda: newest_step(ckpts) > last, timeout=120.0)
            time.sleep(rng.uniform(0.0, 0.05))
        else:  # while a checkpoint is being written: this process's temp folder exists
            wait_for(lambda: writing(ckpts, pid))
            time.sleep(rng.uniform(0.0, 0.06))
        os.kill(pid, signal.SIGKILL)
        rc = forks.wait(pid)
        text = log.read_text()
        assert rc == -signal.SIGKILL, f"attempt {attempt} ended by itself (rc {rc}) before the kill:\n{text}"
        kills += 1
        mid_checkpoint += writing(ckpts, pid)
        # A kill never leaves a step-N folder that fails its manifest (the rename is atomic).
        assert "using the previous checkpoint" not in text
        assert all(not verify_checkpoint(f) for f in checkpoint_folders(ckpts))
        if "resuming from" in text:
            resumed_at.append(int(text.split("(step ")[1].split(" ")[0]))
    log = tmp_path / "log-final"
    assert forks.run(argv, log, env) == 0, log.read_text()
    print(f"kills {kills}, mid-checkpoint {mid_checkpoint}, resumed at steps {resumed_at}")

    assert kills >= 10 and mid_checkpoint >= 3
    assert len(set(resumed_at)) >= 3 and resumed_at == sorted(resumed_at), resumed_at
    assert_bitwise_equal(adapter_tensors(out), adapter_tensors(reference))
    assert metrics(out) == metrics(reference)  # each step once, same losses, no duplicates
    assert [f.name for f in checkpoint_folders(ckpts)] == [f"step-{STEPS - 1:06d}", f"step-{STEPS:06d}"]
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]  # leftovers cleaned on resume


@pytest.mark.parametrize("how", ["sigterm", "sigint"])
def test_signal_finishes_step_checkpoints_and_resumes(how, forks, reference, tiny_model_dir, data_file, tmp_path):
    """SIGTERM to a forked child; SIGINT to a real `python -m hivetune train`."""
    out = tmp_path / "run"
    argv = train_argv(tiny_model_dir, data_file, out, STEPS, "--save-every", "1")
    log = tmp_path / "log"
    env = {"HIVETUNE_TEST_SLOW_CHECKPOINT": "0.02"}
    if how == "sigterm":
        pid, sig = forks.start(argv, log, env), signal.SIGTERM
    else:
        proc = subprocess.Popen([sys.executable, "-m", "hivetune", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        pid, sig = proc.pid, signal.SIGINT
    metrics_file = out / "metrics.jsonl"
    wait_for(lambda: metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3, timeout=60)
    os.kill(pid, sig)
    if how == "sigterm":
        rc, err = forks.wait(pid), log.read_text()
    else:
        _, err = proc.communicate(timeout=60)
        rc = proc.returncode
    assert rc == 128 + sig, err
    step = metrics(out)[-1][0]
    assert 3 <= step < STEPS
    assert err.strip().splitlines()[-1] == f"hivetune: stopped at step {step}; resume with: hivetune train --resume {out}"
    newest = checkpoint_folders(out / "checkpoints")[-1]
    assert newest.name == f"step-{step:06d}" and verify_checkpoint(newest) == ""
    assert not (out / "adapter").exists()

    assert forks.run(["train", "--resume", str(out), "--quiet"], tmp_path / "log-resume") == 0
    assert_bitwise_equal(adapter_tensors(out), adapter_tensors(reference))
    assert metrics(out) == metrics(reference)
