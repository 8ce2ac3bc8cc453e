"""The command line: each subcommand parses its flags and calls one library function.

Errors in user input print one line (``hivetune: error: ...``) and exit 2; ``--debug`` shows
the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from hivetune.core.errors import UserError

# Flags of `train` that are shortcuts for config keys: flag -> (config key, argparse kwargs).
TRAIN_FLAGS = {
    "--model": ("model", {"metavar": "PATH", "help": "HF folder, .gguf or Hub ORG/NAME[@REV] "
                                                    "(default: embedded SmolLM2-135M-Instruct)"}),
    "--data": ("data", {"metavar": "FILE", "help": "JSONL(.gz) / JSON / parquet / CSV file, a folder of them, or a Hub "
                                                  "dataset ORG/NAME (default: the shipped ops dataset)"}),
    "--data-split": ("data_split", {"metavar": "SPLIT", "help": "a Hub dataset's split (default: train)"}),
    "--data-config": ("data_config", {"metavar": "NAME", "help": "a Hub dataset's configuration"}),
    "--val-data": ("val_data", {"metavar": "FILE", "help": "held-out data: validation loss and the end-of-run A/B"}),
    "--val-split": ("val_split", {"type": float, "metavar": "FRACTION",
                                  "help": "hold out this fraction of --data for validation loss"}),
    "--eval-every": ("eval_every", {"type": int, "metavar": "STEPS", "help": "validation loss every N steps"}),
    "--early-stopping": ("early_stopping_patience", {"type": int, "metavar": "EVALS",
                                                     "help": "stop after N validations without improvement"}),
    "--output": ("output_dir", {"metavar": "DIR", "help": "run folder (default: runs/<date>-<time>)"}),
    "--format": ("format", {"help": "alpaca | chat | text | auto"}),
    "--max-length": ("max_length", {"type": int}),
    "--epochs": ("epochs", {"type": float}),
    "--max-steps": ("max_steps", {"type": int}),
    "--batch-size": ("batch_size", {"type": int, "help": "examples per micro-batch"}),
    "--grad-accum": ("grad_accum", {"type": int, "help": "micro-batches per optimizer step"}),
    "--lr": ("lr", {"type": float}),
    "--schedule": ("schedule", {"help": "cosine | linear | constant"}),
    "--batch-order": ("batch_order", {"help": "auto (balanced with packing, else random) | random | balanced (steps of even token counts)"}),
    "--warmup-steps": ("warmup_steps", {"type": int}),
    "--precision": ("precision", {"help": "bf16 | fp16 | fp32 | auto"}),
    "--device": ("device", {"help": "cuda | cpu | auto"}),
    "--seed": ("seed", {"type": int}),
    "--lora-r": ("lora.r", {"type": int}),
    "--lora-alpha": ("lora.alpha", {"type": float}),
    "--lora-dropout": ("lora.dropout", {"type": float}),
    "--lora-targets": ("lora.targets", {"metavar": "NAMES", "help": "comma-separated, e.g. q_proj,v_proj"}),
    "--base-quant": ("base_quant", {"help": "none | nf4 | int8 | keep (a .gguf's own blocks): the frozen base quantized"}),
    "--save-every": ("save_every", {"type": int, "metavar": "STEPS"}),
    "--report-to": ("report_to", {"metavar": "NAMES", "help": "also log to tensorboard, mlflow, wandb "
                                                             "(comma-separated)"}),
    "--threads": ("threads", {"type": int}),
}
TRAIN_SWITCHES = {
    "--train-on-inputs": ("train_on_inputs", True, "loss on prompt tokens too"),
    "--no-packing": ("packing", False, "pad each micro-batch instead of packing it"),
    "--gradient-checkpointing": ("gradient_checkpointing", True, "recompute activations in backward"),
    "--rslora": ("lora.rslora", True, "rank-stabilised LoRA scaling"),
    "--tensorboard": ("tensorboard", True, "also write TensorBoard event files (RUN/tensorboard/)"),
    "--no-doctor": ("skip_doctor", True, "start even on a stack the doctor's quick checks call broken"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetune", description="Fast, lean LoRA fine-tuning of Llama-family models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="LoRA fine-tune (no arguments: the embedded default job)",
                           description="LoRA fine-tune a model. With no arguments: SmolLM2-135M-Instruct "
                                       "on the shipped Linux / GPU ops dataset.")
    train.add_argument("--config", metavar="YAML", help="config file; flags and --set override it")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="any config key, e.g. --set lora.r=8 (repeatable)")
    for flag, (_, kwargs) in TRAIN_FLAGS.items():
        train.add_argument(flag, default=None, **kwargs)
    for flag, (_, value, help_text) in TRAIN_SWITCHES.items():
        train.add_argument(flag, action="store_const", const=value, default=None, help=help_text)
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--auto", action="store_true",
                       help="pick batch_size / grad_accum (same product), checkpointing and, where nothing "
                            "fits without, host_embeddings / activation_offload to fit this GPU (from "
                            "./tune.yaml when present, else the planner)")
    train.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                       help="train on N local processes (GPUs) through torchrun; multi-node: "
                            "torchrun --nnodes ... -m hivetune train ...")
    train.add_argument("--resume", metavar="RUN", help="go on from RUN's newest valid checkpoint with RUN's "
                                                       "config (flags that would change it are refused)")

    gen = sub.add_parser("generate", help="greedy generation from a model, optionally with an adapter")
    gen.add_argument("prompt", help="the prompt (chat template applied when the model has one)")
    gen.add_argument("--model", default="", metavar="PATH", help="HF folder or .gguf (default: embedded model)")
    gen.add_argument("--adapter", default="", metavar="RUN", help="run folder or adapter folder")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--no-chat", action="store_true", help="raw continuation, no chat template")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--precision", default="auto")
    bench = sub.add_parser("bench", help="time a workload (W1, W2, W4: random-init shapes) or your own job "
                                         "(--model DIR --data FILE)")
    bench.add_argument("workload", nargs="?", default=None, help="W1 (default) | W2 | W4 | all")
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
    bench.add_argument("--baseline", default="", choices=["", "hf-peft"],
                       help="also time HF Trainer + PEFT on the same workload or job")
    bench.add_argument("--baseline-steps", type=int, default=0, metavar="N",
                       help="time N baseline steps (after 2 warm-up steps) and extrapolate (0: the full run)")
    bench.add_argument("--memory-cap", type=float, default=0.0, metavar="GIB",
                       help="let the training loop's allocator hold at most GIB (as a card of that size would)")
    bench.add_argument("--table-only", action="store_true",
                       help="only rewrite BENCHMARKS.md's generated table from the results files")
    doctor = sub.add_parser("doctor", help="check the torch / GPU stack, self-test it, and name known fixes",
                            description="Report torch's build, drivers, GPUs and attention back-ends, run a short "
                                        "self-test, and list known problems with their fixes. Exits 1 when any "
                                        "finding is an error.")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    add_data_parser(sub)
    add_eval_parser(sub)
    add_plan_parser(sub)
    add_tune_parser(sub)
    add_report_parser(sub)
    add_export_parser(sub)
    add_chat_parser(sub)
    return parser


def train_overrides(ns: argparse.Namespace) -> dict:
    from hivetune.core.config import merge, parse_overrides

    pairs = {}
    for flag, (key, _) in TRAIN_FLAGS.items():
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None:
            pairs[key] = value
    for flag, (key, _, _) in TRAIN_SWITCHES.items():
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None:
            pairs[key] = value
    nested: dict = {}
    for key, value in pairs.items():
        node = nested
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    # --set comes last: it wins over the shortcut flags.
    return merge(nested, parse_overrides(ns.overrides))


def run_train(ns) -> int:
    from hivetune.checkpoint import TrainingFailed, resume_config
    from hivetune.core.config import TrainConfig, load_config
    from hivetune.core.fileio import release_run_locks
    from hivetune.train.loop import TrainingStopped
    from hivetune.workflows.train_job import train

    if ns.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        import subprocess

        from hivetune.parallel.distributed import torchrun_argv

        return subprocess.call(torchrun_argv(ns.nproc_per_node, ns.argv))
    overrides = train_overrides(ns)
    if ns.auto and "auto" in getattr(TrainConfig, "__dataclass_fields__", {}):
        overrides["auto"] = True  # fit then also retries a CUDA out-of-memory with a smaller micro-batch
    cfg = resume_config(ns.resume, ns.config, overrides) if ns.resume else load_config(ns.config, overrides)
    if (ns.auto or getattr(cfg, "auto", False)) and not ns.resume:
        from hivetune.core.device import resolve_device
        from hivetune.plan import auto_config
        cfg, explanation = auto_config(cfg, resolve_device(cfg.device))
        print(explanation, file=sys.stderr)
    try:
        result = train(cfg, progress=not ns.quiet)
    except TrainingStopped as e:  # SIGINT / SIGTERM: the step finished and was checkpointed
        print(f"hivetune: stopped at step {e.step}; resume with: hivetune train --resume {e.folder}", file=sys.stderr)
        return 128 + (e.signum or 2)  # 130 for SIGINT, 143 for SIGTERM, as a shell reports them
    except TrainingFailed as e:  # an exception in a step: the last good step was saved where it could be
        if ns.debug:
            raise
        print(f"hivetune: error: {e}", file=sys.stderr)
        return 1
    finally:
        release_run_locks()  # on every exit path: no .hivetune.lock stays behind
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print_train_summary(result)
    return 0


def print_train_summary(result) -> None:
    gib = result.peak_memory_bytes / 2**30
    print(f"\ntrained {result.steps} steps in {result.seconds:.1f} s  "
          f"({result.tokens_per_s:,.0f} tokens/s, final loss {result.final_loss:.4f}, peak memory {gib:.2f} GiB)")
    for s in result.samples:
        print(f"\nheld-out question: {s['question']}")
        print(f"  reference: {s['reference']}")
        print(f"  base:      {s['base']}")
        print(f"  tuned:     {s['tuned']}")
    print(f"\nadapter: {result.adapter}")


def run_generate(ns) -> int:
    from hivetune.workflows.generate import generate

    if ns.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens: must be > 0, got {ns.max_new_tokens}")
    print(generate(model=ns.model, prompt=ns.prompt, adapter=ns.adapter, max_new_tokens=ns.max_new_tokens,
                   chat=not ns.no_chat, device=ns.device, precision=ns.precision))
    return 0


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


def add_data_parser(sub) -> None:
    data = sub.add_parser("data", help="make, check, measure, split and collect training data",
                          description="Tools for training data files (JSONL, or a JSON array). Each streams "
                                      "the file, so multi-GB files work in bounded memory.")
    dsub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    synth = dsub.add_parser("synth", help="write the synthetic Linux / GPU ops dataset")
    synth.add_argument("--n", type=int, default=1500, help="examples (default 1500)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write")
    synth.add_argument("--force", action="store_true", help="overwrite an existing --out")
    validate = dsub.add_parser("validate", help="report every problem: schema, empty, duplicates, too long",
                               description="Exit 0 when clean, 1 when problems were found, 2 for unusable input.")
    validate.add_argument("file", metavar="FILE")
    validate.add_argument("--model", default="", metavar="PATH",
                          help="check token lengths with this model's tokenizer (default with --max-length: "
                               "the embedded model)")
    validate.add_argument("--max-length", type=int, default=None, help="token limit (default 1024)")
    validate.add_argument("--format", default="auto", help="alpaca | chat | text | auto")
    add_source_flags(validate)
    stats = dsub.add_parser("stats", help="token length percentiles, histogram, padding vs packing")
    stats.add_argument("file", metavar="FILE")
    stats.add_argument("--model", default="", metavar="PATH", help="tokenizer to count with (default: embedded model)")
    stats.add_argument("--max-length", type=int, default=None, help="training max_length (default 1024)")
    stats.add_argument("--png", default=None, metavar="OUT.png", help="also draw the histograms (needs matplotlib)")
    stats.add_argument("--format", default="auto", help="alpaca | chat | text | auto")
    add_source_flags(stats)
    split = dsub.add_parser("split", help="deterministic train / held-out split, stratified by category")
    split.add_argument("file", metavar="FILE")
    split.add_argument("--heldout", type=float, default=0.1, help="fraction in (0, 1), or a count (default 0.1)")
    split.add_argument("--seed", type=int, default=0)
    split.add_argument("--out-train", required=True, metavar="FILE")
    split.add_argument("--out-heldout", required=True, metavar="FILE")
    split.add_argument("--force", action="store_true", help="overwrite existing outputs")
    collect = dsub.add_parser("collect", help="append prompt/response pairs from a JSONL log of interactions")
    collect.add_argument("log", metavar="LOG")
    collect.add_argument("--out", required=True, metavar="FILE",
                         help="JSONL data file to append to (created if missing)")
    collect.add_argument("--format", default="auto", help="chat | alpaca | auto (FILE's format; chat for a new file)")


def add_source_flags(parser) -> None:
    """FILE as any data source: --data-split / --data-config of a Hub dataset, --columns."""
    parser.add_argument("--data-split", default="", metavar="SPLIT", help="a Hub dataset's split (default: train)")
    parser.add_argument("--data-config", default="", metavar="NAME", help="a Hub dataset's configuration")
    parser.add_argument("--columns", default="", metavar="FIELD=COLUMN,...",
                        help="the data's column for each field read, e.g. output=answer")


def data_source(ns):
    """The DataSource of `data validate` / `data stats`' FILE and source flags."""
    from hivetune.core.config import COLUMN_FIELDS
    from hivetune.data.sources import DataSource

    columns = {}
    for pair in filter(None, (p.strip() for p in ns.columns.split(","))):
        field_name, _, column = pair.partition("=")
        if not column or field_name not in COLUMN_FIELDS:
            raise UserError(f"--columns: expected FIELD=COLUMN with FIELD one of {', '.join(COLUMN_FIELDS)}, "
                            f"got {pair!r}")
        columns[field_name] = column
    return DataSource(ns.file, columns, ns.data_split, ns.data_config)


def run_data(ns) -> int:
    command = ns.data_command
    if command is None:
        raise UserError("data: name a subcommand: synth, validate, stats, split or collect (see hivetune data --help)")
    if command == "synth":
        from hivetune.data.synth_file import format_synth, write_synthetic

        print(format_synth(write_synthetic(ns.n, ns.seed, ns.out, ns.force)))
        return 0
    if command == "validate":
        from hivetune.data.validate import format_report, validate_file

        report = validate_file(data_source(ns), ns.model, ns.max_length, ns.format)
        print(format_report(report))
        return report.exit_code
    if command == "stats":
        from hivetune.data.stats import data_stats, format_stats

        print(format_stats(data_stats(data_source(ns), ns.model, ns.max_length, ns.png, ns.format)))
        return 0
    if command == "split":
        from hivetune.data.split import format_split, split_file

        print(format_split(split_file(ns.file, ns.heldout, ns.seed, ns.out_train, ns.out_heldout, ns.force)))
        return 0
    from hivetune.data.collect import collect_log, format_collect

    print(format_collect(collect_log(ns.log, ns.out, ns.format)))
    return 0


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="base vs tuned on held-out data: loss, perplexity, answers, scores",
                        description="Score the base model (LoRA off) and the tuned one (adapter on) on prompt/"
                                    "response data: response loss and perplexity, greedy answers with exact "
                                    "match, token F1, ROUGE-L and command hits. Writes eval.json and eval.md.")
    ev.add_argument("--adapter", required=True, metavar="RUN", help="run folder or adapter folder")
    ev.add_argument("--model", default="", metavar="PATH",
                    help="base model (default: the one the adapter names, else the embedded model)")
    ev.add_argument("--data", default="", metavar="FILE", help="alpaca / chat data: a file, folder or Hub dataset "
                                                                "(its test split; default: the shipped held-out set)")
    ev.add_argument("--max-new-tokens", type=int, default=0,
                    help="most tokens per answer (default: the run's max_new_tokens, else 96)")
    ev.add_argument("--limit", type=int, default=0, metavar="K", help="first K examples only (0: all)")
    ev.add_argument("--out", default="", metavar="DIR", help="folder for eval.json and eval.md (default: RUN/eval)")
    ev.add_argument("--force", action="store_true", help="overwrite an existing eval.json / eval.md")
    ev.add_argument("--batch-size", type=int, default=96, help="most prompts generated together")
    ev.add_argument("--max-length", type=int, default=1024, help="token limit for the loss (as in training)")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--precision", default="auto")


def run_eval(ns) -> int:
    from hivetune.workflows.evaluate import evaluate, means_table

    report = evaluate(model=ns.model, adapter=ns.adapter, data=ns.data, max_new_tokens=ns.max_new_tokens,
                      limit=ns.limit, out=ns.out, force=ns.force, batch_size=ns.batch_size,
                      max_length=ns.max_length, device=ns.device, precision=ns.precision)
    print(means_table(report))
    print(f"\n{report['examples']} examples in {report['seconds']['total']:.1f} s; "
          f"wrote {report['out']}/eval.json and eval.md")
    return 0


def add_report_parser(sub) -> None:
    rep = sub.add_parser("report", help="one self-contained HTML page with the run's charts, A/B table and config",
                         description="Draw a run folder's loss / validation loss, learning rate, grad norm, "
                                     "tokens/s and memory, the planner's memory breakdown (plan.json) and the "
                                     "A/B table (eval/eval.json) into report.html (images inlined) and PNGs.")
    rep.add_argument("run", metavar="RUN", help="run folder")
    rep.add_argument("--out", default="", metavar="DIR", help="folder for report.html and the PNGs (default: RUN/report)")


def run_report(ns) -> int:
    from hivetune.workflows.report import report

    result = report(ns.run, ns.out)
    print(f"wrote {result['html']} and {len(result['pngs'])} PNGs ({', '.join(result['pngs'])})")
    return 0


def add_config_flags(parser) -> None:
    """train's config flags (--config, --set, the shortcuts) on another subcommand."""
    parser.add_argument("--config", metavar="YAML", help="training config file; flags and --set override it")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, e.g. --set lora.r=8 (repeatable)")
    for flag, (_, kwargs) in TRAIN_FLAGS.items():
        parser.add_argument(flag, default=None, **kwargs)
    for flag, (_, value, help_text) in TRAIN_SWITCHES.items():
        parser.add_argument(flag, action="store_const", const=value, default=None, help=help_text)


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
                                      "configured architecture, within a memory cap; prints the table and writes "
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


def add_export_parser(sub) -> None:
    ex = sub.add_parser("export", help="a run as a PEFT adapter, a merged HF folder, or GGUF for llama.cpp / Ollama",
                        description="Export a trained run: --format adapter (PEFT files + model card), merged (HF "
                                    "folder with the LoRA merged in) or gguf (merged model, LoRA-only adapter, Ollama "
                                    "Modelfile, llama-server command). Written into a temp folder, renamed at the end.")
    ex.add_argument("run", metavar="RUN", help="run folder (or adapter folder)")
    ex.add_argument("--format", required=True, help="adapter | merged | gguf")
    ex.add_argument("--dtype", default=None, help="merged: f32 (default) | f16 | bf16; gguf: f16 (default) | bf16 | q8_0 | f32")
    ex.add_argument("--out", required=True, metavar="DIR", help="folder to create")
    ex.add_argument("--force", action="store_true", help="replace an existing --out")
    ex.add_argument("--model", default="", metavar="PATH", help="base model (default: the one the adapter names)")


def run_export(ns) -> int:
    from hivetune.workflows.export import export

    result = export(ns.run, ns.format, ns.out, dtype=ns.dtype, force=ns.force, model=ns.model)
    dtype = f" ({result.dtype})" if result.dtype else ""
    print(f"exported {ns.run} as {result.format}{dtype} to {result.out}: {', '.join(result.files)}")
    if result.commands:
        print(result.commands)
    return 0


def add_chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="talk to a model on stdin / stdout (base, + adapter, merged folder or GGUF)",
                          description="Each input line is a user message; the conversation is kept and rendered with "
                                      "the model's chat template. /reset starts over; /exit or end of input ends.")
    chat.add_argument("--model", default="", metavar="PATH", help="HF folder or .gguf (default: embedded model)")
    chat.add_argument("--adapter", default="", metavar="RUN", help="run folder or adapter folder")
    chat.add_argument("--system", default="", help="system message")
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--device", default="auto")
    chat.add_argument("--precision", default="auto")


def run_chat(ns) -> int:
    from hivetune.workflows.chat import chat

    chat(model=ns.model, adapter=ns.adapter, system=ns.system, max_new_tokens=ns.max_new_tokens,
         device=ns.device, precision=ns.precision)
    return 0


COMMANDS = {"train": run_train, "generate": run_generate, "bench": run_bench, "doctor": run_doctor, "data": run_data,
            "eval": run_eval, "report": run_report, "export": run_export, "chat": run_chat,
            "plan": run_plan, "tune": run_tune}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)
    if ns.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[ns.command](ns)
    except UserError as e:
        if ns.debug:
            raise
        print(f"hivetune: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full or read-only disk under any command: one line too
        from hivetune.core.fileio import disk_error_message, is_disk_error

        if ns.debug or not is_disk_error(e):
            raise
        print(f"hivetune: error: {disk_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hivetune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
