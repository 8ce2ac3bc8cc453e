"""Host microseconds and GPU microseconds of the matmul calls a W2 LoRA step makes, under each of
torch's BLAS back ends (torch.backends.cuda.preferred_blas_library: the default, cublas,
cublaslt). An eager W2 step spends ~45 ms of host time in ~950 matmul calls (cProfile, narrow
W2 at 7fd46c1); this says how much of that is the back end's per-call work.

    python bench/blas_host.py [--tokens 3000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

HIDDEN, R = 3584, 32


def calls(n: int, small: bool):
    """(name, fn builder) for the kinds of matmul call lora_group makes, at n tokens. small: the
    narrow widths (the GPU's work negligible, so the loop times the host)."""
    d, o = (448, 512) if small else (HIDDEN, 4608)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(n, d, device=dev, dtype=bf)
    w = torch.randn(o, d, device=dev, dtype=bf)
    a = torch.randn(3 * R, d, device=dev, dtype=bf)
    bd = torch.randn(o, 3 * R, device=dev, dtype=bf)
    g = torch.randn(n, o, device=dev, dtype=bf)
    xa = torch.randn(n, 3 * R, device=dev, dtype=bf)
    y = torch.empty(n, o, device=dev, dtype=bf)
    a32 = torch.zeros(3 * R, d, device=dev, dtype=torch.float32)
    b32 = torch.zeros(o, R, device=dev, dtype=torch.float32)
    return [
        ("y = x W^T (mm)", lambda: torch.mm(x, w.t())),
        ("y = r + x W^T (addmm)", lambda: torch.addmm(y, x, w.t())),
        ("xa = s x A^T (addmm beta 0, out)", lambda: torch.addmm(xa, x, a.t(), beta=0, alpha=2.0, out=xa)),
        ("y += xa Bd^T (addmm_)", lambda: y.addmm_(xa, bd.t())),
        ("g_xa = s g Bd (addmm beta 0, out)", lambda: torch.addmm(xa, g, bd, beta=0, alpha=2.0, out=xa)),
        ("dx = g W (mm)", lambda: torch.mm(g, w)),
        ("dA += g_xa^T x (addmm fp32 out)", lambda: torch.addmm(a32, xa.t(), x, out_dtype=torch.float32, out=a32)),
        ("dB = g^T xa (mm fp32)", lambda: torch.mm(g[:, :o].t(), xa[:, :R], out_dtype=torch.float32)),
        ("dB += g^T xa (addmm fp32 out)", lambda: torch.addmm(b32, g.t(), xa[:, :R], out_dtype=torch.float32, out=b32)),
    ]


def host_us(fn, reps: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    us = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return us


def gpu_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    default = str(torch.backends.cuda.preferred_blas_library())
    rows = []
    for backend in ("default", "cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(default.split(".")[-1].lower() if backend == "default" else backend)
        small = calls(opts.tokens, small=True)
        full = calls(opts.tokens, small=False)
        for (name, fs), (_, ff) in zip(small, full):
            try:
                row = {"backend": backend, "call": name, "host_us": round(host_us(fs), 1), "gpu_us": round(gpu_us(ff), 1)}
            except RuntimeError as e:
                row = {"backend": backend, "call": name, "error": str(e).splitlines()[0][:120]}
            rows.append(row)
            print(row, flush=True)
    print("torch default back end:", default)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        name = Path(opts.out) / f"blas-host-{torch.cuda.get_device_name().split()[1].lower()}.json"
        name.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "default_backend": default, "tokens": opts.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
