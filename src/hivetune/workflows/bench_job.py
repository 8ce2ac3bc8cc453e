"""`hivetune bench --model DIR --data FILE`: the user's own training job, timed as `train` runs
it, optionally beside HF Trainer + PEFT on the same model folder and data, written as JSON.

Each run trains in a temporary folder with no checkpoint inside the loop and no end-of-run A/B;
its clock is the training loop's (train.loop.fit: model loaded and data read before it starts,
the final adapter's write after it stops, both reported apart). With --repeat N the job runs
N times and every figure gets its spread: min, median and max.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import hivetune
from hivetune.core.config import TrainConfig
from hivetune.core.device import resolve_device
from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_bytes, release_run_locks
from hivetune.core.hub import model_path, split_hub_id
from hivetune.doctor.probe import gather_environment
from hivetune.train.loop import fit
from hivetune.train.setup import setup
from hivetune.workflows.bench import BASELINES, peak_tflops, plan_against, train_flops
from hivetune.workflows.trl_baseline import run_trl_pairs, trl_missing
from hivetune.workflows.hf_baseline import HFJob, baseline_missing, epoch_means, pretrained_hf_model, run_hf_job

# Figures of one run whose spread --repeat reports (all numbers; None where not measured).
SPREAD_KEYS = ("runtime_s", "samples_per_s", "steps_per_s", "tokens_per_s", "mfu", "final_loss",
               "peak_memory_allocated_gib", "peak_memory_reserved_gib", "setup_s")


def check_job(cfg: TrainConfig, repeat: int, baseline: str) -> None:
    """One-line errors for input the job cannot run (the CLI exits 2 on them)."""
    if not cfg.model or not cfg.data:
        raise UserError("bench: a job needs --model DIR and --data FILE (or both in --config)")
    if not model_path(cfg.model).exists():
        raise UserError(f"--model: {cfg.model} not found")
    if not Path(cfg.data).exists() and split_hub_id(cfg.data) is None:
        raise UserError(f"--data: {cfg.data} not found")
    if repeat < 1:
        raise UserError(f"--repeat: must be >= 1, got {repeat}")
    if baseline and baseline not in BASELINES:
        raise UserError(f"--baseline: unknown baseline {baseline!r} ({', '.join(BASELINES)})")
    if baseline == "hf-peft" and cfg.method != "sft":
        raise UserError(f"--baseline hf-peft trains SFT; this job's method is {cfg.method}"
                        + (" (its baseline: --baseline trl-dpo)" if cfg.method == "dpo" else ""))
    if baseline == "trl-dpo" and cfg.method != "dpo":
        raise UserError(f"--baseline trl-dpo trains DPO; this job's method is {cfg.method}"
                        + (" (its baseline: --baseline hf-peft)" if cfg.method == "sft" else ""))
    if baseline == "trl-dpo" and trl_missing():
        raise UserError(trl_missing())
    if baseline == "hf-peft" and baseline_missing(cfg.base_quant):
        raise UserError(baseline_missing(cfg.base_quant))
    if baseline and cfg.base_quant == "keep":
        raise UserError(f"--baseline {baseline}: HF + PEFT has no base_quant keep (a GGUF's own blocks); "
                        f"use base_quant nf4 or int8 to compare quantized bases")
    if baseline and not model_path(cfg.model).is_dir():
        raise UserError(f"--baseline {baseline} loads an HF model folder; {cfg.model} is a file")


def bench_job(cfg: TrainConfig, repeat: int = 1, baseline: str = "", out: str | Path = "bench.json",
              overrides: dict | None = None) -> dict:
    """Time the job `repeat` times (and the baseline as often), write the record to `out`."""
    check_job(cfg, repeat, baseline)
    device = resolve_device(cfg.device)
    record = {"model": str(cfg.model), "data": str(cfg.data), "repeat": repeat,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "overrides": overrides or {}, "environment": job_environment(device)}
    runs, jobs = [], []
    for _ in range(repeat):
        figures, job = run_hivetune_job(cfg)
        runs.append(figures)
        jobs.append(job)
    record["hivetune"] = {"runs": runs, "spread": spread(runs)}
    if baseline:
        base = [run_baseline(cfg, jobs[0], device, baseline) for _ in range(repeat)]
        record["baseline"] = {"name": baseline, "runs": base, "spread": spread(base)}
        ours, theirs = record["hivetune"]["spread"]["runtime_s"], record["baseline"]["spread"].get("runtime_s")
        if theirs and theirs["median"] and ours["median"]:
            record["speedup_vs_baseline"] = round(theirs["median"] / ours["median"], 2)
    atomic_write_bytes(Path(out), json.dumps(record, indent=2).encode())
    record["path"] = str(out)
    return record


def run_hivetune_job(cfg: TrainConfig) -> tuple[dict, HFJob]:
    """One timed run of the job; (its figures, the same work for the baseline)."""
    with tempfile.TemporaryDirectory() as tmp:
        job_cfg = dataclasses.replace(cfg, output_dir=str(Path(tmp) / "run"), eval_prompts=0, eval_examples=0,
                                      save_every=0, save_every_minutes=0.0)
        t0 = time.perf_counter()
        try:
            run = setup(job_cfg)
            setup_s = time.perf_counter() - t0
            result = fit(run, progress=False)
            figures = job_figures(run, result, setup_s)
        finally:
            release_run_locks()
    ids = sorted({i for step in run.steps for i in step})
    job = HFJob([run.data.example(i) for i in ids], len(run.steps[0]), cfg.epochs,
                {"r": cfg.lora.r, "alpha": cfg.lora.alpha, "dropout": cfg.lora.dropout,
                 "targets": list(cfg.lora.targets)}, run.precision, lr=cfg.lr, schedule=cfg.schedule,
                warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                gradient_checkpointing=cfg.gradient_checkpointing, batches=halvings(cfg.batch_size, len(run.steps[0])),
                log_losses=True, max_steps=cfg.max_steps, base_quant=cfg.base_quant)
    return figures, job


def job_figures(run, result, setup_s: float) -> dict:
    """The figures of a finished run, from its step plan, its result and metrics.jsonl."""
    steps, seconds = result.steps, max(result.seconds, 1e-9)
    done = run.steps[:steps]
    lengths = [run.data.lengths[i] for step in done for i in step]
    samples, tokens = sum(len(step) for step in done), sum(lengths)
    dense, attention = train_flops(run.model.args, lengths)
    peak = peak_tflops(run.device, run.precision)
    cuda = run.device.type == "cuda"
    return {
        "steps": steps, "samples": samples, "tokens": tokens, "runtime_s": seconds,
        "samples_per_s": samples / seconds, "steps_per_s": steps / seconds, "tokens_per_s": tokens / seconds,
        "mfu": dense / seconds / (peak * 1e12) if peak else None,
        "attention_flops_share": round(attention / (dense + attention), 4) if dense else None,
        "final_loss": result.final_loss, "epoch_losses": epoch_losses(run),
        "peak_memory_allocated_gib": torch.cuda.max_memory_allocated(run.device) / 2**30 if cuda else None,
        "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(run.device) / 2**30 if cuda else None,
        "precision": run.precision, "micro_batch": f"{run.cfg.batch_size} x {run.cfg.grad_accum}",
        "setup_s": round(setup_s, 3), "adapter_save_s": round(result.save_seconds, 3),
        "plan": plan_against(run.cfg, run.device, steps, seconds, model_args=run.model.args, index=run.data),
    }


def epoch_losses(run) -> list[float]:
    """Mean logged step loss of each epoch (metrics.jsonl; log_every 1 logs every step). A step
    counts in the epoch its last example comes from."""
    per_step, n = len(run.steps[0]), max(1, run.train_examples)
    pairs = []
    for line in (run.folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and "step" in row and "event" not in row:
            pairs.append(((row["step"] * per_step - 1) // n, row["loss"]))
    return epoch_means(pairs)


def run_baseline(cfg: TrainConfig, job: HFJob, device: torch.device, baseline: str = "hf-peft") -> dict:
    """HF Trainer + PEFT (or TRL's DPOTrainer + PEFT) on the job, with the figures named as hivetune's are."""
    build = lambda: pretrained_hf_model(str(model_path(cfg.model)), device, job.precision)  # noqa: E731
    trl = baseline == "trl-dpo"
    record = (run_trl_pairs(build, job.examples, job.lora, job.epochs, job.examples_per_step, device, lr=cfg.lr,
                            beta=cfg.preference.beta, max_steps=job.max_steps) if trl
              else run_hf_job(build, job, device))
    if "seconds" not in record:
        return record
    seconds, steps = max(record["seconds"], 1e-9), record["steps_run"]
    samples = min(steps * job.examples_per_step, int(job.epochs * len(job.examples)))
    if trl:  # TRL's own count (each answer with its prompt), as its record's tokens/s
        tokens = round(record["tokens_per_s"] * seconds)
    elif job.max_steps:  # a cut run: the mean example's tokens for each sample
        tokens = round(samples * sum(len(e.ids) for e in job.examples) / len(job.examples))
    else:  # every epoch's examples (the Trainer keeps a last short batch)
        tokens = round(job.epochs * sum(len(e.ids) for e in job.examples))
    return {**record, "runtime_s": record["seconds"], "steps": steps, "samples": samples, "tokens": tokens,
            "samples_per_s": samples / seconds, "steps_per_s": steps / seconds,
            "tokens_per_s": record["tokens_per_s"] if trl else tokens / seconds}


def halvings(batch: int, per_step: int) -> list[int]:
    """Micro-batches for the baseline: the job's, then halved while it divides the step's examples."""
    out = [batch]
    while out[-1] > 1 and out[-1] % 2 == 0 and per_step % (out[-1] // 2) == 0:
        out.append(out[-1] // 2)
    return out


def spread(runs: list[dict]) -> dict:
    """min, median and max of each SPREAD_KEYS figure measured in every run."""
    out = {}
    for key in SPREAD_KEYS:
        values = [r.get(key) for r in runs]
        if values and all(isinstance(v, (int, float)) for v in values):
            out[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return out


def job_environment(device: torch.device) -> dict:
    """GPU, driver and runtime (CUDA or ROCm / HIP), torch and hivetune versions."""
    env = gather_environment(selftest=False, triton=False)
    gpu = env.gpus[device.index or 0] if device.type == "cuda" and env.gpus else None
    runtime = (f"ROCm/HIP {env.hip_version}" if env.hip_version else f"CUDA {env.cuda_version}"
               if env.cuda_version else None)
    return {"gpu": gpu.name if gpu else None, "gpu_arch": gpu.arch if gpu else None,
            "driver": env.nvidia_driver or env.amdgpu_driver, "driver_cuda": env.driver_cuda_version,
            "system_rocm": env.system_rocm_version, "runtime": runtime, "torch": torch.__version__,
            "hivetune": hivetune.__version__, "python": platform.python_version(),
            "transformers": env.packages.get("transformers"), "peft": env.packages.get("peft"),
            "cpu": env.cpu.model, "threads": torch.get_num_threads()}


def summary_lines(record: dict) -> list[str]:
    """A few lines for the terminal: the medians, the spread where repeated, the baseline."""
    def line(name: str, part: dict) -> str:
        s = part["spread"]
        if "runtime_s" not in s:
            return f"{name}: {part['runs'][0].get('error', 'no figures')}"
        med = {k: v["median"] for k, v in s.items()}
        text = (f"{name}: {med['runtime_s']:.2f} s, {med['samples_per_s']:.2f} samples/s, "
                f"{med['steps_per_s']:.3f} steps/s, {med['tokens_per_s']:,.0f} tokens/s")
        if med.get("mfu"):
            text += f", MFU {med['mfu']:.1%}"
        if med.get("final_loss") is not None:
            text += f", final loss {med['final_loss']:.4f}"
        if med.get("peak_memory_allocated_gib"):
            text += f", peak {med['peak_memory_allocated_gib']:.2f} GiB"
        if record["repeat"] > 1:
            r = s["runtime_s"]
            text += f" (median of {record['repeat']}; runtime {r['min']:.2f}-{r['max']:.2f} s)"
        return text

    out = [line("hivetune", record["hivetune"])]
    if "baseline" in record:
        out.append(line(record["baseline"]["name"], record["baseline"]))
    if "speedup_vs_baseline" in record:
        out.append(f"hivetune {record['speedup_vs_baseline']}x faster")
    out.append(f"-> {record['path']}")
    return out


def print_summary(record: dict) -> None:
    print("\n".join(summary_lines(record)))
