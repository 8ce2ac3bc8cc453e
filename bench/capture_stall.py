"""What makes a CUDA graph capture's host pass wait while replays are queued (issue 10)?

Under DDP, W2's deferred captures of new token sizes take 0.3-0.7 s on the host when replays are
queued ahead, against 0.1-0.2 s with the GPU idle; cProfile puts the extra time in one matmul
call (ours through cuBLASLt, or torch's linear), as if that call waited for the queue to drain.
This probe isolates it on one GPU: a "busy" graph of large matmuls (~90 ms, as a W2 replay) is
queued N times, then a small layer-like graph (matmuls through torch and through ops.blas, an
elementwise op, fresh activations) is captured for a token count; each call's host time inside the
capture is recorded, and whether the queue had drained by the capture's end. Cases:

- idle: nothing queued (the baseline host pass);
- busy, new: a token count never run before (new shapes, new memory in the pool);
- busy, seen: the same ops run eagerly at that token count first (kernels loaded, plans made);
- busy, same pool reused: a token count below one already captured in the shared pool;
- busy, malloc: a fresh 256 MiB torch.empty (a cudaMalloc) with the queue full, outside capture;
- instantiate idle / busy: graph.instantiate() of a captured graph (keep_graph=True), a small one
  and a W2-sized one (~3,000 nodes);
- busy, a token count captured before, while a W2-sized graph instantiates on a worker thread.

Prints one JSON line per case, the first with the device, versions and commit (HIVETUNE_COMMIT
wins). Usage: python3 bench/capture_stall.py [--queued 4] [--loop-stream]. Results:
bench/results/ddp-27/capture-stall-*.jsonl (those two runs' first lines name torch and the GPU only),
bench/results/ddp-31/capture-stall-*.jsonl.

--loop-stream: every case runs with a non-blocking side stream as the current stream (torch's
pool streams are made with cudaStreamNonBlocking), where the training loop, like this probe by
default, queues its replays on the legacy default stream, which every blocking stream and some
driver calls synchronise with. Does a capture or an instantiation still wait for the queue to
drain when that queue is not on the default stream? Yes, it does (2 x H200, d679db4, four
replays queued: new token counts 412-425 ms, a 3,000-node instantiation 416 ms, against 409-423
and 407 ms on the default stream; bench/results/ddp-31/capture-stall-*.jsonl): what waits is
context-wide.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from hivetune.workflows.bench import environment  # noqa: E402
from hivetune.ops import blas  # noqa: E402

D, FF = 3584, 18944  # W2's hidden and intermediate widths
BF = dict(dtype=torch.bfloat16, device="cuda")
ALIVE: list = []
STREAM: torch.cuda.Stream | None = None  # the capture stream, as ops.graphs keeps one (made in main)


def busy_graph(pool):
    """~90 ms of large matmuls, captured once (replayed to fill the queue)."""
    a, b = torch.randn(8192, 8192, **BF), torch.randn(8192, 8192, **BF)
    out = torch.empty(8192, 8192, **BF)
    torch.mm(a, b, out=out)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.mm(a, b, out=out)
    end.record()
    end.synchronize()
    n = max(1, round(90 / (start.elapsed_time(end) / 10)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(n):
            torch.mm(a, b, out=out)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return graph, (a, b, out), start.elapsed_time(end)


class Layer:
    """A layer-like body for `tokens` tokens: fresh activations, torch's and our matmuls."""

    def __init__(self):
        self.w1 = torch.randn(FF, D, **BF) / D ** 0.5
        self.w2 = torch.randn(D, FF, **BF) / FF ** 0.5
        self.a = torch.randn(32, D, **BF) / D ** 0.5

    def ops(self, x):
        """(name, thunk) pairs, run in order; each returns a tensor later ones may use."""
        state = {"x": x}

        def linear():
            state["h"] = torch.nn.functional.linear(state["x"], self.w1)

        def act():
            state["h"] = torch.nn.functional.silu(state["h"])

        def down():
            state["y"] = blas.gemm(state["h"], self.w2.t())

        def lora():
            state["xa"] = blas.gemm(state["x"], self.a.t())

        def grad_w():
            state["gw"] = blas.gemm(state["y"].t(), state["x"], out_dtype=torch.float32)

        return [("torch linear", linear), ("silu", act), ("blas down", down), ("blas lora", lora),
                ("blas grad", grad_w)]


def timed_ops(layer, x, reps=3):
    times = []
    for _ in range(reps):
        for name, op in layer.ops(x):
            t0 = time.perf_counter()
            op()
            times.append((name, time.perf_counter() - t0))
    return times


def capture(layer, tokens, pool, queued, busy, keep=True, reps=3):
    """Capture the layer body for `tokens` with `queued` busy replays ahead; host times."""
    x = torch.randn(tokens, D, **BF)
    torch.cuda.synchronize()
    for _ in range(queued):
        busy.replay()
    mark = torch.cuda.Event()
    mark.record()
    stream = STREAM
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph(keep_graph=keep)
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        times = timed_ops(layer, x, reps)
        graph.capture_end()
    host = time.perf_counter() - t0
    drained = mark.query()
    torch.cuda.current_stream().wait_stream(stream)
    slow = [(name, round(t * 1000, 2)) for name, t in times if t > 0.005]
    ALIVE.append(graph)  # a pool whose graphs are all gone cannot take another capture
    return graph, {"tokens": tokens, "queued": queued, "host_ms": round(host * 1000, 1), "drained": drained,
                   "slow_ops_ms": slow}


def timed_instantiation(graph, busy, queued: int, label: str) -> None:
    """graph.instantiate() with `queued` busy replays ahead: its host time, and whether the
    queue had drained by its end (one JSON line)."""
    torch.cuda.synchronize()
    for _ in range(queued):
        busy.replay()
    mark = torch.cuda.Event()
    mark.record()
    t0 = time.perf_counter()
    graph.instantiate()
    ms = (time.perf_counter() - t0) * 1000
    print(json.dumps({"case": label, "queued": queued, "host_ms": round(ms, 2), "drained": mark.query()}), flush=True)
    torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--queued", type=int, default=4)
    p.add_argument("--loop-stream", action="store_true", help="queue everything on a non-blocking side stream")
    args = p.parse_args()
    torch.cuda.init()
    loop = torch.cuda.Stream() if args.loop_stream else torch.cuda.current_stream()
    with torch.cuda.stream(loop):
        run_cases(args)


def run_cases(args):
    pool = torch.cuda.graph_pool_handle()
    busy, keep_alive, busy_ms = busy_graph(torch.cuda.graph_pool_handle())
    layer = Layer()
    global STREAM
    STREAM = torch.cuda.Stream()
    # warm every op once eagerly at an unrelated size, on the capture stream (handles, its
    # cuBLASLt workspace, first loads)
    STREAM.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(STREAM):
        timed_ops(layer, torch.randn(1000, D, **BF), reps=1)
    torch.cuda.synchronize()
    env = {**environment(torch.device("cuda")), "module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)"),
           "busy_replay_ms": round(busy_ms, 1),
           "loop_stream": "side, non-blocking" if args.loop_stream else "legacy default"}
    print(json.dumps({"case": "env", **env}), flush=True)
    q = args.queued
    cases = []
    g, r = capture(layer, 1728, pool, 0, busy)  # the largest first, GPU idle (as the plan's top)
    g.instantiate()
    cases.append(("idle, largest", r))
    for tokens in (1600, 1472):
        g, r = capture(layer, tokens, pool, q, busy)
        g.instantiate()
        cases.append(("busy, new", r))
    for tokens in (1408,):
        g, r = capture(layer, tokens, pool, 0, busy)
        g.instantiate()
        cases.append(("idle, new", r))
    for tokens in (1344, 1280):  # the ops first run eagerly at this size, the GPU then idle
        with torch.cuda.stream(STREAM):
            timed_ops(layer, torch.randn(tokens, D, **BF), reps=1)
        torch.cuda.synchronize()
        g, r = capture(layer, tokens, pool, q, busy)
        g.instantiate()
        cases.append(("busy, seen eagerly", r))
    for tokens in (1600, 1472):  # captured before: same shapes, same pool
        g, r = capture(layer, tokens, pool, q, busy)
        g.instantiate()
        cases.append(("busy, captured before", r))
    g, r = capture(layer, 1216, torch.cuda.graph_pool_handle(), q, busy)  # a fresh pool: new memory
    cases.append(("busy, new, fresh pool", r))
    # the previous capture instantiating on a worker thread meanwhile (ops.graphs' background mode)
    prev, _ = capture(layer, 1088, pool, 0, busy)
    worker = threading.Thread(target=lambda: (torch.cuda.set_device(0), prev.instantiate()))
    worker.start()
    g, r = capture(layer, 1024, pool, q, busy)
    worker.join()
    cases.append(("busy, new, previous instantiating", r))
    torch.cuda.synchronize()
    for label, r in cases:
        print(json.dumps({"case": label, **r}), flush=True)
    # a W2-sized graph (~3,000 nodes: 600 passes of the body) instantiating, idle and busy, and on
    # a worker while this thread captures a token count captured before, with the queue full
    for queued in (0, q):
        timed_instantiation(capture(layer, 1600, pool, 0, busy, reps=600)[0], busy, queued, "instantiate, 3,000 nodes")
    for worker_on in (False, True):
        big, _ = capture(layer, 1600, pool, 0, busy, reps=600)
        torch.cuda.synchronize()
        worker = threading.Thread(target=lambda: (torch.cuda.set_device(0), big.instantiate()))
        if worker_on:
            worker.start()
        g, r = capture(layer, 1472, pool, q, busy)
        if worker_on:
            worker.join()
        print(json.dumps({"case": "busy, captured before" + (", a 3,000-node graph instantiating" if worker_on
                                                               else " (control)"), **r}), flush=True)
        torch.cuda.synchronize()
    # a cudaMalloc with the queue full (the cache holds no block this size)
    for queued in (0, q):
        torch.cuda.synchronize()
        for _ in range(queued):
            busy.replay()
        t0 = time.perf_counter()
        t = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        ms = (time.perf_counter() - t0) * 1000
        del t
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(json.dumps({"case": "malloc 256 MiB", "queued": queued, "host_ms": round(ms, 2)}), flush=True)
    # instantiation idle and busy
    for queued in (0, q):
        timed_instantiation(capture(layer, 1152 - 64 * (queued > 0), pool, 0, busy)[0], busy, queued, "instantiate")
    del keep_alive


if __name__ == "__main__":
    main()
