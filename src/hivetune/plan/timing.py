"""Step time from FLOPs and a measured efficiency, or from kernel dispatch when that is slower.

FLOPs per token of LoRA training: the frozen base needs forward (2N) and the gradient of its
input (2N), no weight gradient: 4N, N = matmul weights incl. the LM head (ModelArgs.
linear_weight_count); checkpointing recomputes the forward of the layers it covers: 6N with all of
them, 4N + 2N c / L with the first c of L (checkpoint_layers). Attention adds 2 q L per token and
layer forward for an example of L tokens (causal), three times that with backward (four in a
checkpointed layer).

A micro-batch takes max(FLOPs / (peak x efficiency), layers x dispatch): small models are bound
by eager PyTorch launching ~140 kernels a layer, big ones by the matmuls. Constants calibrated
by ``calibrate`` from the H200 grid (benchmarks/results/plan-grid-h200.json: each point's steady
steps, timed from a synchronisation after each) and checked against it by tests/plan/test_plan.py.
The grid's equal-length micro-batches reach 0.49 of the bf16 rate; the workloads' mixed lengths
(`hivetune bench` records the plan beside each run: W2 0.42, W4 0.45) less, so bf16 takes 0.45.
Graphed replays of small micro-batches take 0.6-0.8 ms a layer on an H200 (W1's whole runs warm
0.58-0.61 at 1,592 tokens a micro-batch, first runs 0.63-0.70; the grid's 0.5B point, timed step
by step, 0.79 at 2,048): 0.62, W1's warm epoch within 7%.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from hivetune.model.config import ModelArgs, qwen25_shape

EFFICIENCY = {"bf16": 0.45, "fp16": 0.45, "fp32": 0.63}  # of the datasheet dense rate
DISPATCH_S_PER_LAYER = 0.0054  # eager, per micro-batch (fwd + bwd + the optimizer step's share)
GRAPHED_DISPATCH_S_PER_LAYER = 0.00062  # CUDA graphs replay (train.cuda_graphs)
# method dpo: the reference pass (a forward with LoRA off, no backward) on top of the policy's
# forward + backward, in compute and in dispatch (PW1 on an H200: eager ~190 ms a step measured,
# 24 layers x 5.4 ms x 4/3 = 173 ms planned; graphed 31 ms measured, 24 x 0.62 ms x 4/3 = 20 ms planned)
REFERENCE_PASS = 4 / 3


def flops_per_token(args: ModelArgs, example_tokens: float, checkpointing: float) -> float:
    """`checkpointing`: the share of the decoder layers checkpointed (True: all, False: none)."""
    share = float(checkpointing)
    dense = (4 + 2 * share) * args.linear_weight_count
    attn_fwd = 2 * args.num_attention_heads * args.head_dim * example_tokens * args.num_hidden_layers
    return dense + attn_fwd * (3 + share)


def micro_batch_seconds(args: ModelArgs, tokens: float, example_tokens: float, checkpointing: float,
                        precision: str, tflops: float, graphs: bool = False) -> float:
    compute = tokens * flops_per_token(args, example_tokens, checkpointing) / (tflops * 1e12 * EFFICIENCY[precision])
    dispatch = args.num_hidden_layers * (GRAPHED_DISPATCH_S_PER_LAYER if graphs else DISPATCH_S_PER_LAYER)
    return max(compute, dispatch)


def calibrate(grid: str | Path | dict, peak_tflops: dict) -> dict:
    """Efficiency per precision (median over compute-bound points) and the dispatch time per
    layer (median over points far from compute-bound) from a plan-grid JSON (or its record)."""
    record = grid if isinstance(grid, dict) else json.loads(Path(grid).read_text())
    shapes = {"0.5B": (151936, 896, 4864, 24, 14, 2, True), "1.5B": (151936, 1536, 8960, 28, 12, 2, True),
              "7B": (152064, 3584, 18944, 28, 28, 4, False)}
    eff: dict = {}
    dispatch, graphed = [], []
    for pt in record["points"]:
        m, p = pt.get("measured"), pt["point"]
        if not m or not m["step_seconds"]:
            continue
        args = qwen25_shape(*shapes[p["model"]])
        step = statistics.median(m["step_seconds"])
        flops = m["tokens"] * flops_per_token(args, p["length"], p["gradient_checkpointing"])
        ideal = flops / (peak_tflops[p["precision"]] * 1e12)
        if ideal / step > 0.25:  # compute-bound
            eff.setdefault(p["precision"], []).append(ideal / step)
        elif ideal / step < 0.15:
            (graphed if p.get("cuda_graphs") else dispatch).append(step / args.num_hidden_layers)
    return {"efficiency": {k: statistics.median(v) for k, v in eff.items()},
            "dispatch_s_per_layer": statistics.median(dispatch) if dispatch else None,
            "graphed_dispatch_s_per_layer": statistics.median(graphed) if graphed else None}
