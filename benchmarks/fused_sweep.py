"""GPU time of the norm / SwiGLU kernels that carry the LoRA dropout (elementwise.rms_norm_dropped,
swiglu_dropped) at W1 / W2 shapes, for each launch shape tried, against the kernels they replace
(rms_norm + dropout_seeded + the masked add; SwiGLU + the in-matmul dropout's share).

    python benchmarks/fused_sweep.py [--out bench/results]   # prints, and writes fused-sweep-<commit>.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dropout_speed import gpu_us  # noqa: E402  (a CUDA graph of repeated calls, timed)
from hivetune.ops import elementwise as ew  # noqa: E402

SHAPES = {"W1": (1920, 896, 4864), "W2": (2900, 3584, 18944)}  # tokens, hidden, intermediate


def norm_times(t: int, d: int) -> dict:
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([7], device="cuda")
    dy, dyd, dr = (torch.randn_like(x) for _ in range(3))
    x.requires_grad_(True)
    fwd = gpu_us(lambda: ew.rms_norm_dropped_only(x, w, 1e-6, seed, 0.05))  # the recompute (no y, no rstd)

    def both():
        y, yd, same = ew.rms_norm_dropped(x, w, 1e-6, seed, 0.05)
        torch.autograd.backward((y, yd, same), (dy, dyd, dr))

    old_fwd = gpu_us(lambda: ew.dropout_seeded(ew.rms_norm(x.detach(), w, 1e-6), seed, 0.05))
    return {"recompute_us": round(fwd, 2), "fwd_bwd_us": round(gpu_us(both, reps=20), 2),
            "old_norm_then_dropout_us": round(old_fwd, 2)}


def swiglu_times(t: int, i: int) -> dict:
    gu = torch.randn(t, 2 * i, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([7], device="cuda")
    dh, dhd = torch.randn(t, i, device="cuda", dtype=torch.bfloat16), torch.randn(t, i, device="cuda", dtype=torch.bfloat16)
    gu.requires_grad_(True)

    def both():
        h, hd = ew.swiglu_dropped(gu, seed, 0.05)
        torch.autograd.backward((h, hd), (dh, dhd))

    return {"recompute_us": round(gpu_us(lambda: ew.swiglu_dropped_only(gu.detach(), seed, 0.05)), 2),
            "fwd_bwd_us": round(gpu_us(both, reps=20), 2),
            "old_swiglu_fwd_us": round(gpu_us(lambda: ew.swiglu_raw(gu.detach())), 2)}


def main() -> None:
    import argparse
    import json
    from datetime import datetime

    from hivetune.workflows.bench import environment, git_commit

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    for name, (t, d, i) in SHAPES.items():
        for warps in (0, 1, 2, 4, 8):
            ew.NORM_DROP_WARPS = warps
            rows.append({"workload": name, "kernel": "rms_norm_dropped", "warps": warps or "auto", **norm_times(t, d)})
            print(rows[-1], flush=True)
        ew.NORM_DROP_WARPS = 0
        for block in (512, 1024, 2048):
            for warps in (2, 4, 8):
                ew.SWIGLU_DROP_BLOCK, ew.SWIGLU_DROP_WARPS = block, warps
                rows.append({"workload": name, "kernel": "swiglu_dropped", "block": block, "warps": warps,
                             **swiglu_times(t, i)})
                print(rows[-1], flush=True)
        ew.SWIGLU_DROP_BLOCK, ew.SWIGLU_DROP_WARPS = 1024, 4
    if args.out:
        path = Path(args.out) / f"fused-sweep-{git_commit()}-{datetime.now():%Y%m%d-%H%M%S}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"environment": environment(torch.device("cuda")), "rows": rows}, indent=1))
        print("->", path)


if __name__ == "__main__":
    main()
