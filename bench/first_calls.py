"""The host time of the loop's first clipping and optimizer step, against the later ones (issue 10).

W2's DDP step timeline (2 x H200, cc35b65) put 57-79 ms of host time in the first step's
clipping (three kernels on one flat buffer; ~0.5 ms later) and 88-135 ms in its optimizer step
(~0.6 ms later), with the GPU idle meanwhile. This probe, in a fresh process, takes W2's LoRA
tensors (Qwen2.5-7B shape, r 32: 392 tensors, 80.7M fp32 values) laid out as the CUDA graphs lay
them out (parameters and gradients each views of one buffer) and times, on the host:
- kernels first met in the process: a 16-value vector_norm, clamp and mul, and a one-tensor
  fused AdamW step, each called twice (a first call that loads kernels is the slow one);
- hivetune's clip_grad_norm over the gradients, three times;
- FusedAdamW's step, three times, the first split into torch's state set-up (_init_group), its
  fused kernels, and FusedAdamW's flat re-layout (_flat).
Run it once as it is and once with CUDA_MODULE_LOADING=EAGER (every kernel loaded at start-up).
Usage: python bench/first_calls.py [--warm] (--warm: fastpath.tail_kernels first, timed, as
fastpath.prewarm's thread runs it before the loop). One JSON line on stdout, with the
environment (versions, commit); session 30's files in bench/results/ddp-30/ predate it and name
their commit in the file name only."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.workflows.bench import environment  # noqa: E402
from hivetune.core.fastpath import FusedAdamW, clip_grad_norm, tail_kernels  # noqa: E402

HIDDEN, INTER, KV, LAYERS, R = 3584, 18944, 512, 28, 32  # Qwen2.5-7B, W2's LoRA rank


def lora_shapes() -> list[tuple[int, int]]:
    out = []
    for _ in range(LAYERS):
        for fan_in, fan_out in ((HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
                                (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)):
            out += [(R, fan_in), (fan_out, R)]
    return out


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return round(host * 1e3, 3), out


def small_kernels() -> dict:
    x = torch.ones(16, device="cuda")
    p = torch.nn.Parameter(torch.zeros(16, device="cuda"))
    p.grad = torch.ones(16, device="cuda")
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    out = {}
    for k in (1, 2):
        out[f"vector_norm_{k}"] = timed(lambda: torch.linalg.vector_norm(x, 2.0))[0]
        out[f"clamp_mul_{k}"] = timed(lambda: x.mul_(torch.clamp(1.0 / (x.sum() + 1e-6), max=1.0)))[0]
        out[f"fused_adamw_{k}"] = timed(opt.step)[0]
    return out


def main() -> None:
    warm = "--warm" in sys.argv
    t0 = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    result = {"cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "(torch's default)"), "warm": warm,
              "context_ms": round((time.perf_counter() - t0) * 1e3, 1), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__}
    if warm:  # the first run under cProfile (stderr: what its time went to)
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        first = timed(lambda: tail_kernels(torch.device("cuda")))[0]
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        result["tail_kernels_ms"] = [first, timed(lambda: tail_kernels(torch.device("cuda")))[0]]
    shapes = lora_shapes()
    total = sum(a * b for a, b in shapes)
    flat_p = torch.zeros(total, device="cuda")
    flat_g = torch.randn(total, device="cuda") * 1e-3
    params, at = [], 0
    for a, b in shapes:
        p = torch.nn.Parameter(flat_p[at:at + a * b].view(a, b))
        p.grad = flat_g[at:at + a * b].view(a, b)
        params.append(p)
        at += a * b
    torch.cuda.synchronize()
    result["tensors"], result["values"] = len(params), total
    result["clip_ms"] = [timed(lambda: clip_grad_norm(params, 1.0))[0] for _ in range(3)]
    opt = FusedAdamW(params, lr=2e-4, weight_decay=0.0, fused=True)
    parts: dict[str, float] = {}

    def wrap(owner, name):
        original = getattr(owner, name)

        def inner(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[name] = round(parts.get(name, 0.0) + (time.perf_counter() - t) * 1e3, 3)
        setattr(owner, name, inner)
        return original

    init_group = wrap(torch.optim.AdamW, "_init_group")
    flat = wrap(FusedAdamW, "_flat")
    result["optimizer_ms"] = [timed(opt.step)[0] for _ in range(3)]
    torch.optim.AdamW._init_group, FusedAdamW._flat = init_group, flat
    result["first_step_parts_ms"] = parts
    if not warm:
        result["small_after"] = small_kernels()
    result["environment"] = environment(torch.device("cuda"))  # after the timings; HIVETUNE_COMMIT wins
    print(json.dumps(result))


if __name__ == "__main__":
    main()
