"""benchmarks/multi_gpu.py's step timeline (--timeline DIR) on 2 gloo processes, with CUDA
events replaced by host-clock stand-ins (the probe's bookkeeping, not the GPU's clock)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHIM = """
import runpy, sys, time, torch
class Event:  # a CUDA event's record / elapsed_time on the host clock
    def __init__(self, enable_timing=False):
        self.t = None
    def record(self, stream=None):
        self.t = time.perf_counter()
    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3
torch.cuda.Event = Event
torch.cuda.synchronize = lambda *a, **k: None
sys.argv = [sys.argv[1], "ddp", "tiny", "--device", "cpu", "--timeline", sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ddp_step_timeline_marks_each_step_and_sums_its_parts(tmp_path):
    shim = tmp_path / "shim.py"
    shim.write_text(SHIM)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(shim), str(ROOT / "benchmarks" / "multi_gpu.py"), str(tmp_path / "tl")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in (0, 1):
        timeline = json.loads((tmp_path / "tl" / f"timeline-rank{rank}.json").read_text())
        marks = timeline["marks"]
        expected = [(what, k) for k in range(3) for what in ("start", "reduce", "reduced")]
        assert [(m["what"], m["step"]) for m in marks] == expected
        tail = [(m["what"], m["step"]) for m in timeline["tail"]]
        assert tail == [(what, k) for k in range(3) for what in ("clip", "clipped", "optimized")]
        # each step's tail lies between its all-reduce and the next step's start
        at = {(m["what"], m["step"]): m["host_s"] for m in marks + timeline["tail"]}
        assert all(at[("reduced", k)] <= at[("clip", k)] <= at[("clipped", k)] <= at[("optimized", k)]
                   for k in range(3))
        assert all(at[("optimized", k)] <= at[("start", k + 1)] for k in range(2))
        gpu = [m["gpu_s"] for m in marks]
        assert gpu[0] == 0.0 and gpu == sorted(gpu)
        assert timeline["summary"].startswith(f"rank {rank}: 3 steps; micro-batches sum ")
        # the three parts of steps 0-1 and step 2's first two add up to the span of the marks
        parts = [float(p.split("sum ")[1].split(" s")[0]) for p in timeline["summary"].split("; ")[1:4]]
        assert abs(sum(parts) - gpu[-1]) < 5e-3


def test_capture_profile_reports_each_deferred_capture(tmp_path, monkeypatch):
    """--capture-profile: each deferred capture's wall time, whether the GPU's queue
    outlasted it, and its functions by own time (here a capture that sleeps 50 ms: the sleep
    tops the list); the method is restored after."""
    import importlib.util
    import re
    import time

    import torch

    from hivetune.train import replay as graphs
    spec = importlib.util.spec_from_file_location("multi_gpu_bench", ROOT / "benchmarks" / "multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Event:  # the GPU still busy with what was queued before each capture
        def record(self, stream=None):
            pass

        def query(self):
            return False

    def capture(self):
        time.sleep(0.05)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(graphs.GraphedForwardBackward, "_capture_deferred", capture)
    graphed = object.__new__(graphs.GraphedForwardBackward)
    with module.capture_profile(1, str(tmp_path)):
        graphed._capture_deferred()
        graphed._capture_deferred()
    assert graphs.GraphedForwardBackward._capture_deferred is capture
    text = (tmp_path / "captures-rank1.txt").read_text()
    walls = [float(w) for w in re.findall(r"== capture \d: ([\d.]+) s, the work queued before it still running "
                                          r"at its end: True", text)]
    assert len(walls) == 2 and all(0.05 <= w < 1.0 for w in walls)
    first = text.split("== capture 2")[0]
    rows = [line for line in first.splitlines() if re.match(r"\s+\d+\s+[\d.]+", line)]
    assert "time.sleep" in rows[0] and float(rows[0].split()[1]) >= 0.05  # the top row by own time


def test_pass_profile_reports_each_pass_and_what_the_first_paid(tmp_path, monkeypatch):
    """--pass-profile: each of the first passes (train.step.forward_backward) under its own
    cProfile, then the functions by how much more own time the first pass spent than the second
    (here a first pass that sleeps 140 ms more: time.sleep tops that list with what the first pass
    slept more, as the two passes' walls say: a loaded machine oversleeps either pass); passes beyond
    the count run unprofiled, and train.step.forward_backward is restored after."""
    import importlib.util
    import re
    import time
    from types import SimpleNamespace

    import torch

    import hivetune.train.step as train_module

    spec = importlib.util.spec_from_file_location("multi_gpu_bench_passes", ROOT / "benchmarks" / "multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []

    def forward_backward(run, batch, n_targets, loss_fn):
        calls.append(n_targets)
        time.sleep(0.15 if len(calls) == 1 else 0.01)
        return torch.tensor(float(len(calls)))

    monkeypatch.setattr(train_module, "forward_backward", forward_backward)
    run = SimpleNamespace(device=torch.device("cpu"))
    batch = SimpleNamespace(input_ids=torch.zeros(1, 96, dtype=torch.long))
    with module.pass_profile(0, str(tmp_path), passes=2):
        losses = [train_module.forward_backward(run, batch, k, None).item() for k in range(3)]
    assert losses == [1.0, 2.0, 3.0] and calls == [0, 1, 2]
    assert train_module.forward_backward is forward_backward
    text = (tmp_path / "passes-rank0.txt").read_text()
    walls = [float(w) for w in re.findall(r"== pass \d: ([\d.]+) ms host \(under cProfile\), tokens 96, "
                                          r"capturing False, GPU busy at its end None, allocator \{\}", text)]
    assert len(walls) == 2 and walls[0] >= 150 and 10 <= walls[1] < walls[0]
    diff = text.split("== own time, pass 1 minus pass 2 (ms)\n")[1].splitlines()
    extra, name = diff[0].split(maxsplit=1)
    slept_more = walls[0] - walls[1]
    assert "sleep" in name and 0.8 * slept_more - 5 <= float(extra) <= slept_more + 5


def test_median_by_size_takes_steps_of_one_graph_size_after_the_first_two():
    """The timeline's micro-batch GPU time by graph size: only steps from the third whose
    micro-batches all took one size count (step 3 mixed two sizes; steps 0-1 warm up and plan)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rank_profiles_sizes", ROOT / "benchmarks" / "rank_profiles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seconds = {0: 0.7, 1: 0.2, 2: 0.094, 3: 0.18, 4: 0.093, 5: 0.081, 6: 0.095, 7: 0.5}
    sizes = [(0, 1728, 1650), (1, 1728, 1700), (2, 1728, 1690), (3, 1536, 1500), (3, 1728, 1600),
             (4, 1600, 1580), (5, 1408, 1400), (6, 1728, 1620)]  # step 7: eager, no graph
    assert module.median_by_size(seconds, sizes) == {1728: (95.0, 2), 1600: (93.0, 1), 1408: (81.0, 1)}
    assert module.median_by_size(seconds, []) == {}
