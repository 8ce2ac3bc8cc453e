"""GPU benchmark: a frozen linear on a quantized base, forward and input gradient, against the
bf16 matmul, at the W2 (Qwen2.5-7B) and 14B shapes and several token counts.

For each (shape, tokens) it times, in microseconds of GPU time (kernel_timing.gpu_us):
    bf16        F.linear / g @ W on the dense bf16 weight (the floor)
    nf4_dequant the whole weight dequantized to bf16 by one Triton kernel, then cuBLAS
    int8_dequant  the same for int8
and appends one line to benchmarks/results/quant-matmul-<device>.jsonl.

    python benchmarks/quant_matmul.py [--tokens 16,256,2944,8192] [--results DIR] [--commit C]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kernel_timing import add_result_flags, append_kernel_rows, gpu_us  # noqa: E402

from hivetune.ops import int8, nf4  # noqa: E402

# (name, out, in): the linears of a Qwen2.5-7B and a Qwen2.5-14B layer
SHAPES = [("7b.qkv_q", 3584, 3584), ("7b.kv", 512, 3584), ("7b.gate_up", 18944, 3584), ("7b.down", 3584, 18944),
          ("14b.q", 5120, 5120), ("14b.gate_up", 13824, 5120), ("14b.down", 5120, 13824)]


def time_shape(name: str, n: int, k: int, m: int) -> dict:
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    q = nf4.quantize(w)
    p = (q.packed, q.q_absmax, q.absmax2, q.offset)
    i8 = int8.quantize(w)
    row = {"shape": name, "out": n, "in": k, "tokens": m}
    row["bf16_fwd_us"] = gpu_us(lambda: F.linear(x, w))
    row["bf16_dx_us"] = gpu_us(lambda: g @ w)
    row["nf4_dequant_us"] = gpu_us(lambda: nf4.dequantize_triton(*p, (n, k), torch.bfloat16))
    row["nf4_dequant_fwd_us"] = gpu_us(lambda: F.linear(x, nf4.dequantize_triton(*p, (n, k), torch.bfloat16)))
    row["nf4_dequant_dx_us"] = gpu_us(lambda: g @ nf4.dequantize_triton(*p, (n, k), torch.bfloat16))
    row["int8_dequant_fwd_us"] = gpu_us(lambda: F.linear(x, int8.dequantize(*i8, torch.bfloat16)))
    return {k_: round(v, 1) if isinstance(v, float) else v for k_, v in row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,256,2944,8192", help="token counts (rows of x)")
    add_result_flags(parser)
    ns = parser.parse_args()
    rows = []
    for m in (int(t) for t in ns.tokens.split(",")):
        for name, n, k in SHAPES:
            rows.append(time_shape(name, n, k, m))
            r = rows[-1]
            print(f"{name:12s} M={m:5d}  bf16 {r['bf16_fwd_us']:8.1f}/{r['bf16_dx_us']:8.1f}  "
                  f"dequant {r['nf4_dequant_us']:7.1f} -> {r['nf4_dequant_fwd_us']:8.1f}/{r['nf4_dequant_dx_us']:8.1f}  "
                  f"int8 {r['int8_dequant_fwd_us']:8.1f}", flush=True)
    append_kernel_rows(ns.results, "quant-matmul", rows, ns.commit)


if __name__ == "__main__":
    main()
