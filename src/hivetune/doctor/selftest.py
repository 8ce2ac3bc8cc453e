"""The self-test: a matmul (fp32 and half precision) and a LoRA forward / backward on the device
checked against float64 on the CPU, and measured matmul TFLOP/s and copy bandwidth."""

from __future__ import annotations

import copy
import time

import torch

from hivetune.doctor.environment import Check, first_line


def correctness_checks(device: torch.device, half: torch.dtype) -> list[Check]:
    """A matmul in fp32 and in half precision, and a LoRA forward / backward, each against
    float64 on the CPU. fp32 tolerances allow TF32; the half-precision matmul's reference uses
    the same rounded inputs, so its tolerance covers only accumulation and output rounding."""
    dev = str(device)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 320, generator=gen), torch.randn(320, 192, generator=gen)
    half_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[half]
    checks = [
        _check("matmul_fp32", dev, 1e-3, lambda: (a.to(device) @ b.to(device), a.double() @ b.double())),
        _check(f"matmul_{half_name}", dev, 1e-2 if half == torch.bfloat16 else 2e-3,
               lambda: (a.to(device, half) @ b.to(device, half), a.to(half).double() @ b.to(half).double())),
        _check("lora_fwd_bwd_fp32", dev, 1e-3, lambda: _lora_outputs(device)),
    ]
    return checks


def _check(name: str, device: str, tolerance: float, compute) -> Check:
    try:
        out, ref = compute()
        return Check(name, device, rel_error(out, ref), tolerance)
    except Exception as e:
        return Check(name, device, None, tolerance, first_line(e))


def _lora_outputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRALinear output and gradients (x, A, B) on the device in fp32 and on the CPU in float64,
    each flattened into one vector."""
    from hivetune.model.lora import LoRALinear

    torch.manual_seed(0)
    module = LoRALinear(torch.nn.Linear(96, 80), r=8, alpha=16.0, dropout=0.0, rslora=False)
    module.base_layer.requires_grad_(False)
    with torch.no_grad():
        module.lora_B.weight.normal_(0, 0.1)  # B = 0 at init would make A's gradient zero
    gen = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(4, 12, 96, generator=gen), torch.randn(4, 12, 80, generator=gen)

    def run(m, dev, dtype):
        m = copy.deepcopy(m).to(dev, dtype)
        xd = x.to(dev, dtype).clone().requires_grad_()
        y = m(xd)
        y.backward(grad_out.to(dev, dtype))
        return torch.cat([t.detach().double().cpu().flatten()
                          for t in (y, xd.grad, m.lora_A.weight.grad, m.lora_B.weight.grad)])

    return run(module, device, torch.float32), run(module, torch.device("cpu"), torch.float64)


def measure_speed(device: torch.device, half: torch.dtype) -> dict[str, float]:
    """Matmul TFLOP/s (half precision on a GPU; fp32 and bf16 on the CPU) and copy bandwidth in
    GB/s counting bytes read plus written. About 2 s on a GPU, 1.5 s on a small CPU."""
    gpu = device.type == "cuda"
    n, seconds = (8192, 0.7) if gpu else (1024, 0.25)
    out = {}
    dtypes = [half] if gpu else [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        try:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            out[f"matmul_{name}_tflops"] = 2 * n**3 / _seconds_per_call(lambda: a @ b, device, seconds) / 1e12
            del a, b
        except Exception:  # the self-test checks already report a device that cannot compute
            pass
    try:
        size = 2**30 if gpu else 2**27  # bytes: well past the last-level cache
        if gpu:
            size = min(size, torch.cuda.mem_get_info(device)[0] // 4)
        src = torch.empty(size // 4, device=device, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        out["copy_gbps"] = 2 * size / _seconds_per_call(lambda: dst.copy_(src), device, seconds / 2) / 1e9
    except Exception:
        pass
    return {k: round(v, 3) for k, v in out.items()}


def _seconds_per_call(fn, device: torch.device, budget: float) -> float:
    """Warm up, time one call, then time as many as fit in `budget` seconds with one sync."""
    fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    calls = max(1, min(1000, int(budget / max(time.perf_counter() - start, 1e-6))))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / calls



def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float64 on the CPU."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

