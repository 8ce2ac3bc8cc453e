"""A training run: what the loop holds (Run), what it returns (TrainResult), its folder and the
files rank 0 writes there (checkpoints, adapters)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from hivetune.checkpoint import capture_rng, existing_run, save_checkpoint
from hivetune.core.config import TrainConfig
from hivetune.core.fileio import check_writable, hold_run_lock, write_folder_atomically
from hivetune.core.hub import base_model_name
from hivetune.core.metrics import MetricsSink
from hivetune.data.dataset import DatasetIndex, TokenizedExamples
from hivetune.data.step_plan import StepPlan
from hivetune.data.sources import DataSource
from hivetune.model.decoder import CausalLM
from hivetune.model.lora import LoRASpec, lora_state_dict, save_adapter
from hivetune.parallel import distributed


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
    steps: StepPlan | list[list[int]]  # example ids of each step (a list where a test cuts a plan by hand)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    val_path: Path | DataSource | None = None
    val: tuple | None = None  # (dataset, example ids) for validation loss, or None
    parallel: distributed.Dist = field(default_factory=distributed.Dist)  # this rank under torchrun
    strategy: str = "none"  # none (one process), ddp or fsdp
    module: torch.nn.Module | None = None  # what forward is called on: the model, or DDP around it
    sink: MetricsSink | None = None  # metrics.jsonl (+ TensorBoard) while fit runs, on rank 0
    trackers: dict | None = None  # report_to's MLflow / W&B runs, opened by setup on rank 0 (None: not yet)
    train_examples: int = 0  # examples the step plan draws from (the data minus a val_split)
    notes: list[str] = field(default_factory=list)
    start_step: int = 0  # > 0 when resumed from a checkpoint: the step plan's position
    counters: dict = field(default_factory=dict)  # loop totals restored with it (skipped_steps...)
    # The CUDA-graph sizes this rank planned at its first capture (train.replay), saved in
    # checkpoints: a resumed run captures the same sizes, so its matmuls see the same shapes.
    graph_sizes: dict | None = None
    # Read every step's outcome as it ends (no StepLedger batching): `hivetune tune` times steps by
    # their log records, which a host running 16 steps ahead of the GPU would date too early.
    read_every_step: bool = False
    init_adapter: dict | None = None  # {"path", "sha256"} of the adapter LoRA started from (init_adapter)

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


def save_all_ranks(run: Run, step: int, counters: dict) -> None:
    """Checkpoint: every rank hands its RNG state to rank 0, which writes the folder."""
    # One collective: every rank's RNG state and its CUDA-graph sizes (each rank plans its own).
    rngs, graph_sizes = zip(*distributed.all_gather_objects(run.parallel, (capture_rng(), run.graph_sizes)))
    rngs, graph_sizes = list(rngs), list(graph_sizes)
    gathered = None
    if run.strategy == "fsdp":  # collectives: every rank gathers, rank 0 keeps the full tensors
        # loaded here: torch.distributed.checkpoint is slow to import and needed only under FSDP
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

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
    tensors = lora_state_dict(run.model)  # a collective under FSDP: all ranks call it
    if run.parallel.is_main:
        base = base_model_name(run.cfg.model, run.model_path)
        write_folder_atomically(folder, lambda tmp: save_adapter(run.model, run.spec, tmp, base,
                                                                 tensors=tensors))
    distributed.barrier(run.parallel)
