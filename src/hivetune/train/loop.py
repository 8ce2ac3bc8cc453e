"""LoRA fine-tuning: ``setup`` builds everything, ``fit`` is one loop read top to bottom.

Loss normalisation: every micro-batch's summed token loss is divided by the number of target
tokens of the whole optimizer step (known on the host from the dataset index), so gradient
accumulation gives exactly the gradient of the mean over the step's target tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from hivetune.checkpoint import (SaveOnError, SaveSchedule, existing_run, load_lora_weights, resume_point, resume_run,
                                 run_totals, save_checkpoint, with_totals)
from hivetune.core.config import TrainConfig, save_config, step_order
from hivetune.data.batch import collate_packed, collate_padded
from hivetune.data.dataset import DatasetIndex, TokenizedExamples, index_dataset, plan_steps
from hivetune.parallel import distributed
from hivetune.core.device import DTYPES, cuda_index, peak_memory_bytes, resolve_device, resolve_precision, set_threads
from hivetune.doctor.preflight import check_stack
from hivetune.core.fastpath import (adamw, clip_grad_norm, forced, fused_lora_usable, join_prewarm, prewarm,
                               quiet_gc)
from hivetune.core.embedded import default_heldout_data, default_train_data, embedded_model_path
from hivetune.core.errors import UserError
from hivetune.core.fileio import (atomic_write_bytes, check_writable, create_run_folder, hold_run_lock,
                                  write_folder_atomically)
from hivetune.core.metrics import MetricsSink, require_tensorboard
from hivetune.model.decoder import CausalLM
from hivetune.model.load import load_args, load_model
from hivetune.model.lora import LoRASpec, apply_lora, fuse_projections, lora_parameters, save_adapter
from hivetune.model.tokenizer import load_tokenizer
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.train.graphs import micro_step_fn
from hivetune.ops.lora_group import given_seeds, join_aside
from hivetune.ops.loss import target_loss_sum


@dataclass
class Run:
    """Everything the loop needs, built by ``setup``."""

    cfg: TrainConfig
    folder: Path
    model_path: Path
    device: torch.device
    precision: str
    tokenizer: object
    data: DatasetIndex | TokenizedExamples
    model: CausalLM
    spec: LoRASpec
    steps: list[list[int]]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    val_path: Path | None = None
    val: tuple | None = None  # (dataset, example ids) for validation loss, or None
    parallel: distributed.Dist = field(default_factory=distributed.Dist)  # this rank under torchrun
    strategy: str = "none"  # none (one process), ddp or fsdp
    module: torch.nn.Module | None = None  # what forward is called on: the model, or DDP around it
    sink: MetricsSink | None = None  # metrics.jsonl (+ TensorBoard) while fit runs, on rank 0
    train_examples: int = 0  # examples the step plan draws from (the data minus a val_split)
    notes: list[str] = field(default_factory=list)
    start_step: int = 0  # > 0 when resumed from a checkpoint: the step plan's position
    counters: dict = field(default_factory=dict)  # loop totals restored with it (skipped_steps...)
    # The CUDA-graph sizes this rank planned at its first capture (ops.graphs), saved in
    # checkpoints: a resumed run captures the same sizes, so its matmuls see the same shapes.
    graph_sizes: dict | None = None
    # Read every step's outcome as it ends (no StepLedger batching): `hivetune tune` times steps by
    # their log records, which a host running 16 steps ahead of the GPU would date too early.
    read_every_step: bool = False

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return pad if pad is not None else 0


@dataclass
class TrainResult:
    folder: Path
    adapter: Path
    steps: int
    final_loss: float
    tokens_per_s: float
    seconds: float
    peak_memory_bytes: int
    samples: list[dict] = field(default_factory=list)  # held-out answers, base vs tuned
    best_val_loss: float | None = None
    stopped_early: bool = False
    save_seconds: float = 0.0  # the final adapter's write after the loop (the benchmarks' clocks leave it out)


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


def new_run_folder(cfg: TrainConfig) -> Path:
    """The run folder: new, empty, or a run folder (config.yaml) to resume (checked in setup)."""
    if cfg.output_dir:
        folder = Path(cfg.output_dir)
        existing_run(folder)  # refuses a folder holding files hivetune did not write
    else:
        folder = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    check_writable(folder)
    if (folder / "config.yaml").is_file():
        hold_run_lock(folder)  # before reading its checkpoints: one trainer per run folder
    return folder


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
    if cfg.tensorboard:
        require_tensorboard()  # a missing package stops here, before any weight is read
    model_path = Path(cfg.model) if cfg.model else embedded_model_path()
    data_path = Path(cfg.data) if cfg.data else default_train_data()
    val_path = Path(cfg.val_data) if cfg.val_data else (default_heldout_data() if not cfg.data else None)
    if val_path is not None and not val_path.exists():
        raise UserError(f"val_data: {val_path} not found")
    folder = distributed.on_main(parallel, new_run_folder, cfg)  # rank 0 names (and locks) it
    resuming = (folder / "config.yaml").is_file()
    checkpoint = resume_point(folder, cfg) if resuming else None  # refuses another config
    args = load_args(model_path)  # architecture only: cheap, catches a bad model early
    if cfg.max_length > args.max_position_embeddings:
        raise UserError(f"max_length: {cfg.max_length} exceeds the model's context "
                        f"({args.max_position_embeddings})")
    check_offload_layers(cfg, args.num_hidden_layers)
    device = distributed.device_for(parallel, resolve_device(cfg.device))
    precision = resolve_precision(cfg.precision, device)
    prewarm(device)  # overlaps the tokenizer and the weights' load
    tokenizer = load_tokenizer(str(model_path))
    if len(tokenizer) > args.vocab_size:
        raise UserError(f"{model_path}: tokenizer has {len(tokenizer)} tokens, more than the model's "
                        f"vocab_size {args.vocab_size}")
    data = index_dataset(data_path, cfg.format, tokenizer, cfg.max_length, cfg.train_on_inputs)

    # fp16 / bf16 runs keep the frozen base in half precision; only LoRA is fp32.
    model = load_model(model_path, dtype=DTYPES[precision], device=device)
    run = assemble(cfg, model, data, tokenizer, device, precision, folder, model_path, parallel)
    if parallel.is_main:
        hold_run_lock(folder)  # a new folder: locked as soon as it exists
    run.val_path = val_path
    if cfg.val_data:
        val_index = index_dataset(val_path, cfg.format, tokenizer, cfg.max_length, cfg.train_on_inputs)
        run.val = (val_index, list(range(len(val_index))))
    if data.truncated:
        run.notes.append(f"{data.truncated} examples truncated to max_length={cfg.max_length}")
    if data.skipped_no_target:
        run.notes.append(f"{data.skipped_no_target} examples skipped: no response token within max_length")
    if resuming:
        resume_run(run, checkpoint)  # last: it restores the RNG states the loop goes on with
        restore_rank_rng(run)
    return run


def wide_groups(model: CausalLM, cfg: TrainConfig, data, device: torch.device, strategy: str = "none") -> bool:
    """Whether q/k/v and gate/up take the wide layout (lora.fuse_projections): wide_lora true or
    auto, but not FSDP (auto); on CUDA, where a micro-batch's matmuls are small enough for CUDA
    graphs (ops.graphs.MAX_TFLOP_PER_MICRO_BATCH, from the data's mean length). There the LoRA
    update riding in the base matmul saves W1 ~5% of its loop: 10.23 / 10.26 s against 10.78 /
    10.99 under the 4 GiB cap (H100, 674eeb2; 3.69 against 3.67 GiB allocated, 3.95 against 3.93
    reserved, the frozen weights stacked: lora.stack_frozen; before that it reserved ~0.4 GiB more
    and ran out of memory under the cap, so it was not the default on one process), and W2's DDP
    ranks (8 examples each, graphed) 2-7% (2 x H100, 058b554). W2 on one GPU (7B, 16 x 1, ~80
    TFLOP a micro-batch: not graphed, so not wide) ran 8% slower with it."""
    from hivetune.train.graphs import MAX_TFLOP_PER_MICRO_BATCH

    asked = cfg.wide_lora == "true" or (cfg.wide_lora == "auto" and strategy != "fsdp")
    if not asked or device.type != "cuda" or forced("wide_lora") or not len(data):
        return False
    tokens = cfg.batch_size * data.total_tokens / len(data)
    return 4 * model.args.linear_weight_count * tokens / 1e12 <= MAX_TFLOP_PER_MICRO_BATCH


def assemble(cfg: TrainConfig, model: CausalLM, data, tokenizer, device: torch.device, precision: str,
             folder: Path, model_path: Path, parallel: distributed.Dist = distributed.Dist()) -> Run:
    """Add LoRA, wrap for several processes, plan the steps, build optimizer and schedule,
    create the run folder."""
    spec = LoRASpec(cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, tuple(cfg.lora.targets), cfg.lora.rslora)
    torch.manual_seed(cfg.seed)  # LoRA init independent of anything loaded before (and alike on every rank)
    apply_lora(model, spec, param_dtype=torch.float32)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    if device.type == "cuda" and precision != "fp32":  # probe flash varlen now, not inside a checkpointed forward
        from hivetune.ops.attention import varlen_supported

        varlen_supported(torch.empty((1, 1, 1, 1), dtype=DTYPES[precision], device=device))
    strategy, module = "none", model
    if parallel.enabled:
        base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        strategy = distributed.choose_strategy(cfg.distributed, base_bytes, device, cfg, model.args)
    if strategy != "fsdp" and fused_lora_usable():  # FSDP shards each weight: it keeps them apart
        fuse_projections(model, wide=wide_groups(model, cfg, data, device, strategy))
    if cfg.host_embeddings and device.type == "cuda":
        from hivetune.ops.host_embedding import move_embeddings

        if strategy == "fsdp":
            print("hivetune: host_embeddings: off under FSDP (it shards the table with the rest)", file=sys.stderr)
        else:
            move_embeddings(model)
    model.activation_offload = activation_offload(cfg, model, device, strategy)  # after the fusing: it reads the storages
    if device.type == "cuda":
        from hivetune.ops import blas
        blas.available(device)  # loads cuBLAS / cuBLASLt here, not in the first step (~85 ms on an H100 host)
    model.runs_in_dtype = runs_in_dtype(model, precision, strategy)
    if parallel.enabled:
        module = distributed.wrap(model, strategy, parallel, device)

    per_step = cfg.batch_size * cfg.grad_accum * parallel.world  # the global batch
    train_ids, val_ids = split_validation(len(data), cfg.val_split, cfg.seed)
    lengths = [data.lengths[i] for i in train_ids]
    steps = [[train_ids[i] for i in step] for step in plan_steps(
        len(train_ids), per_step, cfg.epochs, cfg.max_steps, cfg.seed, lengths, step_order(cfg))]
    params = lora_parameters(model)
    # Fused on the CPU too: one pass over all LoRA tensors instead of ~10 foreach kernels each
    # (SmolLM2's 420, 2-core CPU: ~35 -> ~10 ms a step single-threaded, and far less exposed to
    # another process's load than many tiny multi-threaded kernels).
    optimizer = adamw(params, cfg.lr, cfg.weight_decay, fused=strategy != "fsdp")
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, round(0.03 * len(steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.schedule, warmup, len(steps), cfg.min_lr_ratio))
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    if parallel.is_main:
        create_run_folder(folder)  # its marker first: the folder is hivetune's
        if not (folder / "config.yaml").exists():  # a resumed run's stays as written: checkpoints hash it
            save_config(cfg, folder / "config.yaml")
    distributed.barrier(parallel)
    if parallel.enabled:
        torch.manual_seed(cfg.seed + 1_000_003 * parallel.rank)  # each rank its own dropout masks
    run = Run(cfg, folder, model_path, device, precision, tokenizer, data, model, spec, steps,
              optimizer, scheduler, scaler, val=(data, val_ids) if val_ids else None,
              train_examples=len(train_ids), parallel=parallel, strategy=strategy, module=module)
    planned_memory(run)
    return run


def planned_memory(run: Run) -> None:
    """What the planner's memory model decides for the run, at the step plan's largest
    micro-batch (so a resumed run decides the same): cfg.lora_inputs on the model's CastCache
    (whether the seeded-dropout LoRA groups keep their dropped inputs for backward; auto:
    plan.memory.resolve_keep_inputs), the micro-batch activation_offload's layer count is for, and
    the host memory it will use, pinned before the loop (W2 with 8 layers: ~2.9 GB; pinned in its
    first steps instead, the run took 20.8 s against 19.8 with this, in two H200 calls)."""
    from hivetune.train.graphs import planned_micro_batches
    from hivetune.plan.memory import keep_inputs_extra_bytes, offloaded_bytes, offloaded_layer_bytes
    from hivetune.plan.planner import _memory_config

    casts, offload = getattr(run.model, "lora_casts", None), run.model.activation_offload
    if casts is None and offload is None:
        return
    tokens = max((t for t, _ in planned_micro_batches(run, start=0)), default=0)
    mc = _memory_config(run.cfg, run.precision, run.cfg.gradient_checkpointing, cuda=run.device.type == "cuda",
                        args=run.model.args, tokens=tokens, memory_bytes=device_memory_bytes(run.device))
    if casts is not None:
        casts.keep_inputs = mc.keep_inputs
        # what recomputing would free, for the out-of-memory message (auto's choice only)
        casts.kept_by_auto_bytes = (keep_inputs_extra_bytes(run.model.args, mc, tokens)
                                    if mc.keep_inputs and run.cfg.lora_inputs == "auto" else 0)
    if offload is not None and tokens:
        # smaller micro-batches offload fewer layers (ActivationOffload.layers_for); not under
        # torchrun, where a step that runs out of memory cannot be redone on one rank (back_off)
        offload.max_tokens = None if run.parallel.enabled else tokens
        offload.reserve(offloaded_bytes(run.model.args, mc, tokens), offloaded_layer_bytes(run.model.args, mc, tokens))


def device_memory_bytes(device: torch.device) -> int:
    """What this process may hold on a CUDA device: its memory times the per-process fraction
    where one is set (bench --memory-cap), and no more than is free now plus what this process
    already holds (another process on the same GPU keeps its share); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    index = cuda_index(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)
    free, total = torch.cuda.mem_get_info(index)
    return int(min(total * fraction, free + torch.cuda.memory_reserved(index)))


def check_offload_layers(cfg: TrainConfig, layers: int) -> None:
    if cfg.activation_offload > layers:
        raise UserError(f"activation_offload: {cfg.activation_offload} exceeds the model's {layers} decoder "
                        f"layers (offload at most {layers})")


def activation_offload(cfg: TrainConfig, model: CausalLM, device: torch.device, strategy: str):
    """The ops.offload.ActivationOffload of cfg.activation_offload layers, or None: off, with one
    line on stderr, on the CPU, with gradient checkpointing and under FSDP (its per-layer weight
    gathers are saved too). CUDA-graphed micro-batches skip it at capture (ops.offload)."""
    if not cfg.activation_offload:
        return None
    check_offload_layers(cfg, model.args.num_hidden_layers)
    reason = None
    if device.type != "cuda":
        reason = f"CUDA only, this run is on {device.type}"
    elif cfg.gradient_checkpointing:
        reason = "gradient_checkpointing keeps only each layer's input already"
    elif strategy == "fsdp":
        reason = "not under FSDP"
    if reason:
        print(f"hivetune: activation_offload off ({reason})", file=sys.stderr)
        return None
    from hivetune.ops.offload import ActivationOffload

    return ActivationOffload(model, cfg.activation_offload)


def restore_rank_rng(run: Run) -> None:
    """A checkpoint of several processes holds every rank's RNG state: each rank takes its own
    when the process count is the same (the data plan already checked the global batch)."""
    from hivetune.checkpoint import restore_rng

    world = run.counters.pop("world", 1)
    states = run.counters.pop("rank_rng", None)
    if run.parallel.enabled and states and world == run.parallel.world:
        restore_rng(states[run.parallel.rank])
    elif run.parallel.enabled:
        torch.manual_seed(run.cfg.seed + 1_000_003 * run.parallel.rank + run.start_step)
        run.notes.append(f"resumed on {run.parallel.world} processes from a checkpoint of {world}: "
                         f"dropout masks are drawn afresh")


def split_validation(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, validation ids): a seeded random `fraction` of range(n) held out, at least one."""
    if fraction <= 0:
        return list(range(n)), []
    k = max(1, round(fraction * n))
    if k >= n:
        raise UserError(f"val_split: {fraction:g} of {n} examples leaves none to train on")
    order = list(range(n))
    random.Random(seed * 1_000_003 + 7919).shuffle(order)
    return sorted(order[k:]), sorted(order[:k])


def micro_batches(run: Run, example_ids: list[int], size: int = 0, step: int | None = None):
    """Tokenise the step's examples and cut them into micro-batches of at most `size` examples
    (default batch_size: grad_accum micro-batches; micro_parts); given the step's index, each
    carries its dropout seeds (dropout_seeds)."""
    cfg = run.cfg
    pad = run.pad_id
    for k, part in enumerate(micro_parts(run, example_ids, size)):
        chunk = [run.data.example(i) for i in part]
        batch = collate_packed(chunk, pad_id=pad) if cfg.packing else collate_padded(chunk, pad)
        batch.dropout_seeds = dropout_seeds(run, step, k) if step is not None else None
        yield batch


def micro_parts(run: Run, example_ids: list[int], size: int = 0) -> list[list[int]]:
    """These examples cut into micro-batches of at most `size` (default batch_size): with packing
    and the examples' lengths, as many micro-batches as `size` gives, of near-equal counts and
    token sums (distributed.balanced_split, as Dist.shares splits a step among ranks), so that one
    process's grad_accum micro-batches are the shares that as many ranks would take (the same
    sums, in the same groups); else consecutive runs of `size`."""
    size = size or run.cfg.batch_size
    lengths = getattr(run.data, "lengths", None)
    n = -(-len(example_ids) // size)
    if n <= 1 or not run.cfg.packing or lengths is None:
        return [example_ids[i:i + size] for i in range(0, len(example_ids), size)]
    return distributed.balanced_split(example_ids, lengths, n)


def dropout_seeds(run: Run, step: int, micro: int) -> torch.Tensor | None:
    """The seeded LoRA dropout's seeds for micro-batch `micro` of step `step` on this rank: one
    int64 a joined group call of the model's forward, drawn on the host from a generator seeded
    by (run seed, rank, step, micro-batch). Given to the forward (lora_group.given_seeds), they
    make its masks a function of the step plan alone: a resumed run draws what an unbroken one
    does, and a CUDA graph reads them from its static inputs (ops.graphs) instead of drawing
    from torch's CUDA generator. None where nothing is seeded: no LoRA dropout, or no joined
    groups (lora.fuse_projections), or not on CUDA (the CPU's dropout draws from torch's
    generator)."""
    casts = getattr(run.model, "lora_casts", None)
    if casts is None or run.device.type != "cuda" or run.cfg.lora.dropout <= 0:
        return None
    key = f"{run.cfg.seed}:{run.parallel.rank}:{step}:{micro}".encode()
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
    return torch.randint(0, 2**31 - 1, (len(casts.slots),), generator=generator, dtype=torch.int64)


def autocast(run: Run):
    """Autocast to the run's precision, unless nothing needs it: fp32, or a model whose frozen
    weights are in that dtype already and whose every LoRA layer runs through ops.lora_group
    (which casts the fp32 LoRA weights itself). There autocast would change no result and only
    cost host time: a dispatch wrapper on each of ~1,200 matmuls and a context switch in each
    of 112 group calls a W2 step. HIVETUNE_REFERENCE=autocast keeps it on."""
    if run.precision == "fp32" or (getattr(run.model, "runs_in_dtype", False) and not forced("autocast")):
        return nullcontext()
    return torch.autocast(run.device.type, dtype=DTYPES[run.precision])


def runs_in_dtype(model: CausalLM, precision: str, strategy: str) -> bool:
    """Whether the model computes in `precision` without autocast (see autocast)."""
    if precision == "fp32" or strategy == "fsdp" or getattr(model, "lora_casts", None) is None:
        return False
    return all(p.dtype == DTYPES[precision] for p in model.parameters() if not p.requires_grad)


def forward_backward(run: Run, batch, n_targets: int, loss_fn) -> torch.Tensor:
    """One micro-batch: forward, loss over its targets divided by the step's target count,
    backward (gradients accumulate in the LoRA parameters). Returns the detached loss."""
    model = run.model
    with autocast(run), given_seeds(batch.dropout_seeds):
        hidden = (run.module or model)(batch.input_ids, batch.position_ids, batch.layout)
        loss_sum = loss_fn(hidden, model.lm_head.weight, batch.target_index, batch.target_ids)
    loss = loss_sum / n_targets
    # FSDP averages the gradients over ranks; times world makes that the sum over ranks of
    # sum(token losses) / (the step's target tokens), the one-process gradient (ddp sums).
    scaled = loss * run.parallel.world if run.strategy == "fsdp" else loss
    try:
        (run.scaler.scale(scaled) if run.scaler else scaled).backward()
    finally:
        join_aside()  # LoRA weight gradients put on a side stream (in graph captures): complete from here
    return loss.detach()


class TrainingStopped(Exception):
    """fit stopped early: by SIGINT / SIGTERM after checkpointing the step it finished
    (`signum` set), or by `stop_after` in tests with no checkpoint, as a kill would."""

    def __init__(self, step: int, signum: int | None, folder: Path):
        super().__init__(f"stopped at step {step}")
        self.step, self.signum, self.folder = step, signum, folder


def fit(run: Run, progress: bool = True, stop_after: int | None = None) -> TrainResult:
    """The training loop: forward, loss, backward, clip, step, log, validate, checkpoint.

    Starts at run.start_step (resumed runs). SIGINT / SIGTERM finish the current step, write a
    checkpoint and raise TrainingStopped; so does `stop_after=N` after step N, minus the
    checkpoint (tests: a crash at a chosen step). Under torchrun every rank runs this loop on
    its share of each step; rank 0 alone writes files.
    """
    cfg, model, device, parallel = run.cfg, run.model, run.device, run.parallel
    params = lora_parameters(model)
    loss_fn = fused_target_loss_sum if cfg.fused_loss else target_loss_sum
    micro_step = micro_step_fn(run, loss_fn)  # forward_backward, replayed from CUDA graphs when it can be
    counters = {"skipped_steps": 0, "bad_in_a_row": 0, "last_loss": float("nan"), "best_val_loss": None,
                "best_step": 0, "evals_since_best": 0, "rollbacks": 0, "micro_batch": cfg.batch_size,
                **run.counters}
    model.train()
    bar = _progress_bar(len(run.steps), progress and parallel.is_main)
    tokens_done, loss_ema = 0, None
    t_start = t_log = time.perf_counter()
    tokens_since_log = samples_since_log = 0
    if device.type == "cuda":
        # What loading left in the allocator's cache (a dequantised GGUF, an fp32 build cast to
        # bf16: W2's 28 GiB) would otherwise stay reserved beside the loop's own memory.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        join_prewarm()  # the first step's Triton launches would otherwise redo its work beside it

    step = done = run.start_step  # resumed from a checkpoint of the last step: no step runs
    run.sink = MetricsSink(run.folder, tensorboard=cfg.tensorboard) if parallel.is_main else None
    # CUDA with fused AdamW: a non-finite step is skipped by the optimizer kernel itself (its
    # found_inf input), so no step waits for the GPU; the host reads what happened in batches.
    ledger = StepLedger(deferred=defer_steps(run), started=t_start)
    saves = SaveSchedule(cfg, len(run.steps), one_process=not parallel.enabled)
    # An exception in a step: save the last completed step, then one line (TrainingFailed).
    on_error = SaveOnError(run, lambda: (done, with_totals(counters, time.perf_counter() - t_start, tokens_done)),
                           save_all_ranks, flush=lambda: ledger.pending and [
                               write_metrics(run, r) for r in ledger.read(counters, cfg.max_bad_steps)[0]],
                           passthrough=(TrainingStopped,))
    with _stop_signals() as stop, (run.sink or nullcontext()), quiet_gc(), on_error:
        while step < len(run.steps):
            example_ids = run.steps[step]
            n_targets = sum(run.data.n_targets[i] for i in example_ids)  # the whole step's, all ranks
            step_loss, step_tokens = accumulate_step(run, parallel.shard(example_ids, getattr(run.data, "lengths", None)),
                                                     n_targets, micro_step, counters, step)
            # One collective per step: loss and tokens summed over ranks, and whether any rank
            # got SIGINT / SIGTERM (all ranks must stop at the same step).
            step_loss, step_tokens, signal_flag = reduce_step(parallel, step_loss, step_tokens, stop.signum,
                                                         sum(run.data.lengths[i] for i in example_ids))

            if run.scaler:
                run.scaler.unscale_(run.optimizer)
            if cfg.max_grad_norm > 0:
                grad_norm = clip_grad_norm(params, cfg.max_grad_norm)
            else:
                grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
            if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
                grad_norm = grad_norm.full_tensor()
            lr = run.optimizer.param_groups[0]["lr"]
            # A non-finite loss or gradient would poison the weights and Adam's moments for good:
            # skip the update; the data position and the lr schedule move on. (fp16: overflowing
            # gradients are the grad scaler's to skip and back off from; only the loss counts.)
            finite = torch.isfinite(step_loss)
            if not run.scaler:
                finite &= torch.isfinite(grad_norm)
            if ledger.deferred:
                run.optimizer.found_inf = (~finite).float()  # the fused kernel leaves everything as it was
                run.optimizer.step()
            else:
                finite = bool(finite)  # one host sync per step (the ledger takes the bool as it is)
                if finite and run.scaler:
                    run.scaler.step(run.optimizer)
                elif finite:
                    run.optimizer.step()
            if run.scaler:
                run.scaler.update()
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()" after a skip
                warnings.simplefilter("ignore", UserWarning)
                run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            done = step + 1

            tokens_done += step_tokens
            tokens_since_log += step_tokens
            samples_since_log += len(example_ids)
            record = None
            if done % cfg.log_every == 0 or done == len(run.steps):
                now = time.perf_counter()
                elapsed = max(now - t_log, 1e-9)
                record = {
                    "step": done,
                    "epoch": round(done * len(example_ids) / run.train_examples, 4),
                    "loss": step_loss,  # tensors until the ledger reads them
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": round(tokens_since_log / elapsed, 1),
                    "samples_per_s": round(samples_since_log / elapsed, 3),
                    "peak_memory_bytes": peak_memory_bytes(device),
                    "elapsed_s": round(now - t_start, 3),
                }
                t_log, tokens_since_log, samples_since_log = now, 0, 0
            ledger.add(finite, record, signal_flag, step_tokens, len(example_ids))
            validate = run.val is not None and (done == len(run.steps) or (cfg.eval_every and done % cfg.eval_every == 0))
            save_now = saves.due(done)
            if not ledger.due(validate or save_now or done == len(run.steps) or done == stop_after or signal_flag is True):
                step = done
                continue
            records, bad_run_end, signalled = ledger.read(counters, cfg.max_bad_steps)
            for record in records:
                loss_value = record["loss"]
                counters["last_loss"] = loss_value if loss_value is not None else float("nan")
                write_metrics(run, record)
                if loss_value is not None:
                    loss_ema = loss_value if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_value
                bar.update(record["step"], loss_ema if loss_ema is not None else counters["last_loss"],
                           record["tokens_per_s"])
            if bad_run_end:
                step = roll_back(run, done, counters, bar)  # or raise UserError
                continue
            stop_early = False
            if validate:
                write_metrics(run, validate_step(run, done, counters))
                stop_early = 0 < cfg.early_stopping_patience <= counters["evals_since_best"]
            if signalled or save_now or (saves.enabled and stop_early):
                save_all_ranks(run, done, with_totals(counters, time.perf_counter() - t_start, tokens_done))
            if signalled or done == stop_after:
                bar.close()
                raise TrainingStopped(done, (stop.signum or signal.SIGTERM) if signalled else None, run.folder)
            if stop_early:
                if parallel.is_main:
                    print(f"hivetune: early stopping at step {done}: validation loss has not improved for "
                          f"{counters['evals_since_best']} evaluations; keeping the adapter of step "
                          f"{counters['best_step']} (val_loss {counters['best_val_loss']:.4f})", file=sys.stderr)
                break
            step = done

    seconds = time.perf_counter() - t_start
    seconds, tokens_done = run_totals(counters, seconds, tokens_done)  # the whole run, across resumes
    bar.close()
    if cfg.early_stopping_patience and (run.folder / BEST_ADAPTER).is_dir():
        load_lora_weights(model, run.folder / BEST_ADAPTER)  # the adapter of the best validation loss
    adapter = run.folder / "adapter"
    saving = time.perf_counter()
    save_adapter_all_ranks(run, adapter)
    return TrainResult(run.folder, adapter, done, counters["last_loss"], tokens_done / max(seconds, 1e-9),
                       seconds, peak_memory_bytes(device), best_val_loss=counters["best_val_loss"],
                       stopped_early=done < len(run.steps), save_seconds=time.perf_counter() - saving)


def accumulate_step(run: Run, example_ids: list[int], n_targets: int, micro_step, counters: dict,
                    step: int | None = None):
    """Forward + backward of this rank's examples of one step, counters["micro_batch"] examples
    per micro-batch; returns (summed loss, tokens). On a CUDA out-of-memory error: where the
    activation offload moved fewer layers than it may (one process), redo the step with more
    (ActivationOffload.back_off); with `auto`, halve the micro-batch and redo the step (same
    examples, same gradient); else stop with a message that says what would fit."""
    while True:
        size = counters["micro_batch"]
        step_loss = torch.zeros((), device=run.device)
        step_tokens = 0
        batches = []
        try:
            batches = list(micro_batches(run, example_ids, size, step))
            for k, batch in enumerate(batches):
                # FSDP: the gradient collective runs once, after the last micro-batch (ddp: after the step).
                with distributed.gradient_sync(run.module, run.strategy, k == len(batches) - 1):
                    step_loss += micro_step(batch, n_targets)
                step_tokens += batch.n_tokens
            if run.strategy == "ddp":
                distributed.allreduce_gradients(run.optimizer.param_groups[0]["params"], run.parallel)
            return step_loss, step_tokens
        except torch.OutOfMemoryError:
            pass  # handled below, outside the except block: its traceback holds the step's tensors
        del step_loss
        run.optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        offload = getattr(run.model, "activation_offload", None)
        if offload is not None and not run.parallel.enabled and offload.back_off():
            where = f" at step {step + 1}" if step is not None else ""  # numbered as in metrics.jsonl
            print(f"hivetune: CUDA out of memory{where} with {offload.last_layers} of activation_offload's "
                  f"{offload.layers} layers offloaded (fewer for a smaller micro-batch); redoing the step with "
                  f"{offload.share:.0%} of that budget", file=sys.stderr)
            continue
        counters["micro_batch"] = out_of_memory(run, size, max((b.n_tokens for b in batches), default=0))


def out_of_memory(run: Run, size: int, tokens: int) -> int:
    """The smaller micro-batch to retry with (auto), or a UserError naming the way out."""
    from hivetune.checkpoint import checkpoint_folders

    saved = checkpoint_folders(run.folder / "checkpoints")
    last = f"the last checkpoint, {saved[-1]}, is intact" if saved else "no checkpoint was written yet"
    smaller = size // 2
    if run.cfg.auto and smaller >= 1 and not run.parallel.enabled:
        print(f"hivetune: CUDA out of memory with {size} examples ({tokens} tokens) per micro-batch; "
              f"retrying the step with {smaller} (the step's examples and gradient stay the same)", file=sys.stderr)
        return smaller
    per_step = run.cfg.batch_size * run.cfg.grad_accum
    hint = (f"--batch-size {max(1, size // 2)} --grad-accum {per_step // max(1, size // 2)}"
            if size > 1 else "--gradient-checkpointing or a smaller --max-length")
    kept = getattr(getattr(run.model, "lora_casts", None), "kept_by_auto_bytes", 0)
    if kept:  # lora_inputs auto kept them: the GPU looked roomy, yet something else took the room
        hint = f"--set lora_inputs=recompute (frees ~{kept / 2**30:.2f} GiB of LoRA inputs kept for backward), {hint}"
    raise UserError(f"CUDA out of memory with {size} examples ({tokens} tokens) per micro-batch; {last}. "
                    f"{planner_hint(run)}try {hint}, or --auto to shrink the micro-batch when this happens")


def planner_hint(run: Run) -> str:
    """What `hivetune plan` says of this config on this GPU, as the start of a sentence."""
    if run.device.type != "cuda":
        return "`hivetune plan` predicts what fits; "
    try:
        from hivetune.plan import plan
        total = torch.cuda.get_device_properties(run.device).total_memory / 2**30
        p = plan(run.cfg, memory_gib=total, model_args=run.model.args)
        return (f"The planner: micro-batches up to {p.largest_micro_batch_tokens:,} tokens fit this GPU "
                f"({p.suggestion}); ")
    except Exception as e:  # noqa: BLE001 - a hint must never hide the out-of-memory message
        return f"`hivetune plan` predicts what fits (no plan here: {type(e).__name__}); "


def reduce_step(parallel: distributed.Dist, step_loss: torch.Tensor, step_tokens: int, signum, all_tokens: int):
    """(loss summed over ranks, tokens of the whole step, whether any rank was signalled: a bool,
    or under torchrun a device tensor that the ledger reads). `all_tokens`: the step's tokens
    counted on the host from the data's lengths (every rank knows them)."""
    if not parallel.enabled:
        return step_loss, step_tokens, bool(signum)
    # new_full fills on the device; new_tensor would copy a host scalar, and torch syncs the
    # stream after such a copy: every DDP step's host waited for the GPU there, then left it
    # idle ~4 ms a step while it queued the all-reduce, the optimizer and the next micro-batch.
    stats = torch.stack([step_loss.float(), step_loss.new_full((), 1.0 if signum else 0.0)])
    distributed.sum_across(parallel, stats)
    return stats[0], all_tokens, stats[1] > 0


def defer_steps(run: Run) -> bool:
    """Whether the loop reads its steps' outcomes in batches (StepLedger): on CUDA with fused
    AdamW and no grad scaler, unless the run is timed step by step (Run.read_every_step)."""
    return (run.device.type == "cuda" and not run.scaler and bool(run.optimizer.defaults.get("fused"))
            and not run.read_every_step)


class StepLedger:
    """What the host learns of each finished step (finite or skipped, its log record, whether a
    rank was signalled), read from the device in one batch.

    Without deferral (CPU, fp16's scaler, foreach AdamW) every step is read at once, as before.
    Deferred (CUDA + fused AdamW, where the optimizer kernel skips a non-finite step on its own)
    the host reads every FLUSH_STEPS steps and at each validation, checkpoint, stop and the last
    step: between reads the host runs ahead of the GPU (W1's steps are ~25 ms; a sync each step
    left the GPU idle ~5 ms of each while the host prepared the next). The read replays the
    counters step by step, so skipped_steps, bad_in_a_row and the logged records are what the
    per-step reads gave; a rollback (max_bad_steps in a row) starts at the read that sees it.
    Reads happen at the same steps on every rank (step counts, never time), so under torchrun
    all ranks stop at the same step.

    Deferred, the host dates a record when it queues the step, up to FLUSH_STEPS steps before
    the GPU runs it (graphed W1 steps 3-5 ms apart where each takes ~16 ms, tune at 5d590cf), so
    with `started` (the loop's start on `clock`) a read re-dates its records: the GPU finished
    every step read by the time the read returns, so the steps since the previous read ran in
    that window, and each record's elapsed_s is placed in it by the tokens done (tokens_per_s and
    samples_per_s then follow: the window's rate).
    """

    FLUSH_STEPS = 16

    def __init__(self, deferred: bool, started: float | None = None, clock=time.perf_counter):
        self.deferred, self.started, self.clock = deferred, started, clock
        # (finite, record, signal, tokens, samples) per step
        self.pending: list[tuple[object, dict | None, object, int, int]] = []
        self.synced = 0.0  # seconds from the start to the previous read
        self.dated = 0.0  # ... to the newest record dated
        self.since = [0, 0]  # tokens and samples since that record

    def add(self, finite, record: dict | None, signal, tokens: int = 0, samples: int = 0) -> None:
        self.pending.append((finite, record, signal, tokens, samples))

    def _redate(self, now: float) -> None:
        window = max(now - self.synced, 1e-9)
        total = sum(t for *_, t, _ in self.pending)
        done = 0
        for k, (_, record, _, tokens, samples) in enumerate(self.pending):
            done += tokens
            self.since[0] += tokens
            self.since[1] += samples
            if record is None:
                continue
            share = done / total if total else (k + 1) / len(self.pending)
            elapsed = self.synced + window * share
            span = max(elapsed - self.dated, 1e-9)
            record.update(elapsed_s=round(elapsed, 3), tokens_per_s=round(self.since[0] / span, 1),
                          samples_per_s=round(self.since[1] / span, 3))
            self.dated, self.since = elapsed, [0, 0]
        self.synced = now

    def due(self, forced: bool) -> bool:
        return not self.deferred or forced or len(self.pending) >= self.FLUSH_STEPS

    def read(self, counters: dict, max_bad_steps: int) -> tuple[list[dict], bool, bool]:
        """(the log records with numbers, whether max_bad_steps non-finite steps came in a row,
        whether a rank was signalled at the newest step); counters updated in step order."""
        values = []
        for finite, record, *_ in self.pending:
            values.append(finite)
            if record is not None:
                values += [record["loss"], record["grad_norm"]]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        signal = self.pending[-1][2]
        if isinstance(signal, torch.Tensor):
            tensors.append(signal)
        host = iter(torch.stack([t.float().reshape(()) for t in tensors]).tolist() if tensors else [])
        if self.deferred and self.started is not None:
            self._redate(self.clock() - self.started)
        read = (lambda v: float(next(host)) if isinstance(v, torch.Tensor) else float(v))
        records, bad_run = [], False
        for finite, record, *_ in self.pending:
            if read(finite):
                counters["bad_in_a_row"] = 0
            else:
                counters["skipped_steps"] += 1
                counters["bad_in_a_row"] += 1
                bad_run = bad_run or counters["bad_in_a_row"] >= max_bad_steps
            if record is not None:
                loss, norm = read(record["loss"]), read(record["grad_norm"])
                records.append({**record, "loss": loss if math.isfinite(loss) else None,
                                "grad_norm": round(norm, 6) if math.isfinite(norm) else None,
                                "skipped_steps": counters["skipped_steps"]})
        signalled = bool(read(signal)) if isinstance(signal, torch.Tensor) else bool(signal)
        self.pending = []
        return records, bad_run, signalled


def write_metrics(run: Run, record: dict) -> None:
    """One record to metrics.jsonl (and TensorBoard when asked), on rank 0."""
    if run.sink is not None:
        run.sink.write(record)


def save_all_ranks(run: Run, step: int, counters: dict) -> None:
    """Checkpoint: every rank hands its RNG state to rank 0, which writes the folder."""
    from hivetune.checkpoint import capture_rng

    # One collective: every rank's RNG state and its CUDA-graph sizes (each rank plans its own).
    rngs, graph_sizes = zip(*distributed.all_gather_objects(run.parallel, (capture_rng(), run.graph_sizes)))
    rngs, graph_sizes = list(rngs), list(graph_sizes)
    gathered = None
    if run.strategy == "fsdp":  # collectives: every rank gathers, rank 0 keeps the full tensors
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from hivetune.model.lora import lora_state_dict

        gathered = (lora_state_dict(run.model),
                    get_optimizer_state_dict(run.module, run.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    if run.parallel.is_main:
        extra = {"world": run.parallel.world, "rank_rng": rngs} if run.parallel.enabled else {"world": 1}
        if any(sizes is not None for sizes in graph_sizes):
            extra["graph_sizes"] = graph_sizes
        save_checkpoint(run, step, {**counters, **extra}, gathered)
    distributed.barrier(run.parallel)


def save_adapter_all_ranks(run: Run, folder: Path) -> None:
    """An adapter folder (adapter/, best_adapter/), written by rank 0 (FSDP: every rank joins
    gathering the shards) and replaced whole: each file of save_adapter is atomic, but a crash
    between them would leave new weights beside an old config (fileio.write_folder_atomically)."""
    from hivetune.model.lora import lora_state_dict

    tensors = lora_state_dict(run.model)  # a collective under FSDP: all ranks call it
    if run.parallel.is_main:
        write_folder_atomically(folder, lambda tmp: save_adapter(run.model, run.spec, tmp, str(run.model_path),
                                                                 tensors=tensors))
    distributed.barrier(run.parallel)


def roll_back(run: Run, done: int, counters: dict, bar) -> int:
    """max_bad_steps non-finite steps in a row: stop (on_bad_steps=stop), or go back to the
    last checkpoint with the learning rate times rollback_lr_factor. Returns the step to redo."""
    from hivetune.checkpoint import checkpoint_folders, load_checkpoint, newest_valid_checkpoint, truncate_metrics

    cfg = run.cfg
    checkpoint = newest_valid_checkpoint(run.folder) if checkpoint_folders(run.folder / "checkpoints") else None
    if cfg.on_bad_steps != "rollback" or checkpoint is None or counters["rollbacks"] >= cfg.max_rollbacks:
        bar.close()
        message = _bad_steps_message(run, done, counters["bad_in_a_row"], checkpoint)
        if cfg.on_bad_steps == "rollback" and checkpoint is not None:
            message += f" (after {counters['rollbacks']} rollbacks, max_rollbacks)"
        raise UserError(message)
    rollbacks = counters["rollbacks"] + 1
    restored = load_checkpoint(run, checkpoint)
    back_to = restored.pop("step")
    restored.pop("world", None)
    restored.pop("rank_rng", None)
    counters.update(restored, rollbacks=rollbacks, bad_in_a_row=0)
    # LambdaLR multiplies base_lrs by the schedule: scaling them lowers every later step's lr,
    # and the next checkpoints carry the scaled values.
    run.scheduler.base_lrs = [lr * cfg.rollback_lr_factor for lr in run.scheduler.base_lrs]
    sched = run.scheduler
    for group, base, factor in zip(run.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)
    if run.parallel.is_main:
        truncate_metrics(run.folder / "metrics.jsonl", back_to)
        run.sink.reopen()
        write_metrics(run, {"step": back_to, "event": "rollback", "from_step": done,
                            "lr_scale": cfg.rollback_lr_factor ** rollbacks})
        print(f"hivetune: {cfg.max_bad_steps} non-finite steps in a row; rolled back from step {done} to "
              f"{checkpoint} with the learning rate x{cfg.rollback_lr_factor:g} (rollback {rollbacks} of "
              f"{cfg.max_rollbacks})", file=sys.stderr)
    return back_to


BEST_ADAPTER = "best_adapter"


@torch.no_grad()
def validation_loss(run: Run) -> tuple[float, int]:
    """Mean loss over the validation set's target tokens (dropout off), and their count."""
    cfg, model = run.cfg, run.model
    data, ids = run.val
    ids = run.parallel.shard(ids)
    forward = run.module if run.strategy == "fsdp" else model  # FSDP: the root gathers the shards
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    n_targets = 0
    for start in range(0, len(ids), cfg.batch_size):
        chunk = [data.example(i) for i in ids[start:start + cfg.batch_size]]
        batch = (collate_packed(chunk, pad_id=run.pad_id) if cfg.packing else collate_padded(chunk, run.pad_id))
        batch = batch.to(run.device)
        with autocast(run):
            hidden = forward(batch.input_ids, batch.position_ids, batch.layout)
            total += fused_target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids)
        n_targets += int(batch.target_ids.numel())
    model.train(was_training)
    if run.parallel.enabled:
        both = distributed.sum_across(run.parallel, torch.stack([total, total.new_tensor(float(n_targets))]))
        total, n_targets = both[0], int(both[1])
    return float(total) / max(n_targets, 1), n_targets


def validate_step(run: Run, step: int, counters: dict) -> dict:
    """Validation loss at `step`; track the best one (saving its adapter when early stopping is on)."""
    val_loss, val_tokens = validation_loss(run)
    best = counters["best_val_loss"]
    if best is None or val_loss < best:
        counters.update(best_val_loss=val_loss, best_step=step, evals_since_best=0)
        if run.cfg.early_stopping_patience:
            save_adapter_all_ranks(run, run.folder / BEST_ADAPTER)
    else:
        counters["evals_since_best"] += 1
    return {"step": step, "val_loss": val_loss, "val_tokens": val_tokens,
            "best_val_loss": counters["best_val_loss"]}


def _bad_steps_message(run: Run, step: int, bad: int, checkpoint: Path | None) -> str:
    last = f"the last checkpoint, {checkpoint}, is intact" if checkpoint else "no checkpoint was written"
    return (f"step {step}: loss or gradients not finite in {bad} steps in a row (max_bad_steps), so training "
            f"stopped; {last}. Try a lower lr than {run.cfg.lr:g} (e.g. --lr {run.cfg.lr / 4:g}) in a new run")


class _stop_signals:
    """SIGINT / SIGTERM during fit: note the first, so the loop finishes its step, checkpoints
    and stops; a second one interrupts at once (KeyboardInterrupt; the last checkpoint stays)."""

    def __init__(self):
        self.signum, self.previous = 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal() works only there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        # os.write, not print: the handler may run while the loop is inside a print to stderr
        os.write(2, b"\nhivetune: finishing this step, then writing a checkpoint (again to stop now)\n")

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        return False


class _progress_bar:
    """One line on stderr: step, loss, tokens/s and ETA; silent when not wanted."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.t0 = total, enabled, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last_print = 0.0

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not self.tty and now - self.last_print < 10 and step != self.total:
            return
        self.last_print = now
        elapsed = now - self.t0
        eta = elapsed / step * (self.total - step)
        width = 24
        filled = int(width * step / self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total}  loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s  ETA {_fmt_s(eta)}")
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _fmt_s(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def answer_heldout(run: Run, n: int, max_new_tokens: int) -> list[dict]:
    """The first n held-out questions answered by the base (LoRA off) and the tuned model."""
    from hivetune.data.formats import alpaca_messages, check_record, detect_format, iter_records
    from hivetune.workflows.generate import generate_text
    from hivetune.model.lora import lora_enabled

    if run.val_path is None or n == 0:
        return []
    questions = []
    for line, _, record in iter_records(run.val_path):
        fmt = detect_format(record)
        check_record(record, fmt or "?", f"{run.val_path}:{line}")
        if fmt == "alpaca":
            messages = alpaca_messages(record)
        elif fmt == "chat":
            messages = record["messages"]
        else:
            continue
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        reference = next((m["content"] for m in messages[last_user:] if m["role"] == "assistant"), "")
        questions.append((messages[last_user]["content"], reference))
        if len(questions) == n:
            break
    run.model.eval()
    prompts = [q for q, _ in questions]
    with lora_enabled(run.model, False):
        base = generate_text(run.model, run.tokenizer, prompts, max_new_tokens)
    tuned = generate_text(run.model, run.tokenizer, prompts, max_new_tokens)
    return [{"question": q, "reference": r, "base": b, "tuned": t}
            for (q, r), b, t in zip(questions, base, tuned)]


def heldout_eval(run: Run) -> dict | None:
    """The end-of-run A/B: `hivetune eval` on the model still in memory, over the first
    eval_examples held-out examples, into RUN/eval/ (eval.json, eval.md); prints the means
    table. None when there is no held-out file, eval_examples or eval_prompts is 0, or the
    file has no prompt/response records (a note says so: the trained adapter is already saved)."""
    from hivetune.workflows.evaluate import heldout_ab, means_table

    cfg = run.cfg
    if run.val_path is None or cfg.eval_examples == 0 or cfg.eval_prompts == 0:
        return None
    try:
        report = heldout_ab(run.model, run.tokenizer, run.val_path, run.folder / "eval", model_path=run.model_path,
                            adapter_folder=run.folder / "adapter", device=run.device, precision=run.precision,
                            max_new_tokens=cfg.max_new_tokens, limit=cfg.eval_examples, max_length=cfg.max_length)
    except UserError as e:
        print(f"note: no base vs tuned evaluation: {e}", file=sys.stderr)
        return None
    print(f"\nbase vs tuned on {report['examples']} held-out examples of {run.val_path} "
          f"({report['seconds']['total']:.0f} s; all rows in {report['out']}/eval.json):\n{means_table(report)}")
    return report


def train(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """`hivetune train`: setup, fit, save; then base vs tuned on the held-out file (heldout_eval)."""
    run = setup(cfg)
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    result = fit(run, progress)
    if run.parallel.enabled:  # rank 0 goes on alone: held-out answers, summary
        distributed.shutdown(run.parallel)
        if not run.parallel.is_main:
            return result
        if run.strategy == "fsdp":  # the sharded model cannot run on one rank
            cfg.eval_prompts = 0
    ab = heldout_eval(run)
    if ab is not None:
        result.samples = [{"question": r["question"], "reference": r["reference"], "base": r["base"]["generation"],
                           "tuned": r["tuned"]["generation"]} for r in ab["rows"][:cfg.eval_prompts]]
    else:
        result.samples = answer_heldout(run, cfg.eval_prompts, cfg.max_new_tokens)
    from hivetune.workflows.report import environment

    summary = {
        "adapter": str(result.adapter), "steps": result.steps, "final_loss": result.final_loss,
        "tokens_per_s": round(result.tokens_per_s, 1), "train_seconds": round(result.seconds, 2),
        "peak_memory_bytes": result.peak_memory_bytes, "device": str(run.device),
        "precision": run.precision, "examples": len(run.data), "data_format": run.data.format,
        "samples": result.samples,
        "eval": None if ab is None else {"out": ab["out"], "examples": ab["examples"], "means": ab["means"],
                                         "seconds": ab["seconds"]["total"]},
        "environment": environment(str(run.device)),
    }
    atomic_write_bytes(run.folder / "summary.json", json.dumps(summary, indent=2).encode())
    return result
