"""Host microseconds of a cuBLAS matmul call by when it runs: the first call of a shape, later
calls of it (eager), and calls inside a CUDA graph capture (a new shape, a shape already run).
W1's warm-up and captures spend ~0.1 s a pass in ~400 matmul calls; this says which of these
costs that is. Shapes: W1's (Qwen2.5-0.5B, LoRA r 16) at a bucket's token count.

    python bench/cublas_host.py [--tokens 1920] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def shapes(n: int) -> list[tuple[str, tuple, tuple, str]]:
    """(name, a shape, b shape, how) for one W1 layer's kinds of matmul at n tokens."""
    return [("qkv", (n, 944), (944, 1152), "mm"), ("gate_up", (n, 928), (928, 9728), "mm"),
            ("down+res", (n, 4864), (4864, 896), "addmm"), ("xa", (n, 896), (896, 48), "addmm0"),
            ("bwd_gu", (n, 9728), (9728, 928), "mm"), ("dB", (4864, n), (n, 16), "fp32add"),
            ("dA", (32, n), (n, 896), "fp32add")]


def call(how, a, b, c, c32):
    if how == "mm":
        return torch.mm(a, b)
    if how == "addmm":
        return torch.addmm(c, a, b)
    if how == "addmm0":
        return torch.addmm(c, a, b, beta=0, alpha=2.0, out=c)
    return torch.addmm(c32, a, b, out_dtype=torch.float32, out=c32)


def timed(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1920)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    dev = torch.device("cuda")
    torch.mm(torch.ones(8, 8, device=dev), torch.ones(8, 8, device=dev))  # context, handle
    torch.cuda.synchronize()
    rows = []
    for n in (opts.tokens, opts.tokens + 128):
        for name, sa, sb, how in shapes(n):
            a = torch.randn(sa, device=dev, dtype=torch.bfloat16)
            b = torch.randn(sb, device=dev, dtype=torch.bfloat16)
            c = torch.randn((sa[0], sb[1]), device=dev, dtype=torch.bfloat16)
            c32 = torch.zeros((sa[0], sb[1]), device=dev, dtype=torch.float32)
            torch.cuda.synchronize()
            first = timed(lambda: call(how, a, b, c, c32), 1)
            torch.cuda.synchronize()
            again = []
            for _ in range(20):
                again.append(timed(lambda: call(how, a, b, c, c32), 1))
                torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                g.capture_begin()
                captured = [timed(lambda: call(how, a, b, c, c32), 1) for _ in range(10)]
                g.capture_end()
            torch.cuda.synchronize()
            rows.append({"tokens": n, "matmul": name, "how": how, "first_us": round(first, 1),
                         "eager_us": round(sorted(again)[10], 1), "captured_first_us": round(captured[0], 1),
                         "captured_us": round(sorted(captured[1:])[4], 1)})
            print(rows[-1], flush=True)
    # a shape new to the capture itself
    n = opts.tokens + 256
    a = torch.randn((n, 928), device=dev, dtype=torch.bfloat16)
    b = torch.randn((928, 9728), device=dev, dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g.capture_begin()
        new = [timed(lambda: torch.mm(a, b), 1) for _ in range(5)]
        g.capture_end()
    print({"new_shape_in_capture_us": [round(x, 1) for x in new]})
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        name = Path(opts.out) / f"cublas-host-{torch.cuda.get_device_name().split()[1].lower()}.json"
        name.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "rows": rows, "new_shape_in_capture_us": new}, indent=1))


if __name__ == "__main__":
    main()
