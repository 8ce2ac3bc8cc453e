"""Host memory of a large training file: what indexing it, planning its steps and train setup's
data plan hold, and the transient peak of each, in a fresh process per size; one JSON line
appended to benchmarks/results/data-memory-<device>.jsonl.

    python benchmarks/data_memory.py                          # 50,000 and 100,000 records of 1 KB
    python benchmarks/data_memory.py --records 100000 400000 --format parquet

Each size runs in its own process: the tiny tokenizer loads, then the resident set is read
(/proc/self/statm) before `index_dataset` (records are re-read by byte offset: keep_records_below=0,
as for any file over 64 MiB), after it, after `plan_steps` of one epoch (8 examples a step, the
balanced order: the shipped default with packing) and after `data.step_plan.data_plan`, the calls
setup makes for the data plan (the same plan, 5% held out for validation). Each of these two runs
in a fork of the indexed process, so that neither reuses memory the other freed; its growth and
peak (VmHWM, reset through /proc/self/clear_refs) count from the fork. Each runs once more in a
fork under tracemalloc: `*_traced` count the bytes Python and numpy allocate, without the
allocator's slack that makes a resident set of a few MB noisy. The growth per record between two
sizes is what a record costs; `per_10gb_mb` extrapolates the resident set after `plan_steps` to a
10 GB file of records this size, `run_per_10gb_mb` what a run holds (the index and setup's plan),
`run_peak_per_10gb_mb` its highest point while planning.
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

CHILD = r"""
import json, os, resource, sys, time, tracemalloc
from hivetune.data.dataset import index_dataset
from hivetune.data.step_plan import plan_steps
from hivetune.model.tokenizer import load_tokenizer
from hivetune.data.step_plan import data_plan

def rss():  # resident now
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

def peak():  # the highest resident set since the last reset_peak (VmHWM)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

def in_fork(plan, traced=False):  # plan() in a fork of this process: (held, peak, its length, seconds)
    read, write = os.pipe()
    if os.fork() == 0:  # the fork's resident set starts lower (file pages not yet touched): growth from it
        reset_peak()
        if traced:  # the bytes Python and numpy allocate, exactly (the allocator's slack left out)
            tracemalloc.start()
        start, t = rss(), time.perf_counter()
        held = plan()
        seconds = time.perf_counter() - t
        grew = tracemalloc.get_traced_memory() if traced else (rss() - start, peak() - start)
        os.write(write, json.dumps([*grew, len(held[0] if isinstance(held, tuple) else held),
                                    round(seconds, 2)]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = json.loads(f.read())
    os.wait()
    return out

tok = load_tokenizer(sys.argv[1])
tok("warm up the tokenizer")
before, peak_start = rss(), peak()
reset_peak()
t = time.perf_counter()
index = index_dataset(sys.argv[2], "auto", tok, 1024, False, keep_records_below=0)
index_s = time.perf_counter() - t
indexed, peak_index = rss(), peak()
def plan():
    return plan_steps(len(index), 8, 1.0, 0, 0, index.lengths, "balanced")

def setup_plan():
    return data_plan(index, 8, 1.0, 0, 0, 0.05, "balanced")

plan_growth, plan_peak_growth, steps, plan_s = in_fork(plan)
setup_growth, setup_peak_growth, setup_steps, setup_s = in_fork(setup_plan)
plan_traced, plan_traced_peak, _, _ = in_fork(plan, traced=True)
setup_traced, setup_traced_peak, _, _ = in_fork(setup_plan, traced=True)
print(json.dumps({"records": len(index), "rss_before": before, "rss_indexed": indexed,
                  "rss_planned": indexed + plan_growth, "rss_setup": indexed + setup_growth,
                  "rss_peak": max(peak_start, peak_index, indexed + plan_peak_growth, indexed + setup_peak_growth),
                  "plan_growth": plan_growth, "setup_growth": setup_growth, "plan_peak_growth": plan_peak_growth,
                  "setup_peak_growth": setup_peak_growth, "plan_traced": plan_traced,
                  "plan_traced_peak": plan_traced_peak, "setup_traced": setup_traced,
                  "setup_traced_peak": setup_traced_peak,
                  "index_seconds": round(index_s, 2), "plan_seconds": plan_s, "setup_plan_seconds": setup_s,
                  "steps": steps, "setup_steps": setup_steps}))
"""
WORDS = ("restart nginx journalctl podman systemctl status sshd redis chronyd firewall reload kernel "
         "module gpu driver rocm cuda container volume mount service unit timer").split()


def write_records(path: Path, n: int, record_bytes: int, fmt: str) -> int:
    """n alpaca records of about record_bytes each; returns the file's size."""
    def record(i):
        words = [WORDS[(i * 7 + k * 13) % len(WORDS)] for k in range(record_bytes // 8)]
        return {"instruction": f"Question {i}: " + " ".join(words[:len(words) // 4]), "input": "",
                "output": " ".join(words[len(words) // 4:])}

    if fmt == "jsonl":
        with open(path, "w") as f:
            for i in range(n):
                f.write(json.dumps(record(i)) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None
        for start in range(0, n, 50_000):
            batch = [record(i) for i in range(start, min(n, start + 50_000))]
            table = pa.Table.from_pylist(batch)
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
        writer.close()
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[50_000, 100_000], help="sizes, in records")
    parser.add_argument("--record-bytes", type=int, default=1000, help="about this many bytes a record (default 1000)")
    parser.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    parser.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument("--note", default="", help="free text (what else ran on the machine)")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from startup import build_tiny_job

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, _ = build_tiny_job(work)
        for n in args.records:
            data = work / f"data-{n}.{args.format}"
            size = write_records(data, n, args.record_bytes, args.format)
            env = {**os.environ, "HIVETUNE_CACHE": str(work / "cache")}
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(data)], capture_output=True,
                                  text=True, env=env)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update(file_bytes=size, wall_seconds=round(time.perf_counter() - t, 2),
                       index_growth=row["rss_indexed"] - row["rss_before"])
            rows.append(row)
            print(f"{n:>9,} records ({size / 1e6:,.0f} MB): index +{row['index_growth'] / 1e6:,.1f} MB "
                  f"in {row['index_seconds']} s, step plan +{row['plan_growth'] / 1e6:,.1f} MB "
                  f"(peak +{row['plan_peak_growth'] / 1e6:,.1f}) in {row['plan_seconds']} s, setup's plan +{row['setup_growth'] / 1e6:,.1f} MB "
                  f"(peak +{row['setup_peak_growth'] / 1e6:,.1f}; traced +{row['setup_traced'] / 1e6:,.1f}, peak "
                  f"+{row['setup_traced_peak'] / 1e6:,.1f}) in {row['setup_plan_seconds']} s")

    import torch

    from hivetune.workflows.bench import environment
    from hivetune.workflows.bench_results import append_result

    figures = {}
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        dn = b["records"] - a["records"]
        per_record = {k: (b[k] - a[k]) / dn for k in ("rss_indexed", "rss_planned", "rss_peak", "index_growth",
                                                      "plan_growth", "setup_growth", "plan_peak_growth",
                                                      "setup_peak_growth", "setup_traced", "setup_traced_peak")}
        records_10gb = 10e9 / (b["file_bytes"] / b["records"])
        run = per_record["index_growth"] + per_record["setup_growth"]
        run_peak = per_record["index_growth"] + per_record["setup_peak_growth"]
        figures = {"bytes_per_record_indexed": round(per_record["rss_indexed"], 1),
                   "bytes_per_record_planned": round(per_record["rss_planned"], 1),
                   "records_in_10gb": int(records_10gb),
                   "bytes_per_record_peak": round(per_record["rss_peak"], 1),
                   "per_10gb_mb": round(per_record["rss_planned"] * records_10gb / 1e6),
                   "peak_per_10gb_mb": round(per_record["rss_peak"] * records_10gb / 1e6),
                   "bytes_per_record_index": round(per_record["index_growth"], 1),
                   "bytes_per_record_plan": round(per_record["plan_growth"], 1),
                   "bytes_per_record_plan_peak": round(per_record["plan_peak_growth"], 1),
                   "bytes_per_record_setup_plan": round(per_record["setup_growth"], 1),
                   "bytes_per_record_setup_peak": round(per_record["setup_peak_growth"], 1),
                   "bytes_per_record_setup_traced": round(per_record["setup_traced"], 1),
                   "bytes_per_record_setup_traced_peak": round(per_record["setup_traced_peak"], 1),
                   "run_per_10gb_mb": round(run * records_10gb / 1e6),
                   "run_peak_per_10gb_mb": round(run_peak * records_10gb / 1e6)}
        print(f"per record: {figures['bytes_per_record_index']} bytes indexed; plan_steps "
              f"{figures['bytes_per_record_plan']} (peak {figures['bytes_per_record_plan_peak']}); setup's plan "
              f"{figures['bytes_per_record_setup_plan']} (peak {figures['bytes_per_record_setup_peak']}; traced "
              f"{figures['bytes_per_record_setup_traced']}, peak {figures['bytes_per_record_setup_traced_peak']}); a 10 GB file "
              f"({figures['records_in_10gb']:,} records): a run holds ~{figures['run_per_10gb_mb']:,} MB, "
              f"~{figures['run_peak_per_10gb_mb']:,} MB at the peak while planning")
    env = environment(torch.device("cpu"), args.commit)
    env.update(cpu_count=os.cpu_count(), note=args.note)
    record = {"workload": "data-memory", "device": "cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
              "commit": env["commit"], "setting": f"{args.format}, ~{args.record_bytes} bytes a record",
              "environment": env, "sizes": rows, "figures": figures}
    print(f"appended to {append_result(Path(args.results), record)}")


if __name__ == "__main__":
    main()
