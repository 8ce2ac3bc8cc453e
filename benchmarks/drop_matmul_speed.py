"""GPU microseconds of a LoRA group's dropout + A matmuls, two ways, at W1's and W2's shapes:
dropout_seeded + cuBLAS (the path before the dropout moved into the matmuls) against the
Triton kernels that drop x's tiles as they load them (ops.elementwise.drop_matmul & co).

    python benchmarks/drop_matmul_speed.py [--out FILE.json]
    python benchmarks/drop_matmul_speed.py --sweep [--out FILE.json]   # the kernels' split choices

--sweep times the forward kernel at every (row block, column split) and A's gradient at every
row split against what drop_matmul / drop_matmul_grad choose: the data for their split rules.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.workflows.bench import environment  # noqa: E402  (versions, driver, commit)
from hivetune.ops import elementwise as ew  # noqa: E402
from hivetune.ops.lora_group import mm_fp32  # noqa: E402

from dropout_speed import gpu_us  # noqa: E402  (benchmarks/: CUDA-graph replays, so no launch cost)

# (workload, group, tokens, d, n x r)
SHAPES = [("W1", "q/k/v", 1600, 896, 24), ("W1", "gate/up", 1600, 896, 16), ("W1", "o", 1600, 896, 8),
          ("W1", "down", 1600, 4864, 8), ("W2", "q/k/v", 3000, 3584, 96), ("W2", "gate/up", 3000, 3584, 64),
          ("W2", "o", 3000, 3584, 32), ("W2", "down", 3000, 18944, 32)]


def sweep(out_path: str) -> None:
    rows = []
    p, s = 0.05, 2.0
    seed = torch.tensor([7], device="cuda")
    for workload, group, t, d, r in SHAPES:  # R above DROP_MM_MAX_R too: the data for that bound
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(r, d, device="cuda", dtype=torch.bfloat16) * 0.02
        g = torch.randn(t, r, device="cuda", dtype=torch.bfloat16)
        want = ew.drop_matmul(x, a, seed, p, s).float()
        row = {"workload": workload, "group": group, "tokens": t, "d": d, "r_total": r,
               "chosen_forward": round(gpu_us(lambda: ew.drop_matmul(x, a, seed, p, s)), 1),
               "chosen_grad_a": round(gpu_us(lambda: ew.drop_matmul_grad(g, x, seed, p)), 1),
               "forward": {}, "grad_a": {}}
        for bt in (16, 64):
            for splits in (1, 2, 4, 8, 16):
                got = ew.drop_matmul(x, a, seed, p, s, bt=bt, splits=splits).float()
                assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (bt, splits)
                row["forward"][f"bt{bt}-s{splits}"] = round(
                    gpu_us(lambda: ew.drop_matmul(x, a, seed, p, s, bt=bt, splits=splits)), 1)
        for splits in (1, 2, 4, 8, 16, 32):
            row["grad_a"][f"s{splits}"] = round(gpu_us(lambda: ew.drop_matmul_grad(g, x, seed, p, splits=splits)), 1)
        best_f = min(row["forward"], key=row["forward"].get)
        best_g = min(row["grad_a"], key=row["grad_a"].get)
        print(f"{workload} {group:8s}: forward chosen {row['chosen_forward']} us, best {best_f} "
              f"{row['forward'][best_f]} us; A grad chosen {row['chosen_grad_a']} us, best {best_g} "
              f"{row['grad_a'][best_g]} us")
        rows.append(row)
    if out_path:
        Path(out_path).write_text(json.dumps({"device": torch.cuda.get_device_name(), "sweep": rows,
                                              "environment": environment(torch.device("cuda"))}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    parser.add_argument("--sweep", action="store_true", help="time the kernels' split choices")
    opts = parser.parse_args()
    if opts.sweep:
        sweep(opts.out)
        return
    rows = []
    p, s = 0.05, 2.0
    for workload, group, t, d, r in SHAPES:
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(r, d, device="cuda", dtype=torch.bfloat16) * 0.02
        g = torch.randn(t, r, device="cuda", dtype=torch.bfloat16)
        out = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        seed = torch.tensor([7], device="cuda")

        def old_fwd():
            xd = ew.dropout_seeded(x, seed, p)
            xa = x.new_empty((t, r))
            torch.addmm(xa, xd, a.t(), beta=0, alpha=s, out=xa)

        def old_grad():
            mm_fp32(g.t(), ew.dropout_seeded(x, seed, p))

        def old_add():
            ew.seeded_masked_add_(out, g @ a, seed, p)

        times = {"old_forward": gpu_us(old_fwd), "old_grad_a": gpu_us(old_grad), "old_masked_add": gpu_us(old_add),
                 "new_forward": gpu_us(lambda: ew.drop_matmul(x, a, seed, p, s)),
                 "new_grad_a": gpu_us(lambda: ew.drop_matmul_grad(g, x, seed, p)),
                 "new_masked_add": gpu_us(lambda: ew.matmul_drop_add_(out, g, a, seed, p))}
        old = times["old_forward"] + times["old_grad_a"] + times["old_masked_add"]
        new = times["new_forward"] + times["new_grad_a"] + times["new_masked_add"]
        rows.append({"workload": workload, "group": group, "tokens": t, "d": d, "r_total": r,
                     **{k: round(v, 1) for k, v in times.items()}, "old_us": round(old, 1), "new_us": round(new, 1)})
        print(f"{workload} {group:8s} T {t} d {d:5d} R {r:3d}: old {old:7.1f} us "
              f"({times['old_forward']:.1f} + {times['old_grad_a']:.1f} + {times['old_masked_add']:.1f}), "
              f"new {new:7.1f} us ({times['new_forward']:.1f} + {times['new_grad_a']:.1f} + "
              f"{times['new_masked_add']:.1f})")
    if opts.out:
        Path(opts.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows,
                                              "environment": environment(torch.device("cuda"))}, indent=1))


if __name__ == "__main__":
    main()
