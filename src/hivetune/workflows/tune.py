"""`hivetune tune`: time a few steps of each candidate config on this device, keep the fastest that fits.

Candidates: micro-batch sizes (divisors of the effective batch batch_size * grad_accum, so the
optimisation is unchanged), gradient checkpointing off / on, and on CUDA the attention back-end
(flash varlen, or the SDPA reference path: the config key attention=sdpa). On CUDA, a micro-batch
that does not fit as it is is also timed with what keeps it whole (memory_savers): the fewest
first layers checkpointed with CUDA graphs on, and the fewest layers of activation offload,
eager. Which of those is faster depends on the host as much as on the GPU, so tune measures it.
Each runs `steps` optimizer steps of hivetune's own loop (train.assemble + train.fit) on a
random-init model of the configured architecture (no weights read) over examples of `length`
tokens. Candidates the planner puts over the memory cap are skipped unmeasured; a CUDA
out-of-memory counts as not fitting. Writes the fastest fitting config as YAML overrides for
`hivetune train --config` (and `train --auto`, which reads ./tune.yaml).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from hivetune.core.config import TrainConfig
from hivetune.core.errors import UserError


@dataclass
class TuneRow:
    batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    attention: str  # varlen | sdpa (CUDA), reference (CPU)
    predicted_gib: float
    lora_inputs: str = "auto"  # what the candidate trained with: auto resolved as train would (_candidate_memory)
    status: str = "ok"  # ok | over cap (predicted) | over cap (measured) | out of memory
    step_seconds: float | None = None
    tokens_per_s: float | None = None
    peak_gib: float | None = None  # measured max_memory_reserved over what the process held before (CUDA)
    wall_seconds: float | None = None  # the candidate's whole cost: model build, warm-up (graph capture), steps
    saver: dict = field(default_factory=dict)  # the config keys memory_savers set (tune.yaml repeats them)


@dataclass
class TuneResult:
    rows: list[TuneRow]
    best: TuneRow | None
    cap_gib: float
    device: str
    out: str | None
    overrides: dict = field(default_factory=dict)


def _candidate_memory(cfg: TrainConfig, args, precision: str, checkpointing: bool, cuda: bool, tokens: int,
                      memory_bytes: int):
    """(the planner's MemoryConfig for a candidate, the lora_inputs it trains with). auto is
    resolved as train resolves it (plan.memory.resolve_keep_inputs) at the candidate's micro-batch
    (`tokens`) within `memory_bytes` (the process's device memory, no more than the cap), then
    pinned: the predicted and measured columns describe the same run, and tune.yaml repeats it
    (a later train without the cap would keep where tune recomputed). Before, the prediction
    always counted the inputs recomputed while the timed run kept them on a roomy GPU: up to
    ~5 GiB low for a 7B model."""
    from hivetune.plan.memory import seeded_dropout
    from hivetune.plan.planner import memory_config

    mc = memory_config(cfg, precision, checkpointing, cuda=cuda, args=args, tokens=tokens, memory_bytes=memory_bytes)
    inputs = cfg.lora_inputs
    if inputs == "auto" and seeded_dropout(mc):
        inputs = "keep" if mc.keep_inputs else "recompute"
    return mc, inputs


def memory_savers(cfg: TrainConfig, args, precision: str, tokens: int, budget: int,
                  cuda: bool) -> list[tuple[dict, float]]:
    """For a micro-batch of `tokens` that does not fit `budget` bytes as it is: the changes to the
    config that keep it whole, each with its predicted peak in bytes. The fewest first layers
    checkpointed with CUDA graphs on (plan.planner.checkpoint_to_fit; with the input embedding in
    host memory where that takes fewer layers), and the input embedding in host memory with
    the fewest layers of activation offload, eager (plan.auto.offload_fit). Empty off CUDA,
    where train moves nothing to the host and graphs do not run."""
    from hivetune.plan.auto import offload_fit
    from hivetune.plan.graph_sizes import launch_bound
    from hivetune.plan.planner import checkpoint_to_fit, graphed_peak, uses_graphs

    if not cuda:
        return []
    out = []
    untied = not args.tie_word_embeddings and not cfg.host_embeddings
    options = [{}] + ([{"host_embeddings": True}] if untied else [])
    layers = [checkpoint_to_fit(args, dataclasses.replace(cfg, **o), precision, tokens, 1.0, budget)
              for o in options]
    fits = [(n, i) for i, n in enumerate(layers) if 0 < n < args.num_hidden_layers]
    if fits:  # the fewest checkpointed layers; the embedding stays on the GPU where that needs no more
        n, i = min(fits)
        changes = {**options[i], "gradient_checkpointing": True, "checkpoint_layers": n}
        out.append((changes, graphed_peak(args, dataclasses.replace(cfg, **options[i]), precision, tokens, n)))
    graphed = uses_graphs(cfg, precision) and launch_bound(args.linear_weight_count, tokens)
    eager = dataclasses.replace(cfg, cuda_graphs=False) if graphed else cfg  # a captured graph skips the offload
    found = offload_fit(eager, args, precision, tokens, budget)
    if found is not None:
        new, peak, _ = found
        if graphed and new.activation_offload == cfg.activation_offload:  # the embedding alone: graphs may stay
            padded = graphed_peak(args, new, precision, tokens)
            if padded <= budget:
                new, peak = dataclasses.replace(new, cuda_graphs=True), padded
        changes = {k: getattr(new, k) for k in ("host_embeddings", "activation_offload", "cuda_graphs")
                   if getattr(new, k) != getattr(cfg, k)}
        out.append((changes, peak))
    return out


def _time_candidate(cfg: TrainConfig, args, device: torch.device, precision: str, length: int,
                    steps: int) -> tuple[float, float, float | None]:
    """(median seconds per optimizer step after the first, tokens per step, peak reserved GiB over
    what the process held before)."""
    import json

    from hivetune.workflows.workloads import random_model
    from hivetune.data.dataset import TokenizedExamples
    from hivetune.data.formats import Encoded
    from hivetune.core.device import DTYPES
    from hivetune.train.loop import fit
    from hivetune.train.setup import assemble

    per_step = cfg.batch_size * cfg.grad_accum
    gen = torch.Generator().manual_seed(0)
    examples = [Encoded(torch.randint(0, args.vocab_size, (length,), generator=gen).tolist(),
                        [False] * (length // 4) + [True] * (length - length // 4), False)
                for _ in range(per_step * (steps + 1))]
    held = 0
    if device.type == "cuda":  # what the process holds already is not the candidate's
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved(device)
    model = random_model(args, device, DTYPES[precision])
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as tmp:
        run = assemble(cfg, model, TokenizedExamples(examples), None, device, precision, Path(tmp) / "run",
                       Path("random"))
        # each step read as it ends, so its record's time follows the GPU: batched reads let the
        # host date 3 graphed W1 steps 3-5 ms apart where each takes ~26 ms (docs/log.md)
        run.read_every_step = True
        fit(run, progress=False)
        times = [json.loads(x)["elapsed_s"] for x in (run.folder / "metrics.jsonl").read_text().splitlines()]
    deltas = [b - a for a, b in zip(times, times[1:])] or times
    peak = (torch.cuda.max_memory_reserved(device) - held) / 2**30 if device.type == "cuda" else None
    del run, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(deltas), per_step * length, peak


def tune(cfg: TrainConfig, batch_sizes: list[int] | None = None, steps: int = 3, length: int | None = None,
         cap_gib: float | None = None, out: str | None = "tune.yaml", attention: list[str] | None = None,
         force: bool = False) -> TuneResult:
    """Measure the candidates and write the fastest that fits the cap to `out` (None: no file)."""
    from hivetune.core.config import load_config, to_dict
    from hivetune.core.device import resolve_device, resolve_precision, set_threads
    from hivetune.core.hub import model_path as hub_model_path
    from hivetune.core.fileio import atomic_write_bytes
    from hivetune.model.load import load_args
    from hivetune.plan.memory import GIB, breakdown
    from hivetune.plan.gpus import device_memory_bytes

    if steps < 2:
        raise UserError(f"--steps: at least 2 (the first step warms up), got {steps}")
    if out and Path(out).exists() and not force:
        raise UserError(f"{out}: already exists (--force to overwrite)")
    set_threads(cfg.threads)
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    args = load_args(hub_model_path(cfg.model))
    length = length or cfg.max_length
    if length > cfg.max_length or length < 2:
        raise UserError(f"--length: must be in [2, max_length={cfg.max_length}], got {length}")
    effective = cfg.batch_size * cfg.grad_accum
    sizes = batch_sizes or [d for d in range(1, effective + 1) if effective % d == 0]
    bad = [b for b in sizes if b <= 0 or effective % b]
    if bad:
        raise UserError(f"--batch-sizes: {bad[0]} does not divide the effective batch "
                        f"batch_size*grad_accum = {effective}")
    if cap_gib is None:
        if device.type == "cuda":
            cap_gib = 0.9 * torch.cuda.get_device_properties(device).total_memory / GIB
        else:
            cap_gib = 0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    # what train's lora_inputs auto will see: the device's memory for this process, within the cap
    memory_bytes = min(device_memory_bytes(device), int(cap_gib * GIB)) if device.type == "cuda" else 0
    backends = attention or (["varlen", "sdpa"] if device.type == "cuda" else ["reference"])

    rows = []
    for backend in backends:
        for ckpt in (False, True):
            for b in sorted(sizes):
                values = {**to_dict(cfg), "batch_size": b, "grad_accum": effective // b, "gradient_checkpointing": ckpt,
                          "max_steps": steps, "eval_prompts": 0, "save_every": 0, "save_every_minutes": 0, "log_every": 1,
                          "output_dir": "", "device": device.type, "precision": precision}
                c = load_config(None, values)
                mc, inputs = _candidate_memory(c, args, precision, ckpt, device.type == "cuda", b * length,
                                               memory_bytes)
                # train setup hands the attention key to ops.attention
                c = dataclasses.replace(c, lora_inputs=inputs, attention="sdpa" if backend == "sdpa" else "auto")
                if backend == "sdpa":
                    mc = dataclasses.replace(mc, attention="sdpa")
                planned = breakdown(args, mc, b * length)
                predicted = (planned.total if device.type == "cuda" else planned.reserved) / GIB
                row = TuneRow(b, effective // b, ckpt, backend, round(predicted, 2), inputs)
                rows.append(row)
                if predicted <= cap_gib:
                    _measure(row, c, args, device, precision, length, steps, cap_gib)
                    continue
                row.status = "over cap (predicted)"
                if ckpt:
                    continue
                for changes, peak in memory_savers(c, args, precision, b * length, int(cap_gib * GIB),
                                                   device.type == "cuda"):
                    saved = TuneRow(b, effective // b, changes.get("gradient_checkpointing", False), backend,
                                    round(peak / GIB, 2), inputs, saver=changes)
                    rows.append(saved)
                    _measure(saved, dataclasses.replace(c, **changes), args, device, precision, length, steps,
                             cap_gib)
    fitting = [r for r in rows if r.status == "ok"]
    best = min(fitting, key=lambda r: r.step_seconds) if fitting else None
    result = TuneResult(rows, best, round(cap_gib, 2), str(device), out)
    if best is not None:
        result.overrides = {"batch_size": best.batch_size, "grad_accum": best.grad_accum,
                            "gradient_checkpointing": best.gradient_checkpointing, **best.saver}
        if best.lora_inputs != cfg.lora_inputs:  # auto, resolved for this candidate
            result.overrides["lora_inputs"] = best.lora_inputs
        if out:
            text = (f"# hivetune tune: fastest of {len(rows)} candidates on {device} within {cap_gib:.1f} GiB "
                    f"({best.tokens_per_s:,.0f} tokens/s at {length} tokens an example)\n")
            if best.attention == "sdpa":
                result.overrides["attention"] = "sdpa"  # the SDPA path was fastest
            text += yaml.safe_dump(result.overrides, sort_keys=False)
            atomic_write_bytes(Path(out), text.encode())
    return result


def _measure(row: TuneRow, c: TrainConfig, args, device, precision: str, length: int, steps: int,
             cap_gib: float) -> None:
    """Time candidate `c` into `row`: its step time, tokens/s and peak, or why it does not fit."""
    t0 = time.perf_counter()
    try:
        seconds, tokens, peak = _time_candidate(c, args, device, precision, length, steps)
    except torch.cuda.OutOfMemoryError:
        row.status = "out of memory"
        torch.cuda.empty_cache()
        return
    finally:
        row.wall_seconds = round(time.perf_counter() - t0, 2)
    row.step_seconds, row.tokens_per_s = round(seconds, 4), round(tokens / seconds, 1)
    row.peak_gib = round(peak, 2) if peak is not None else None
    if peak is not None and peak > cap_gib:
        row.status = "over cap (measured)"


def format_tune(result: TuneResult) -> str:
    # the lora_inputs column where auto was resolved (a GPU in bf16 / fp16 with LoRA dropout)
    inputs = any(r.lora_inputs != "auto" for r in result.rows)
    lines = [f"{'batch':>5} {'accum':>5} {'ckpt':>4} {'attention':>9}{' inputs   ' if inputs else ''} {'pred GiB':>8} "
             f"{'peak GiB':>8} {'s/step':>8} {'tokens/s':>10}  status"]
    for r in result.rows:
        mark = (f" ({', '.join(f'{k}={v}' for k, v in r.saver.items())})" if r.saver else "") + (
            " <- fastest" if r is result.best else "")
        lines.append(f"{r.batch_size:>5} {r.grad_accum:>5} {'on' if r.gradient_checkpointing else 'off':>4} "
                     f"{r.attention:>9}{f' {r.lora_inputs:<9}' if inputs else ''} {r.predicted_gib:>8.2f} "
                     f"{r.peak_gib if r.peak_gib is not None else '-':>8} "
                     f"{r.step_seconds if r.step_seconds is not None else '-':>8} "
                     f"{f'{r.tokens_per_s:,.0f}' if r.tokens_per_s else '-':>10}  {r.status}{mark}")
    if result.best is None:
        lines.append(f"no candidate fits within {result.cap_gib} GiB on {result.device}")
    elif result.out:
        lines.append(f"wrote {result.out}: {result.overrides}  (hivetune train --config {result.out}, or --auto)")
    return "\n".join(lines)
