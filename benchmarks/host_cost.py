"""Host microseconds per call of what an eager step is made of, and how many of each one eager
W2 micro-step makes: where an eager step waits for the host, each call's host cost is its time.

    python benchmarks/host_cost.py [--counts] [--results benchmarks/results] [--commit C]

Each figure is the host's time per call over 20,000 calls on small operands (the GPU work of each
is a few microseconds, so the host sets the pace and the queue never fills): a torch kernel
(add_), torch.mm with out=, ops.blas.gemm on a cached plan (given out, and making it), a Triton
launch through its JIT (Triton's binder and cache key) and through the compiled kernel, an
autograd Function's apply, a CUDA torch.empty, and the reference switch's check (forced). With
--counts, W2 in its 24 GiB configuration runs four steps and the fourth's calls of ops.blas.gemm
and of each Triton kernel are counted. Appends a line to <results>/host-cost-<device>.jsonl.
Needs a CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from kernel_timing import add_result_flags, append_kernel_rows  # noqa: E402
from hivetune.core.fallbacks import forced  # noqa: E402
from hivetune.ops import blas  # noqa: E402


def host_us(fn, n: int = 20000) -> float:
    """Host microseconds per call of fn, after 300 untimed calls."""
    for _ in range(300):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(us, 2)


class _Same(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def per_call() -> list[dict]:
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    d = torch.device("cuda")
    a, b = (torch.randn(64, 64, device=d, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(64, 64, device=d, dtype=torch.bfloat16)
    x = torch.randn(128, device=d)
    y = torch.empty_like(x)
    compiled = copy.warmup(x, y, 128, BLOCK=128, grid=(1,))
    calls = {
        "torch add_": lambda: y.add_(1.0),
        "torch.mm(out=)": lambda: torch.mm(a, b, out=out),
        "blas.gemm(out)": lambda: blas.gemm(a, b, out),
        "blas.gemm (new out)": lambda: blas.gemm(a, b),
        "triton launch (JIT)": lambda: copy[(1,)](x, y, 128, BLOCK=128),
        "triton launch (compiled kernel)": lambda: compiled[(1, 1, 1)](x, y, 128, 128),
        "Function.apply": lambda: _Same.apply(x),
        "torch.empty (CUDA)": lambda: torch.empty((64, 64), device=d, dtype=torch.bfloat16),
        "forced()": lambda: forced("cublaslt"),
    }
    return [{"call": name, "host_us": host_us(fn)} for name, fn in calls.items()]


def w2_counts() -> dict:
    """ops.blas.gemm calls and each Triton kernel's launches in W2's (24 GiB) fourth micro-step."""
    from triton.runtime import jit

    from hivetune.train import loop
    from hivetune.workflows import bench

    counts: collections.Counter = collections.Counter()
    run = jit.JITFunction.run

    def counted_run(self, *args, **kwargs):
        counts["triton " + self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    gemm = blas.gemm

    def counted_gemm(*args, **kwargs):
        counts["blas.gemm"] += 1
        return gemm(*args, **kwargs)

    jit.JITFunction.run = counted_run
    for module in list(sys.modules.values()):  # the modules that imported gemm by name
        if getattr(module, "__name__", "").startswith("hivetune.") and getattr(module, "gemm", None) is gemm:
            module.gemm = counted_gemm
    seen = []
    step = loop.optimizer_step

    def counted_step(*args, **kwargs):
        seen.append(dict(counts))
        return step(*args, **kwargs)

    loop.optimizer_step = counted_step
    bench.bench("W2", max_steps=4, out_dir="/tmp/host-cost", table=None,
                overrides={"host_embeddings": True, "activation_offload": 5}, memory_cap_gib=24)
    before, after = seen[2], seen[3]
    return {k: after[k] - before.get(k, 0) for k in sorted(after, key=lambda k: before.get(k, 0) - after[k])
            if after[k] - before.get(k, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", action="store_true", help="count the calls of one eager W2 micro-step")
    add_result_flags(parser)
    ns = parser.parse_args()
    rows = per_call()
    for row in rows:
        print(f"{row['call']:34s} {row['host_us']:7.2f} us")
    extra = {}
    if ns.counts:
        extra["w2_micro_step_calls"] = w2_counts()
        print(extra["w2_micro_step_calls"])
    append_kernel_rows(ns.results, "host-cost", rows, ns.commit, **extra)


if __name__ == "__main__":
    main()
