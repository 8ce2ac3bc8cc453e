"""`hivetune bench`: time a workload (W1, W2, W4: hivetune.workflows.workloads) with hivetune's training
loop, optionally HF Trainer + PEFT on the same work in the same process, and append the figures
as one line to benchmarks/results/<workload>-<device>.jsonl (hivetune.workflows.bench_results).

The clock covers the training loop only: the model is built and the data made before it starts,
and the final adapter write comes after it stops (recorded as adapter_save_s).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import platform
import subprocess
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

from hivetune.core.config import load_config
from hivetune.core.device import DTYPES, cap_memory
from hivetune.core.errors import UserError
from hivetune.core.versions import installed_version
from hivetune.plan import plan
from hivetune.plan.gpus import gpu_for_device_name
from hivetune.plan.timing import flops_per_token
from hivetune.ops import compile_ahead, prewarm
from hivetune.train import pair_graph
from hivetune.train import replay as graphs
from hivetune.train import loop as train_loop
from hivetune.train.loop import fit
from hivetune.train.setup import assemble
from hivetune.train.twin import compile_early
from hivetune.workflows.bench_results import append_result, device_kind, setting_text, write_table
from hivetune.workflows.report import head_commit
from hivetune.workflows.hf_baseline import baseline_missing, random_hf_model, run_hf_job, workload_job
from hivetune.workflows.trl_baseline import run_trl_dpo, trl_missing
from hivetune.workflows.workloads import WORKLOADS, Workload, random_model


def peak_tflops(device, precision: str = "bf16") -> float | None:
    """The GPU's dense TFLOP/s at this precision from hivetune.plan.gpus (for MFU); None off CUDA
    or on a GPU the table does not know."""
    if device.type != "cuda":
        return None
    gpu = gpu_for_device_name(torch.cuda.get_device_name(device))
    return gpu.tflops(precision) if gpu else None


def train_flops(args, lengths) -> tuple[float, float]:
    """(matmul FLOPs by the 4N rule, attention FLOPs) of LoRA training on examples of these
    lengths: attention adds 6 x layers x heads x head_dim x L^2 an example of L tokens (causal
    forward 2 q L per token and layer, three times that with backward: plan.timing)."""
    dense = 4 * args.linear_weight_count
    return dense * sum(lengths), sum(n * (flops_per_token(args, n, False) - dense) for n in lengths)


def git_commit(commit: str = "") -> str:
    """`commit` where given (the benchmark scripts pass it: a device's copy of the tree may hold no
    .git, or a stale one), else HEAD's short hash, else "unknown"."""
    return commit or head_commit() or "unknown"


def triton_cache_has_kernels() -> bool:
    """Whether Triton's on-disk kernel cache (compile_ahead.triton_cache_dir) holds a file (stops at
    the first: this runs when the module is imported)."""
    try:
        return any(p.is_file() for p in compile_ahead.triton_cache_dir().rglob("*"))
    except OSError:
        return False


# Whether this process started with Triton's kernels compiled on disk: a cold cache adds the
# kernels' JIT compile (~3.5 s on W1, H100) to the first steps; a user's later runs find it warm.
TRITON_CACHE_WARM_AT_START = triton_cache_has_kernels()


def environment(device, commit: str = "") -> dict:
    """Versions, commit and device of a measurement."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "commit": git_commit(commit),
           "triton": importlib.util.find_spec("triton") is not None,
           "reference_paths": os.environ.get("HIVETUNE_REFERENCE", "")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["triton_cache"] = "warm" if TRITON_CACHE_WARM_AT_START else "cold"
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True).split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            env["driver"] = "unknown"
    else:
        env["gpu"] = None
    for name in ("transformers", "peft"):
        env[name] = installed_version(name)
    return env


def process_seconds() -> float | None:
    """Seconds since this process started, the interpreter's own start included (Linux: from
    /proc, to the clock tick); None where /proc does not say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: ticks after boot
        return round(float(Path("/proc/uptime").read_text().split()[0]) - started, 2)
    except (OSError, ValueError, IndexError):
        return None


def launch_us(device, calls: int = 2000) -> float:
    """Host microseconds one small kernel launch takes (an in-place add on a 256-element tensor,
    the mean of `calls`, after a warm-up): the CPU that eager steps wait on."""
    x = torch.zeros(256, device=device)
    for _ in range(100):
        x.add_(1.0)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(calls):
        x.add_(1.0)
    seconds = time.perf_counter() - t
    torch.cuda.synchronize(device)
    return round(seconds / calls * 1e6, 2)


def host_probe(device) -> dict:
    """What this machine gives, measured after the run (hosts of one GPU model spread: W1 ±5%,
    W2 up to 35%): a bf16 8192^3 matmul's TFLOP/s (the GPU's clocks and power), the host
    microseconds of a small kernel launch (the CPU that eager steps wait on), the SM clock."""
    if device.type != "cuda":
        return {}
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    tflops = 20 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1e3) / 1e12
    del a, b
    probe = {"matmul_tflops": round(tflops, 1), "launch_us": launch_us(device)}
    try:
        probe["sm_clock_mhz"] = int(subprocess.check_output(
            ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
             f"--id={device.index or 0}"], text=True).split()[0])
    except Exception:
        pass
    return probe


def run_hivetune(w: Workload, device: torch.device, overrides: dict | None = None, max_steps: int = 0,
                 memory_cap_gib: float = 0.0, model=None) -> dict:
    """Train the workload with hivetune's loop; return the measured figures. memory_cap_gib: the
    caching allocator may hold at most this much from assembly on (as on a card of that size;
    set after the model is built: W2's random init runs in fp32). model: a prebuilt CausalLM of
    the workload's shape on `device` instead of random_model's (benchmarks/keep_w1.py)."""
    # overlaps building the data and the model, as in train's setup
    prewarm.prewarm(device, int((overrides or {}).get("compile_workers", -1)))
    examples = w.data()  # token ids, or PW1's preference pairs
    values = {"model": "random", "data": "generator", "precision": "bf16" if device.type == "cuda" else "fp32",
              "method": w.method,
              "device": device.type, "epochs": w.epochs, "max_steps": max_steps,
              "batch_size": w.micro_batch or w.examples_per_step,
              "grad_accum": w.examples_per_step // (w.micro_batch or w.examples_per_step),
              "lr": 2e-4, "lora": w.lora, "eval_prompts": 0, "max_length": 4096, "log_every": 50,
              "save_every_minutes": 0}  # the figure times training alone: no checkpoint inside the clock
    values.update(overrides or {})
    cfg = load_config(None, values)
    quant = cfg.base_quant if cfg.base_quant in ("nf4", "int8") else "none"  # quantized before any memory cap
    capped = device.type == "cuda" and memory_cap_gib > 0
    if model is None:  # as train's setup: the first step's kernels compile while the model is built
        compile_early(cfg, w.args, examples, device, cfg.precision,
                      memory_bytes=int(memory_cap_gib * 2**30) if capped else None)
        model = random_model(w.args, device, DTYPES[cfg.precision], quant)
    if capped:  # before assemble: lora_inputs auto reads it (train.device_memory_bytes)
        cap_memory(device, memory_cap_gib)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = assemble(cfg, model, examples, None, device, cfg.precision, Path(tmp) / "run", Path("random"))
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            graphs.last_stats = pair_graph.last_stats = {}
            before = allocator_counts(device)
            t0 = time.perf_counter()
            with first_step_clock(device) as first, compile_ahead.counting_compiles() as compiles:
                result = fit(run, progress=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            # The clock stops at the loop's end: the final adapter's write (W2: 80.7M fp32 LoRA
            # weights, ~0.5 s with its fsync) is reported apart, as the HF baseline writes none.
            seconds = time.perf_counter() - t0 - result.save_seconds
            allocator = {k: v - before.get(k, 0) for k, v in allocator_counts(device).items()}
            losses = [json.loads(line)["loss"] for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
            graph_stats = graphs.last_stats or pair_graph.last_stats  # the SFT or the preference step's graphs
    finally:
        if capped:  # the next workload of `bench all` runs uncapped unless capped itself
            cap_memory(device, 0)
    tokens = sum(examples.lengths[i] for step in run.steps for i in step)
    dense, attention = train_flops(w.args, [examples.lengths[i] for step in run.steps for i in step])
    tps = tokens / seconds
    peak = peak_tflops(device)
    return {
        "steps": len(run.steps), "seconds": round(seconds, 3), "tokens": tokens,
        "micro_batch": f"{cfg.batch_size} examples x {cfg.grad_accum}",
        "tokens_per_s": round(tps, 1), "samples_per_s": round(len(run.steps) * w.examples_per_step / seconds, 2),
        "steps_per_s": round(len(run.steps) / seconds, 3),
        "mfu": round(dense / seconds / (peak * 1e12), 4) if peak else None,
        # attention's FLOPs beside the 4N rule's (W4's long examples): their share, and MFU with them
        "attention_flops_share": round(attention / (dense + attention), 4),
        "mfu_with_attention": round((dense + attention) / seconds / (peak * 1e12), 4) if peak else None,
        "peak_memory_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
        "peak_memory_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3) if device.type == "cuda" else None,
        "final_loss": result.final_loss, "losses_logged": losses,
        "cuda_graphs": dict(graph_stats) if cfg.cuda_graphs and graph_stats else None,
        "memory_cap_gib": memory_cap_gib or None,
        # the first optimizer step's wall seconds (to the GPU's end of it): several seconds where
        # Triton compiled this workload's kernels (a cache warm with other shapes' kernels only)
        "first_step_s": first.get("seconds"),
        "adapter_save_s": round(result.save_seconds, 3),  # after the loop, outside `seconds`
        # forwards, layers offloaded in all (ActivationOffload.layers_for), copies, bytes, late unpacks
        "activation_offload": dict(run.model.activation_offload.stats) if run.model.activation_offload else None,
        "allocator": allocator or None,
        "lora_inputs": f"{cfg.lora_inputs}: " + ("kept" if getattr(getattr(run.model, "lora_casts", None), "keep_inputs", False)
                                                 else "recomputed"),
        # when the prewarm thread finished, in seconds from the loop's start (negative: before it;
        # positive: the loop waited for it), and how its run of the step's tail kernels went
        "prewarm_done_s": round(prewarm.PREWARM_DONE_AT - t0, 3) if prewarm.PREWARM_DONE_AT else None,
        "prewarm_tail": prewarm.PREWARM_TAIL,
        # Triton's compiles in this process during the loop (none on a warm cache; after compile_ahead's
        # first pass, the kernels of shapes met later), those that found the cache, and their stages' seconds
        "triton_compiles": compiles,
        "compile_ahead": compile_ahead.STATS,  # the first pass's kernels compiled by the workers, and how long it waited
        "plan": plan_against(cfg, device, len(run.steps), seconds, memory_cap_gib, model_args=w.args, index=examples),
    }


def plan_against(cfg, device: torch.device, steps: int, seconds: float, memory_cap_gib: float = 0.0,
                 **given) -> dict | None:
    """`hivetune plan`'s prediction for a finished run (its config, the GPU by name, the memory
    cap; `given`: plan's model_args / index where the run's model and data are not files) against
    what it measured: peak memory allocated (the plan's peak less the CUDA context and the
    allocator's slack), reserved (less the context) and the loop's seconds (its step time x
    steps), each with its error in percent. None off CUDA."""
    if device.type != "cuda":
        return None
    gpu = gpu_for_device_name(torch.cuda.get_device_name(device))
    try:
        p = plan(cfg, gpu=gpu.name if gpu else None, memory_gib=memory_cap_gib or None, **given)
    except Exception as e:  # noqa: BLE001 - the figure is recorded, not the run's concern
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    parts = p.parts_gib
    predicted = {"allocated_gib": p.peak_gib - parts.get("CUDA context", 0) - parts.get("allocator slack", 0),
                 "reserved_gib": p.peak_gib - parts.get("CUDA context", 0),
                 "seconds": p.step_seconds * steps if p.step_seconds else None}
    measured = {"allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30, "seconds": seconds}
    out = {"micro_batch_tokens": p.micro_batch_tokens, "cuda_graphs": p.cuda_graphs}
    for key, value in predicted.items():
        out[f"planned_{key}"] = round(value, 3) if value is not None else None
        out[f"{key}_error_pct"] = round(100 * (value / measured[key] - 1), 1) if value is not None else None
    return out


@contextmanager
def first_step_clock(device: torch.device):
    """Yields a dict that gets "seconds": the wall time of fit's first optimizer step from the
    block's start, the GPU's work included (one synchronisation, after that step only)."""
    out, real, start = {}, train_loop.accumulate_step, time.perf_counter()

    def timed(*args, **kwargs):
        result = real(*args, **kwargs)
        if "seconds" not in out:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out["seconds"] = round(time.perf_counter() - start, 3)
        return result

    train_loop.accumulate_step = timed
    try:
        yield out
    finally:
        train_loop.accumulate_step = real


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's slow-path counters (torch.cuda.memory_stats): retries after
    freeing its cache (each synchronises the device), out-of-memory errors, cudaMalloc / cudaFree
    calls. A run under a memory cap that pays these shows it here; {} off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def run_hf_peft(w: Workload, device: torch.device, timed_steps: int = 0, warmup_steps: int = 2,
                overrides: dict | None = None) -> dict:
    """HF Trainer + PEFT on the same model shape and examples (hf_baseline.workload_job: bf16 on
    GPUs, SDPA, AdamW lr 2e-4, cosine; the largest of w.hf_batches that fits, else the seeds'
    batch 2). timed_steps > 0: warmup_steps + timed_steps optimizer steps, the last timed_steps
    timed and extrapolated to the workload's step count (labelled in the result)."""
    return run_hf_job(lambda: random_hf_model(w.args, device), workload_job(w, device, overrides), device,
                      timed_steps, warmup_steps)


BASELINES = ("hf-peft", "trl-dpo")  # trl-dpo: TRL's DPOTrainer + PEFT on a preference workload (PW1)


def bench(workload: str = "W1", max_steps: int = 0, out_dir: str = "benchmarks/results",
          overrides: dict | None = None, baseline: str = "", baseline_steps: int = 0,
          table: str | None = "BENCHMARKS.md", memory_cap_gib: float = 0.0, commit: str = "") -> dict:
    """`hivetune bench`: time a workload (and, with `baseline`, HF Trainer + PEFT on it in the same
    process), append its line to out_dir/<workload>-<device>.jsonl, and rewrite the generated
    table of `table` where out_dir is the folder that table is made from (benchmarks/results
    beside it): results written elsewhere (--out /tmp/x) leave the table as it is."""
    names = ["W1", "W2", "W4"] if workload == "all" else [workload]  # all: the dense workloads
    for name in names:
        if name not in WORKLOADS:
            raise UserError(f"bench: unknown workload {name!r} ({', '.join(WORKLOADS)}, all)")
    if baseline and baseline not in BASELINES:
        raise UserError(f"--baseline: unknown baseline {baseline!r} ({', '.join(BASELINES)})")
    method = (overrides or {}).get("method")
    for name in names:
        if method is not None and method != WORKLOADS[name].method:
            raise UserError(f"--set method={method}: workload {name} is {WORKLOADS[name].method} (its data is "
                            f"made for it; PW1 is the preference workload); time your own job with --model and --data")
    quant = (overrides or {}).get("base_quant", "none")
    missing = trl_missing() if baseline == "trl-dpo" else baseline_missing(quant) if baseline else ""
    if missing:
        raise UserError(missing)
    if baseline_steps < 0:
        raise UserError(f"--baseline-steps: must be >= 0, got {baseline_steps}")
    if memory_cap_gib < 0:
        raise UserError(f"--memory-cap: must be >= 0 GiB, got {memory_cap_gib}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name in names:
        results[name] = measure(WORKLOADS[name], device, max_steps, overrides, baseline, baseline_steps,
                                memory_cap_gib, commit)
        # the whole command so far: imports, the workloads before this one, the host probe
        results[name]["environment"]["process_s"] = process_seconds()
        results[name]["path"] = str(append_result(Path(out_dir), results[name]))
    made_from = Path(table).parent / "benchmarks" / "results" if table else None
    if made_from is not None and Path(table).is_file() and Path(out_dir).resolve() == made_from.resolve():
        write_table(Path(table), Path(out_dir))
    return results


def measure(w: Workload, device: torch.device, max_steps: int, overrides: dict | None, baseline: str,
            baseline_steps: int, memory_cap_gib: float, commit: str) -> dict:
    """One workload's record (a line of its results file): hivetune's figures, the host probe and,
    with `baseline`, the peer's figures and the ratio."""
    env = environment(device, commit)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ours = run_hivetune(w, device, overrides, max_steps, memory_cap_gib)
    # kernels compiled by the first pass: a first run of this workload on this machine, its own row of the table
    compiled = (ours.get("compile_ahead") or {}).get("kernels", 0)
    record = {"workload": w.name, "device": device_kind(env["gpu"]), "date": date, "commit": env["commit"],
              "setting": setting_text(overrides, memory_cap_gib, env["reference_paths"], max_steps, compiled),
              "environment": env, "max_steps": max_steps, "overrides": overrides or {}, "hivetune": ours}
    _release_memory(device)
    env["host_probe"] = host_probe(device)
    if baseline:
        _release_memory(device)
        peer = (run_trl_dpo(w, device, baseline_steps) if baseline == "trl-dpo"
                else run_hf_peft(w, device, baseline_steps, overrides=overrides))
        record["baseline"] = {"name": baseline, **peer}
        if not max_steps and "seconds" in record["baseline"]:  # the same work on both sides: the full workload
            record["speedup_vs_baseline"] = round(record["baseline"]["seconds"] / record["hivetune"]["seconds"], 2)
    _release_memory(device)
    return record


def _release_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
