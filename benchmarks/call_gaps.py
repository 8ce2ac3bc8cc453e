"""Where a whole `hivetune bench` run's GPU time goes, call by call, without a profiler: CUDA
events around each of the loop's micro-step calls (replay, capture or eager) and optimizer steps.

    python benchmarks/call_gaps.py W4                      # after an untimed run has warmed the caches
    python benchmarks/call_gaps.py W1 cuda_graphs=false    # config overrides as key=value
    python benchmarks/call_gaps.py W4 --kernels 50         # and the kernels of calls 50-51, traced

Prints, and writes as JSON to $OUT (or /tmp)/call-gaps-<workload>.json: the run's figures, the
GPU's idle time between calls (a call's start event fires when the GPU reaches it, so a gap is
time the GPU waited for the host), each kind's GPU time (a call's events bracket its own work
and any idle inside it: the first call's capture shows as its host time), the longest gaps and
the first calls. With --kernels N, micro-steps N and N + 1 run under torch's profiler: each kernel's
time and the GPU's idle time before it (the joins of a replay's kernels), summed by kernel name
and in start order (the profiler's tracing lengthens those calls). Not a results line: the figures of record come from `hivetune bench`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.ops import triton_early  # noqa: E402

triton_early.start("bench")  # before torch's import, as the CLI does: else the first step waits for the prewarm

import torch  # noqa: E402

from hivetune.core.config import parse_overrides  # noqa: E402
from hivetune.train import loop  # noqa: E402
from hivetune.workflows import bench  # noqa: E402

CALLS: list[tuple] = []  # (kind, start event, end event, host seconds, tokens)
TRACE = {"at": None, "calls": 0, "profiler": None, "kernels": None}  # --kernels: the traced micro-steps' kernels


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _traced_optimizer_step(step):
    def traced(*args, **kwargs):
        t0, start = time.perf_counter(), _event()
        out = step(*args, **kwargs)
        CALLS.append(("optimizer", start, _event(), time.perf_counter() - t0, None))
        return out
    return traced


def _traced_micro_step_fn(make):
    def traced_make(run, loss_fn):
        micro_step = make(run, loss_fn)

        class Traced:
            def __getattr__(self, name):
                return getattr(micro_step, name)

            def __call__(self, batch, n_targets):
                before = dict(getattr(micro_step, "stats", None) or {})
                TRACE["calls"] += 1
                if TRACE["calls"] == TRACE["at"]:
                    TRACE["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    TRACE["profiler"].__enter__()
                t0, start = time.perf_counter(), _event()
                loss = micro_step(batch, n_targets)
                end, after = _event(), getattr(micro_step, "stats", None) or {}
                kind = next((k for k, stat in (("capture", "graphs"), ("replay", "replays"), ("eager", "eager"))
                             if after.get(stat, 0) > before.get(stat, 0)), "eager")
                CALLS.append((kind, start, end, time.perf_counter() - t0, batch.input_ids.shape[1]))
                if TRACE["profiler"] is not None and TRACE["calls"] == TRACE["at"] + 1:
                    torch.cuda.synchronize()
                    TRACE["profiler"].__exit__(None, None, None)
                    TRACE["kernels"] = kernel_gaps(TRACE["profiler"])
                    TRACE["profiler"] = None
                return loss
        return Traced()
    return traced_make


def kernel_gaps(profiler) -> dict:
    """The traced calls' kernels in start order: the GPU's busy and idle time, and by kernel name
    the count, the time and the idle time before each (from the previous kernel's end)."""
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in profiler.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    by_name: dict[str, list[float]] = {}
    idle, end = 0.0, None
    for start, stop, name in kernels:
        gap = max(start - end, 0.0) if end is not None else 0.0
        end = stop if end is None else max(end, stop)
        idle += gap
        row = by_name.setdefault(name[:90], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += stop - start
        row[2] += gap
    busy = sum(r[1] for r in by_name.values())
    rows = sorted(({"name": n, "count": c, "us": round(t), "idle_before_us": round(g), "idle_each_us": round(g / c, 2)}
                   for n, (c, t, g) in by_name.items()), key=lambda r: -r["idle_before_us"])
    order = [(round(start - kernels[0][0], 1), round(stop - start, 2), name[:60]) for start, stop, name in kernels]
    return {"kernels": len(kernels), "busy_ms": round(busy / 1000, 2), "idle_ms": round(idle / 1000, 2),
            "span_ms": round((kernels[-1][1] - kernels[0][0]) / 1000, 2) if kernels else 0.0, "by_name": rows,
            "order": order}


def summary(result: dict) -> dict:
    rows, busy, idle = [], {}, 0.0
    first = CALLS[0][1]
    for i, (kind, start, end, host_s, tokens) in enumerate(CALLS):
        gap = CALLS[i - 1][2].elapsed_time(start) if i else 0.0
        idle += max(gap, 0.0)
        gpu = start.elapsed_time(end)
        busy.setdefault(kind, []).append(gpu)
        rows.append({"i": i, "kind": kind, "tokens": tokens, "gpu_ms": round(gpu, 2), "gap_ms": round(gap, 2),
                     "at_ms": round(first.elapsed_time(start), 1), "host_ms": round(1000 * host_s, 2)})
    return {"seconds": result["seconds"], "tokens_per_s": result["tokens_per_s"], "mfu": result["mfu"],
            "first_step_s": result["first_step_s"], "gpu_span_ms": round(first.elapsed_time(CALLS[-1][2]), 1),
            "idle_between_calls_ms": round(idle, 1),
            "by_kind": {k: {"calls": len(v), "gpu_ms": round(sum(v), 1), "mean_ms": round(sum(v) / len(v), 2)}
                        for k, v in busy.items()},
            "longest_gaps": sorted(rows, key=lambda r: -r["gap_ms"])[:10], "first_calls": rows[:12],
            "cuda_graphs": result["cuda_graphs"], "kernels": TRACE["kernels"], "calls": rows}


def main() -> None:
    args = sys.argv[1:]
    if "--kernels" in args:
        i = args.index("--kernels")
        TRACE["at"] = int(args[i + 1])
        del args[i:i + 2]
    workload = args[0] if args else "W4"
    overrides = parse_overrides(args[1:]) or None
    loop.optimizer_step = _traced_optimizer_step(loop.optimizer_step)
    loop.micro_step_fn = _traced_micro_step_fn(loop.micro_step_fn)
    result = bench.bench(workload, out_dir="/tmp/call-gaps-results", overrides=overrides, table=None)[workload]
    torch.cuda.synchronize()
    record = summary(result["hivetune"])
    shown = {k: v for k, v in record.items() if k not in ("calls", "kernels")}
    if record["kernels"]:
        shown["kernels"] = {k: v for k, v in record["kernels"].items() if k != "order"}
        shown["kernels"]["by_name"] = shown["kernels"]["by_name"][:25]
    print(json.dumps(shown, indent=1))
    path = Path(os.environ.get("OUT", "/tmp")) / f"call-gaps-{workload}.json"
    path.write_text(json.dumps(record) + "\n")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
