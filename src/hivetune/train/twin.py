"""The first step's Triton kernels found before the weights load.

On a cold Triton cache the first training pass sends its missing kernels to the compile workers
and waits for them (ops.compile_ahead): W2's 15 kernels cost its first step ~1.6 s. A twin of
the model finds the same kernels before the real weights exist: the architecture cut to
TWIN_LAYERS decoder layers, its weights zeros of the run's dtype (quantized as the run's), made
ready as the run's model (train.prepare.prepare_model, with the choices made for the whole
model: the wide LoRA groups, lora_inputs), runs the first micro-batch of the step plan under
the discovery hook. The workers then compile while the weights load, and the first pass finds
the kernels on disk. Cutting the layers changes no kernel: every layer runs the same ones, and
the second layer's backward has the input-gradient products the first lacks.

Only where Triton's cache lacks this model's marker (a cold cache, or one warm from other models'
runs: kernel_key; compile_ahead.discovers_early), supervised fine-tuning, one process. The
twin leaves nothing behind: the RNG states are put back, its memory is freed before the load,
and a failure of any kind leaves the kernels to the first pass, as without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from hivetune.core.config import TrainConfig
from hivetune.core.device import DTYPES
from hivetune.model.config import ModelArgs
from hivetune.model.decoder import CausalLM
from hivetune.model.load import build_model
from hivetune.model.lora import lora_parameters
from hivetune.ops import compile_ahead
from hivetune.ops.attention import Packed
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.loss import target_loss_sum
from hivetune.ops.prewarm import join_prewarm
from hivetune.plan.graph_sizes import launch_bound
from hivetune.train import step
from hivetune.train.graph_batch import Bucket, batch_key, pad_packed_batch
from hivetune.train.graph_plan import graphs_unsupported, ignoring_loss_fn
from hivetune.train.prepare import grad_scaler, lora_spec, planned_memory, prepare_model, step_plan
from hivetune.train.replay import attach_persistent_grads, persistent_grads
from hivetune.train.run import Run

TWIN_LAYERS = 2
# config keys that pick no kernel of the first step: left out of kernel_key (a key not named here
# counts, so a new one errs towards running the twin)
NOT_KERNELS = frozenset({
    "model", "data", "data_columns", "data_split", "data_config", "val_data", "val_split", "eval_every",
    "early_stopping_patience", "output_dir", "init_adapter", "epochs", "max_steps", "lr", "weight_decay", "schedule",
    "warmup_steps", "min_lr_ratio", "max_grad_norm", "compile_workers", "seed", "device", "threads", "skip_doctor",
    "log_every", "tensorboard", "report_to", "save_every", "save_every_minutes", "keep_checkpoints", "max_bad_steps",
    "on_bad_steps", "rollback_lr_factor", "max_rollbacks", "eval_prompts", "max_new_tokens", "eval_examples"})


def twin_args(args: ModelArgs, layers: int = TWIN_LAYERS) -> ModelArgs:
    """The architecture cut to its first `layers` decoder layers."""
    n = min(layers, args.num_hidden_layers)
    return dataclasses.replace(args, num_hidden_layers=n,
                               layer_types=args.layer_types[:n] if args.layer_types else None)


def twin_model(args: ModelArgs, dtype: torch.dtype, device: torch.device, base_quant: str = "none") -> CausalLM:
    """A model of `args` with every weight zero, built as a loaded one is (model.load.build_model:
    nf4 / int8 quantized a weight at a time)."""
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in CausalLM(args).named_parameters()]
    tensors = ((name, torch.zeros(shape, dtype=dtype, device=device)) for name, shape in shapes)
    return build_model(args, tensors, dtype, device, "twin", base_quant)


def kernel_key(cfg: TrainConfig, args: ModelArgs, precision: str, memory_bytes: int | None = None) -> str:
    """What picks the first step's kernels, hashed: the architecture (its depth aside), the
    precision, the config keys that shape the model or its micro-batches (not NOT_KERNELS) and
    the memory the run plans for (compile_early's `memory_bytes`).
    The marker of a finished first pass under this key (compile_ahead.warm_marker) says its
    kernels are in Triton's cache."""
    shape = dataclasses.replace(args, num_hidden_layers=0, layer_types=None)
    keys = {k: v for k, v in sorted(dataclasses.asdict(cfg).items()) if k not in NOT_KERNELS}
    return hashlib.sha256(repr((shape, precision, keys, memory_bytes)).encode()).hexdigest()[:16]


def compile_early(cfg: TrainConfig, args: ModelArgs, data, device: torch.device, precision: str,
                  memory_bytes: int | None = None) -> dict | None:
    """Run the twin's first micro-batch under the discovery hook (the module's doc), where it
    helps; returns compile_ahead.EARLY's figures, or None where nothing ran. `memory_bytes`: the
    device memory the run decides lora_inputs for (a benchmark's cap set after the model is built)."""
    if (device.type != "cuda" or cfg.method != "sft" or not len(data) or not compile_ahead.may_start(cfg.compile_workers)
            or not compile_ahead.cache_looks_cold(key := kernel_key(cfg, args, precision, memory_bytes))):
        return None
    join_prewarm()  # the workers start in prewarm's thread
    if not compile_ahead.discovers_early(key):
        return None
    states = torch.get_rng_state(), torch.cuda.get_rng_state(device)
    try:
        run = twin_run(cfg, args, data, device, precision, memory_bytes)
        ids = run.steps[0]
        batch = next(step.micro_batches(run, ids, 0, 0))
        n_targets = sum(run.data.n_targets[i] for i in ids)
        loss_fn = fused_target_loss_sum if cfg.fused_loss else target_loss_sum
        return compile_ahead.discover_early(first_call(run, args, batch, n_targets, loss_fn))
    except Exception as e:  # noqa: BLE001 - a twin that cannot be built: the first pass finds the kernels
        compile_ahead.EARLY = {"kernels": 0, "error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
        return compile_ahead.EARLY
    finally:
        run = batch = None
        torch.set_rng_state(states[0])
        torch.cuda.set_rng_state(states[1], device)
        torch.cuda.empty_cache()


def through_replay(run: Run, loss_fn) -> bool:
    """Whether the loop's calls go through train.replay (train.graph_plan): CUDA graphs asked for
    and nothing refusing them. Its eager calls too add into the persistent gradients."""
    return bool(run.cfg.cuda_graphs) and graphs_unsupported(run, loss_fn) is None


def graphed(run: Run, args: ModelArgs, batch, replayed: bool) -> bool:
    """Whether the loop's first call of this run is graphed: through replay (`replayed`:
    through_replay), packed, and a micro-batch small enough for the whole model (replay's
    launch-bound check)."""
    return (replayed and isinstance(batch.layout, Packed)
            and launch_bound(args.linear_weight_count, batch.input_ids.numel(), run.cfg.gradient_checkpointing))


def first_call(run: Run, args: ModelArgs, batch, n_targets: int, loss_fn):
    """The loop's first forward and backward on the twin, as the loop would make it: eager on the
    micro-batch, or, graphed, replay's warm-up: the micro-batch padded to its grid bucket in a
    graph's static inputs, the loss that ignores pad targets, gradients added into the
    persistent arena (their shapes and addresses pick the kernels' specialisations). Replay's
    eager calls (compute-bound micro-batches) add into that arena too: the A gradient's
    in-matmul dropout kernel then accumulates (another specialisation)."""
    replayed = through_replay(run, loss_fn)
    if not graphed(run, args, batch, replayed):
        on_device = batch.to(run.device)
        if replayed:
            attach_arena(run)
        return lambda: step.forward_backward_pass(run, on_device, n_targets, loss_fn)
    key = batch_key(batch)
    padded = pad_packed_batch(batch, key[0], run.pad_id)
    seeds = batch.dropout_seeds.numel() if batch.dropout_seeds is not None else 0
    bucket = Bucket(key[0], key[1] - 1, padded.n_examples, run.device, seeds)
    bucket.load(padded, n_targets)
    attach_arena(run)
    ignoring = ignoring_loss_fn(loss_fn)

    def warm_up():
        bucket.cu.copy_(bucket.cu_src)
        return step.forward_backward_pass(run, bucket.batch, bucket.n_targets, ignoring)
    return warm_up


def attach_arena(run: Run) -> None:
    """The LoRA parameters' .grad pointed at persistent gradients made as train.replay makes them."""
    params = lora_parameters(run.model)
    arena, grads = persistent_grads(params, run.model)
    attach_persistent_grads(params, grads, arena)


def twin_run(cfg: TrainConfig, args: ModelArgs, data, device: torch.device, precision: str,
             memory_bytes: int | None) -> Run:
    """The twin made ready as assemble makes the run's model, with the step plan the run will
    have and its loss scaling; no activation offload (it moves tensors, it launches no Triton
    kernel), no optimizer, no folder."""
    quant = cfg.base_quant if cfg.base_quant in ("nf4", "int8") else "none"
    model = twin_model(twin_args(args), DTYPES[precision], device, quant)
    # host_embeddings: the table stays on the GPU (pinning W2's takes ~1.4 s; the kernel is the same)
    prepare_model(cfg, model, data, device, precision, args=args, pin_embeddings=False)
    model.activation_offload = None
    steps, n_train, _ = step_plan(cfg, data)
    run = Run(cfg, Path("twin"), Path("twin"), device, precision, None, data, model, lora_spec(cfg), steps,
              None, None, grad_scaler(device, precision), train_examples=n_train)
    planned_memory(run, args=args, memory_bytes=memory_bytes)
    return run
