"""Per-step figures of one bench run: each optimizer step's GPU time (CUDA events at the steps'
starts, no host synchronisation added) and the caching allocator's slow paths during it (retries
after freeing its cache, each of which synchronises the device; cudaMalloc / cudaFree calls).
For the W2 runs under a memory cap: which steps pay the retries, and what they cost.

    python bench/step_probe.py W2 --cap 24 --set host_embeddings=true --set activation_offload=5 \
        [--max-steps 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import hivetune.train.loop as train  # noqa: E402
from hivetune.workflows.bench import WORKLOADS, allocator_counts, run_hivetune  # noqa: E402
from hivetune.core.config import parse_overrides  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", default="W2", nargs="?")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--cap", type=float, default=0.0, help="allocator cap in GiB, as bench's --memory-cap")
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--json", default="", help="write the per-step rows here")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    real = train.accumulate_step

    def probed(run, example_ids, *rest, **kw):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        before = allocator_counts(device)
        host = time.perf_counter()
        out = real(run, example_ids, *rest, **kw)
        after = allocator_counts(device)
        rows.append({"start": start, "host_s": time.perf_counter() - host,
                     "tokens": sum(run.data.lengths[i] for i in example_ids),
                     **{k: after[k] - before[k] for k in after}})
        return out

    train.accumulate_step = probed
    result = run_hivetune(WORKLOADS[args.workload], device, parse_overrides(args.overrides), args.max_steps,
                          memory_cap_gib=args.cap)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    starts = [r.pop("start") for r in rows] + [end]
    for i, r in enumerate(rows):
        r["gpu_ms"] = round(starts[i].elapsed_time(starts[i + 1]), 2)  # to the next step's start: its optimizer too
        r["host_s"] = round(r["host_s"], 4)
    slow = [i for i, r in enumerate(rows) if r["num_alloc_retries"] or r["num_device_free"]]
    gpu = sum(r["gpu_ms"] for r in rows) / 1e3
    print(f"{args.workload}: {result['steps']} steps in {result['seconds']} s ({result['tokens_per_s']:,.0f} tokens/s), "
          f"peak {result['peak_memory_allocated_gib']} GiB allocated / {result['peak_memory_reserved_gib']} reserved; "
          f"allocator {result['allocator']}")
    print(f"step to step on the GPU: {gpu:.2f} s in all; {1e3 * gpu / len(rows):.1f} ms a step; "
          f"per token {1e6 * gpu / sum(r['tokens'] for r in rows):.1f} us")
    print(f"steps with retries or cudaFree: {len(slow)}: " + ", ".join(
        f"#{i} {rows[i]['gpu_ms']} ms ({rows[i]['num_alloc_retries']} retries, {rows[i]['num_device_free']} frees, "
        f"{rows[i]['num_device_alloc']} allocs)" for i in slow[:20]))
    normal = sorted(r["gpu_ms"] / r["tokens"] * 1e3 for i, r in enumerate(rows) if i not in slow and i > 0)
    if normal:
        print(f"other steps after the first: median {normal[len(normal) // 2]:.1f} us a token, "
              f"first step {rows[0]['gpu_ms']} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"result": result, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
