"""Time `hivetune eval` (base vs tuned: response loss and greedy answers) on N examples with the
embedded SmolLM2-135M-Instruct, and append the figure to benchmarks/results/eval-<device>.jsonl.

    python benchmarks/eval_speed.py --adapter runs/RUN --n 200 [--results benchmarks/results] [--commit C]

The examples are `hivetune.data.synth.synthesize(N, seed=1)`: the shipped dataset's kind of
question, none of them the shipped files' (those are seed 0). The load average before and
after is recorded: other processes on the machine slow this down, so measure when it is quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", required=True, help="a run folder of the default job (its adapter)")
    parser.add_argument("--n", type=int, default=200, help="examples (default 200)")
    parser.add_argument("--max-new-tokens", type=int, default=0,
                        help="default: the run's max_new_tokens, as `hivetune eval` (64 in the default job)")
    parser.add_argument("--batch-size", type=int, default=96)
    parser.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()

    import torch

    from hivetune.data.synth import synthesize
    from hivetune.workflows.evaluate import evaluate
    from hivetune.workflows.bench import environment
    from hivetune.workflows.bench_results import append_result, device_kind

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "examples.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in synthesize(args.n, seed=1)))
        t0 = time.perf_counter()
        report = evaluate(adapter=args.adapter, data=str(data), max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size, out=str(Path(tmp) / "eval"), force=True)
        wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src/hivetune"], capture_output=True,
                           text=True).stdout.strip()
    device = torch.device(report["device"])
    env = environment(device, args.commit)
    env.update(threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
               load_average_before=[round(x, 2) for x in load_before],
               load_average_after=[round(x, 2) for x in load_after])
    record = {
        "workload": "eval", "device": device_kind(env.get("gpu")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "commit": env["commit"],
        "setting": f"{report['examples']} examples, batch {args.batch_size}, {report['precision']}",
        "environment": env, "src_tree_dirty": bool(dirty),
        "hivetune": {"seconds": round(wall, 2), "examples": report["examples"],
                     "examples_per_s": round(report["examples"] / wall, 2), "seconds_parts": report["seconds"],
                     "max_new_tokens": report["max_new_tokens"],
                     "generated_tokens_mean": {s: round(report["means"][s]["generated_tokens"], 1)
                                               for s in ("base", "tuned")},
                     "means": report["means"]},
        "adapter": report["adapter"], "model": report["model"],
    }
    path = append_result(Path(args.results), record)
    print(f"{report['examples']} examples in {wall:.1f} s ({report['seconds']}); load {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f}; appended to {path}")


if __name__ == "__main__":
    main()
