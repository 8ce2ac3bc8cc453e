"""The model as a run trains it (assemble's model part, shared with train.twin): LoRA added,
projections fused, embeddings on the host, the activation offload, and what the planner's memory
model decides for it."""

from __future__ import annotations

import sys

import torch

from hivetune.core.config import TrainConfig, step_order
from hivetune.core.device import DTYPES
from hivetune.core.errors import UserError
from hivetune.data.step_plan import data_plan
from hivetune.model.config import ModelArgs
from hivetune.model.decoder import CausalLM
from hivetune.model.lora import LoRASpec, apply_lora, fuse_projections
from hivetune.model.quant import is_quantized, quantize_model
from hivetune.ops import blas
from hivetune.ops.attention import varlen_supported
from hivetune.ops.host_embedding import move_embeddings
from hivetune.ops.lora_group import fused_lora_usable
from hivetune.ops.offload import ActivationOffload
from hivetune.ops.switches import configure_ops
from hivetune.parallel import distributed
from hivetune.plan.gpus import device_memory_bytes
from hivetune.plan.graph_sizes import launch_bound
from hivetune.plan.memory import keep_inputs_extra_bytes, offloaded_bytes, offloaded_layer_bytes
from hivetune.plan.planner import memory_config
from hivetune.train.graph_plan import planned_micro_batches
from hivetune.train.run import Run
from hivetune.train.step import runs_in_dtype


def wide_groups(args: ModelArgs, cfg: TrainConfig, data, device: torch.device, strategy: str = "none") -> bool:
    """Whether q/k/v and gate/up take the wide layout (lora.fuse_projections): wide_lora true or
    auto, but not FSDP (auto); on CUDA, where a micro-batch's matmuls are small enough for CUDA
    graphs (plan.graph_sizes.launch_bound, from the data's mean length). There the LoRA update
    riding in the base matmul saves W1 ~5% of its loop and W2's DDP ranks 2-7%; W2 on one GPU
    (16 x 1, ~80 TFLOP a micro-batch, not graphed) runs 8% slower with it (docs/log.md)."""
    asked = cfg.wide_lora == "true" or (cfg.wide_lora == "auto" and strategy != "fsdp")
    if not asked or device.type != "cuda" or not len(data):
        return False
    tokens = cfg.batch_size * data.total_tokens / len(data)
    return launch_bound(args.linear_weight_count, tokens)


def step_plan(cfg: TrainConfig, data, world: int = 1):
    """(steps, training examples, validation ids): data.step_plan.data_plan at the config's global
    batch (batch_size x grad_accum on each of `world` processes)."""
    return data_plan(data, cfg.batch_size * cfg.grad_accum * world, cfg.epochs, cfg.max_steps, cfg.seed,
                     cfg.val_split, step_order(cfg))


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaling (none in bf16 / fp32)."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def lora_spec(cfg: TrainConfig) -> LoRASpec:
    return LoRASpec(cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, tuple(cfg.lora.targets), cfg.lora.rslora)


def prepare_model(cfg: TrainConfig, model: CausalLM, data, device: torch.device, precision: str,
                  parallel: distributed.Dist = distributed.Dist(), args: ModelArgs | None = None,
                  pin_embeddings: bool = True) -> str:
    """The model as the run trains it: quantized (base_quant, a model built in memory), LoRA
    added, ops configured, projections fused, embeddings on the host where asked; returns the
    strategy (none, ddp or fsdp). `args`: the architecture the choices are made for, where
    `model` is a cut of it (train.twin); `pin_embeddings` False: host_embeddings' table stays on
    the GPU, read by the same kernel (the twin's)."""
    args = args or model.args
    if cfg.base_quant in ("nf4", "int8") and not is_quantized(model):  # a model built in memory (bench, tune)
        quantize_model(model, cfg.base_quant)
    torch.manual_seed(cfg.seed)  # LoRA init independent of anything loaded before (and alike on every rank)
    apply_lora(model, lora_spec(cfg), param_dtype=torch.float32)
    model.gradient_checkpointing = cfg.gradient_checkpointing
    model.checkpoint_layers = cfg.checkpoint_layers
    configure_ops(cfg.attention, cfg.fused_ops)
    if device.type == "cuda" and precision != "fp32":  # probe flash varlen now, not inside a checkpointed forward
        varlen_supported(torch.empty((1, 1, 1, 1), dtype=DTYPES[precision], device=device))
    strategy = "none"
    quantized = is_quantized(model)
    if parallel.enabled and quantized:  # FSDP2 shards parameters: the packed blocks are buffers
        if cfg.distributed == "fsdp":
            raise UserError(f"distributed: fsdp does not shard a quantized base (base_quant {cfg.base_quant}: its "
                            f"weights are buffers of packed blocks); use ddp or auto, or base_quant none")
        strategy = "ddp"
    elif parallel.enabled:
        base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        strategy = distributed.choose_strategy(cfg.distributed, base_bytes, device, cfg, model.args)
    if strategy != "fsdp" and fused_lora_usable():  # FSDP shards each weight: it keeps them apart
        # on a quantized base each group dequantizes its members into one weight per call, kept
        # for backward under gradient checkpointing (lora.fuse_projections)
        fuse_projections(model, wide=wide_groups(args, cfg, data, device, strategy),
                         keep_weight=cfg.gradient_checkpointing)
    if cfg.host_embeddings and device.type == "cuda":
        if strategy == "fsdp":
            print("hivetune: host_embeddings: off under FSDP (it shards the table with the rest)", file=sys.stderr)
        else:
            move_embeddings(model, pin_embeddings)
    if device.type == "cuda":
        blas.available(device)  # loads cuBLAS / cuBLASLt here, not in the first step (~85 ms on an H100 host)
    model.runs_in_dtype = runs_in_dtype(model, precision, strategy)
    return strategy


def planned_memory(run: Run, args: ModelArgs | None = None, memory_bytes: int | None = None) -> None:
    """What the planner's memory model decides for the run, at the step plan's largest
    micro-batch (so a resumed run decides the same): cfg.lora_inputs on the model's CastCache
    (whether the seeded-dropout LoRA groups keep their dropped inputs for backward; auto:
    plan.memory.resolve_keep_inputs), the micro-batch activation_offload's layer count is for, and
    the host memory it will use, pinned before the loop (W2 with 8 layers: ~2.9 GB; pinning it in
    the first steps instead costs ~1 s, docs/log.md). `args`, `memory_bytes`: the architecture and
    the device memory to decide for, where run.model is a cut of it built before a memory cap
    (train.twin)."""
    casts, offload = getattr(run.model, "lora_casts", None), run.model.activation_offload
    if casts is None and offload is None:
        return
    tokens = max((t for t, _ in planned_micro_batches(run, start=0)), default=0)
    args = args or run.model.args
    mc = memory_config(run.cfg, run.precision, run.cfg.gradient_checkpointing, cuda=run.device.type == "cuda",
                       args=args, tokens=tokens,
                       memory_bytes=device_memory_bytes(run.device) if memory_bytes is None else memory_bytes)
    if casts is not None:
        casts.keep_inputs = mc.keep_inputs
        # what recomputing would free, for the out-of-memory message (auto's choice only)
        casts.kept_by_auto_bytes = (keep_inputs_extra_bytes(args, mc, tokens)
                                    if mc.keep_inputs and run.cfg.lora_inputs == "auto" else 0)
    if offload is not None and tokens:
        # smaller micro-batches offload fewer layers (ActivationOffload.layers_for); not under
        # torchrun, where a step that runs out of memory cannot be redone on one rank (back_off)
        offload.max_tokens = None if run.parallel.enabled else tokens
        offload.reserve(offloaded_bytes(args, mc, tokens), offloaded_layer_bytes(args, mc, tokens))


def check_offload_layers(cfg: TrainConfig, layers: int) -> None:
    """activation_offload and checkpoint_layers name at most the model's decoder layers."""
    for key, verb in (("activation_offload", "offload"), ("checkpoint_layers", "checkpoint")):
        if getattr(cfg, key) > layers:
            raise UserError(f"{key}: {getattr(cfg, key)} exceeds the model's {layers} decoder "
                            f"layers ({verb} at most {layers})")


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
    return ActivationOffload(model, cfg.activation_offload)
