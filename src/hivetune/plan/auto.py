"""`train --auto`: a micro-batch that fits, keeping the effective batch; and the OOM fallback."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import yaml

from hivetune.core.config import TrainConfig
from hivetune.core.device import resolve_precision
from hivetune.core.hub import model_path as hub_model_path
from hivetune.core.errors import UserError
from hivetune.model.load import load_args
from hivetune.plan.gpus import device_memory_bytes
from hivetune.plan.memory import GIB, breakdown
from hivetune.plan.planner import memory_config, bucketed, offload_to_fit, uses_graphs

TUNE_FILE = "tune.yaml"  # written by `hivetune tune`, read by --auto when present
# what tune.yaml may set beside the micro-batch: the memory savers tune timed (workflows.tune.memory_savers)
TUNE_SAVERS = ("checkpoint_layers", "host_embeddings", "activation_offload", "cuda_graphs")


def _with(cfg: TrainConfig, **changes) -> TrainConfig:
    return dataclasses.replace(cfg, **changes)


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def smaller_micro_batch(cfg: TrainConfig) -> TrainConfig | None:
    """After a CUDA out-of-memory error: fewer examples per micro-batch, the same per step.

    batch_size becomes its largest proper divisor (half when even) and grad_accum grows by the
    same factor, so batch_size * grad_accum (and the loss normalisation) stays; None when
    batch_size is already 1.
    """
    if cfg.batch_size <= 1:
        return None
    smaller = next(d for d in _divisors_desc(cfg.batch_size) if d < cfg.batch_size)
    return _with(cfg, batch_size=smaller, grad_accum=cfg.grad_accum * (cfg.batch_size // smaller))


def read_tune_file(path: str | Path) -> dict:
    """The overrides a tune run wrote (batch_size, grad_accum, gradient_checkpointing, lora_inputs
    where it resolved auto, and the memory savers of a micro-batch kept whole: TUNE_SAVERS)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{path}: unreadable tune result ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys")
    allowed = {"batch_size", "grad_accum", "gradient_checkpointing", "lora_inputs", *TUNE_SAVERS}
    return {k: v for k, v in data.items() if k in allowed}


def offload_fit(cfg: TrainConfig, args, precision: str, tokens: int, budget: float):
    """(cfg, its predicted peak, what moved, for the message) with the input embedding in pinned
    host memory (an untied one) and then the fewest layers of activation offload, at most half the
    layers, with which an eager micro-batch of `tokens` fits `budget` bytes; None where nothing
    does, or where train would not move them (FSDP). Preferred to a smaller micro-batch or
    checkpointing: W2 (7B, 16 examples) under a 24 GiB cap with host_embeddings and 5 layers
    offloaded ran ~8% faster than 2 x 8 examples graphed on an H100 (docs/log.md). auto_config
    still takes a smaller micro-batch first where one fits without (the two are close), and this
    before checkpointing, which recomputes every layer's forward (offload: 2.9-5.5% slower than
    none, W2 on H200s)."""
    if cfg.distributed == "fsdp":
        return None
    if not args.tie_word_embeddings and not cfg.host_embeddings:
        cfg = _with(cfg, host_embeddings=True)
        peak = breakdown(args, memory_config(cfg, precision, False), tokens).total
        if peak <= budget:
            return cfg, peak, ", host_embeddings"
    moved = ", host_embeddings" if cfg.host_embeddings else ""
    if cfg.activation_offload:  # the user's count stands
        return None
    n = offload_to_fit(args, cfg, precision, tokens, 1.0, int(budget))
    if not n or n > args.num_hidden_layers // 2:
        return None
    cfg = _with(cfg, activation_offload=n)
    return cfg, breakdown(args, memory_config(cfg, precision, False), tokens).total, f"{moved}, activation_offload={n}"


def auto_config(cfg: TrainConfig, device, tune_file: str | Path | None = None,
                memory_gib: float | None = None) -> tuple[TrainConfig, str]:
    """Pick batch_size / grad_accum (same batch_size * grad_accum) and gradient_checkpointing.

    A tune result (tune_file, or ./tune.yaml) whose effective batch matches wins; otherwise the
    planner: the largest micro-batch (a divisor of the effective batch) that fits the device's
    memory without checkpointing; where none does, the largest that fits with its input embedding
    in host memory and the fewest layers of activation offload (offload_fit); else with
    checkpointing. Micro-batches are sized at max_length tokens an example (the worst case), in
    `memory_gib`, by default what this process may hold on the device (plan.gpus.device_memory_bytes:
    its memory times a per-process fraction where one is set, no more than is free plus what the
    process holds, which a GPU shared with another process or capped allows). On a CPU nothing
    changes.
    """
    effective = cfg.batch_size * cfg.grad_accum
    tune_path = Path(tune_file) if tune_file else Path(TUNE_FILE)
    if tune_path.is_file():
        found = read_tune_file(tune_path)
        b = found.get("batch_size")  # its grad_accum was for its own effective batch: ours is kept
        if isinstance(b, int) and b > 0 and effective % b == 0:
            ckpt = bool(found.get("gradient_checkpointing", cfg.gradient_checkpointing))
            savers = {k: found[k] for k in TUNE_SAVERS if k in found}
            new = _with(cfg, batch_size=b, grad_accum=effective // b, gradient_checkpointing=ckpt, **savers)
            inputs = found.get("lora_inputs")
            pinned = ""
            if cfg.lora_inputs == "auto" and inputs in ("keep", "recompute"):  # what tune measured
                new, pinned = _with(new, lora_inputs=inputs), f", lora_inputs {inputs}"
            saved = "".join(f", {k} {v}" for k, v in savers.items())
            return new, (f"auto: from {tune_path}: batch_size {b} x grad_accum {effective // b}, "
                         f"checkpointing {'on' if ckpt else 'off'}{saved}{pinned} (measured fastest)")
    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda" and memory_gib is None:
        return cfg, "auto: CPU run, config unchanged (the planner sizes GPU memory)"
    args = load_args(hub_model_path(cfg.model))
    if memory_gib is None:  # what this process may hold: a per-process cap, other processes' share
        memory_gib = device_memory_bytes(device) / GIB
    budget = memory_gib * GIB
    precision = cfg.precision
    if precision == "auto":
        precision = resolve_precision("auto", device) if device.type == "cuda" else "bf16"
    for ckpt, offload in ((False, False), (False, True), (True, False)):
        mcs = {graphed: memory_config(cfg, precision, ckpt, graphs=graphed) for graphed in (False, True)}
        for b in _divisors_desc(effective):
            tokens = bucketed(b * cfg.max_length, uses_graphs(cfg, precision), args, ckpt)
            graphed = tokens != b * cfg.max_length
            new = _with(cfg, batch_size=b, grad_accum=effective // b, gradient_checkpointing=ckpt)
            peak, moved = breakdown(args, mcs[graphed], tokens).total, ""  # graphed: no offload
            if offload:  # eager at its own size (a captured graph skips the offload)
                found = offload_fit(_with(new, cuda_graphs=False) if graphed else new, args, precision,
                                    b * cfg.max_length, budget)
                if found is None:
                    continue
                new, peak, moved = found
                moved += ", CUDA graphs off" if graphed else ""
            if peak <= budget:
                return new, (f"auto: batch_size {b} x grad_accum {effective // b}, checkpointing "
                             f"{'on' if ckpt else 'off'}{moved}: predicted peak {peak / GIB:.1f} of "
                             f"{memory_gib:.1f} GiB at {cfg.max_length} tokens an example")
    new = _with(cfg, batch_size=1, grad_accum=effective, gradient_checkpointing=True)
    return new, (f"auto: even one example of {cfg.max_length} tokens is predicted not to fit in "
                 f"{memory_gib:.1f} GiB; trying batch_size 1 with checkpointing (lower max_length?)")
