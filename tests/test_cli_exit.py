"""cli.exit_quickly: a GPU command leaves without the interpreter's teardown, having flushed its
output, joined its threads and run its atexit handlers."""

import subprocess
import sys

SCRIPT = """
import atexit, threading, time
from hivetune.cli import exit_quickly
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.3)
    print("thread done")
threading.Thread(target=late).start()
print("unflushed", end="")
exit_quickly({code}, join={join})
print("never")
"""


def run(code: int, join: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(code=code, join=join)], capture_output=True,
                          text=True, timeout=60)


def test_exit_quickly_flushes_joins_and_runs_atexit():
    done = run(3, True)
    assert done.returncode == 3
    assert done.stdout.splitlines() == ["unflushedthread done", "atexit ran"]


def test_a_torchrun_worker_leaves_without_joining():
    done = run(0, False)
    assert done.returncode == 0 and done.stdout == "unflushed"


def test_a_cpu_command_exits_as_usual(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hivetune", "plan", "--model", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("hivetune: error: ")
