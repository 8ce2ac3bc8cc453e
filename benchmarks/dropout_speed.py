"""GPU time of the seeded dropout kernels at W1 / W2 shapes (forward and its backward add).

    python benchmarks/dropout_speed.py [--out bench/results]     # prints, and writes dropout-speed-<commit>.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.ops import elementwise  # noqa: E402
import triton  # noqa: E402  (GPU only)
import triton.language as tl  # noqa: E402


@triton.jit
def _per_element_draw(X, Y, SEED, n, p, scale, BLOCK: tl.constexpr):
    """For comparison with the shipped kernel: one Philox draw (tl.rand) per element."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    keep = tl.rand(tl.load(SEED), i) >= p
    x = tl.load(X + i, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + i, tl.where(keep, x * scale, 0.0).to(Y.dtype.element_ty), mask=m)


def per_element(x, seed, p):
    y = torch.empty_like(x)
    n = x.numel()
    _per_element_draw[(triton.cdiv(n, 1024),)](x, y, seed, n, p, 1.0 / (1.0 - p), BLOCK=1024)
    return y


def gpu_us(fn, reps: int = 50) -> float:
    """GPU microseconds per call: `reps` calls captured in one CUDA graph and replayed, so the
    host's launch cost (~20-45 us a Triton launch, more than these kernels take) stays out."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


def main() -> None:
    import argparse
    import json
    from datetime import datetime

    from hivetune.workflows.bench import environment, git_commit

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/hivetune-bench")
    out_dir = Path(parser.parse_args().out)
    rows = []
    seed = torch.tensor([7], device="cuda")
    for name, shape in (("W1", (1600, 896)), ("W2", (2896, 3584)), ("W2 down_proj", (2896, 18944))):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        out, t = torch.randn_like(x), torch.randn_like(x)
        fwd = gpu_us(lambda: elementwise.dropout_seeded(x, seed, 0.05))
        bwd = gpu_us(lambda: elementwise.seeded_masked_add_(out, t, seed, 0.05))
        old = gpu_us(lambda: per_element(x, seed, 0.05))
        mb = x.numel() * 2 / 1e6
        print(f"{name} {list(shape)}: dropout {fwd:.1f} us ({2 * mb / fwd:.2f} TB/s), "
              f"masked add {bwd:.1f} us ({3 * mb / bwd:.2f} TB/s); one draw per element (before): dropout {old:.1f} us")
        rows.append({"shape": name, "elements": list(shape), "dropout_us": round(fwd, 2),
                     "masked_add_us": round(bwd, 2), "one_draw_per_element_dropout_us": round(old, 2)})
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"dropout-speed-{git_commit()}-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps({"benchmark": "seeded_dropout_kernels", "date": datetime.now().isoformat(timespec="seconds"),
                                "p": 0.05, "dtype": "bfloat16", "timing": "50 calls inside one CUDA graph",
                                "rows": rows, "environment": environment(torch.device("cuda"))}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
