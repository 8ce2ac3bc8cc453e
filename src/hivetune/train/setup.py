"""Build a Run: resolve paths, read and check the data, load the model, add LoRA, wrap it for
several processes, plan the steps, make optimizer and schedule, create the run folder; and the
memory decisions the planner's model makes for it (planned_memory)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from hivetune.checkpoint import load_lora_weights, restore_rng, resume_point, resume_run
from hivetune.core.config import TrainConfig, save_config, to_dict
from hivetune.core.device import DTYPES, resolve_device, resolve_precision, set_threads
from hivetune.core.embedded import default_heldout_data
from hivetune.core.hub import base_model_name, model_path as hub_model_path
from hivetune.core.errors import UserError
from hivetune.ops.adamw import adamw
from hivetune.ops.prewarm import prewarm
from hivetune.core.fileio import create_run_folder, hold_run_lock, sha256_file
from hivetune.core.metrics import require_tensorboard
from hivetune.core.trackers import open_trackers, require_tracker
from hivetune.data.dataset import index_dataset
from hivetune.data.pairs import index_pairs
from hivetune.data.sources import held_out_source, source_exists, train_source
from hivetune.doctor.preflight import check_stack
from hivetune.model.decoder import CausalLM
from hivetune.model.load import load_args, load_model
from hivetune.model.lora import ADAPTER_WEIGHTS, LoRASpec, lora_parameters, read_adapter_spec
from hivetune.model.tokenizer import load_tokenizer
from hivetune.parallel import distributed
from hivetune.train.preference import preference_sources
from hivetune.train.prepare import (activation_offload, check_offload_layers, grad_scaler, lora_spec, planned_memory,
                                    prepare_model, step_plan)
from hivetune.train.run import Run, new_run_folder
from hivetune.train.twin import compile_early

def setup(cfg: TrainConfig) -> Run:
    """Resolve paths, read and check data, load the model, add LoRA; then create the run folder.

    The folder is created last, so bad input leaves nothing behind.
    """
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    set_threads(cfg.threads)
    parallel = distributed.init(cfg.device)
    if not cfg.skip_doctor:
        check_stack(cfg.device, cfg.precision)  # the doctor's quick checks: a known-bad stack stops here
    if cfg.tensorboard or "tensorboard" in cfg.report_to:
        require_tensorboard()  # a missing package stops here, before any weight is read
    for name in set(cfg.report_to) - {"tensorboard"}:
        require_tracker(name)
    model_path = hub_model_path(cfg.model)  # a local path, a Hub id's snapshot, or the embedded model
    data_path = train_source(cfg)  # a file, folder or Hub dataset, with data_columns / split / config
    val_path = held_out_source(cfg.val_data, cfg) if cfg.val_data else (
        default_heldout_data() if not cfg.data else None)
    if cfg.method != "sft":  # dpo / orpo: empty data is the shipped preference pairs
        data_path, val_path = preference_sources(cfg, data_path, val_path)
    if val_path is not None and not source_exists(val_path):
        raise UserError(f"val_data: {val_path} not found")
    folder = distributed.on_main(parallel, new_run_folder, cfg)  # rank 0 names (and locks) it
    resuming = (folder / "config.yaml").is_file()
    checkpoint = resume_point(folder, cfg) if resuming else None  # refuses another config
    # a checkpoint holds the LoRA weights: the init adapter matters only without one
    init_folder = check_init_adapter(cfg, model_path) if cfg.init_adapter and checkpoint is None else None
    args = load_args(model_path)  # architecture only: cheap, catches a bad model early
    if cfg.max_length > args.max_position_embeddings:
        raise UserError(f"max_length: {cfg.max_length} exceeds the model's context "
                        f"({args.max_position_embeddings})")
    check_offload_layers(cfg, args.num_hidden_layers)
    device = distributed.device_for(parallel, resolve_device(cfg.device))
    precision = resolve_precision(cfg.precision, device)
    prewarm(device, cfg.compile_workers)  # overlaps the tokenizer and the weights' load
    tokenizer = load_tokenizer(str(model_path))
    if len(tokenizer) > args.vocab_size:
        raise UserError(f"{model_path}: tokenizer has {len(tokenizer)} tokens, more than the model's "
                        f"vocab_size {args.vocab_size}")
    data = index_data(cfg, data_path, tokenizer)

    # the first step's missing Triton kernels compile while the weights load (a cold cache)
    compile_early(cfg, args, data, device, precision)
    # fp16 / bf16 runs keep the frozen base in half precision; only LoRA is fp32.
    model = load_model(model_path, dtype=DTYPES[precision], device=device, base_quant=cfg.base_quant)
    run = assemble(cfg, model, data, tokenizer, device, precision, folder, model_path, parallel)
    if parallel.is_main:
        hold_run_lock(folder)  # a new folder: locked as soon as it exists
    if init_folder is not None:
        load_lora_weights(run.model, init_folder)  # into the (fused) LoRA tensors in place; optimizer fresh
    run.init_adapter = init_adapter_record(cfg.init_adapter, init_folder)
    run.val_path = val_path
    if cfg.val_data:
        val_index = index_data(cfg, val_path, tokenizer)
        run.val = (val_index, range(len(val_index)))
    if data.truncated:
        run.notes.append(f"{data.truncated} examples truncated to max_length={cfg.max_length}")
    if data.skipped_no_target:
        run.notes.append(f"{data.skipped_no_target} examples skipped: no response token within max_length")
    if resuming:
        resume_run(run, checkpoint)  # last: it restores the RNG states the loop goes on with
        restore_rank_rng(run)
    return run


def init_adapter_folder(arg: str) -> Path:
    """A run folder (its adapter/) or an adapter folder (adapter_config.json) as init_adapter."""
    path = Path(arg)
    for folder in (path / "adapter", path):
        if (folder / "adapter_config.json").is_file():
            return folder
    if not path.exists():
        raise UserError(f"--init-adapter {arg}: not found")
    raise UserError(f"--init-adapter {arg}: neither a run folder nor an adapter folder (no adapter_config.json)")


def check_init_adapter(cfg: TrainConfig, model_path: Path) -> Path:
    """init_adapter's adapter folder, refused with one line naming the first mismatch when its
    base, rank, alpha, targets or rslora are not this run's: weights of another shape or scale
    would not be that adapter any more."""
    arg = cfg.init_adapter
    folder = init_adapter_folder(arg)
    spec = read_adapter_spec(folder)
    named = (json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or "")
    mine = base_model_name(cfg.model, model_path)
    if named and named != mine and Path(named).resolve() != Path(mine).resolve():
        raise UserError(f"--init-adapter {arg}: base {named}, this run's model is {mine}")
    wanted = LoRASpec(cfg.lora.r, cfg.lora.alpha, 0.0, tuple(cfg.lora.targets), cfg.lora.rslora)
    if spec.r != wanted.r:
        raise UserError(f"--init-adapter {arg}: rank {spec.r}, this run's lora.r is {wanted.r}")
    if sorted(spec.targets) != sorted(wanted.targets):
        raise UserError(f"--init-adapter {arg}: targets {','.join(sorted(spec.targets))}, this run's lora.targets "
                        f"is {','.join(sorted(wanted.targets))}")
    if spec.alpha != wanted.alpha:
        raise UserError(f"--init-adapter {arg}: lora_alpha {spec.alpha:g}, this run's lora.alpha is {wanted.alpha:g}")
    if spec.rslora != wanted.rslora:
        raise UserError(f"--init-adapter {arg}: use_rslora {str(spec.rslora).lower()}, this run's lora.rslora is "
                        f"{str(wanted.rslora).lower()}")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"--init-adapter {arg}: {folder / ADAPTER_WEIGHTS} not found")
    return folder


def init_adapter_record(arg: str, folder: Path | None) -> dict | None:
    """What summary.json says of init_adapter: the folder and its weights' sha256 (None when a
    resumed run's checkpoint took the weights and the folder is gone)."""
    if not arg:
        return None
    if folder is None:
        folder = Path(arg) / "adapter" if (Path(arg) / "adapter" / ADAPTER_WEIGHTS).is_file() else Path(arg)
    weights = folder / ADAPTER_WEIGHTS
    return {"path": str(folder.resolve()), "sha256": sha256_file(weights) if weights.is_file() else None}


def index_data(cfg: TrainConfig, source, tokenizer):
    """The training (or validation) data's index: examples (sft), or preference pairs (dpo, orpo)."""
    if cfg.method != "sft":
        return index_pairs(source, tokenizer, cfg.max_length, cfg.format)
    return index_dataset(source, cfg.format, tokenizer, cfg.max_length, cfg.train_on_inputs)


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float):
    """Multiplier of the peak lr at a step: linear warmup, then cosine / linear decay or constant."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return min_ratio + (1 - min_ratio) * decay

    return f


def assemble(cfg: TrainConfig, model: CausalLM, data, tokenizer, device: torch.device, precision: str,
             folder: Path, model_path: Path, parallel: distributed.Dist = distributed.Dist()) -> Run:
    """Add LoRA, wrap for several processes, plan the steps, build optimizer and schedule,
    create the run folder."""
    strategy = prepare_model(cfg, model, data, device, precision, parallel)
    model.activation_offload = activation_offload(cfg, model, device, strategy)  # after the fusing: it reads the storages
    module = distributed.wrap(model, strategy, parallel, device) if parallel.enabled else model

    steps, n_train, val_ids = step_plan(cfg, data, parallel.world)
    params = lora_parameters(model)
    # Fused on the CPU too: one pass over all LoRA tensors instead of ~10 foreach kernels each
    # (SmolLM2's 420 on a 2-core CPU: ~35 -> ~10 ms a step).
    optimizer = adamw(params, cfg.lr, cfg.weight_decay, fused=strategy != "fsdp")
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, round(0.03 * len(steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.schedule, warmup, len(steps), cfg.min_lr_ratio))
    scaler = grad_scaler(device, precision)

    # report_to's trackers start before the folder exists: one that does not start leaves nothing
    trackers = open_trackers(cfg.report_to, folder, to_dict(cfg)) if parallel.is_main else {}
    if parallel.is_main:
        create_run_folder(folder)  # its marker first: the folder is hivetune's
        if not (folder / "config.yaml").exists():  # a resumed run's stays as written: checkpoints hash it
            save_config(cfg, folder / "config.yaml")
    distributed.barrier(parallel)
    if parallel.enabled:
        torch.manual_seed(cfg.seed + 1_000_003 * parallel.rank)  # each rank its own dropout masks
    run = Run(cfg, folder, model_path, device, precision, tokenizer, data, model, lora_spec(cfg), steps,
              optimizer, scheduler, scaler, val=(data, val_ids) if val_ids else None,
              train_examples=n_train, parallel=parallel, strategy=strategy, module=module,
              trackers=trackers)
    planned_memory(run)
    return run


def restore_rank_rng(run: Run) -> None:
    """A checkpoint of several processes holds every rank's RNG state: each rank takes its own
    when the process count is the same (the data plan already checked the global batch)."""
    world = run.counters.pop("world", 1)
    states = run.counters.pop("rank_rng", None)
    if run.parallel.enabled and states and world == run.parallel.world:
        restore_rng(states[run.parallel.rank])
    elif run.parallel.enabled:
        torch.manual_seed(run.cfg.seed + 1_000_003 * run.parallel.rank + run.start_step)
        run.notes.append(f"resumed on {run.parallel.world} processes from a checkpoint of {world}: "
                         f"dropout masks are drawn afresh")
