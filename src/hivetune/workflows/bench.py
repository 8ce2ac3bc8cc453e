"""Benchmark workloads W1 / W2 (../shared/WORKLOADS.md): random-init Qwen2.5 shapes, generator data.

Throughput does not depend on weight values, so the workloads need no model hub and time the
same work anywhere. The clock covers the training loop only (model built, data made before;
the final adapter write after, recorded as adapter_save_s).
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from hivetune.core.config import load_config
from hivetune.data.dataset import TokenizedExamples
from hivetune.data.formats import Encoded
from hivetune.core.device import DTYPES, cap_memory
from hivetune.core.errors import UserError
from hivetune.model.config import ModelArgs
from hivetune.model.decoder import CausalLM
from hivetune.train import replay as graphs
# Dense bf16 tensor-core peak, TFLOP/s, for MFU (vendor datasheets, no sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "RTX 4090": 165.0,
                    "RTX 5090": 209.0, "MI300X": 1307.0, "MI250": 362.0, "MI50": 26.5}


@dataclass
class Workload:
    name: str
    args: ModelArgs
    n_examples: int
    cap: int  # 0: no cap
    epochs: float
    examples_per_step: int
    lora: dict
    # examples per forward / backward (0: all of the step's), the rest by accumulation; the
    # optimizer still sees examples_per_step per step. W2 with 2 x 8 (--set batch_size=8 --set
    # grad_accum=2) peaks at 26.9 GiB instead of 35, but its eager steps are then bound by the
    # host's kernel dispatch: 6,463 against ~14,000 tokens/s on an H100 (faae9e6).
    micro_batch: int = 0


def qwen25_shape(vocab, hidden, intermediate, layers, heads, kv, tied) -> ModelArgs:
    return ModelArgs(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                     rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                     tie_word_embeddings=tied, attention_bias=True, model_type="qwen2")


WORKLOADS = {
    "W1": Workload("W1", qwen25_shape(151936, 896, 4864, 24, 14, 2, True), 1500, 0, 3.0, 8,
                   {"r": 8, "alpha": 16, "dropout": 0.05}),
    "W2": Workload("W2", qwen25_shape(152064, 3584, 18944, 28, 28, 4, False), 1500, 256, 1.0, 16,
                   {"r": 32, "alpha": 64, "dropout": 0.05}),
}


def workload_examples(n: int, vocab: int, cap: int = 0, seed: int = 0) -> list[Encoded]:
    """The generator of WORKLOADS.md, call for call: prompt p tokens (masked), response r."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(16, 96)
        r = int(min(400, max(8, rng.lognormvariate(4.8, 0.6))))
        ids = [rng.randrange(1000, vocab - 1000) for _ in range(p + r)]
        mask = [False] * p + [True] * r
        if cap:
            ids, mask = ids[:cap], mask[:cap]
        out.append(Encoded(ids, mask, truncated=False))
    return out


def random_model(args: ModelArgs, device, dtype) -> CausalLM:
    """HF's initialisation (normal, std 0.02; norms at 1) so losses start near ln(vocab)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(args)
    init_like_hf(model)
    return model.to(dtype)


@torch.no_grad()
def init_like_hf(model: CausalLM) -> None:
    """In place, in parameter order: norms 1, biases 0, the rest normal(0, 0.02); all frozen."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02)
        p.requires_grad_(False)


def peak_tflops(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def git_commit() -> str:
    """HEAD's short hash; HIVETUNE_COMMIT wins (the device gets the working tree, with no .git or
    a stale one: `git rev-parse` there named d70dcbd for a run of cd7630d in session 17)."""
    if os.environ.get("HIVETUNE_COMMIT"):
        return os.environ["HIVETUNE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def triton_cache_has_kernels() -> bool:
    """Whether Triton's on-disk kernel cache (TRITON_CACHE_DIR or ~/.triton/cache) holds a file
    (stops at the first: this runs when the module is imported)."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        return any(p.is_file() for p in folder.rglob("*"))
    except OSError:
        return False


# Whether this process started with Triton's kernels compiled on disk: a cold cache adds the
# kernels' JIT compile (~3.5 s on W1, H100) to the first steps; a user's later runs find it warm.
TRITON_CACHE_WARM_AT_START = triton_cache_has_kernels()


# switches under trial, recorded with each result where set (the graphs' ones: ops.graphs)
EXPERIMENTS = ("HIVETUNE_LORA_SIDE_STREAM", "HIVETUNE_CAPTURE_LEAD", "HIVETUNE_GRAPH_DEFER", "HIVETUNE_CAPTURE_TOKENS",
               "HIVETUNE_GRAPH_MAX_TFLOP", "HIVETUNE_GRAPH_GRAIN", "HIVETUNE_RANK_SPEEDS", "CUDA_MODULE_LOADING",
               "HIVETUNE_PRELOAD_LAYERS", "HIVETUNE_SIZE_COSTS")


def environment(device) -> dict:
    from hivetune.ops import triton_util
    env = {"python": platform.python_version(), "torch": torch.__version__, "commit": git_commit(),
           "fused_ops": triton_util.triton is not None and os.environ.get("HIVETUNE_FUSED_OPS", "1") != "0",
           "reference_paths": os.environ.get("HIVETUNE_REFERENCE", ""),
           "experiments": " ".join(f"{k}={os.environ[k]}" for k in EXPERIMENTS if os.environ.get(k))}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["triton_cache"] = "warm" if TRITON_CACHE_WARM_AT_START else "cold"
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True).split()[0]
        except Exception:
            env["driver"] = "unknown"
    else:
        env["gpu"] = None
    for name in ("transformers", "peft"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    return env


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
                 memory_cap_gib: float = 0.0) -> dict:
    """Train the workload with hivetune's loop; return the measured figures. memory_cap_gib: the
    caching allocator may hold at most this much from assembly on (as on a card of that size;
    set after the model is built: W2's random init runs in fp32)."""
    from hivetune.ops import prewarm
    from hivetune.train.loop import fit
    from hivetune.train.setup import assemble

    prewarm.prewarm(device)  # overlaps building the data and the model, as in train's setup
    examples = TokenizedExamples(workload_examples(w.n_examples, w.args.vocab_size, w.cap))
    values = {"model": "random", "data": "generator", "precision": "bf16" if device.type == "cuda" else "fp32",
              "device": device.type, "epochs": w.epochs, "max_steps": max_steps,
              "batch_size": w.micro_batch or w.examples_per_step,
              "grad_accum": w.examples_per_step // (w.micro_batch or w.examples_per_step),
              "lr": 2e-4, "lora": w.lora, "eval_prompts": 0, "max_length": 4096, "log_every": 50}
    values.update(overrides or {})
    cfg = load_config(None, values)
    model = random_model(w.args, device, DTYPES[cfg.precision])
    capped = device.type == "cuda" and memory_cap_gib > 0
    if capped:  # before assemble: lora_inputs auto reads it (train.device_memory_bytes)
        cap_memory(device, memory_cap_gib)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = assemble(cfg, model, examples, None, device, cfg.precision, Path(tmp) / "run", Path("random"))
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            graphs.last_stats = {}
            before = allocator_counts(device)
            t0 = time.perf_counter()
            with first_step_clock(device) as first:
                result = fit(run, progress=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            # The clock stops at the loop's end: the final adapter's write (W2: 80.7M fp32 LoRA
            # weights, ~0.5 s with its fsync) is reported apart, as the HF baseline writes none.
            seconds = time.perf_counter() - t0 - result.save_seconds
            allocator = {k: v - before.get(k, 0) for k, v in allocator_counts(device).items()}
            losses = [json.loads(line)["loss"] for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
    finally:
        if capped:  # the next workload of `bench all` runs uncapped unless capped itself
            cap_memory(device, 0)
    tokens = sum(examples.lengths[i] for step in run.steps for i in step)
    flops_per_token = 4 * w.args.linear_weight_count
    tps = tokens / seconds
    peak = peak_tflops(device)
    return {
        "steps": len(run.steps), "seconds": round(seconds, 3), "tokens": tokens,
        "micro_batch": f"{cfg.batch_size} examples x {cfg.grad_accum}",
        "tokens_per_s": round(tps, 1), "samples_per_s": round(len(run.steps) * w.examples_per_step / seconds, 2),
        "steps_per_s": round(len(run.steps) / seconds, 3),
        "mfu": round(tps * flops_per_token / (peak * 1e12), 4) if peak else None,
        "peak_memory_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
        "peak_memory_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3) if device.type == "cuda" else None,
        "final_loss": result.final_loss, "losses_logged": losses,
        "cuda_graphs": dict(graphs.last_stats) if cfg.cuda_graphs and graphs.last_stats else None,
        "memory_cap_gib": memory_cap_gib or None,
        # the first optimizer step's wall seconds (to the GPU's end of it): several seconds where
        # Triton compiled this workload's kernels (a cache warm with other shapes' kernels only)
        "first_step_s": first.get("seconds"),
        "adapter_save_s": round(result.save_seconds, 3),  # after the loop, outside `seconds`
        # forwards, layers offloaded in all (ActivationOffload.layers_for), copies, bytes, late unpacks
        "activation_offload": dict(run.model.activation_offload.stats) if run.model.activation_offload else None,
        "allocator": allocator or None,
        "lora_inputs": f"{cfg.lora_inputs}: " + ("kept" if getattr(run.model.lora_casts, "keep_inputs", False)
                                                 else "recomputed"),
        # when the prewarm thread finished, in seconds from the loop's start (negative: before it;
        # positive: the loop waited for it), and how its run of the step's tail kernels went
        "prewarm_done_s": round(prewarm.PREWARM_DONE_AT - t0, 3) if prewarm.PREWARM_DONE_AT else None,
        "prewarm_tail": prewarm.PREWARM_TAIL,
    }


@contextmanager
def first_step_clock(device: torch.device):
    """Yields a dict that gets "seconds": the wall time of fit's first optimizer step from the
    block's start, the GPU's work included (one synchronisation, after that step only)."""
    import hivetune.train.loop as train

    out, real, start = {}, train.accumulate_step, time.perf_counter()

    def timed(*args, **kwargs):
        result = real(*args, **kwargs)
        if "seconds" not in out:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out["seconds"] = round(time.perf_counter() - start, 3)
        return result

    train.accumulate_step = timed
    try:
        yield out
    finally:
        train.accumulate_step = real


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's slow-path counters (torch.cuda.memory_stats): retries after
    freeing its cache (each synchronises the device), out-of-memory errors, cudaMalloc / cudaFree
    calls. A run under a memory cap that pays these shows it here; {} off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def run_hf_peft(w: Workload, device: torch.device, timed_steps: int = 0, warmup_steps: int = 2) -> dict:
    """HF Trainer + PEFT with the seeds' config (batch 2, gradient accumulation to the workload's
    examples per step, bf16 on GPUs, SDPA attention, AdamW lr 2e-4, cosine) on the same model
    shape and examples. timed_steps > 0: run warmup_steps + timed_steps optimizer steps, time the
    last timed_steps and extrapolate to the workload's step count (labelled in the result)."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    examples = workload_examples(w.n_examples, w.args.vocab_size, w.cap)
    features = [{"input_ids": e.ids, "labels": [t if m else -100 for t, m in zip(e.ids, e.mask)]} for e in examples]
    total_steps = max(1, int(w.epochs * w.n_examples) // w.examples_per_step)  # hivetune's plan
    a = w.args
    config = transformers.Qwen2Config(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings)
    config._attn_implementation = "sdpa"
    half = device.type == "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    if half:
        model = model.to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=w.lora["r"], lora_alpha=w.lora["alpha"], lora_dropout=w.lora["dropout"],
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"], task_type="CAUSAL_LM"))

    def collate(batch):
        width = max(len(f["input_ids"]) for f in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, f in enumerate(batch):
            n = len(f["input_ids"])
            ids[row, :n] = torch.tensor(f["input_ids"])
            labels[row, :n] = torch.tensor(f["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())

    max_steps = warmup_steps + timed_steps if timed_steps else -1
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=2, gradient_accumulation_steps=w.examples_per_step // 2,
            num_train_epochs=w.epochs, max_steps=max_steps, learning_rate=2e-4, lr_scheduler_type="cosine",
            warmup_steps=max(1, round(0.03 * total_steps)), bf16=half, use_cpu=not half, logging_steps=10**9,
            save_strategy="no", report_to=[], disable_tqdm=True, remove_unused_columns=False, seed=0,
            dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=features, data_collator=collate,
                          callbacks=[Clock()])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        output = trainer.train()
        seconds = time.perf_counter() - t0
    steps_done = len(stamps)
    mean_tokens = sum(len(e.ids) for e in examples) / len(examples)
    optim = getattr(args.optim, "value", args.optim)
    record = {"config": f"batch 2 x accum {w.examples_per_step // 2}, {'bf16' if half else 'fp32'}, sdpa, {optim}",
              "steps_run": steps_done, "train_loss": round(output.training_loss, 6),
              "peak_memory_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
              if device.type == "cuda" else None}
    if timed_steps:
        timed = stamps[-1] - stamps[warmup_steps - 1] if warmup_steps else stamps[-1] - t0
        per_step = timed / timed_steps
        record.update(measured="extrapolated", timed_steps=timed_steps, seconds_per_step=round(per_step, 4),
                      seconds=round(per_step * total_steps, 1), extrapolated_to_steps=total_steps,
                      tokens_per_s=round(w.examples_per_step * mean_tokens / per_step, 1),
                      tokens_per_s_note="steps/s x examples per step x mean example length")
    else:
        record.update(measured="full", seconds=round(seconds, 3), seconds_per_step=round(seconds / steps_done, 4),
                      tokens_per_s=round(w.examples_per_step * steps_done * mean_tokens / seconds, 1))
    del trainer, model
    return record


BASELINES = ("hf-peft",)


def bench(workload: str = "W1", max_steps: int = 0, out_dir: str = "bench/results", overrides: dict | None = None,
          baseline: str = "", baseline_steps: int = 0, table: str | None = "BENCHMARKS.md",
          memory_cap_gib: float = 0.0) -> dict:
    """`hivetune bench`: time a workload (and, with `baseline`, HF Trainer + PEFT on it in the same
    process), write its JSON under out_dir, and rewrite the generated table of `table` where
    out_dir is the folder that table is made from (bench/results beside it): a run written
    elsewhere (--out /tmp/x) leaves the table as it is."""
    names = list(WORKLOADS) if workload == "all" else [workload]
    for name in names:
        if name not in WORKLOADS:
            raise UserError(f"bench: unknown workload {name!r} (W1, W2, all)")
    if baseline and baseline not in BASELINES:
        raise UserError(f"--baseline: unknown baseline {baseline!r} ({', '.join(BASELINES)})")
    if baseline_steps < 0:
        raise UserError(f"--baseline-steps: must be >= 0, got {baseline_steps}")
    if memory_cap_gib < 0:
        raise UserError(f"--memory-cap: must be >= 0 GiB, got {memory_cap_gib}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name in names:
        w = WORKLOADS[name]
        record = {"workload": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "environment": environment(device), "max_steps": max_steps, "overrides": overrides or {},
                  "hivetune": run_hivetune(w, device, overrides, max_steps, memory_cap_gib)}
        _release_memory(device)
        record["environment"]["host_probe"] = host_probe(device)
        if baseline:
            _release_memory(device)
            record["baseline"] = {"name": baseline, **run_hf_peft(w, device, baseline_steps)}
            if not max_steps:  # the same work on both sides: the full workload
                record["speedup_vs_baseline"] = round(record["baseline"]["seconds"] / record["hivetune"]["seconds"], 2)
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        record["path"] = str(path)
        results[name] = record
        _release_memory(device)
    made_from = Path(table).parent / "bench" / "results" if table else None
    if made_from is not None and Path(table).is_file() and Path(out_dir).resolve() == made_from.resolve():
        write_table(Path(table), Path(out_dir))
    return results


def _release_memory(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


TABLE_BEGIN = "<!-- bench-table:begin (generated by `hivetune bench` from bench/results/*.json; do not edit) -->"
TABLE_END = "<!-- bench-table:end -->"


def results_table(folder: Path) -> str:
    """A markdown table of every W1 / W2 result JSON in `folder`, newest first."""
    rows = []
    for path in sorted(folder.glob("W[12]-*.json"), reverse=True):
        try:
            r = json.loads(path.read_text())
            h = r["hivetune"]
        except (OSError, ValueError, KeyError):
            continue
        env = r.get("environment", {})
        setting = ", ".join(f"{k}={v}" for k, v in (r.get("overrides") or {}).items()) or "defaults"
        if env.get("gpu") and env.get("fused_ops") is False:
            setting += "; PyTorch RMSNorm / RoPE / SwiGLU"
        if h.get("micro_batch") and not h["micro_batch"].endswith(" x 1"):
            setting += f"; micro-batch {h['micro_batch']}"
        if env.get("reference_paths"):
            setting += f"; reference paths: {env['reference_paths']}"
        if env.get("experiments"):
            setting += f"; experiments: {env['experiments']}"
        if h.get("memory_cap_gib"):
            setting += f"; allocator capped at {h['memory_cap_gib']:g} GiB"
        if env.get("triton_cache"):
            setting += f"; Triton kernel cache {env['triton_cache']} at start"
        if h.get("first_step_s") is not None:  # seconds where this workload's kernels compiled in the clock
            setting += f"; first step {h['first_step_s']:g} s"
        if h.get("adapter_save_s") is not None:  # results before it counted the final adapter write
            setting += f"; adapter write {h['adapter_save_s']:g} s after the clock"
        offload = h.get("activation_offload")
        if offload and offload.get("passes"):
            setting += f"; {offload['layers'] / offload['passes']:.1f} layers offloaded a micro-batch"
        graphs = h.get("cuda_graphs")
        if graphs and graphs.get("off"):
            setting += f"; CUDA graphs off: {graphs['off']}"
        elif graphs:
            setting += f"; {graphs['graphs']} CUDA graphs, capture {graphs['capture_s']} s"
            if graphs.get("bucket_tokens", 256) not in (256, "planned"):
                setting += f", {graphs['bucket_tokens']}-token buckets"
            elif graphs.get("sizes"):
                sizes = sorted({s for group in graphs["sizes"].values() for s in group})
                setting += f", sizes {', '.join(map(str, sizes))} (pad {graphs['pad_tokens']:,} tokens)"
        steps = f"{h['steps']}" + ("" if not r.get("max_steps") else " (max_steps)")
        base = r.get("baseline")
        if base:
            how = "" if base.get("measured") == "full" else f", extrapolated from {base['timed_steps']} steps"
            base_txt = f"{base['seconds']:,} s, {base['tokens_per_s']:,.0f} tok/s{how}"
        else:
            base_txt = ""
        ratio = f"{r['speedup_vs_baseline']}x" if r.get("speedup_vs_baseline") else ""
        mem = lambda key: f"{h[key]:.1f}" if h.get(key) is not None else ""  # noqa: E731
        mfu = f"{h['mfu']:.1%}" if h.get("mfu") is not None else ""
        rows.append(f"| {r['workload']} | {env.get('commit', '?')} | {env.get('gpu') or 'cpu'} | {setting} | {steps} | "
                    f"{h['seconds']:.1f} | {h['tokens_per_s']:,.0f} | {mfu} | {mem('peak_memory_allocated_gib')} | "
                    f"{mem('peak_memory_reserved_gib')} | {base_txt} | {ratio} | {path.name} |")
    head = ("| workload | commit | device | settings | steps | seconds | tokens/s | MFU | peak alloc GiB | "
            "peak reserved GiB | HF + PEFT seed config | speedup | file |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *rows])


def write_table(md: Path, folder: Path) -> None:
    """Rewrite the generated section of `md` (between the markers) from the JSON in `folder`."""
    text = md.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return
    before, rest = text.split(TABLE_BEGIN, 1)
    after = rest.split(TABLE_END, 1)[1]
    md.write_text(f"{before}{TABLE_BEGIN}\n{results_table(folder)}\n{TABLE_END}{after}")
