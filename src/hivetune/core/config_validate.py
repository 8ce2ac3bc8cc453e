"""The checks of a TrainConfig's values: choices, ranges and keys that exclude each other.

``validate`` returns one line per problem, each naming its config key, for ``load_config`` to
report all at once; it reads no file and touches no weight.
"""

from __future__ import annotations

from hivetune.core.config_schema import COLUMN_FIELDS, TrainConfig

FORMATS = ("auto", "alpaca", "chat", "text")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
SCHEDULES = ("cosine", "linear", "constant")
BATCH_ORDERS = ("auto", "random", "balanced")
LORA_INPUTS = ("auto", "keep", "recompute")
WIDE_LORA = ("auto", "true", "false")
DEVICES = ("auto", "cpu", "cuda")
ATTENTIONS = ("auto", "flash", "sdpa")
BASE_QUANTS = ("none", "nf4", "int8", "keep")
METHODS = ("sft", "dpo", "orpo")
PREFERENCE_LOSSES = ("sigmoid", "ipo")


def validate(cfg: TrainConfig) -> list[str]:
    """One line per problem of `cfg`, each naming its key; empty when the config is valid."""
    errors = []

    def choice(key, value, options):
        if value not in options:
            errors.append(f"{key}: {value!r} is not one of {', '.join(options)}")

    choice("format", cfg.format, FORMATS)
    choice("precision", cfg.precision, PRECISIONS)
    choice("schedule", cfg.schedule, SCHEDULES)
    choice("batch_order", cfg.batch_order, BATCH_ORDERS)
    choice("lora_inputs", cfg.lora_inputs, LORA_INPUTS)
    choice("wide_lora", cfg.wide_lora, WIDE_LORA)
    choice("device", cfg.device, DEVICES)
    choice("attention", cfg.attention, ATTENTIONS)
    choice("on_bad_steps", cfg.on_bad_steps, ("stop", "rollback"))
    choice("base_quant", cfg.base_quant, BASE_QUANTS)
    choice("method", cfg.method, METHODS)
    choice("preference.loss", cfg.preference.loss, PREFERENCE_LOSSES)
    if cfg.preference.beta <= 0:
        errors.append(f"preference.beta: must be > 0, got {cfg.preference.beta}")
    if not 0 <= cfg.preference.label_smoothing < 0.5:
        errors.append(f"preference.label_smoothing: must be in [0, 0.5), got {cfg.preference.label_smoothing}")
    if cfg.preference.label_smoothing and cfg.preference.loss != "sigmoid":
        errors.append("preference.label_smoothing: applies to the sigmoid loss only")
    if cfg.preference.orpo_lambda < 0:
        errors.append(f"preference.orpo_lambda: must be >= 0, got {cfg.preference.orpo_lambda}")
    if cfg.base_quant == "keep" and cfg.model and not cfg.model.lower().endswith(".gguf"):
        errors.append(f"base_quant: keep needs a .gguf model (its blocks are kept); {cfg.model} is not one: "
                      f"use none, nf4 or int8")
    choice("distributed", cfg.distributed, ("auto", "ddp", "fsdp"))
    if not 0 < cfg.rollback_lr_factor <= 1:
        errors.append(f"rollback_lr_factor: must be in (0, 1], got {cfg.rollback_lr_factor}")
    if cfg.max_rollbacks < 0:
        errors.append(f"max_rollbacks: must be >= 0, got {cfg.max_rollbacks}")
    for key in ("max_length", "batch_size", "grad_accum", "lora.r", "log_every", "keep_checkpoints",
                "max_bad_steps"):
        value = cfg.lora.r if key == "lora.r" else getattr(cfg, key)
        if value <= 0:
            errors.append(f"{key}: must be > 0, got {value}")
    for key in ("max_steps", "save_every", "save_every_minutes", "threads", "eval_prompts", "max_new_tokens",
                "eval_every", "early_stopping_patience", "activation_offload", "checkpoint_layers"):
        if getattr(cfg, key) < 0:
            errors.append(f"{key}: must be >= 0, got {getattr(cfg, key)}")
    if cfg.compile_workers < -1:
        errors.append(f"compile_workers: must be >= -1 (-1: auto, 0: off), got {cfg.compile_workers}")
    if not 0 <= cfg.val_split < 1:
        errors.append(f"val_split: must be in [0, 1), got {cfg.val_split}")
    if cfg.val_split > 0 and cfg.val_data:
        errors.append("val_split: give either val_split or val_data, not both")
    if cfg.early_stopping_patience > 0 and not (cfg.val_split > 0 or cfg.val_data):
        errors.append("early_stopping_patience: needs a validation set (val_split or val_data)")
    if cfg.eval_examples < 0:
        errors.append(f"eval_examples: must be >= 0, got {cfg.eval_examples}")
    if cfg.lr <= 0:
        errors.append(f"lr: must be > 0, got {cfg.lr}")
    if cfg.epochs <= 0 and cfg.max_steps == 0:
        errors.append(f"epochs: must be > 0 when max_steps is 0, got {cfg.epochs}")
    if not 0 <= cfg.lora.dropout < 1:
        errors.append(f"lora.dropout: must be in [0, 1), got {cfg.lora.dropout}")
    if cfg.lora.alpha <= 0:
        errors.append(f"lora.alpha: must be > 0, got {cfg.lora.alpha}")
    if not cfg.lora.targets:
        errors.append("lora.targets: must name at least one module")
    if not 0 <= cfg.min_lr_ratio <= 1:
        errors.append(f"min_lr_ratio: must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.max_grad_norm < 0:
        errors.append(f"max_grad_norm: must be >= 0, got {cfg.max_grad_norm}")
    if cfg.weight_decay < 0:
        errors.append(f"weight_decay: must be >= 0, got {cfg.weight_decay}")
    if cfg.warmup_steps < -1:
        errors.append(f"warmup_steps: must be >= 0 (or -1 for 3%), got {cfg.warmup_steps}")
    for name in cfg.report_to:
        if name not in ("tensorboard", "mlflow", "wandb"):
            errors.append(f"report_to: {name!r} is not one of tensorboard, mlflow, wandb")
    for name in cfg.data_columns:
        if name not in COLUMN_FIELDS:
            errors.append(f"data_columns.{name}: not a field hivetune reads ({', '.join(COLUMN_FIELDS)})")
    if cfg.device == "cpu" and cfg.precision == "fp16":
        errors.append("precision: fp16 needs a GPU; use bf16 or fp32 with device cpu")
    return errors

