"""Multi-GPU benchmark, one device call on 2 GPUs:

    python benchmarks/multi_gpu.py all --out DIR      # orchestrates the runs below, writes one JSON

- single W2: the W2 workload on one GPU (global batch 16 examples per step).
- ddp W2:    the same workload on 2 GPUs through torchrun + DDP, 8 examples per GPU per step
             (the same global batch of 16), the same seeded step plan.
- fsdp 14B:  a Qwen2.5-14B-shape model (random init) trained with FSDP2 on 2 GPUs
             (20 steps of W2-style examples, 4 per GPU), per-GPU peak memory recorded.
- ddp 14B nf4: the same with the base quantized to nf4, under DDP (FSDP2 refuses a quantized base).

Each run prints one JSON line (rank 0); `all` collects them with the device, versions, commit.
`--timeline DIR` and the other profile flags write each rank's timeline or profile into DIR;
`python benchmarks/multi_gpu.py ddp tiny --device cpu` under torchrun is a CPU smoke test (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hivetune.core.config import load_config, parse_overrides
from hivetune.data.dataset import TokenizedExamples
from hivetune.model.decoder import CausalLM
from hivetune.ops import prewarm
from hivetune.parallel import distributed
from hivetune.train import replay as graphs
from hivetune.train.loop import fit
from hivetune.train.setup import assemble
from hivetune.workflows.bench import allocator_counts, environment, git_commit
from hivetune.workflows.bench_results import append_result, device_kind, setting_text
from hivetune.workflows.workloads import WORKLOADS, init_like_hf, qwen25_shape, random_model, workload_examples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_profiles import capture_profile, first_steps_profile, kernel_profile, pass_profile, step_timeline  # noqa: E402

QWEN25_14B = qwen25_shape(152064, 5120, 13824, 48, 40, 8, False)


def random_model_bf16(args, device) -> CausalLM:
    """HF-style random init made directly in bf16 on the GPU (no fp32 copy: a 14B model would
    take 59 GB in fp32); the same seed gives the same weights on every rank."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = CausalLM(args)
    finally:
        torch.set_default_dtype(previous)
    init_like_hf(model)
    return model


def allreduce_probe(numel: int = 80_740_352, repeats: int = 20) -> dict:
    """The gradient all-reduce alone: `numel` fp32 values (W2's LoRA gradients by default) summed
    over the ranks `repeats` times after 3 untimed, each timed on the GPU clock after a barrier
    (so no rank waits for another's late arrival); median and best milliseconds and the bus
    bandwidth (2 (n - 1) / n of the bytes a millisecond), the figure nccl-tests reports."""
    import torch.distributed as dist

    parallel = distributed.init("cuda")
    device = distributed.device_for(parallel, torch.device("cuda"))
    flat = torch.ones(numel, dtype=torch.float32, device=device)
    times = []
    for k in range(repeats + 3):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(flat)
        end.record()
        end.synchronize()
        if k >= 3:
            times.append(start.elapsed_time(end))
    times.sort()
    n, median = parallel.world, times[len(times) // 2]
    busbw = 2 * (n - 1) / n * numel * 4 / (median / 1e3) / 1e9
    out = {"mode": "allreduce", "ranks": n, "numel": numel, "median_ms": round(median, 3),
           "best_ms": round(times[0], 3), "busbw_gb_s": round(busbw, 1), "environment": environment(device)}
    distributed.shutdown(parallel)
    return out


def train_once(mode: str, workload: str, device_name: str = "cuda", settings: list[str] = (),
               profiles: dict[str, str | None] | None = None) -> dict:
    """One run of `workload` (single, ddp or fsdp); `settings`: config overrides "key=value" for an
    A/B; `profiles`: the folders of the optional profiles (PROFILES' keys)."""
    parallel = distributed.init(device_name)
    device = distributed.device_for(parallel, torch.device(device_name))
    prewarm.prewarm(device)  # as train's setup does: overlaps building the data and the model
    if workload == "tiny":  # a CPU smoke test of this script (gloo)
        args, n_examples, cap, per_step = qwen25_shape(2048, 64, 128, 2, 4, 2, False), 64, 64, 8
        lora, max_steps = {"r": 4, "alpha": 8, "dropout": 0.0}, 3
    elif workload == "14B":
        args, n_examples, cap, per_step = QWEN25_14B, 400, 256, 8
        lora, max_steps = {"r": 16, "alpha": 32, "dropout": 0.05}, 20
    else:
        w = WORKLOADS[workload]
        args, n_examples, cap, per_step, lora, max_steps = w.args, w.n_examples, w.cap, w.examples_per_step, w.lora, 0
    examples = TokenizedExamples(workload_examples(n_examples, args.vocab_size, cap))
    extra = parse_overrides(list(settings))
    cfg = load_config(None, {
        "model": "random", "data": "generator", "precision": "bf16" if device.type == "cuda" else "fp32",
        "device": device.type, "epochs": 1.0,
        "max_steps": max_steps, "batch_size": per_step // parallel.world, "lr": 2e-4, "lora": lora,
        "eval_prompts": 0, "max_length": 4096, "log_every": 10, "save_every_minutes": 0,
        "distributed": "fsdp" if mode == "fsdp" else "ddp", **extra})
    model = random_model_bf16(args, device) if device.type == "cuda" else random_model(args, device, torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(distributed.on_main(parallel, lambda: tmp)) / "run"
        run = assemble(cfg, model, examples, None, device, cfg.precision, folder, Path("random"), parallel)
        del model
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        distributed.barrier(parallel)
        t0 = time.perf_counter()
        where, rank = profiles or {}, parallel.rank
        with (kernel_profile(rank, where.get("kernel_profile")), step_timeline(rank, where.get("timeline")),
              capture_profile(rank, where.get("capture_profile")),
              first_steps_profile(rank, where.get("first_profile")), pass_profile(rank, where.get("pass_profile"))):
            result = fit(run, progress=False)
            if cuda:
                torch.cuda.synchronize()
        distributed.barrier(parallel)
        seconds = time.perf_counter() - t0 - result.save_seconds  # as bench.run_hivetune: the loop alone
        losses = ([json.loads(line)["loss"] for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
                  if parallel.is_main else [])
    peaks = distributed.all_gather_objects(parallel, (torch.cuda.max_memory_allocated(device),
                                                       torch.cuda.max_memory_reserved(device)) if cuda else (0, 0))
    # every rank's graph counters: each rank plans and captures its own graphs (their sizes should agree)
    graphs_per_rank = distributed.all_gather_objects(parallel, dict(graphs.last_stats))
    tokens = sum(examples.lengths[i] for step in run.steps for i in step)
    out = {"mode": mode, "workload": workload, "gpus": parallel.world, "strategy": run.strategy,
           "steps": len(run.steps), "global_batch": per_step, "per_gpu_micro_batch": cfg.batch_size,
           "seconds": round(seconds, 3), "adapter_save_s": round(result.save_seconds, 3),
           "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
           "peak_allocated_gib_per_gpu": [round(a / 2**30, 2) for a, _ in peaks],
           "peak_reserved_gib_per_gpu": [round(r / 2**30, 2) for _, r in peaks],
           "final_loss": result.final_loss, "losses_logged": losses,
           "params_billion": round(n_params / 1e9, 3), "cuda_graphs": dict(graphs.last_stats),
           "cuda_graphs_per_rank": graphs_per_rank, "overrides": extra,
           "allocator": allocator_counts(device),  # rank 0's: a cudaFree or a retry syncs the device
           "prewarm_tail": prewarm.PREWARM_TAIL,  # the step's tail kernels in the prewarm thread
           # as hivetune bench's: when the prewarm thread finished, from the loop's start (positive: it waited)
           "prewarm_done_s": round(prewarm.PREWARM_DONE_AT - t0, 3) if prewarm.PREWARM_DONE_AT else None,
           "environment": environment(device)}  # device, versions, commit: each line a record
    distributed.shutdown(parallel)
    return out


def run_all(out_dir: Path, results: Path, commit: str = "", skip_14b: bool = False,
            passed: list[str] = ()) -> dict:
    """W2 on one GPU and on two, then the 14B shape with FSDP2 (unless `skip_14b`), each in its own
    process(es) given `passed` (the --set and profile flags); one JSON in `out_dir`, the result
    lines appended in `results`."""
    here = Path(__file__).resolve()
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    runs = {}
    commands = {
        "single_W2": [sys.executable, str(here), "single", "W2", *passed],
        "ddp_W2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(here),
                   "ddp", "W2", *passed],
        # the 14B runs name their strategy (their results lines' setting): FSDP2 in bf16, and DDP on
        # an nf4 base (FSDP2 does not shard a quantized base's packed blocks, which are buffers)
        "fsdp_14B": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(here),
                     "fsdp", "14B", "--set", "distributed=fsdp", *passed],
        "ddp_14B_nf4": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(here), "ddp", "14B", "--set", "distributed=ddp", "--set", "base_quant=nf4", *passed],
    }
    if skip_14b:  # a shorter call when only the W2 figures changed
        commands.pop("fsdp_14B")
        commands.pop("ddp_14B_nf4")
    for name, command in commands.items():
        t0 = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        runs[name] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
            "error": proc.stderr[-4000:], "returncode": proc.returncode}
        runs[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(runs[name])[:400], flush=True)
    single, ddp = runs.get("single_W2", {}), runs.get("ddp_W2", {})
    result = {"environment": environment(torch.device("cuda"), commit), "commit": git_commit(commit),
              "gpus_visible": torch.cuda.device_count(), "runs": runs,
              "ddp_speedup_W2": round(ddp["tokens_per_s"] / single["tokens_per_s"], 3)
              if "tokens_per_s" in single and "tokens_per_s" in ddp else None}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"multigpu-{result['commit']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}; W2 speedup on 2 GPUs: {result['ddp_speedup_W2']}")
    for name, run in runs.items():
        if "tokens_per_s" in run:
            line = results_line(run, result, single if name == "ddp_W2" else None)
            print(f"appended to {append_result(results, line)}")
    return result


def results_line(run: dict, result: dict, single: dict | None) -> dict:
    """One run of run_all as a line of benchmarks/results/<workload>-<device>.jsonl (bench_results'
    schema); a DDP run carries the one-GPU run of the same call as its baseline."""
    env = result["environment"]
    figures = {k: run[k] for k in ("steps", "seconds", "tokens", "tokens_per_s", "final_loss", "adapter_save_s",
                                   "strategy", "cuda_graphs", "allocator") if k in run}
    figures["peak_memory_allocated_gib"] = max(run["peak_allocated_gib_per_gpu"])
    figures["peak_memory_reserved_gib"] = max(run["peak_reserved_gib_per_gpu"])
    line = {"workload": run["workload"], "device": device_kind(env.get("gpu"), run["gpus"]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "commit": result["commit"],
            "setting": setting_text(run.get("overrides")), "environment": env, "max_steps": 0,
            "overrides": run.get("overrides", {}), "hivetune": figures}
    if single:
        line["baseline"] = {"name": "1 GPU", "seconds": single["seconds"], "tokens_per_s": single["tokens_per_s"],
                            "measured": "full"}
        line["speedup_vs_baseline"] = round(single["seconds"] / run["seconds"], 2)
    return line


PROFILES = {"timeline": "each rank's steps on the GPU clock (step_timeline)",
            "kernel_profile": "each rank's GPU kernels and host CUDA calls over the fit (kernel_profile)",
            "first_profile": "the loop's first two steps under cProfile (first_steps_profile)",
            "pass_profile": "the first forward-backward passes under cProfile (pass_profile)",
            "capture_profile": "each deferred CUDA-graph capture under cProfile (capture_profile)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["all", "single", "ddp", "fsdp", "allreduce"])
    parser.add_argument("workload", nargs="?", default="W2", help="W2 (default), 14B, or tiny (a CPU smoke test)")
    parser.add_argument("--out", default="/tmp/hivetune-bench")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for an A/B (repeatable)")
    parser.add_argument("--skip-14b", action="store_true", help="all: leave out the 14B FSDP2 run")
    for name, what in PROFILES.items():
        parser.add_argument("--" + name.replace("_", "-"), metavar="DIR", help=f"write {what} into DIR")
    ns = parser.parse_args()
    profiles = {name: getattr(ns, name) for name in PROFILES}
    if ns.mode == "all":
        passed = [a for s in ns.set for a in ("--set", s)]
        passed += [a for name, d in profiles.items() if d for a in ("--" + name.replace("_", "-"), d)]
        run_all(Path(ns.out), Path(ns.results), ns.commit, ns.skip_14b, passed)
        return
    result = (allreduce_probe() if ns.mode == "allreduce"
              else train_once(ns.mode, ns.workload, ns.device, ns.set, profiles))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
