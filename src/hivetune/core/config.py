"""Typed training config: YAML file + ``key=value`` overrides, validated once, all errors at once.

Nothing here touches weights or data: ``load_config`` runs before any model is opened, so a
typo costs milliseconds, not a model load.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hivetune.core.errors import UserError

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
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Names people bring from HF Trainer / PEFT / other tools, mapped to ours for "did you mean".
KEY_ALIASES = {
    "rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "target_modules": "targets", "use_rslora": "rslora", "learning_rate": "lr",
    "num_epochs": "epochs", "num_train_epochs": "epochs", "per_device_train_batch_size": "batch_size",
    "micro_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum",
    "lr_scheduler_type": "schedule", "lr_scheduler": "schedule", "max_seq_length": "max_length",
    "sequence_len": "max_length", "dataset": "data", "output": "output_dir", "bf16": "precision",
    "fp16": "precision", "model_name_or_path": "model", "base_model": "model",
}


@dataclass
class LoRAConfig:
    r: int = 16
    """Rank of the update B A."""
    alpha: float = 32.0
    """Scale numerator: the update is multiplied by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.0
    """Dropout on the LoRA input path during training (PEFT's default is 0 too)."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Short names of the linear layers to adapt; one that matches nothing is an error."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""


@dataclass
class PreferenceConfig:
    beta: float = 0.1
    """DPO's beta: the strength of the pull towards the reference model (the base with LoRA off);
    rewards are beta x (log-prob of the answer - the reference's)."""
    loss: str = "sigmoid"
    """DPO's loss of z = beta x the reward margin: sigmoid (-log sigmoid(z), the DPO paper) or ipo
    ((h - 1/(2 beta))^2 of the log-ratio margin h, the IPO paper; sums of token log-probs)."""
    label_smoothing: float = 0.0
    """Conservative DPO: the share eps of pairs assumed mislabelled, loss -(1-eps) log sigmoid(z) -
    eps log sigmoid(-z) (sigmoid loss only); in [0, 0.5)."""
    orpo_lambda: float = 0.1
    """ORPO's weight of the odds-ratio term beside the chosen answer's mean token NLL."""
    shared_prompt: bool = True
    """Run each pair as one row [prompt, chosen, rejected] (both answers attend to the prompt, not to
    each other) with the fused per-token log-probs; false: the reference path, the prompt run twice
    and plain logits."""


@dataclass
class TrainConfig:
    model: str = ""
    """HF model folder (config.json + safetensors), a .gguf file, or a Hugging Face Hub id ORG/NAME[@REVISION]
    (from the Hub's cache, fetched when online; a local path of that name wins); empty: the embedded
    SmolLM2-135M-Instruct."""
    data: str = ""
    """Training data: a JSONL, JSONL.gz, JSON array, parquet or CSV file, a folder of these, or a Hugging
    Face Hub dataset id ORG/NAME[@REVISION] (read through the datasets library); empty: the shipped
    Linux / GPU ops dataset. In YAML also a mapping {path, columns, split, config} of this key and the
    three below (--set data.columns.output=answer)."""
    data_columns: dict[str, str] = field(default_factory=dict)
    """The data's column for a field hivetune reads (instruction, input, output, messages, text,
    conversations), e.g. {output: answer}; applied to data and val_data."""
    data_split: str = ""
    """The split of a Hub dataset (or of a dataset folder in the Hub's layout) to train on; empty: train.
    A Hub dataset as val_data reads its test split."""
    data_config: str = ""
    """The configuration (subset) of a Hub dataset; empty: its default."""
    val_data: str = ""
    """Held-out data for the end-of-run A/B (a file or source as for data); empty with the default
    data: the shipped held-out split."""
    val_split: float = 0.0
    """Fraction of the training data held out (deterministically, by seed) for validation loss; 0: none."""
    eval_every: int = 0
    """Validation loss every this many optimizer steps and at the end, when there is a validation
    set (val_split, or val_data given explicitly); 0: at the end only."""
    early_stopping_patience: int = 0
    """Stop when the validation loss has not improved for this many evaluations in a row, and keep
    the adapter of the best evaluation; 0: off."""
    format: str = "auto"
    """alpaca (instruction/input/output), chat (messages), text, or auto-detected per file."""
    max_length: int = 1024
    """Examples longer than this many tokens are truncated (and counted)."""
    train_on_inputs: bool = False
    """Put loss on prompt tokens too (default: response tokens only)."""
    packing: bool = True
    """Pack the examples of a micro-batch into one row with per-example attention (no padding)."""
    batch_order: str = "auto"
    """random: each step draws its examples from the epoch's shuffled order. balanced: the same
    epochs, each step's examples dealt by length so that every step holds about the same number of
    tokens (one from each length stratum, still at random): CUDA graphs then need fewer sizes and
    pad less, and the largest micro-batch (the memory peak) is near the mean. auto: balanced with
    packing, random without (a padded micro-batch would hold a long example every step). A run
    folder whose config.yaml predates this key resumes as random (step_order)."""
    output_dir: str = ""
    """Run folder; empty: runs/<date>-<time>. An existing run folder of the same config is
    resumed from its newest valid checkpoint; any other non-empty folder is refused."""
    init_adapter: str = ""
    """Start LoRA from an earlier adapter (a run folder or a PEFT adapter folder) instead of a fresh
    init: its A and B weights loaded, the optimizer and schedule fresh. Its base model, lora.r,
    lora.alpha, lora.targets and lora.rslora must be this run's. summary.json names it (path and
    weights' sha256). Empty: a fresh LoRA."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    method: str = "sft"
    """sft (supervised: loss on the response tokens), dpo (Direct Preference Optimization against the
    base with LoRA off) or orpo (odds-ratio preference, no reference model); dpo and orpo read
    preference pairs {prompt | messages, chosen, rejected} (docs/preference.md); empty data: the
    shipped preference pairs."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    epochs: float = 1.0
    """Passes over the data (fractions allowed); ignored when max_steps > 0."""
    max_steps: int = 0
    """Optimizer steps to run; 0: derived from epochs."""
    batch_size: int = 8
    """Examples per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; effective batch = batch_size * grad_accum examples."""
    lr: float = 2e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    schedule: str = "cosine"
    """cosine, linear or constant, after warmup."""
    warmup_steps: int = -1
    """Linear warmup steps; -1: 3% of the steps (at least 1)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr (cosine and linear)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    precision: str = "auto"
    """bf16, fp16 (with loss scaling), fp32, or auto: bf16 where the device runs it fast."""
    gradient_checkpointing: bool = False
    """Recompute layer activations in backward to save memory."""
    activation_offload: int = 0
    """Keep the saved activations of the first N decoder layers in pinned CPU memory between
    forward and backward: less GPU memory (W2, a 7B model: ~0.34 GiB a layer at 3,400 tokens),
    the PCIe copies overlapped with compute. CUDA only; not with gradient_checkpointing, FSDP or
    inside CUDA-graphed micro-batches; at most the model's layer count. 0: off."""
    host_embeddings: bool = False
    """Keep the frozen input embedding table in pinned host memory and gather each micro-batch's
    rows from it over PCIe (a Triton kernel; W2, a 7B model: 1.02 GiB less GPU memory for ~0.4 ms
    a step). CUDA with Triton; not for models whose LM head shares the table (tied embeddings)
    nor under FSDP: there it stays on the GPU, with one line saying why."""
    lora_inputs: str = "auto"
    """With LoRA dropout on a GPU (the seeded Triton dropout): keep each LoRA group's dropped
    input from forward for its backward, or recompute it there from tensors saved anyway (the
    norm's input, the attention output, the gate/up output). keep runs ~150 fewer kernels a W1
    step and costs memory (W1: 0.84 GiB at 2,496 tokens; W2: ~5.3 GiB); auto keeps when that costs
    at most 1 GiB at the step plan's largest micro-batch (the planner's figure), or when the
    planner's peak with them kept is at most 60% of the GPU memory this process can use (free
    plus its own, under any per-process cap: train.device_memory_bytes; W2 under DDP on 80 GB
    cards: ~2.5% faster for 2.35 GiB more; on a 24 GB card W2 recomputes), and never where that
    peak would not fit. Where an out-of-memory error follows, its message names
    lora_inputs=recompute first."""
    attention: str = "auto"
    """Attention of packed rows on a GPU: flash (flash varlen attention; an error where this
    GPU, torch build or dtype has no working kernel), sdpa (SDPA over a padded view, the
    reference), or auto: flash where a tiny probe runs it and matches float32, else sdpa with
    one line saying why."""
    fused_ops: bool = True
    """On a GPU with Triton (bf16 / fp16): RMSNorm, RoPE, SwiGLU and the LoRA dropout as fused
    Triton kernels; false: their plain PyTorch references."""
    base_quant: str = "none"
    """The frozen base's decoder weights kept quantized in memory, each layer dequantized as its
    matmul runs (LoRA, its gradients and the optimizer as without): nf4 (QLoRA's 4-bit
    NormalFloat, double-quantized scales, ~0.52 bytes a weight), int8 (per-row absmax, ~1 byte),
    keep (a .gguf base's own blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), or none.
    An HF base is quantized as it loads, layer by layer."""
    fused_loss: bool = True
    """Chunked LM head + cross-entropy with the gradient taken in forward (one chunk of logits
    alive at a time); false: the plain reference path."""
    wide_lora: str = "auto"
    """On CUDA, for graph-sized micro-batches: q/k/v's and gate/up's weights stored beside their
    LoRA B, so the base matmul carries the LoRA update and its gradient. true, false, or auto (the
    default): on, but not under FSDP. W1 under its 4 GiB cap: ~5% faster for the same reserved
    memory; W2 on 2 x H100: ~4% faster (docs/log.md)."""
    cuda_graphs: bool = True
    """On CUDA (bf16, packing): replay each micro-batch's forward + loss + backward from a CUDA
    graph, one per token-count bucket (256 tokens), captured on first use; eager otherwise."""
    seed: int = 0
    """Seeds LoRA init, dropout and the data order."""
    device: str = "auto"
    """cuda when available, else cpu."""
    threads: int = 0
    """CPU threads for torch; 0: all cores."""
    skip_doctor: bool = False
    """Start even when the doctor's quick checks find a stack known to fail (a driver older than
    torch's CUDA, a GPU missing from the build, a wrong HSA_OVERRIDE_GFX_VERSION...)."""
    log_every: int = 1
    """Write a metrics.jsonl line every this many optimizer steps."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files in RUN/tensorboard/ (needs the
    tensorboard package: pip install 'hivetune[tensorboard]')."""
    report_to: list[str] = field(default_factory=list)
    """Also send metrics.jsonl's records to these trackers: tensorboard, mlflow (MLFLOW_TRACKING_URI,
    MLFLOW_EXPERIMENT_NAME), wandb (WANDB_PROJECT, WANDB_MODE); pip install 'hivetune[trackers]'."""
    save_every: int = 0
    """Checkpoint (adapter, optimizer, RNG...) every this many optimizer steps and at the end,
    in checkpoints/step-N/; 0: only the final adapter (and a checkpoint on SIGINT / SIGTERM)."""
    save_every_minutes: float = 10.0
    """Also checkpoint every this many minutes of training, and at the end, so that a run that
    dies (an exception, a kill, a power cut) keeps its progress; 0: off. In one process only:
    under torchrun the ranks' clocks could disagree on when, so save_every counts there."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep."""
    max_bad_steps: int = 5
    """A step whose loss or gradients are not finite is skipped (no update); after this many in a
    row, on_bad_steps decides."""
    on_bad_steps: str = "stop"
    """stop: end the run with an error, the last checkpoint intact; rollback: go back to the last
    checkpoint and go on with the learning rate times rollback_lr_factor (at most max_rollbacks times)."""
    rollback_lr_factor: float = 0.5
    """Learning-rate multiplier applied at each rollback."""
    max_rollbacks: int = 3
    """Rollbacks allowed before the run stops with an error."""
    distributed: str = "auto"
    """Under torchrun with several processes: ddp (LoRA replicated, base on every GPU), fsdp (FSDP2
    shards the base too), or auto: ddp when the planner says the run fits one GPU, else fsdp."""
    auto: bool = False
    """Micro-batch from the planner; on a CUDA out-of-memory error, halve the micro-batch (the
    examples per optimizer step stay the same) and retry the step instead of stopping."""
    eval_prompts: int = 1
    """Held-out questions answered by the base and the tuned model at the end (0: none)."""
    max_new_tokens: int = 96
    """Generation length for those answers."""
    eval_examples: int = 200
    """End of run, with a held-out file (val_data, or the shipped split with the default data):
    base vs tuned on its first this many examples as `hivetune eval` scores them (response
    loss, answers, F1 / ROUGE-L / command hits), written to RUN/eval/; 0: only eval_prompts answers."""


def field_doc(cls, name: str) -> str:
    """The docstring written under a dataclass field (used for --help and errors)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    for i, node in enumerate(body[:-1]):
        nxt = body[i + 1]
        if (isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name
                and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)):
            return str(nxt.value.value)
    return ""


def _coerce(value, typ, key: str, errors: list[str]):
    """Convert a YAML / CLI value to the field's type; record an error instead of raising."""
    origin = typing.get_origin(typ)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(v, (str, int, float)) for v in value.values()):
            errors.append(f"{key}: expected a mapping of field: column, got {value!r}")
            return None
        return {str(k): str(v) for k, v in value.items()}
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            errors.append(f"{key}: expected a list of names, got {value!r}")
            return None
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        errors.append(f"{key}: expected true or false, got {value!r}")
        return None
    if typ is int:
        if isinstance(value, bool):
            errors.append(f"{key}: expected an integer, got {value!r}")
            return None
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            errors.append(f"{key}: expected an integer, got {value!r}")
            return None
    if typ is float:
        if isinstance(value, bool):
            errors.append(f"{key}: expected a number, got {value!r}")
            return None
        try:
            number = float(value)
        except (TypeError, ValueError):
            errors.append(f"{key}: expected a number, got {value!r}")
            return None
        if not math.isfinite(number):  # nan passes every `<= 0` check; inf epochs crash plan_steps
            errors.append(f"{key}: expected a finite number, got {value!r}")
            return None
        return number
    if typ is str:
        if isinstance(value, bool):  # YAML's true / false for a key that also takes auto
            return "true" if value else "false"
        if isinstance(value, (dict, list)):
            errors.append(f"{key}: expected a string, got {value!r}")
            return None
        return "" if value is None else str(value)
    raise AssertionError(f"unhandled type {typ}")


def _suggest(obj, key: str, prefix: str) -> str:
    """The full name of the key the user probably meant: exact alias, else the closest name or
    alias (difflib), in this section or, from the top level, in a sub-section (lora_alpha)."""
    spots = {}  # spelling -> full key
    for f in dataclasses.fields(obj):
        spots[f.name] = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(getattr(obj, f.name)):
            for sub in dataclasses.fields(getattr(obj, f.name)):
                spots.setdefault(sub.name, f"{prefix}{f.name}.{sub.name}")
    for alias, target in KEY_ALIASES.items():
        if target in spots:
            spots.setdefault(alias, spots[target])
    if key in spots:
        return spots[key]
    close = difflib.get_close_matches(key, list(spots), n=1)
    return spots[close[0]] if close else ""


# `data` as a YAML mapping: its keys -> the flat config keys they stand for.
DATA_SECTION = {"path": "data", "columns": "data_columns", "split": "data_split", "config": "data_config"}
COLUMN_FIELDS = ("instruction", "input", "output", "messages", "text", "conversations")


def _fold_data_section(values: dict, errors: list[str]) -> dict:
    """{data: {path, columns, split, config}} -> {data, data_columns, data_split, data_config}."""
    section, values = values["data"], dict(values)
    del values["data"]
    for key, value in section.items():
        if key not in DATA_SECTION:
            errors.append(f"data.{key}: unknown key (expected {', '.join(DATA_SECTION)})")
        else:
            values[DATA_SECTION[key]] = value
    return values


def _apply(obj, values: dict, prefix: str, errors: list[str]) -> None:
    if not prefix and isinstance(values.get("data"), dict):
        values = _fold_data_section(values, errors)
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in names:
            hint = _suggest(obj, str(key), prefix)
            hint = f" (did you mean {hint}?)" if hint else ""
            errors.append(f"{full}: unknown key{hint}")
            continue
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                errors.append(f"{full}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(typ))}")
                continue
            _apply(getattr(obj, key), value, f"{full}.", errors)
            continue
        coerced = _coerce(value, typ, full, errors)
        if coerced is not None:
            setattr(obj, key, coerced)


def parse_overrides(pairs: list[str]) -> dict:
    """["lora.r=8", "lr=1e-4"] -> {"lora": {"r": 8}, "lr": 1e-4} (values parsed as YAML scalars)."""
    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"override {pair!r}: expected key=value")
        key, _, raw = pair.partition("=")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        except RecursionError:
            raise UserError(f"override {key.strip()}: value nested too deeply") from None
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {pair!r}: {part} is not a section")
        node[parts[-1]] = value
    return out


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if k == "data" and k in out and isinstance(v, dict) != isinstance(out[k], dict):
            # a path (--data FILE) meets the data section (--set data.columns.output=x): it is the path
            v = v if isinstance(v, dict) else {"path": v}
            out[k] = out[k] if isinstance(out[k], dict) else {"path": out[k]}
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: unreadable config ({e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    except RecursionError:
        raise UserError(f"{path}: invalid YAML (nested too deeply)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys at the top level")
    return data


DEFAULT_RECIPE = Path(__file__).parents[1] / "recipes" / "default.yaml"


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """YAML (optional) + overrides -> a validated TrainConfig; every problem in one UserError.

    With no file and neither model nor data given, the embedded default recipe is the base.
    """
    overrides = overrides or {}
    if path is None and not overrides.get("model") and not overrides.get("data"):
        path = DEFAULT_RECIPE
    values = read_yaml(path) if path else {}
    values = merge(values, overrides)
    cfg = TrainConfig()
    errors: list[str] = []
    _apply(cfg, values, "", errors)
    errors += validate(cfg)
    if errors:
        raise UserError("invalid config:\n  " + "\n  ".join(errors) if len(errors) > 1 else errors[0])
    return cfg


def step_order(cfg: TrainConfig) -> str:
    """The step plan's order (data.step_plan.plan_steps) for batch_order: auto is balanced with
    packing, random without."""
    if cfg.batch_order != "auto":
        return cfg.batch_order
    return "balanced" if cfg.packing else "random"


def load_run_config(path: str | Path, overrides: dict | None = None) -> TrainConfig:
    """A run folder's config.yaml (load_config), keys it lacks given the value its run had: a
    config written before batch_order existed ran in random order."""
    values = read_yaml(path)
    if isinstance(values, dict) and "batch_order" not in values:
        overrides = {"batch_order": "random", **(overrides or {})}
    return load_config(path, overrides)


def validate(cfg: TrainConfig) -> list[str]:
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
                "eval_every", "early_stopping_patience", "activation_offload"):
        if getattr(cfg, key) < 0:
            errors.append(f"{key}: must be >= 0, got {getattr(cfg, key)}")
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


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: Path) -> None:
    from hivetune.core.fileio import atomic_write_bytes

    atomic_write_bytes(path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
