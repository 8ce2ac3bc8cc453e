"""LoRA fine-tuning: ``setup`` builds everything, ``fit`` is one loop read top to bottom.

Loss normalisation: every micro-batch's summed token loss is divided by the number of target
tokens of the whole optimizer step (known on the host from the dataset index), so gradient
accumulation gives exactly the gradient of the mean over the step's target tokens.
"""

from __future__ import annotations

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

from hivetune.checkpoint import resume_point, resume_run, save_checkpoint
from hivetune.config import TrainConfig, save_config
from hivetune.data.batch import collate_packed, collate_padded
from hivetune.data.dataset import DatasetIndex, TokenizedExamples, index_dataset, plan_steps
from hivetune.device import DTYPES, peak_memory_bytes, resolve_device, resolve_precision, set_threads
from hivetune.doctor.preflight import check_stack
from hivetune.fastpath import adamw
from hivetune.embedded import default_heldout_data, default_train_data, embedded_model_path
from hivetune.errors import UserError
from hivetune.fileio import atomic_write_bytes, check_writable, hold_run_lock
from hivetune.model.decoder import CausalLM
from hivetune.model.load import load_args, load_model
from hivetune.model.lora import LoRASpec, apply_lora, lora_parameters, save_adapter
from hivetune.model.tokenizer import load_tokenizer
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.graphs import micro_step_fn
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
    notes: list[str] = field(default_factory=list)
    start_step: int = 0  # > 0 when resumed from a checkpoint: the step plan's position
    counters: dict = field(default_factory=dict)  # loop totals restored with it (skipped_steps...)

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
        if (folder.exists() and (not folder.is_dir() or any(folder.iterdir()))
                and not (folder / "config.yaml").is_file()):
            raise UserError(f"output_dir: {folder} already exists and is not empty; choose another")
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
    if not cfg.skip_doctor:
        check_stack(cfg.device, cfg.precision)  # the doctor's quick checks: a known-bad stack stops here
    model_path = Path(cfg.model) if cfg.model else embedded_model_path()
    data_path = Path(cfg.data) if cfg.data else default_train_data()
    val_path = Path(cfg.val_data) if cfg.val_data else (default_heldout_data() if not cfg.data else None)
    if val_path is not None and not val_path.exists():
        raise UserError(f"val_data: {val_path} not found")
    folder = new_run_folder(cfg)
    resuming = (folder / "config.yaml").is_file()
    checkpoint = resume_point(folder, cfg) if resuming else None  # refuses another config
    args = load_args(model_path)  # architecture only: cheap, catches a bad model early
    if cfg.max_length > args.max_position_embeddings:
        raise UserError(f"max_length: {cfg.max_length} exceeds the model's context "
                        f"({args.max_position_embeddings})")
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    tokenizer = load_tokenizer(str(model_path))
    if len(tokenizer) > args.vocab_size:
        raise UserError(f"{model_path}: tokenizer has {len(tokenizer)} tokens, more than the model's "
                        f"vocab_size {args.vocab_size}")
    data = index_dataset(data_path, cfg.format, tokenizer, cfg.max_length, cfg.train_on_inputs)

    # fp16 / bf16 runs keep the frozen base in half precision; only LoRA is fp32.
    model = load_model(model_path, dtype=DTYPES[precision], device=device)
    run = assemble(cfg, model, data, tokenizer, device, precision, folder, model_path)
    hold_run_lock(folder)  # a new folder: locked as soon as it exists
    run.val_path = val_path
    if data.truncated:
        run.notes.append(f"{data.truncated} examples truncated to max_length={cfg.max_length}")
    if data.skipped_no_target:
        run.notes.append(f"{data.skipped_no_target} examples skipped: no response token within max_length")
    if resuming:
        resume_run(run, checkpoint)  # last: it restores the RNG states the loop goes on with
    return run


def assemble(cfg: TrainConfig, model: CausalLM, data, tokenizer, device: torch.device, precision: str,
             folder: Path, model_path: Path) -> Run:
    """Add LoRA, plan the steps, build optimizer and schedule, create the run folder."""
    spec = LoRASpec(cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, tuple(cfg.lora.targets), cfg.lora.rslora)
    torch.manual_seed(cfg.seed)  # LoRA init independent of anything loaded before
    apply_lora(model, spec, param_dtype=torch.float32)
    model.gradient_checkpointing = cfg.gradient_checkpointing

    per_step = cfg.batch_size * cfg.grad_accum
    steps = plan_steps(len(data), per_step, cfg.epochs, cfg.max_steps, cfg.seed)
    params = lora_parameters(model)
    optimizer = adamw(params, cfg.lr, cfg.weight_decay, fused=device.type == "cuda")
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, round(0.03 * len(steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.schedule, warmup, len(steps), cfg.min_lr_ratio))
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "config.yaml").exists():  # a resumed run's stays as written: checkpoints hash it
        save_config(cfg, folder / "config.yaml")
    return Run(cfg, folder, model_path, device, precision, tokenizer, data, model, spec, steps,
               optimizer, scheduler, scaler)


def micro_batches(run: Run, example_ids: list[int]):
    """Tokenise the step's examples and cut them into grad_accum micro-batches."""
    cfg = run.cfg
    examples = [run.data.example(i) for i in example_ids]
    pad = run.pad_id
    for start in range(0, len(examples), cfg.batch_size):
        chunk = examples[start:start + cfg.batch_size]
        yield collate_packed(chunk, pad_id=pad) if cfg.packing else collate_padded(chunk, pad)


def autocast(run: Run):
    if run.precision == "fp32":
        return nullcontext()
    return torch.autocast(run.device.type, dtype=DTYPES[run.precision])


def forward_backward(run: Run, batch, n_targets: int, loss_fn) -> torch.Tensor:
    """One micro-batch: forward, loss over its targets divided by the step's target count,
    backward (gradients accumulate in the LoRA parameters). Returns the detached loss."""
    model = run.model
    with autocast(run):
        hidden = model(batch.input_ids, batch.position_ids, batch.layout)
        loss_sum = loss_fn(hidden, model.lm_head.weight, batch.target_index, batch.target_ids)
    loss = loss_sum / n_targets
    (run.scaler.scale(loss) if run.scaler else loss).backward()
    return loss.detach()


class TrainingStopped(Exception):
    """fit stopped early: by SIGINT / SIGTERM after checkpointing the step it finished
    (`signum` set), or by `stop_after` in tests with no checkpoint, as a kill would."""

    def __init__(self, step: int, signum: int | None, folder: Path):
        super().__init__(f"stopped at step {step}")
        self.step, self.signum, self.folder = step, signum, folder


def fit(run: Run, progress: bool = True, stop_after: int | None = None) -> TrainResult:
    """The training loop: forward, loss, backward, clip, step, log, checkpoint.

    Starts at run.start_step (resumed runs). SIGINT / SIGTERM finish the current step, write a
    checkpoint and raise TrainingStopped; so does `stop_after=N` after step N, minus the
    checkpoint (tests: a crash at a chosen step).
    """
    cfg, model, device = run.cfg, run.model, run.device
    params = lora_parameters(model)
    loss_fn = fused_target_loss_sum if cfg.fused_loss else target_loss_sum
    micro_step = micro_step_fn(run, loss_fn)  # forward_backward, replayed from CUDA graphs when it can be
    counters = {"skipped_steps": 0, "bad_in_a_row": 0, "last_loss": float("nan"), **run.counters}
    model.train()
    bar = _progress_bar(len(run.steps), progress)
    tokens_done, loss_ema = 0, None
    samples_done = run.start_step * cfg.batch_size * cfg.grad_accum  # every step sees that many
    t_start = t_log = time.perf_counter()
    tokens_since_log = samples_since_log = 0
    total_examples = len(run.data)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    with open(run.folder / "metrics.jsonl", "a") as metrics_file, _stop_signals() as stop:
        for step in range(run.start_step, len(run.steps)):
            example_ids = run.steps[step]
            n_targets = sum(run.data.n_targets[i] for i in example_ids)
            step_loss = torch.zeros((), device=device)
            step_tokens = 0
            for batch in micro_batches(run, example_ids):
                step_loss += micro_step(batch, n_targets)
                step_tokens += batch.n_tokens

            if run.scaler:
                run.scaler.unscale_(run.optimizer)
            if cfg.max_grad_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            else:
                grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
            lr = run.scheduler.get_last_lr()[0]
            # A non-finite loss or gradient would poison the weights and Adam's moments for good:
            # skip the update; the data position and the lr schedule move on. (fp16: overflowing
            # gradients are the grad scaler's to skip and back off from; only the loss counts.)
            finite = torch.isfinite(step_loss)
            if not run.scaler:
                finite &= torch.isfinite(grad_norm)
            if bool(finite):  # one host sync per step
                if run.scaler:
                    run.scaler.step(run.optimizer)
                else:
                    run.optimizer.step()
                counters["bad_in_a_row"] = 0
            else:
                counters["skipped_steps"] += 1
                counters["bad_in_a_row"] += 1
            if run.scaler:
                run.scaler.update()
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()" after a skip
                warnings.simplefilter("ignore", UserWarning)
                run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            done = step + 1

            tokens_done += step_tokens
            samples_done += len(example_ids)
            tokens_since_log += step_tokens
            samples_since_log += len(example_ids)
            if done % cfg.log_every == 0 or done == len(run.steps):
                loss_value = float(step_loss)
                counters["last_loss"] = loss_value
                now = time.perf_counter()
                elapsed = max(now - t_log, 1e-9)
                record = {
                    "step": done,
                    "epoch": round(samples_done / total_examples, 4),
                    "loss": round(loss_value, 6) if math.isfinite(loss_value) else None,
                    "lr": lr,
                    "grad_norm": round(float(grad_norm), 6) if math.isfinite(float(grad_norm)) else None,
                    "tokens_per_s": round(tokens_since_log / elapsed, 1),
                    "samples_per_s": round(samples_since_log / elapsed, 3),
                    "peak_memory_bytes": peak_memory_bytes(device),
                    "elapsed_s": round(now - t_start, 3),
                    "skipped_steps": counters["skipped_steps"],
                }
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                if math.isfinite(loss_value):
                    loss_ema = loss_value if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_value
                bar.update(done, loss_ema if loss_ema is not None else loss_value, record["tokens_per_s"])
                t_log, tokens_since_log, samples_since_log = now, 0, 0
            if counters["bad_in_a_row"] >= cfg.max_bad_steps:
                bar.close()
                raise UserError(_bad_steps_message(run, done, counters["bad_in_a_row"]))
            signum = stop.signum  # read once: a signal landing in between waits for the next step
            if signum or (cfg.save_every and (done % cfg.save_every == 0 or done == len(run.steps))):
                save_checkpoint(run, done, counters)
            if signum or done == stop_after:
                bar.close()
                raise TrainingStopped(done, signum or None, run.folder)

    seconds = time.perf_counter() - t_start
    bar.close()
    adapter = run.folder / "adapter"
    save_adapter(model, run.spec, adapter, str(run.model_path))
    return TrainResult(run.folder, adapter, len(run.steps), counters["last_loss"], tokens_done / max(seconds, 1e-9),
                       seconds, peak_memory_bytes(device))


def _bad_steps_message(run: Run, step: int, bad: int) -> str:
    from hivetune.checkpoint import checkpoint_folders

    saved = checkpoint_folders(run.folder / "checkpoints")
    last = f"the last checkpoint, {saved[-1]}, is intact" if saved else "no checkpoint was written"
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
    from hivetune.generate import generate_text
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


def train(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """`hivetune train`: setup, fit, save; then answer held-out questions with base and tuned."""
    run = setup(cfg)
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    result = fit(run, progress)
    result.samples = answer_heldout(run, cfg.eval_prompts, cfg.max_new_tokens)
    summary = {
        "adapter": str(result.adapter), "steps": result.steps, "final_loss": result.final_loss,
        "tokens_per_s": round(result.tokens_per_s, 1), "train_seconds": round(result.seconds, 2),
        "peak_memory_bytes": result.peak_memory_bytes, "device": str(run.device),
        "precision": run.precision, "examples": len(run.data), "data_format": run.data.format,
        "samples": result.samples,
    }
    atomic_write_bytes(run.folder / "summary.json", json.dumps(summary, indent=2).encode())
    return result
