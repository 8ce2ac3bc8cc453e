"""Planner accuracy on the GPU: predicted peak vs torch.cuda.max_memory_reserved().

Usage (one device call, about 6 minutes on an H200; --budget keeps it under 9):
    python benchmarks/plan_grid.py --out "$OUT" --commit <short hash>
Each grid point runs in a fresh subprocess (a clean caching allocator): a random-init Qwen2.5
shape built straight in the training dtype, one micro-batch of `batch_size` equal-length
examples packed in one row, a few optimizer steps through hivetune's own loop (train.fit, so
the path training takes: LoRA groups joined by model.lora.fuse_projections unless
HIVETUNE_REFERENCE=fused_lora, the Triton RMSNorm / SwiGLU in bf16), then the peak reserved
memory is compared with hivetune.plan's prediction for that path, and the step time with
hivetune.plan.timing's. Afterwards one more forward / backward records the phases (allocated after
forward = weights + saved activations) so a miss can be traced to a term. Writes
plan-grid-<commit>-<device>.json and .md after every point (the commit from --commit, else
git: the device copy has no .git), with timing.calibrate's constants from this grid beside the
ones in hivetune.plan.timing. benchmarks/results/plan-grid-h200.json is such a file
(tests/plan/test_plan.py reads it). `--attention sdpa` runs and predicts every point with SDPA (the
config key `attention`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # vocab, hidden, intermediate, layers, heads, kv heads, tied (config.json of each)
    "0.5B": (151936, 896, 4864, 24, 14, 2, True),
    "1.5B": (151936, 1536, 8960, 28, 12, 2, True),
    "7B": (152064, 3584, 18944, 28, 28, 4, False),
}
QV = ["q_proj", "v_proj"]
# model, precision, examples x length (the micro-batch), checkpointing, r, dropout, targets
GRID = [
    ("0.5B", "bf16", 4, 512, False, 8, 0.0, None),
    ("0.5B", "bf16", 8, 1024, False, 64, 0.0, None),
    ("0.5B", "bf16", 16, 1024, True, 16, 0.0, None),
    ("0.5B", "fp32", 8, 512, False, 16, 0.0, None),
    ("0.5B", "fp32", 8, 512, True, 8, 0.05, None),
    ("1.5B", "bf16", 8, 512, False, 16, 0.05, None),
    ("1.5B", "bf16", 16, 1024, True, 32, 0.0, None),
    ("1.5B", "fp32", 4, 512, False, 16, 0.0, None),
    ("1.5B", "fp32", 8, 1024, True, 64, 0.0, None),
    ("1.5B", "bf16", 8, 1024, False, 8, 0.0, QV),
    ("7B", "bf16", 4, 512, False, 16, 0.0, None),
    ("7B", "bf16", 8, 512, False, 32, 0.05, None),
    ("7B", "bf16", 16, 1024, True, 64, 0.0, None),
    ("7B", "bf16", 8, 1024, True, 8, 0.0, None),
    ("7B", "fp32", 4, 512, False, 16, 0.0, None),
    ("7B", "fp32", 8, 1024, True, 16, 0.0, None),
    # out of sample for the memory model's calibration
    ("0.5B", "bf16", 32, 256, True, 32, 0.1, None),
    ("1.5B", "fp32", 2, 2048, False, 8, 0.0, QV),
    ("7B", "bf16", 2, 2048, False, 64, 0.0, None),
]


# The same bf16 packed points with CUDA graphs on (the config key cuda_graphs).
GRAPHED = [0, 1, 5, 9, 10, 11, 18]


def point_dict(row, graphs: bool = False) -> dict:
    model, precision, batch, length, ckpt, r, dropout, targets = row
    return {"model": model, "precision": precision, "batch_size": batch, "length": length,
            "gradient_checkpointing": ckpt, "r": r, "dropout": dropout, "targets": targets, "cuda_graphs": graphs}


def point_config(p: dict, device: str = "cuda"):
    """The TrainConfig a point trains with (run_point) and is planned with (predict)."""
    from hivetune.core.config import load_config

    lora = {"r": p["r"], "alpha": 2 * p["r"], "dropout": p["dropout"]}
    if p["targets"]:
        lora["targets"] = p["targets"]
    steps = 4 if p["precision"] == "fp32" and p["model"] == "7B" else 6
    return load_config(None, {"cuda_graphs": p["cuda_graphs"], "save_every_minutes": 0,
                              "attention": p.get("attention", "auto"), "model": "random", "data": "generator",
                              "precision": p["precision"], "device": device, "batch_size": p["batch_size"],
                              "grad_accum": 1, "max_steps": steps, "max_length": p["length"], "lora": lora,
                              "gradient_checkpointing": p["gradient_checkpointing"], "eval_prompts": 0,
                              "log_every": 1, "lr": 1e-4})


def predict(p: dict, memory_bytes: int) -> dict:
    """hivetune.plan's prediction for the point as train resolves its config (planner.memory_config
    on this machine's torch: varlen GQA or not), `memory_bytes` the device's (lora_inputs auto
    keeps the dropped inputs where they fit)."""
    from hivetune.workflows.workloads import qwen25_shape
    from hivetune.plan.memory import breakdown
    from hivetune.plan.planner import bucketed, memory_config

    args = qwen25_shape(*SHAPES[p["model"]])
    tokens = bucketed(p["batch_size"] * p["length"], p["cuda_graphs"], args)
    targets = p["batch_size"] * (p["length"] - p["length"] // 4)  # every response token is a target
    if p["cuda_graphs"]:
        targets = tokens  # the graphed loss runs a bucket of rows, the pad rows ignored
    mc = memory_config(point_config(p), p["precision"], p["gradient_checkpointing"], graphs=p["cuda_graphs"],
                       args=args, tokens=tokens, memory_bytes=memory_bytes)
    b = breakdown(args, mc, tokens, targets)
    return {"predicted_reserved_bytes": b.reserved, "peak_phase": b.peak_phase,
            "path": {"joined": mc.joined, "fused_layers": mc.fused_layers, "keep_inputs": mc.keep_inputs},
            "parts": {k: v for k, v in b.parts.items()}}


def predict_seconds(p: dict, tokens: int, gpu) -> float | None:
    """hivetune.plan.timing's seconds for one micro-batch of the point (None: no rates for this GPU)."""
    from hivetune.workflows.workloads import qwen25_shape
    from hivetune.plan.timing import micro_batch_seconds

    if gpu is None:
        return None
    args = qwen25_shape(*SHAPES[p["model"]])
    return micro_batch_seconds(args, tokens, p["length"], p["gradient_checkpointing"], p["precision"],
                               gpu.tflops(p["precision"]), p["cuda_graphs"])


def run_point(p: dict) -> dict:
    """In this (fresh) process: build, train a few steps, measure."""
    import torch

    from hivetune.workflows.workloads import init_like_hf, qwen25_shape
    from hivetune.data.dataset import TokenizedExamples
    from hivetune.data.formats import Encoded
    from hivetune.core.device import DTYPES
    from hivetune.model.decoder import CausalLM
    from hivetune.ops.attention import _varlen_fn
    from hivetune.ops.fused_ce import fused_target_loss_sum
    from hivetune.train import loop as train_loop
    from hivetune.train.loop import fit
    from hivetune.train.setup import assemble
    from hivetune.train.step import autocast, micro_batches

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke test only
    mem = torch.cuda if device.type == "cuda" else _NoCuda()
    args = qwen25_shape(*SHAPES[p["model"]])
    dtype = DTYPES[p["precision"]]
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # parameters born in the training dtype: no fp32 detour
    with torch.device(device):
        model = CausalLM(args)
    torch.set_default_dtype(torch.float32)
    init_like_hf(model)
    gen = torch.Generator().manual_seed(0)
    n, length = p["batch_size"], p["length"]
    examples = []
    for _ in range(n * 4):
        ids = torch.randint(args.vocab_size // 8, args.vocab_size - 1, (length,), generator=gen).tolist()
        examples.append(Encoded(ids, [False] * (length // 4) + [True] * (length - length // 4), False))
    data = TokenizedExamples(examples)
    cfg = point_config(p, device.type)
    with tempfile.TemporaryDirectory() as tmp:
        run = assemble(cfg, model, data, None, device, p["precision"], Path(tmp) / "run", Path("random"))
        mem.synchronize()
        mem.empty_cache()
        mem.reset_peak_memory_stats(device)
        before = mem.memory_allocated(device)
        ends = []  # each step's end, the GPU's work included (a synchronisation after each step)
        real = train_loop.accumulate_step

        def timed(*a, **kw):
            out = real(*a, **kw)
            mem.synchronize()
            ends.append(time.perf_counter())
            return out

        train_loop.accumulate_step = timed
        t0 = time.perf_counter()
        try:
            fit(run, progress=False)
        finally:
            train_loop.accumulate_step = real
        mem.synchronize()
        seconds = time.perf_counter() - t0
        reserved = mem.max_memory_reserved(device)
        allocated = mem.max_memory_allocated(device)
        # Phases of one more step: what forward leaves saved, the peaks of forward+loss and backward.
        batch = next(micro_batches(run, run.steps[0])).to(device)
        mem.synchronize()
        mem.reset_peak_memory_stats(device)
        start = mem.memory_allocated(device)
        with autocast(run):
            hidden = model(batch.input_ids, batch.position_ids, batch.layout)
            loss = fused_target_loss_sum(hidden, model.lm_head.weight, batch.target_index, batch.target_ids,
                                         softcap=model.args.final_logit_softcapping)
        mem.synchronize()
        after_forward = mem.memory_allocated(device)
        peak_forward = mem.max_memory_allocated(device)
        mem.reset_peak_memory_stats(device)
        loss.backward()
        mem.synchronize()
        peak_backward = mem.max_memory_allocated(device)
    # steady steps: from the second step's end on (the first compiles, the second captures a graph);
    # a step's interval holds the previous step's optimizer update
    step_times = [round(b - a, 4) for a, b in zip(ends[1:], ends[2:])]
    return {"max_memory_reserved": reserved, "max_memory_allocated": allocated, "allocated_before_fit": before,
            "phase_start_allocated": start, "phase_after_forward_allocated": after_forward,
            "phase_forward_peak": peak_forward, "phase_backward_peak": peak_backward,
            "tokens": batch.input_ids.numel(), "targets": int(batch.target_ids.numel()),
            "fit_seconds": round(seconds, 3), "step_seconds": step_times,
            "varlen": _varlen_fn()[0] is not None, "varlen_gqa": _varlen_fn()[2], "graph_stats": _graph_stats()}


def _graph_stats():
    try:
        from hivetune.train import replay as graphs
        return {k: v for k, v in graphs.last_stats.items() if isinstance(v, (int, float, str, bool))}
    except Exception:
        return None


class _NoCuda:
    """Stands in for torch.cuda on a CPU smoke run: every figure reads 0."""

    def __getattr__(self, name):
        return lambda *a, **k: 0


def markdown(record: dict) -> str:
    lines = ["| model | precision | micro-batch tokens | checkpointing | r | dropout | targets | predicted GiB "
             "| measured reserved GiB | error | step s predicted | step s measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pt in record["points"]:
        p, m = pt["point"], pt.get("measured")
        pred = pt["predicted_reserved_bytes"] / 2**30
        if not m:
            why = " ".join(pt.get("error", "").split())[-120:].replace("|", "/")
            lines.append(f"| {p['model']} | {p['precision']} | {p['batch_size']} x {p['length']} | "
                         f"{'on' if p['gradient_checkpointing'] else 'off'} | {p['r']} | {p['dropout']} | "
                         f"{'q,v' if p['targets'] else 'all 7'}{' (graphs)' if p['cuda_graphs'] else ''} | {pred:.2f} "
                         f"| not measured: {why} | | | |")
            continue
        meas = m["max_memory_reserved"] / 2**30
        step = f"{statistics.median(m['step_seconds']):.3f}" if m.get("step_seconds") else ""
        step_pred = f"{pt['predicted_step_seconds']:.3f}" if pt.get("predicted_step_seconds") else ""
        lines.append(f"| {p['model']} | {p['precision']} | {p['batch_size']} x {p['length']} = "
                     f"{p['batch_size'] * p['length']:,} | {'on' if p['gradient_checkpointing'] else 'off'} | {p['r']} "
                     f"| {p['dropout']} | {'q,v' if p['targets'] else 'all 7'}{' (graphs)' if p['cuda_graphs'] else ''} | {pred:.2f} | {meas:.2f} "
                     f"| {pt['error_pct']:+.1f}% | {step_pred} | {step} |")
    cal = record.get("timing_calibration")
    if cal:
        lines += ["", f"timing.calibrate on this grid: {json.dumps(cal['measured'])}",
                  f"hivetune.plan.timing in use: {json.dumps(cal['constants'])}"]
    return "\n".join(lines) + "\n"


def timing_calibration(record: dict, gpu) -> dict | None:
    """hivetune.plan.timing.calibrate on the grid just written, beside the constants in use."""
    from hivetune.plan import timing
    if gpu is None:
        return None
    try:
        measured = timing.calibrate(record, {"bf16": gpu.tflops("bf16"), "fp32": gpu.tflops("fp32")})
    except (ValueError, KeyError, statistics.StatisticsError) as e:
        measured = {"error": f"{type(e).__name__}: {e}"}
    return {"measured": measured,
            "constants": {"efficiency": timing.EFFICIENCY, "dispatch_s_per_layer": timing.DISPATCH_S_PER_LAYER,
                          "graphed_dispatch_s_per_layer": timing.GRAPHED_DISPATCH_S_PER_LAYER}}


def write_results(env: dict, points: list, out: Path, gpu=None):
    errors = [abs(pt["error_pct"]) for pt in points if "error_pct" in pt and not pt["point"]["cuda_graphs"]]
    record = {"environment": env, "points": points,
              "max_abs_error_pct": max(errors) if errors else None, "measured_points": len(errors)}
    device = (env.get("gpu") or "cpu").replace("NVIDIA ", "").replace(" ", "-").lower()
    out.mkdir(parents=True, exist_ok=True)
    stem = f"plan-grid-{env['commit']}-{device}"
    record["timing_calibration"] = timing_calibration(record, gpu)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(record))
    return record, stem


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/hivetune-bench")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only", type=int, nargs="*", default=None,
                    help="GRID indices to run (each eager, and graphed where GRAPHED lists it)")
    ap.add_argument("--eager-only", action="store_true", help="leave out the CUDA-graphs repeats")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a point may take")
    ap.add_argument("--budget", type=float, default=480,
                    help="seconds for the whole grid: no point starts that the time left cannot hold "
                         "(its timeout, or the longest point so far if less); those are listed as not run")
    ap.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    ap.add_argument("--attention", default="auto", choices=["auto", "flash", "sdpa"],
                    help="the config key attention for every point (default auto)")
    ns = ap.parse_args()
    if ns.point:
        print("RESULT " + json.dumps(run_point(json.loads(ns.point))), flush=True)
        return 0
    import torch

    from hivetune.workflows.bench import environment
    from hivetune.plan.gpus import device_memory_bytes, gpu_for_device_name

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, ns.commit)
    env["device_memory_bytes"] = device_memory_bytes(device)  # what lora_inputs auto sizes against
    gpu = gpu_for_device_name(env["gpu"]) if env.get("gpu") else None
    points = []
    todo = [(i, point_dict(row)) for i, row in enumerate(GRID)]
    if not ns.eager_only:  # first: a budget that runs out cuts eager points, of which there are more
        todo = [(i, point_dict(GRID[i], graphs=True)) for i in GRAPHED] + todo
    todo = [(i, {**p, "attention": ns.attention}) for i, p in todo if ns.only is None or i in ns.only]
    start, longest = time.time(), 0.0
    record, stem = write_results(env, points, Path(ns.out), gpu)
    for i, p in todo:
        entry = {"index": i, "point": p, **predict(p, env["device_memory_bytes"])}
        left = ns.budget - (time.time() - start)
        need = min(ns.timeout, max(longest, 20.0))
        if left < need:
            entry["error"] = f"not run: {left:.0f} s of the {ns.budget:.0f} s budget left (--only {i} runs it)"
            points.append(entry)
            record, stem = write_results(env, points, Path(ns.out), gpu)
            continue
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--point", json.dumps(p)], capture_output=True,
                                  text=True, timeout=min(ns.timeout, max(10, left)))
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                entry["error"] = (proc.stderr or proc.stdout)[-2000:]
            else:
                m = json.loads(line[7:])
                entry["measured"] = m
                entry["error_pct"] = round(100 * (entry["predicted_reserved_bytes"] / m["max_memory_reserved"] - 1), 2)
                entry["predicted_step_seconds"] = predict_seconds(p, m["tokens"], gpu)
        except subprocess.TimeoutExpired:
            entry["error"] = f"timeout after {min(ns.timeout, max(10, left)):.0f} s"
        entry["wall_s"] = round(time.time() - t0, 1)
        longest = max(longest, entry["wall_s"])
        points.append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "parts"}), flush=True)
        record, stem = write_results(env, points, Path(ns.out), gpu)  # after every point: a cut-off run keeps what ran
    print(markdown(record))
    print(f"max |error| {record['max_abs_error_pct']}% over {record['measured_points']} eager points "
          f"in {time.time() - start:.0f} s -> {Path(ns.out) / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
