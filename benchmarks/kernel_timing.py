"""What the kernel benchmarks share (dropout_speed.py, fused_sweep.py, drop_matmul_speed.py): the
GPU time of a call replayed from a CUDA graph, and one results line of their rows.

A line goes to benchmarks/results/<name>-<device>.jsonl (hivetune.workflows.bench_results'
files) with the device, versions and commit; its figures sit under "kernels", not "hivetune", so
BENCHMARKS.md's table of training runs leaves them out.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hivetune.workflows.bench import environment
from hivetune.workflows.bench_results import append_result, device_kind


def gpu_us(fn, reps: int = 50) -> float:
    """GPU microseconds per call: `reps` calls captured in one CUDA graph and replayed, so the
    host's launch cost (~20-45 us a Triton launch, more than these kernels take) stays out."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


def append_kernel_rows(results: str, name: str, rows: list[dict], commit: str = "", setting: str = "defaults",
                       **extra) -> Path:
    """Append one line holding `rows` to `results`/<name>-<device>.jsonl; returns its path."""
    device = torch.device("cuda")
    env = environment(device, commit)
    record = {"workload": name, "device": device_kind(env.get("gpu")),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "commit": env["commit"],
              "setting": setting, "environment": env, **extra, "kernels": rows}
    path = append_result(Path(results), record)
    print(f"appended to {path}")
    return path


def add_result_flags(parser) -> None:
    """--results FOLDER and --commit, as every benchmark script takes them."""
    parser.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
