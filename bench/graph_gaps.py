"""Where a CUDA-graph replay's time goes: its GPU wall time against the sum of its kernels.

    python bench/graph_gaps.py W2 [--steps 6]   # W2's 16-example micro-batch, graphed

Trains a few steps with graphs forced on (HIVETUNE_GRAPH_MAX_TFLOP), then replays the largest
graph --replays times with the loss divided by infinity (its gradients are exact zeros) under the
profiler: wall time per replay (CUDA events) against the sum of the kernels' times inside it,
and the kernel count. The difference is what the graph spends between kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.setdefault("HIVETUNE_GRAPH_MAX_TFLOP", "1000")
os.environ["HIVETUNE_GRAPH_TIMING"] = "1"

from hivetune.workflows.bench import WORKLOADS, random_model, workload_examples  # noqa: E402
from hivetune.core.config import load_config  # noqa: E402
from hivetune.data.dataset import TokenizedExamples  # noqa: E402
from hivetune.train import replay as graphs  # noqa: E402
from hivetune.train.loop import fit  # noqa: E402
from hivetune.train.setup import assemble  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", default="W2", nargs="?")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--replays", type=int, default=5, help="timed replays (more: a GPU at sustained clocks)")
    parser.add_argument("--top", type=int, default=60, help="kernels listed by name (all go to the JSON)")
    parser.add_argument("--out", default="", help="folder for graph-gaps-<commit>-<time>.json")
    opts = parser.parse_args()
    w = WORKLOADS[opts.workload]
    values = {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda",
              "max_steps": opts.steps, "batch_size": w.micro_batch or w.examples_per_step,
              "grad_accum": w.examples_per_step // (w.micro_batch or w.examples_per_step), "lora": w.lora,
              "eval_prompts": 0, "max_length": 4096, "log_every": 1000}
    cfg = load_config(None, values)
    examples = TokenizedExamples(workload_examples(w.n_examples, w.args.vocab_size, w.cap))
    model = random_model(w.args, torch.device("cuda"), torch.bfloat16)
    run = assemble(cfg, model, examples, None, torch.device("cuda"), "bf16", Path(f"/tmp/gaps-{time.time()}"),
                   Path("random"))
    fit(run, progress=False)
    g = graphs.last_graphed
    if g is None or not g.buckets:
        print(f"no graphs: {graphs.last_stats}")
        return
    key = max(g.buckets)
    bucket = g.buckets[key]
    bucket.n_targets.fill_(float("inf"))
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(opts.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            bucket.graph.replay()
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end))
    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in kernels) / 1000
    n = opts.replays
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        by_name.setdefault(e.name[:100], []).append(t)
    mix = [{"kernel": name, "per_replay": len(ts) / n, "us_per_replay": round(sum(ts) / n, 1)}
           for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))]
    if opts.out:
        import json

        from hivetune.workflows.bench import environment

        env = environment(torch.device("cuda"))
        record = {"environment": env, "workload": opts.workload, "steps_before": opts.steps, "graph_tokens": key[0],
                  "replays": n, "replay_ms": [round(x, 3) for x in walls], "kernels_per_replay": len(kernels) / n,
                  "kernel_ms_per_replay": round(busy / n, 3), "kernel_mix": mix}
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"graph-gaps-{env.get('commit', 'unknown')}-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
            json.dumps(record, indent=1) + "\n")
    print(f"{opts.workload}: graph of {key[0]} tokens; replay wall {sum(walls) / n:.1f} ms (first, last: "
          f"{walls[0]:.1f}, {walls[-1]:.1f}); kernels {len(kernels) / n:.0f} a replay, "
          f"their sum {busy / n:.1f} ms a replay; between kernels {(sum(walls) - busy) / n:.1f} ms")
    for row in mix[:opts.top]:
        print(f"{row['per_replay']:8.1f} {row['us_per_replay']:9.1f} us  {row['kernel']}")


if __name__ == "__main__":
    main()
