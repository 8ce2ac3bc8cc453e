"""Choosing the device and the precision by capability, not by vendor name."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from hivetune.core.errors import UserError
from hivetune.core.fallbacks import FORCE_ENV, forced, note_fallback

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda requested but torch sees no GPU (run `hivetune doctor`)")
    return torch.device(name)


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512_BF16 makes bf16 matmuls ~4x faster than fp32 on the CPU (measured here);
    without them bf16 is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("amx_bf16", "avx512_bf16"))


def resolve_precision(name: str, device: torch.device) -> str:
    if name != "auto":
        if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError("precision: bf16 is not supported by this GPU; use fp16 or fp32")
        return name
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported() and not forced("gpu_bf16"):
            return "bf16"
        why = f"{FORCE_ENV} asks for the reference" if forced("gpu_bf16") else "this GPU has no bf16"
        note_fallback("gpu_bf16", "bf16", why, "fp16 with loss scaling")
        return "fp16"
    if cpu_has_fast_bf16() and not forced("cpu_bf16"):
        return "bf16"
    why = f"{FORCE_ENV} asks for the reference" if forced("cpu_bf16") else "this CPU has no AMX or AVX512-BF16"
    note_fallback("cpu_bf16", "fast bf16 autocast", why, "fp32")
    return "fp32"


def set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)
    else:
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def cuda_index(device: torch.device) -> int:
    """A CUDA device's index: its own, or the current device's where it names none ("cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def cap_memory(device: torch.device, gib: float) -> None:
    """Let this process's caching allocator hold at most `gib` GiB of a CUDA device (its
    per-process memory fraction, of the total cudaMemGetInfo reports, which torch multiplies it by:
    out-of-memory errors as on a card that size); 0: no cap."""
    index = cuda_index(device)
    total = torch.cuda.mem_get_info(index)[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total) if gib > 0 else 1.0, index)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
