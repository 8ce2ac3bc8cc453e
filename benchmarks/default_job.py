"""Time the embedded default job end to end (`hivetune train` with no arguments, the A/B on the
shipped held-out split included) and append its figures to benchmarks/results/default-job-cpu.jsonl.

    python benchmarks/default_job.py                    # threads: all cores, as `hivetune train` does
    python benchmarks/default_job.py --threads 1        # when another process holds a core
    python benchmarks/default_job.py --results DIR --commit C

The wall time is the whole command, Python's start and the model load included. The load
average before and after is recorded: on a 2-core CPU another busy process slows the run down
(with 2 torch threads against it, many times over), so measure when the load is below 1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def command_hit_split(report: dict, train_path: Path) -> dict:
    """Tuned hits on held-out examples whose reference command occurs verbatim in train, and on
    those whose arguments only the question gives."""
    train_commands = {json.loads(line)["command"] for line in train_path.read_text().splitlines() if line}
    split = {"command_in_train": [0, 0], "new_arguments": [0, 0]}
    for row in report["rows"]:
        part = split["command_in_train" if all(c in train_commands for c in row["commands"]) else "new_arguments"]
        part[0] += bool(row["tuned"]["command_hit"])
        part[1] += 1
    return {k: {"tuned_hits": h, "examples": n} for k, (h, n) in split.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default 0: all cores)")
    parser.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument("--note", default="", help="free text for machine_note (what else was running)")
    args = parser.parse_args()

    import torch

    from hivetune.core.embedded import default_train_data
    from hivetune.workflows.bench import environment
    from hivetune.workflows.bench_results import append_result

    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src/hivetune"], capture_output=True,
                           text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "hivetune", "train", "--output", str(run), "--quiet"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
        if proc.returncode:
            sys.exit(f"hivetune train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = json.loads((run / "summary.json").read_text())
        report = json.loads((run / "eval" / "eval.json").read_text())
        config = (run / "config.yaml").read_text()
    means = report["means"]
    threads = args.threads or os.cpu_count()
    env = environment(torch.device("cpu"), args.commit)
    env.update(load_average_before=[round(x, 2) for x in load_before],
               load_average_after=[round(x, 2) for x in load_after], note=args.note, cpu_count=os.cpu_count())
    record = {
        "workload": "default-job", "device": "cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "commit": env["commit"], "setting": f"{threads} threads, {report['precision']}", "environment": env,
        "src_tree_dirty": bool(dirty), "max_steps": 0, "overrides": {},
        "command": "hivetune train --output RUN --quiet" + (f" --threads {args.threads}" if args.threads else ""),
        "hivetune": {"steps": summary["steps"], "seconds": summary["train_seconds"], "wall_seconds": round(wall, 2),
                     "tokens_per_s": summary["tokens_per_s"], "final_loss": summary["final_loss"],
                     "ab_examples": report["examples"], "ab_seconds": report["seconds"],
                     "max_new_tokens": report["max_new_tokens"], "eval_means": means,
                     "command_hits": {"base": means["base"]["command_hits"], "tuned": means["tuned"]["command_hits"],
                                      "of": means["tuned"]["command_examples"]},
                     "tuned_hits_split": command_hit_split(report, default_train_data())},
        "sample": summary["samples"][0] if summary["samples"] else None, "config": config,
    }
    path = append_result(Path(args.results), record)
    print(f"default job: {wall:.1f} s wall (train {summary['train_seconds']:.1f} s, A/B {report['seconds']['total']:.1f} s); "
          f"loss {means['base']['loss']:.3f} -> {means['tuned']['loss']:.3f}; command hits "
          f"{means['base']['command_hits']} -> {means['tuned']['command_hits']} of {means['tuned']['command_examples']}; "
          f"load {load_before[0]:.2f} -> {load_after[0]:.2f}; appended to {path}")


if __name__ == "__main__":
    main()
