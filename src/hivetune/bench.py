"""Benchmark workloads W1 / W2 (../shared/WORKLOADS.md): random-init Qwen2.5 shapes, generator data.

Throughput does not depend on weight values, so the workloads need no model hub and time the
same work anywhere. The clock covers the training loop only (model built, data made before).
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from hivetune.config import load_config
from hivetune.data.dataset import TokenizedExamples
from hivetune.data.formats import Encoded
from hivetune.device import DTYPES
from hivetune.errors import UserError
from hivetune.model.config import ModelArgs
from hivetune.model.decoder import CausalLM

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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    model = model.to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def peak_tflops(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def git_commit() -> str:
    """HEAD's short hash; HIVETUNE_COMMIT wins (the device gets the tree without .git)."""
    if os.environ.get("HIVETUNE_COMMIT"):
        return os.environ["HIVETUNE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def environment(device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "commit": git_commit()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
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


def run_hivetune(w: Workload, device: torch.device, overrides: dict | None = None, max_steps: int = 0) -> dict:
    """Train the workload with hivetune's loop; return the measured figures."""
    from hivetune.train import assemble, fit

    examples = TokenizedExamples(workload_examples(w.n_examples, w.args.vocab_size, w.cap))
    values = {"model": "random", "data": "generator", "precision": "bf16" if device.type == "cuda" else "fp32",
              "device": device.type, "epochs": w.epochs, "max_steps": max_steps,
              "batch_size": w.examples_per_step, "lr": 2e-4, "lora": w.lora, "eval_prompts": 0,
              "max_length": 4096, "log_every": 50}
    values.update(overrides or {})
    cfg = load_config(None, values)
    model = random_model(w.args, device, DTYPES[cfg.precision])
    with tempfile.TemporaryDirectory() as tmp:
        run = assemble(cfg, model, examples, None, device, cfg.precision, Path(tmp) / "run", Path("random"))
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        result = fit(run, progress=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        losses = [json.loads(line)["loss"] for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(examples.lengths[i] for step in run.steps for i in step)
    flops_per_token = 4 * w.args.linear_weight_count
    tps = tokens / seconds
    peak = peak_tflops(device)
    return {
        "steps": len(run.steps), "seconds": round(seconds, 3), "tokens": tokens,
        "tokens_per_s": round(tps, 1), "samples_per_s": round(len(run.steps) * w.examples_per_step / seconds, 2),
        "steps_per_s": round(len(run.steps) / seconds, 3),
        "mfu": round(tps * flops_per_token / (peak * 1e12), 4) if peak else None,
        "peak_memory_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
        "peak_memory_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3) if device.type == "cuda" else None,
        "final_loss": result.final_loss, "losses_logged": losses,
    }


def bench(workload: str = "W1", max_steps: int = 0, out_dir: str = "bench/results", overrides: dict | None = None) -> dict:
    """`hivetune bench`: time a workload and write its JSON under bench/results/."""
    names = list(WORKLOADS) if workload == "all" else [workload]
    for name in names:
        if name not in WORKLOADS:
            raise UserError(f"bench: unknown workload {name!r} (W1, W2, all)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name in names:
        w = WORKLOADS[name]
        record = {"workload": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "environment": environment(device), "max_steps": max_steps, "overrides": overrides or {},
                  "hivetune": run_hivetune(w, device, overrides, max_steps)}
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        record["path"] = str(path)
        results[name] = record
    return results
