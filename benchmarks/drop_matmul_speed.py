"""GPU microseconds of a LoRA group's dropout + A matmuls, two ways, at W1's, W2's and W4's shapes:
dropout_seeded then cuBLAS ("apart") against the Triton kernels that drop x's tiles as they load
them ("fused": ops.lora_dropout.drop_matmul, drop_matmul_grad, matmul_drop_add_).

    python benchmarks/drop_matmul_speed.py [--results benchmarks/results] [--commit C]
    python benchmarks/drop_matmul_speed.py --sweep     # the kernels' split choices

--sweep times the forward kernel at every (row block, column split) and A's gradient at every
row split against what drop_matmul / drop_matmul_grad choose: the data for their split rules.
Each appends its rows to benchmarks/results/drop-matmul-<device>.jsonl (drop-matmul-sweep-...
for --sweep). Needs a CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_timing import add_result_flags, append_kernel_rows, gpu_us  # noqa: E402
from hivetune.ops.dropout import dropout_seeded, seeded_masked_add_  # noqa: E402
from hivetune.ops.lora_dropout import drop_matmul, drop_matmul_grad, matmul_drop_add_  # noqa: E402
from hivetune.ops.lora_grads import mm_fp32  # noqa: E402
from hivetune.ops.triton_util import load_kernels  # noqa: E402

# (workload, group, tokens, d, n x r)
SHAPES = [("W1", "q/k/v", 1600, 896, 24), ("W1", "gate/up", 1600, 896, 16), ("W1", "o", 1600, 896, 8),
          ("W1", "down", 1600, 4864, 8), ("W2", "q/k/v", 3000, 3584, 96), ("W2", "gate/up", 3000, 3584, 64),
          ("W2", "o", 3000, 3584, 32), ("W2", "down", 3000, 18944, 32), ("W4", "q/k/v", 9706, 2048, 48),
          ("W4", "gate/up", 9706, 2048, 32), ("W4", "o", 9706, 2048, 16), ("W4", "down", 9706, 6144, 16)]


def sweep(results: str, commit: str) -> None:
    rows = []
    p, s = 0.05, 2.0
    seed = torch.tensor([7], device="cuda")
    for workload, group, t, d, r in SHAPES:  # R above DROP_MM_MAX_R too: the data for that bound
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(r, d, device="cuda", dtype=torch.bfloat16) * 0.02
        g = torch.randn(t, r, device="cuda", dtype=torch.bfloat16)
        want = drop_matmul(x, a, seed, p, s).float()
        row = {"workload": workload, "group": group, "tokens": t, "d": d, "r_total": r,
               "chosen_forward": round(gpu_us(lambda: drop_matmul(x, a, seed, p, s)), 1),
               "chosen_grad_a": round(gpu_us(lambda: drop_matmul_grad(g, x, seed, p)), 1),
               "forward": {}, "grad_a": {}}
        for bt in (16, 64):
            for splits in (1, 2, 4, 8, 16):
                got = drop_matmul(x, a, seed, p, s, bt=bt, splits=splits).float()
                assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (bt, splits)
                row["forward"][f"bt{bt}-s{splits}"] = round(
                    gpu_us(lambda: drop_matmul(x, a, seed, p, s, bt=bt, splits=splits)), 1)
        for splits in (1, 2, 4, 8, 16, 32, 64, 128):
            row["grad_a"][f"s{splits}"] = round(gpu_us(lambda: drop_matmul_grad(g, x, seed, p, splits=splits)), 1)
        best_f = min(row["forward"], key=row["forward"].get)
        best_g = min(row["grad_a"], key=row["grad_a"].get)
        print(f"{workload} {group:8s}: forward chosen {row['chosen_forward']} us, best {best_f} "
              f"{row['forward'][best_f]} us; A grad chosen {row['chosen_grad_a']} us, best {best_g} "
              f"{row['grad_a'][best_g]} us")
        rows.append(row)
    append_kernel_rows(results, "drop-matmul-sweep", rows, commit, "p 0.05, bf16, CUDA-graph replays")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_result_flags(parser)
    parser.add_argument("--sweep", action="store_true", help="time the kernels' split choices")
    opts = parser.parse_args()
    load_kernels()  # the kernels are defined at the first fused call of a training step
    if opts.sweep:
        sweep(opts.results, opts.commit)
        return
    rows = []
    p, s = 0.05, 2.0
    for workload, group, t, d, r in SHAPES:
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(r, d, device="cuda", dtype=torch.bfloat16) * 0.02
        g = torch.randn(t, r, device="cuda", dtype=torch.bfloat16)
        out = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        seed = torch.tensor([7], device="cuda")

        def apart_forward():
            xd = dropout_seeded(x, seed, p)
            xa = x.new_empty((t, r))
            torch.addmm(xa, xd, a.t(), beta=0, alpha=s, out=xa)

        def apart_grad_a():
            mm_fp32(g.t(), dropout_seeded(x, seed, p))

        def apart_masked_add():
            seeded_masked_add_(out, g @ a, seed, p)

        times = {"apart_forward": gpu_us(apart_forward), "apart_grad_a": gpu_us(apart_grad_a),
                 "apart_masked_add": gpu_us(apart_masked_add), "fused_forward": gpu_us(lambda: drop_matmul(x, a, seed, p, s)),
                 "fused_grad_a": gpu_us(lambda: drop_matmul_grad(g, x, seed, p)),
                 "fused_masked_add": gpu_us(lambda: matmul_drop_add_(out, g, a, seed, p))}
        apart = times["apart_forward"] + times["apart_grad_a"] + times["apart_masked_add"]
        fused = times["fused_forward"] + times["fused_grad_a"] + times["fused_masked_add"]
        rows.append({"workload": workload, "group": group, "tokens": t, "d": d, "r_total": r,
                     **{k: round(v, 1) for k, v in times.items()}, "apart_us": round(apart, 1), "fused_us": round(fused, 1)})
        print(f"{workload} {group:8s} T {t} d {d:5d} R {r:3d}: apart {apart:7.1f} us "
              f"({times['apart_forward']:.1f} + {times['apart_grad_a']:.1f} + {times['apart_masked_add']:.1f}), "
              f"fused {fused:7.1f} us ({times['fused_forward']:.1f} + {times['fused_grad_a']:.1f} + "
              f"{times['fused_masked_add']:.1f})")
    append_kernel_rows(opts.results, "drop-matmul", rows, opts.commit, "p 0.05, bf16, CUDA-graph replays")


if __name__ == "__main__":
    main()
