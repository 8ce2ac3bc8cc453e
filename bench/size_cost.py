"""A graph's GPU time by its token count (issue 10): does a W2 micro-batch's replay grow with its
size linearly, as ops.graphs.plan_sizes prices the padding, or in steps (the matmuls' row tiles)?

    HIVETUNE_COMMIT=<hash> python bench/size_cost.py [--workload W2] [--batch 8] [--grain 32]
        [--lo 1280] [--hi 1792] [--repeats 20] [--capacity N] > "$OUT/size-cost.jsonl"

One process on one GPU: the workload's model and LoRA, micro-batches of --batch examples (8: a W2
DDP rank's), the step plan's shortest micro-batch padded to every multiple of --grain from --lo to
--hi (the pad is its own segment and its targets are ignored, as in training). Each size is one
graph (captured largest first, one pool), replayed 3 times untimed, then --repeats times back to
back, each replay between two CUDA events. The graphs hold a target row a token (the reference
path), or --capacity rows each (the same for every size: the token dimension alone varies).
Prints a first line with the device, versions and commit, then one JSON line per size: GPU
milliseconds a replay (median, min, max) and per 1,000 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.workflows.bench import WORKLOADS, environment, workload_examples  # noqa: E402
from hivetune.core.config import load_config  # noqa: E402
from hivetune.data.dataset import TokenizedExamples  # noqa: E402
from hivetune.train import graph_plan, replay as graphs  # noqa: E402
from hivetune.ops.fused_ce import fused_target_loss_sum  # noqa: E402
from hivetune.train.setup import assemble  # noqa: E402
from hivetune.train.step import micro_batches  # noqa: E402
from multi_gpu import random_model_bf16  # noqa: E402  (bench/, this script's folder)


def replay_ms(bucket, repeats: int) -> list[float]:
    for _ in range(3):
        bucket.graph.replay()
    pairs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        bucket.graph.replay()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    parser.add_argument("--batch", type=int, default=8, help="examples a micro-batch")
    parser.add_argument("--grain", type=int, default=32)
    parser.add_argument("--lo", type=int, default=1280)
    parser.add_argument("--hi", type=int, default=1792)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--capacity", type=int, default=0, help="target rows of every graph (0: a row a token)")
    opts = parser.parse_args()
    device = torch.device("cuda")
    w = WORKLOADS[opts.workload]
    examples = TokenizedExamples(workload_examples(w.n_examples, w.args.vocab_size, w.cap))
    cfg = load_config(None, {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda",
                             "epochs": 1.0, "batch_size": opts.batch, "lr": 2e-4, "lora": w.lora,
                             "eval_prompts": 0, "max_length": 4096})
    print(json.dumps({"probe": "size_cost", "workload": opts.workload, "batch": opts.batch,
                      "capacity": opts.capacity or "a row a token", **environment(device)}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = assemble(cfg, random_model_bf16(w.args, device), examples, None, device, "bf16", Path(tmp) / "run",
                       Path("random"))
        run.model.train()
        batches = [b for k, ids in enumerate(run.steps) for b in micro_batches(run, ids, step=k)]
        shortest = min(batches, key=lambda b: b.input_ids.shape[1])
        tokens, segments = shortest.input_ids.shape[1], len(shortest.layout.cu_seqlens) + 1
        n_targets = shortest.target_ids.numel()
        sizes = [s for s in range(opts.lo, opts.hi + 1, opts.grain) if s > tokens]
        graphed = graph_plan.graphed(run, fused_target_loss_sum, None, bucket=opts.grain, max_graphs=len(sizes) + 64)
        graphed(shortest, n_targets)  # the warm-up (eager) and the grid's captures for the step plan
        for size in sorted(sizes, reverse=True):
            key = (size, segments)
            if opts.capacity:
                graphed.capacity[key] = min(opts.capacity, size)
            if key not in graphed.buckets or (opts.capacity and graphed.buckets[key].targets != graphed.capacity[key]):
                graphed.buckets.pop(key, None)
                if not graphed._capture_key(key, None):
                    raise SystemExit(f"size_cost: the capture of {size} tokens failed ({graphed.off})")
            bucket = graphed.buckets[key]
            if not graphed._ready(bucket):
                raise SystemExit(f"size_cost: {size} tokens did not instantiate ({graphed.off})")
        for size in sizes:
            bucket = graphed.buckets[(size, segments)]
            bucket.load(graphs.pad_packed_batch(shortest, size, run.pad_id, bucket.targets), n_targets)
            ms = replay_ms(bucket, opts.repeats)
            median = statistics.median(ms)
            print(json.dumps({"size": size, "real_tokens": tokens, "segments": segments, "target_rows": bucket.targets,
                              "ms_median": round(median, 3), "ms_min": round(min(ms), 3), "ms_max": round(max(ms), 3),
                              "ms_per_1k_tokens": round(1000 * median / size, 3)}), flush=True)


if __name__ == "__main__":
    main()
