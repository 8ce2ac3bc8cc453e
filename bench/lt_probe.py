"""Host and GPU cost of the LoRA groups' matmuls through torch (torch.mm / addmm) and through
ops.blas.gemm (cuBLASLt with the plan cached), and their agreement.

Host time: narrow shapes (the GPU work is negligible, so a call's wall time is its dispatch),
2,000 calls in a row each way. GPU time: W2 shapes (3,000 tokens, hidden 3,584), CUDA events
over 50 calls. Writes JSON rows to --json.

    python bench/lt_probe.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from blas_host import gpu_us, host_us  # noqa: E402  (bench/, the script's folder)
from hivetune.ops import blas  # noqa: E402
from hivetune.ops.lora_group import add_mm_fp32_  # noqa: E402


def cases(n: int, d: int, o: int, r: int, dev) -> dict:
    """(a, b, out, alpha, beta) of each matmul kind the LoRA groups run, torch's call beside it."""
    bf = dict(dtype=torch.bfloat16, device=dev)
    x, w = torch.randn(n, d, **bf), torch.randn(o, d, **bf) / d ** 0.5
    a_all, bd = torch.randn(3 * r, d, **bf) / d ** 0.5, torch.randn(o, 3 * r, **bf)
    g, xa = torch.randn(n, o, **bf), torch.randn(n, 3 * r, **bf)
    y, g_xa = torch.empty(n, o, **bf), torch.empty(n, 3 * r, **bf)
    dx = torch.empty(n, d, **bf)
    da = torch.zeros(3 * r, d, dtype=torch.float32, device=dev)
    db = torch.zeros(o // 2, r, dtype=torch.float32, device=dev)
    gi, xai = g[:, o // 2:], xa[:, r:2 * r]
    return {
        "y = x W^T": ((x, w.t(), y, 1.0, 0.0), lambda: torch.mm(x, w.t(), out=y)),
        "xa = s x A^T": ((x, a_all.t(), g_xa, 2.0, 0.0), lambda: torch.addmm(g_xa, x, a_all.t(), beta=0, alpha=2.0,
                                                                             out=g_xa)),
        "y += xa Bd^T": ((xa, bd.t(), y, 1.0, 1.0), lambda: y.addmm_(xa, bd.t())),
        "g_xa = s g Bd": ((g, bd, g_xa, 2.0, 0.0), lambda: torch.addmm(g_xa, g, bd, beta=0, alpha=2.0, out=g_xa)),
        "dx = g W": ((g, w, dx, 1.0, 0.0), lambda: torch.mm(g, w, out=dx)),
        "dA += g_xa^T x (fp32)": ((g_xa.t(), x, da, 1.0, 1.0),
                                  lambda: add_mm_fp32_(da, g_xa.t(), x)),
        "dB_i += g_i^T xa_i (fp32)": ((gi.t(), xai, db, 1.0, 1.0),
                                      lambda: add_mm_fp32_(db, gi.t(), xai)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="")
    opts = parser.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows = []
    narrow, wide = cases(64, 448, 512, 32, dev), cases(3000, 3584, 4608, 32, dev)
    for name in narrow:
        (args, torch_fn), (wargs, wtorch_fn) = narrow[name], wide[name]
        lt_fn, wlt_fn = (lambda a=args: blas.gemm(*a)), (lambda a=wargs: blas.gemm(*a))
        # agreement on the W2 shapes: fresh outputs from the same inputs
        a, b, out, alpha, beta = wargs
        ref, got = out.clone(), out.clone()
        if out.dtype == torch.float32:
            ref.addmm_(a.float(), b.float(), beta=beta, alpha=alpha)
        else:
            torch.addmm(ref, a, b, beta=beta, alpha=alpha, out=ref)
        blas.gemm(a, b, got, alpha, beta)
        rel = ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
        row = {"call": name, "host_us_torch": round(host_us(torch_fn, 2000), 1),
               "host_us_lt": round(host_us(lt_fn, 2000), 1),
               "gpu_us_torch": round(gpu_us(wtorch_fn), 1), "gpu_us_lt": round(gpu_us(wlt_fn), 1),
               "rel_diff_w2": rel}
        rows.append(row)
        print(row)
    print("blas stats", blas.STATS)
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows,
           "library": blas._find_library(), "stats": dict(blas.STATS)}
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
