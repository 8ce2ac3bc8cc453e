"""`hivetune train`: its flags (shortcuts for config keys), parser and runner."""

from __future__ import annotations

import argparse
import os
import sys


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
    "--init-adapter": ("init_adapter", {"metavar": "DIR", "help": "start LoRA from this run or adapter folder "
                                                                 "(same base, rank and targets; optimizer fresh)"}),
    "--format": ("format", {"help": "alpaca | chat | text | auto"}),
    "--method": ("method", {"help": "sft | dpo | orpo (dpo / orpo: preference pairs, docs/preference.md)"}),
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



def add_train_parser(sub) -> None:
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



def add_config_flags(parser) -> None:
    """train's config flags (--config, --set, the shortcuts) on another subcommand."""
    parser.add_argument("--config", metavar="YAML", help="training config file; flags and --set override it")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, e.g. --set lora.r=8 (repeatable)")
    for flag, (_, kwargs) in TRAIN_FLAGS.items():
        parser.add_argument(flag, default=None, **kwargs)
    for flag, (_, value, help_text) in TRAIN_SWITCHES.items():
        parser.add_argument(flag, action="store_const", const=value, default=None, help=help_text)


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

        from hivetune.core.fileio import die_with_parent
        from hivetune.parallel.distributed import torchrun_argv

        # torchrun dies with this command, and its workers with it (distributed.init)
        return subprocess.call(torchrun_argv(ns.nproc_per_node, ns.argv), preexec_fn=die_with_parent)
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


COMMANDS = {"train": (add_train_parser, run_train)}
