"""One optimizer step's forward and backward on this rank: its examples cut into micro-batches,
each micro-batch's forward, loss and backward (eager here; graphed: train.replay), and the
retry after a CUDA out-of-memory error.

Loss normalisation: every micro-batch's summed token loss is divided by the number of target
tokens of the whole optimizer step (known on the host from the dataset index), so gradient
accumulation gives exactly the gradient of the mean over the step's target tokens.
"""

from __future__ import annotations

import hashlib
import sys
from contextlib import nullcontext

import torch

from hivetune.checkpoint import checkpoint_folders
from hivetune.core.device import DTYPES
from hivetune.core.errors import UserError
from hivetune.data.batch import collate_packed, collate_padded
from hivetune.data import shares
from hivetune.data.pairs import collate_pairs
from hivetune.model.decoder import CausalLM
from hivetune.ops.compile_ahead import first_pass, trained
from hivetune.ops.lora_aside import join_aside
from hivetune.ops.lora_casts import given_seeds
from hivetune.parallel import distributed
from hivetune.plan import plan
from hivetune.train.run import Run


def micro_batches(run: Run, example_ids: list[int], size: int = 0, step: int | None = None):
    """Tokenise the step's examples and cut them into micro-batches of at most `size` examples
    (default batch_size: grad_accum micro-batches; micro_parts); given the step's index, each
    carries its dropout seeds (dropout_seeds)."""
    cfg = run.cfg
    pad = run.pad_id
    for k, part in enumerate(micro_parts(run, example_ids, size)):
        chunk = [run.data.example(i) for i in part]
        if cfg.method != "sft":  # preference pairs (train.preference)
            batch = collate_pairs(chunk, pad, shared=cfg.preference.shared_prompt)
        else:
            batch = collate_packed(chunk, pad_id=pad) if cfg.packing else collate_padded(chunk, pad)
        batch.dropout_seeds = dropout_seeds(run, step, k) if step is not None else None
        yield batch


def micro_parts(run: Run, example_ids: list[int], size: int = 0) -> list[list[int]]:
    """These examples cut into micro-batches of at most `size` (default batch_size), as
    data.shares.micro_parts cuts them (token-balanced with packing)."""
    return shares.micro_parts(example_ids, getattr(run.data, "lengths", None), size or run.cfg.batch_size,
                              run.cfg.packing)


def dropout_seeds(run: Run, step: int, micro: int) -> torch.Tensor | None:
    """The seeded LoRA dropout's seeds for micro-batch `micro` of step `step` on this rank: one
    int64 a joined group call of the model's forward, drawn on the host from a generator seeded
    by (run seed, rank, step, micro-batch). Given to the forward (lora_casts.given_seeds), they
    make its masks a function of the step plan alone: a resumed run draws what an unbroken one
    does, and a CUDA graph reads them from its static inputs (train.replay) instead of drawing
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
    of 112 group calls a W2 step."""
    if run.precision == "fp32" or getattr(run.model, "runs_in_dtype", False):
        return nullcontext()
    return torch.autocast(run.device.type, dtype=DTYPES[run.precision])


def runs_in_dtype(model: CausalLM, precision: str, strategy: str) -> bool:
    """Whether the model computes in `precision` without autocast (see autocast)."""
    if precision == "fp32" or strategy == "fsdp" or getattr(model, "lora_casts", None) is None:
        return False
    return all(p.dtype == DTYPES[precision] for p in model.parameters() if not p.requires_grad)


def forward_backward(run: Run, batch, n_targets: int, loss_fn) -> torch.Tensor:
    """One micro-batch: forward, loss over its targets divided by the step's target count,
    backward (gradients accumulate in the LoRA parameters). Returns the detached loss. The
    process's first call compiles its missing Triton kernels in parallel first (ops.compile_ahead)."""
    return first_pass(lambda: forward_backward_pass(run, batch, n_targets, loss_fn), lambda: trained(run.model),
                      counters=pass_counters(run))


def pass_counters(run: Run) -> tuple:
    """What a forward and backward counts in besides gradients (ops.compile_ahead restores them)."""
    offload = getattr(run.model, "activation_offload", None)
    return (offload.stats,) if offload is not None else ()


def forward_backward_pass(run: Run, batch, n_targets: int, loss_fn) -> torch.Tensor:
    model = run.model
    with autocast(run), given_seeds(batch.dropout_seeds):
        hidden = (run.module or model)(batch.input_ids, batch.position_ids, batch.layout)
        loss_sum = loss_fn(hidden, model.lm_head.weight, batch.target_index, batch.target_ids,
                           softcap=model.args.final_logit_softcapping)
    loss = loss_sum / n_targets
    # FSDP averages the gradients over ranks; times world makes that the sum over ranks of
    # sum(token losses) / (the step's target tokens), the one-process gradient (ddp sums).
    scaled = loss * run.parallel.world if run.strategy == "fsdp" else loss
    try:
        (run.scaler.scale(scaled) if run.scaler else scaled).backward()
    finally:
        join_aside()  # LoRA weight gradients put on a side stream (in graph captures): complete from here
    return loss.detach()


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
        total = torch.cuda.get_device_properties(run.device).total_memory / 2**30
        p = plan(run.cfg, memory_gib=total, model_args=run.model.args)
        return (f"The planner: micro-batches up to {p.largest_micro_batch_tokens:,} tokens fit this GPU "
                f"({p.suggestion}); ")
    except Exception as e:  # noqa: BLE001 - a hint must never hide the out-of-memory message
        return f"`hivetune plan` predicts what fits (no plan here: {type(e).__name__}); "
