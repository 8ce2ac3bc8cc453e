"""Host cost of one call of the ops a training step dispatches, on tiny CUDA tensors (the GPU
work is negligible, so the time per call is the host's: Python, the dispatcher, the launch).

    python bench/launch_cost.py [--out DIR]

Prints microseconds per call and writes launch-cost-<commit>-<time>.json with the environment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.workflows.bench import environment  # noqa: E402
from hivetune.ops import elementwise  # noqa: E402
from hivetune.ops.lora_group import lora_group, mm_fp32  # noqa: E402


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return round(1e6 * host / calls, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    opts = parser.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    a = torch.randn(64, 64, device=dev, dtype=bf)
    b = torch.randn(64, 64, device=dev, dtype=bf)
    c = torch.empty(64, 64, device=dev, dtype=bf)
    x = torch.randn(1, 64, 64, device=dev, dtype=bf)
    w = torch.ones(64, device=dev, dtype=bf)
    seed = elementwise.new_dropout_seed(dev)
    lora_a = [torch.randn(8, 64, device=dev, requires_grad=True) for _ in range(3)]
    lora_b = [torch.randn(16, 8, device=dev, requires_grad=True) for _ in range(3)]
    weight = torch.randn(48, 64, device=dev, dtype=bf)
    xg = torch.randn(64, 64, device=dev, dtype=bf, requires_grad=True)

    def group_fwd_bwd():
        y = lora_group(xg, weight, None, (16, 16, 16), 0.05, 2.0, lora_a, lora_b)
        y.sum().backward()

    # The same Triton kernel launched through its CompiledKernel's C launcher, skipping
    # JITFunction.run's per-call binding, specialisation key and option checks.
    y = torch.empty_like(a)
    n = a.numel()
    thr, scale = elementwise.keep_threshold(0.05)
    grid = (triton.cdiv(n, 128 * elementwise.SEEDED_GROUPS),)
    compiled = elementwise._seeded_dropout[grid](y, a, seed, n, thr, scale, ADD=False, NG=elementwise.SEEDED_GROUPS)
    compiled._init_handles()

    def direct():
        compiled.run(grid[0], 1, 1, torch.cuda.current_stream().cuda_stream, compiled.function,
                     compiled.packed_metadata, None, None, None, y, a, seed, n, thr, scale, False,
                     elementwise.SEEDED_GROUPS)

    def jit_run():
        elementwise._seeded_dropout[grid](y, a, seed, n, thr, scale, ADD=False, NG=elementwise.SEEDED_GROUPS)

    cases = {
        "torch.empty": lambda: torch.empty(64, 64, device=dev, dtype=bf),
        "torch.mm": lambda: torch.mm(a, b),
        "torch.mm(out=)": lambda: torch.mm(a, b, out=c),
        "mm_fp32 (mm out_dtype)": lambda: mm_fp32(a, b),
        "addmm_": lambda: c.addmm_(a, b),
        "F.linear": lambda: F.linear(a, b),
        "tensor.add_": lambda: c.add_(a),
        "rms_norm (Triton fwd)": lambda: elementwise.rms_norm(x, w, 1e-6),
        "dropout_seeded (Triton)": lambda: elementwise.dropout_seeded(a, seed, 0.05),
        "_seeded_dropout[grid](...) alone (JITFunction.run)": jit_run,
        "_seeded_dropout CompiledKernel.run (C launcher)": direct,
        "lora_group q/k/v fwd+bwd (12 kernels + autograd)": group_fwd_bwd,
    }
    with torch.no_grad():
        results = {name: per_call_us(fn) for name, fn in cases.items() if "bwd" not in name}
    results["lora_group q/k/v fwd+bwd (12 kernels + autograd)"] = per_call_us(group_fwd_bwd, 500)
    for name, us in results.items():
        print(f"{us:9.2f} us  {name}")
    env = environment(dev)
    cpu = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith("model name")]
    env["cpu"] = cpu[0] if cpu else None
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"launch-cost-{env.get('commit', 'unknown')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"environment": env, "us_per_call": results}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
