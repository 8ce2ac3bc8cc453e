"""`hivetune bench`, `doctor`, `plan` and `tune`: measure and predict."""

from __future__ import annotations


from hivetune.core.errors import UserError
from hivetune.cli.train import add_config_flags, train_overrides


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="time a workload (W1, W2, W4: random-init shapes) or your own job "
                                         "(--model DIR --data FILE)")
    bench.add_argument("workload", nargs="?", default=None, help="W1 (default) | W2 | W4 | W2-14B | W2-32B | all (W1, W2, W4)")
    bench.add_argument("--model", default=None, metavar="DIR", help="your job: an HF model folder (or .gguf)")
    bench.add_argument("--data", default=None, metavar="FILE", help="your job: its training data")
    bench.add_argument("--config", default=None, metavar="YAML", help="your job: a training config; --set overrides it")
    bench.add_argument("--repeat", type=int, default=1, metavar="N",
                       help="your job: run it N times; the JSON gets each figure's min / median / max")
    bench.add_argument("--json", default="bench.json", metavar="FILE", help="your job: where the JSON goes")
    bench.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: the full workload)")
    bench.add_argument("--out", default="benchmarks/results",
                       help="folder of the results files (one line appended to <workload>-<device>.jsonl)")
    bench.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="training config override, e.g. --set packing=false")
    bench.add_argument("--baseline", default="", choices=["", "hf-peft", "trl-dpo"],
                       help="also time HF Trainer + PEFT (trl-dpo: TRL DPOTrainer + PEFT, PW1) on the same workload or job")
    bench.add_argument("--baseline-steps", type=int, default=0, metavar="N",
                       help="time N baseline steps (after 2 warm-up steps) and extrapolate (0: the full run)")
    bench.add_argument("--memory-cap", type=float, default=0.0, metavar="GIB",
                       help="let the training loop's allocator hold at most GIB (as a card of that size would)")
    bench.add_argument("--table-only", action="store_true",
                       help="only rewrite BENCHMARKS.md's generated table from the results files")


def add_doctor_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="check the torch / GPU stack, self-test it, and name known fixes",
                            description="Report torch's build, drivers, GPUs and attention back-ends, run a short "
                                        "self-test, and list known problems with their fixes. Exits 1 when any "
                                        "finding is an error.")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")


def run_bench(ns) -> int:
    from hivetune.workflows.bench import bench
    from hivetune.core.config import parse_overrides

    if ns.table_only:
        from pathlib import Path

        from hivetune.workflows.bench_results import write_table

        write_table(Path("BENCHMARKS.md"), Path(ns.out))
        return 0
    if ns.model or ns.data or ns.config:
        return run_bench_job(ns)
    if ns.repeat != 1:
        raise UserError("--repeat: applies to your own job (--model DIR --data FILE)")
    results = bench(ns.workload or "W1", ns.max_steps, ns.out, parse_overrides(ns.overrides), ns.baseline, ns.baseline_steps,
                    memory_cap_gib=ns.memory_cap, commit=ns.commit)
    for name, record in results.items():
        h = record["hivetune"]
        mfu = f", MFU {h['mfu']:.1%}" if h["mfu"] else ""
        mem = f", peak {h['peak_memory_allocated_gib']:.2f} GiB" if h["peak_memory_allocated_gib"] else ""
        print(f"{name}: {h['steps']} steps in {h['seconds']:.1f} s, {h['tokens_per_s']:,.0f} tokens/s{mfu}{mem} "
              f"-> {record['path']}")
        probe = record["environment"].get("host_probe")
        if probe:
            print(f"  this host: bf16 8192^3 matmul {probe['matmul_tflops']:,.0f} TFLOP/s, "
                  f"kernel launch {probe['launch_us']:.1f} us, SM clock {probe.get('sm_clock_mhz', '?')} MHz")
        if "baseline" in record:
            b = record["baseline"]
            if "error" in b:
                print(f"  {b['name']}: {b['error']}")
                continue
            ratio = f", hivetune {record['speedup_vs_baseline']}x faster" if "speedup_vs_baseline" in record else ""
            print(f"  {b['name']} ({b['config']}): {b['seconds']:,} s ({b['measured']}), "
                  f"{b['tokens_per_s']:,.0f} tokens/s{ratio}")
    return 0


def run_bench_job(ns) -> int:
    from hivetune.core.config import load_config, merge, parse_overrides
    from hivetune.workflows.bench_job import bench_job, print_summary

    if ns.workload:
        raise UserError(f"bench: give a workload ({ns.workload}) or --model / --data / --config, not both")
    shortcuts = {k: v for k, v in (("model", ns.model), ("data", ns.data), ("max_steps", ns.max_steps or None))
                 if v is not None}
    overrides = merge(shortcuts, parse_overrides(ns.overrides))
    print_summary(bench_job(load_config(ns.config, overrides), ns.repeat, ns.baseline, ns.json, overrides))
    return 0


def run_doctor(ns) -> int:
    from hivetune.doctor import doctor
    return 0 if doctor(json_output=ns.json)["ok"] else 1


def add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="predict peak GPU memory, the largest micro-batch that fits, and the time",
                          description="Memory breakdown and time estimate for a training config on a GPU, from the "
                                      "model's config.json / GGUF metadata (no weights read) and, with --data, the "
                                      "dataset's token lengths.")
    add_config_flags(plan)
    plan.add_argument("--gpu", default=None, metavar="NAME", help="a GPU from the table (H100, 'RTX 4090', MI50...)")
    plan.add_argument("--memory", type=float, default=None, metavar="GIB", help="GPU memory instead of --gpu")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--png", default=None, metavar="OUT.png", help="also draw the breakdown (needs matplotlib)")


def run_plan(ns) -> int:
    import json

    from hivetune.core.config import load_config
    from hivetune.plan import format_plan, plan, plan_dict, plot_plan
    overrides = train_overrides(ns)  # none at all: the embedded default job
    result = plan(load_config(ns.config, overrides), gpu=ns.gpu, memory_gib=ns.memory)
    if ns.png:
        plot_plan(result, ns.png)
    print(json.dumps(plan_dict(result), indent=2) if ns.json else format_plan(result))
    return 0


def add_tune_parser(sub) -> None:
    tune = sub.add_parser("tune", help="time short runs of candidate configs here; write the fastest that fits",
                          description="Runs a few steps of each micro-batch size (dividing batch_size * grad_accum), "
                                      "checkpointing off / on and attention back-end on a random-init model of the "
                                      "configured architecture, within a memory cap; on CUDA a micro-batch over "
                                      "the cap also with the fewest first layers checkpointed (graphs on) and "
                                      "with the fewest layers offloaded (eager); prints the table and writes "
                                      "the fastest config that fits as YAML overrides.")
    add_config_flags(tune)
    tune.add_argument("--batch-sizes", default=None, metavar="LIST", help="micro-batch sizes, e.g. 1,2,4,8 "
                                                                         "(default: every divisor)")
    tune.add_argument("--steps", type=int, default=3, help="optimizer steps per candidate (default 3)")
    tune.add_argument("--length", type=int, default=None, help="tokens per example (default: max_length)")
    tune.add_argument("--cap", type=float, default=None, metavar="GIB", help="memory cap (default: 0.9 x the device)")
    tune.add_argument("--out", default="tune.yaml", metavar="YAML", help="where to write the overrides")
    tune.add_argument("--force", action="store_true", help="overwrite an existing --out")


def run_tune(ns) -> int:
    from hivetune.core.config import load_config
    from hivetune.workflows.tune import format_tune, tune

    sizes = None
    if ns.batch_sizes:
        try:
            sizes = [int(x) for x in ns.batch_sizes.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--batch-sizes: expected integers like 1,2,4, got {ns.batch_sizes!r}") from None
    result = tune(load_config(ns.config, train_overrides(ns)), batch_sizes=sizes, steps=ns.steps, length=ns.length,
                  cap_gib=ns.cap, out=ns.out, force=ns.force)
    print(format_tune(result))
    return 0 if result.best else 1


COMMANDS = {"bench": (add_bench_parser, run_bench), "doctor": (add_doctor_parser, run_doctor),
            "plan": (add_plan_parser, run_plan), "tune": (add_tune_parser, run_tune)}
