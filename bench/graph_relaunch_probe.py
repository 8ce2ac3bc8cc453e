"""Does relaunching a CUDA graph that is still running block the host? (issue 10)

W2's DDP ranks replay one graph per step, then queue the all-reduce and the optimizer. If
graph.replay() of an executable graph still in flight waits for it, the host can never be more
than one replay ahead of the GPU, and a graph captured in turn (HIVETUNE_GRAPH_CAPTURE_EVERY)
can hide only one replay's worth of its host pass. Timed here: the host microseconds of
replay() calls on an idle GPU, back to back on one graph, and alternating two graphs, each
graph ~20 ms of GPU work.

    python bench/graph_relaunch_probe.py       # prints one JSON line
"""

from __future__ import annotations

import json
import time

import torch


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


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    # ~0.14 ms a 4096^3 bf16 matmul on an H100: 150 of them is ~20 ms of GPU work a replay
    a, b = captured(x, w, 150), captured(x, w, 150)
    a.replay(), b.replay()  # the first launch of each uploads it
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a.replay()
    end.record()
    end.synchronize()
    same = host_us([a.replay] * 6)
    alternating = host_us([a.replay, b.replay] * 3)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "replay_gpu_ms": round(start.elapsed_time(end), 2),
                      "host_us_same_graph_back_to_back": same,
                      "host_us_two_graphs_alternating": alternating,
                      "reading": "a replay() taking about replay_gpu_ms of host time waits for the graph's previous launch"}))


if __name__ == "__main__":
    main()
