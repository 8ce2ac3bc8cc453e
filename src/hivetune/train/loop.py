"""The training loop (fit), read top to bottom: forward and backward of each step's micro-batches
(train.step), clip, optimizer step, log, validate, checkpoint; rollback after a run of
non-finite steps; SIGINT / SIGTERM finish the step and checkpoint."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

from hivetune.checkpoint import (SaveOnError, SaveSchedule, checkpoint_folders, load_checkpoint, load_lora_weights,
                                 newest_valid_checkpoint, run_totals, truncate_metrics, with_totals)
from hivetune.core.config import to_dict
from hivetune.core.device import peak_memory_bytes
from hivetune.core.errors import UserError
from hivetune.core.collector import quiet_gc
from hivetune.ops.adamw import clip_grad_norm
from hivetune.ops.prewarm import join_prewarm
from hivetune.core.metrics import MetricsSink
from hivetune.data.batch import collate_packed, collate_padded
from hivetune.model.lora import lora_parameters
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.loss import target_loss_sum
from hivetune.parallel import distributed
from hivetune.train.graph_plan import micro_step_fn
from hivetune.train.ledger import StepLedger
from hivetune.train.pair_graph import preference_step_fn
from hivetune.train.preference import PreferenceStep, preference_validation_loss
from hivetune.train.run import Run, TrainResult, save_adapter_all_ranks, save_all_ranks
from hivetune.train.step import accumulate_step, autocast

BEST_ADAPTER = "best_adapter"


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
    # forward_backward, replayed from CUDA graphs when it can be; dpo / orpo: pairs, with rewards
    micro_step = micro_step_fn(run, loss_fn) if cfg.method == "sft" else preference_step_fn(run, PreferenceStep(run))
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
    run.sink = MetricsSink(run.folder, tensorboard=cfg.tensorboard, report_to=cfg.report_to, config=to_dict(cfg),
                           trackers=run.trackers) if parallel.is_main else None
    run.trackers = None  # the sink closes them; a second fit of this run opens its own
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

            finite, grad_norm, lr = optimizer_step(run, params, step_loss, ledger.deferred)
            rewards = micro_step.step_stats(len(example_ids)) if cfg.method != "sft" else {}
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
                    **rewards,
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


def optimizer_step(run: Run, params: list, step_loss: torch.Tensor, deferred: bool):
    """Clip, step the optimizer (skipping a non-finite step) and the schedule, drop the gradients;
    returns (finite: a device bool where deferred, else a bool; the gradient norm; the step's lr)."""
    cfg = run.cfg
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
    if deferred:
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
    return finite, grad_norm, lr


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


def write_metrics(run: Run, record: dict) -> None:
    """One record to metrics.jsonl (and TensorBoard when asked), on rank 0."""
    if run.sink is not None:  # preference rewards arrive as device tensors: read here, with the ledger's read
        run.sink.write({k: round(float(v), 6) if isinstance(v, torch.Tensor) else v for k, v in record.items()})


def roll_back(run: Run, done: int, counters: dict, bar) -> int:
    """max_bad_steps non-finite steps in a row: stop (on_bad_steps=stop), or go back to the
    last checkpoint with the learning rate times rollback_lr_factor. Returns the step to redo."""
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
            total += fused_target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids,
                                           softcap=model.args.final_logit_softcapping)
        n_targets += int(batch.target_ids.numel())
    model.train(was_training)
    if run.parallel.enabled:
        both = distributed.sum_across(run.parallel, torch.stack([total, total.new_tensor(float(n_targets))]))
        total, n_targets = both[0], int(both[1])
    return float(total) / max(n_targets, 1), n_targets


def validate_step(run: Run, step: int, counters: dict) -> dict:
    """Validation loss at `step`; track the best one (saving its adapter when early stopping is on)."""
    val_loss, val_tokens = validation_loss(run) if run.cfg.method == "sft" else preference_validation_loss(run)
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
