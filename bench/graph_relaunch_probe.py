"""Does relaunching a CUDA graph that is still running block the host? (issue 10)

W2's DDP ranks replay one graph per step, then queue the all-reduce and the optimizer. How far
the host can run ahead of the GPU decides whether a graph captured mid-run could hide its host
pass (~0.17 s on W2) behind queued replays.
Session 15's first probe (H100): with 150-kernel graphs of ~28 ms the 4th replay() waited, for
one graph back to back and for two alternating. Timed here: two graphs alternately replayed on an
idle GPU, for graphs of 10, 150, 600 and 2,400 kernels (each ~15-30 ms of GPU work): which
launch first waits, so whether the limit counts launches or queued kernels.

    python bench/graph_relaunch_probe.py       # prints one JSON line
"""

from __future__ import annotations

import json
import time

import torch

from hivetune.workflows.bench import environment


def captured(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture (cuBLAS workspaces)
            y = x
            for _ in range(n):
                y = y @ w
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        y = x
        for _ in range(n):
            y = y @ w
    return graph


def host_us(calls) -> list[float]:
    torch.cuda.synchronize()
    out = []
    for call in calls:
        t0 = time.perf_counter()
        call()
        out.append(round((time.perf_counter() - t0) * 1e6, 1))
    torch.cuda.synchronize()
    return out


def depth(n_kernels: int, size: int, launches: int = 10) -> dict:
    """Two graphs of n_kernels size^3 matmuls each, replayed alternately on an idle GPU: the host
    microseconds of each replay() and the index of the first that waited (took over a third of a
    replay's GPU time). Session 15 found the first 150-kernel graph probe blocking at the 4th
    launch: is the limit a count of launches or of kernels (W2's DDP replay is ~2,000 kernels)?"""
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16) / size ** 0.5
    w = torch.randn(size, size, device="cuda", dtype=torch.bfloat16) / size ** 0.5
    a, b = captured(x, w, n_kernels), captured(x, w, n_kernels)
    a.replay(), b.replay()  # the first launch of each uploads it
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a.replay()
    end.record()
    end.synchronize()
    gpu_ms = start.elapsed_time(end)
    host = host_us([a.replay, b.replay] * (launches // 2))
    waited = next((i for i, us in enumerate(host) if us > gpu_ms * 1000 / 3), None)
    return {"kernels": n_kernels, "matmul": size, "replay_gpu_ms": round(gpu_ms, 2), "host_us": host,
            "first_waiting_launch": waited,
            "kernels_queued_before_it": None if waited is None else waited * n_kernels}


def main() -> None:
    torch.manual_seed(0)
    # ~20-30 ms of GPU work a replay each: 10 large matmuls, 150 medium, 600 and 2,400 small
    rows = [depth(10, 8192), depth(150, 4096), depth(600, 2048), depth(2400, 1024, launches=8)]
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                      "environment": environment(torch.device("cuda")),  # versions, commit
                      "reading": "first_waiting_launch constant across rows: a limit on launches in "
                                 "flight; kernels_queued_before_it constant: a limit on queued kernels"}))


if __name__ == "__main__":
    main()
