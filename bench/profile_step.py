"""Profile a few optimizer steps of a workload on the GPU: top ops by CUDA and CPU time.

    python bench/profile_step.py W1 [--steps 20] [--set packing=false]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.bench import WORKLOADS, random_model, workload_examples  # noqa: E402
from hivetune.config import load_config, parse_overrides  # noqa: E402
from hivetune.data.dataset import TokenizedExamples  # noqa: E402
from hivetune.train import assemble, fit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", default="W1", nargs="?")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--compile", action="store_true", help="experiment: torch.compile each decoder layer")
    parser.add_argument("--no-profile", action="store_true", help="only time the steps")
    opts = parser.parse_args()
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
        print(f"{len(rest)} steps in {seconds:.3f} s ({1000 * seconds / len(rest):.1f} ms/step), "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
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
