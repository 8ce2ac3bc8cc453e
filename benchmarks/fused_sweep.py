"""GPU time of the norm / SwiGLU kernels that carry the LoRA dropout (ops.norm.rms_norm_dropped,
ops.swiglu.swiglu_dropped) at W1 / W2 shapes, for each launch shape, against the separate kernels
(rms_norm then dropout_seeded; SwiGLU alone).

    python benchmarks/fused_sweep.py [--results benchmarks/results] [--commit C]

Prints each row and appends them to benchmarks/results/fused-sweep-<device>.jsonl. Needs a CUDA
GPU and Triton.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_timing import add_result_flags, append_kernel_rows, gpu_us  # noqa: E402
from hivetune.ops import norm, swiglu  # noqa: E402
from hivetune.ops.dropout import dropout_seeded  # noqa: E402
from hivetune.ops.triton_util import load_kernels  # noqa: E402

SHAPES = {"W1": (1920, 896, 4864), "W2": (2900, 3584, 18944)}  # tokens, hidden, intermediate


def norm_times(t: int, d: int) -> dict:
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([7], device="cuda")
    dy, dyd, dr = (torch.randn_like(x) for _ in range(3))
    x.requires_grad_(True)
    fwd = gpu_us(lambda: norm.rms_norm_dropped_only(x, w, 1e-6, seed, 0.05))  # the recompute (no y, no rstd)

    def both():
        y, yd, same = norm.rms_norm_dropped(x, w, 1e-6, seed, 0.05)
        torch.autograd.backward((y, yd, same), (dy, dyd, dr))

    apart = gpu_us(lambda: dropout_seeded(norm.rms_norm(x.detach(), w, 1e-6), seed, 0.05))
    return {"recompute_us": round(fwd, 2), "fwd_bwd_us": round(gpu_us(both, reps=20), 2),
            "norm_then_dropout_us": round(apart, 2)}


def swiglu_times(t: int, i: int) -> dict:
    gu = torch.randn(t, 2 * i, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([7], device="cuda")
    dh, dhd = torch.randn(t, i, device="cuda", dtype=torch.bfloat16), torch.randn(t, i, device="cuda", dtype=torch.bfloat16)
    gu.requires_grad_(True)

    def both():
        h, hd = swiglu.swiglu_dropped(gu, seed, 0.05)
        torch.autograd.backward((h, hd), (dh, dhd))

    return {"recompute_us": round(gpu_us(lambda: swiglu.swiglu_dropped_only(gu.detach(), seed, 0.05)), 2),
            "fwd_bwd_us": round(gpu_us(both, reps=20), 2),
            "swiglu_alone_us": round(gpu_us(lambda: swiglu.swiglu_raw(gu.detach())), 2)}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_result_flags(parser)
    ns = parser.parse_args()
    load_kernels()  # the kernels are defined at the first fused call of a training step
    rows = []
    for name, (t, d, i) in SHAPES.items():
        for warps in (0, 1, 2, 4, 8):
            norm.NORM_DROP_WARPS = warps
            rows.append({"workload": name, "kernel": "rms_norm_dropped", "warps": warps or "auto", **norm_times(t, d)})
            print(rows[-1], flush=True)
        norm.NORM_DROP_WARPS = 0
        for block in (512, 1024, 2048):
            for warps in (2, 4, 8):
                swiglu.SWIGLU_DROP_BLOCK, swiglu.SWIGLU_DROP_WARPS = block, warps
                rows.append({"workload": name, "kernel": "swiglu_dropped", "block": block, "warps": warps,
                             **swiglu_times(t, i)})
                print(rows[-1], flush=True)
        swiglu.SWIGLU_DROP_BLOCK, swiglu.SWIGLU_DROP_WARPS = 1024, 4
    append_kernel_rows(ns.results, "fused-sweep", rows, ns.commit, "p 0.05, bf16, CUDA-graph replays")


if __name__ == "__main__":
    main()
