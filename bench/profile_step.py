"""Profile a few optimizer steps of a workload on the GPU: top ops by CUDA and CPU time.

    python bench/profile_step.py W1 [--steps 20] [--set packing=false] [--set cuda_graphs=false]
    python bench/profile_step.py W1 --steps 203 --no-profile --bucket 512   # time only

With CUDA graphs each fit call captures its buckets again: the timing line gives ms/step with
and without that capture time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.bench import WORKLOADS, random_model, workload_examples  # noqa: E402
from hivetune.config import load_config, parse_overrides  # noqa: E402
from hivetune.data.dataset import TokenizedExamples  # noqa: E402
from hivetune.train import assemble, fit  # noqa: E402


def capture_seconds() -> float:
    from hivetune.ops import graphs

    return graphs.last_stats.get("capture_s", 0.0) if graphs.last_stats else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", default="W1", nargs="?")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--compile", action="store_true", help="experiment: torch.compile each decoder layer")
    parser.add_argument("--no-profile", action="store_true", help="only time the steps")
    parser.add_argument("--bucket", type=int, default=0, help="CUDA-graph bucket in tokens (default 256)")
    opts = parser.parse_args()
    if opts.bucket:
        os.environ["HIVETUNE_GRAPH_BUCKET"] = str(opts.bucket)
    os.environ["HIVETUNE_GRAPH_TIMING"] = "1"  # GPU time of each graph replay (CUDA events)
    w = WORKLOADS[opts.workload]
    device = torch.device("cuda")
    values = {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda",
              "max_steps": opts.steps, "batch_size": w.examples_per_step, "lora": w.lora, "eval_prompts": 0,
              "max_length": 4096, "log_every": 1000}
    values.update(parse_overrides(opts.overrides))
    cfg = load_config(None, values)
    examples = TokenizedExamples(workload_examples(w.n_examples, w.args.vocab_size, w.cap))
    model = random_model(w.args, device, torch.bfloat16)
    run = assemble(cfg, model, examples, None, device, "bf16", Path(f"/tmp/prof-{time.time()}"), Path("random"))
    if opts.compile:
        torch._dynamo.config.cache_size_limit = 64
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    t_warm = time.perf_counter()
    warm = run.steps[:3]
    run.steps, rest = warm, run.steps[3:]
    fit(run, progress=False)
    torch.cuda.synchronize()
    print(f"warm-up (3 steps{', compile' if opts.compile else ''}): {time.perf_counter() - t_warm:.1f} s")
    run.steps = rest
    if opts.no_profile:
        t0 = time.perf_counter()
        fit(run, progress=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        from hivetune.ops import graphs

        cap = capture_seconds()
        print(f"{len(rest)} steps in {seconds:.3f} s ({1000 * seconds / len(rest):.1f} ms/step; "
              f"{1000 * (seconds - cap) / len(rest):.1f} ms/step without {cap:.2f} s of graph capture), "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved; graphs: {graphs.last_stats or 'off'}")
        if graphs.last_graphed is not None:
            print(f"GPU ms per graph replay (forward + loss + backward of one micro-batch), by bucket: "
                  f"{graphs.last_graphed.replay_ms()}")
        return
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fit(run, progress=False)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"{len(rest)} steps in {seconds:.3f} s under the profiler ({1000 * seconds / len(rest):.1f} ms/step)")
    table = prof.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=25))
    print(table.table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
