"""GPU time of the seeded dropout kernels at W1 / W2 shapes (forward and its backward add), and
of a dropout that draws one Philox number per element, for comparison.

    python benchmarks/dropout_speed.py [--results benchmarks/results] [--commit C]

Prints the figures and appends them to benchmarks/results/dropout-speed-<device>.jsonl. Needs a
CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import sys
from functools import lru_cache
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_timing import add_result_flags, append_kernel_rows, gpu_us  # noqa: E402

P = 0.05
SHAPES = {"W1": (1600, 896), "W2": (2896, 3584), "W2 down_proj": (2896, 18944)}


@lru_cache(maxsize=None)
def per_element_kernel():
    """A Triton kernel drawing one Philox number (tl.rand) per element: the comparison."""
    import triton  # GPU only: --help runs without it
    import triton.language as tl

    @triton.jit
    def per_element_draw(X, Y, SEED, n, p, scale, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        keep = tl.rand(tl.load(SEED), i) >= p
        x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + i, tl.where(keep, x * scale, 0.0).to(Y.dtype.element_ty), mask=m)

    return per_element_draw


def per_element(x, seed, p):
    y = torch.empty_like(x)
    n = x.numel()
    per_element_kernel()[((n + 1023) // 1024,)](x, y, seed, n, p, 1.0 / (1.0 - p), BLOCK=1024)
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_result_flags(parser)
    ns = parser.parse_args()
    from hivetune.ops.dropout import dropout_seeded, seeded_masked_add_
    from hivetune.ops.triton_util import load_kernels

    load_kernels()  # the kernels are defined at the first fused call of a training step
    rows = []
    seed = torch.tensor([7], device="cuda")
    for name, shape in SHAPES.items():
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        out, t = torch.randn_like(x), torch.randn_like(x)
        fwd = gpu_us(lambda: dropout_seeded(x, seed, P))
        bwd = gpu_us(lambda: seeded_masked_add_(out, t, seed, P))
        each = gpu_us(lambda: per_element(x, seed, P))
        mb = x.numel() * 2 / 1e6
        print(f"{name} {list(shape)}: dropout {fwd:.1f} us ({2 * mb / fwd:.2f} TB/s), "
              f"masked add {bwd:.1f} us ({3 * mb / bwd:.2f} TB/s); one draw per element: dropout {each:.1f} us")
        rows.append({"shape": name, "elements": list(shape), "dropout_us": round(fwd, 2),
                     "masked_add_us": round(bwd, 2), "one_draw_per_element_dropout_us": round(each, 2)})
    append_kernel_rows(ns.results, "dropout-speed", rows, ns.commit, f"p {P}, bf16, 50 calls in one CUDA graph")


if __name__ == "__main__":
    main()
