"""Common training GPUs: memory and dense (no sparsity) matmul rates from the vendors' datasheets.

memory_gib is what the device reports (torch.cuda.get_device_properties), a little under the
marketing GB. fp32 is plain fp32 (no TF32: hivetune does not enable it); for AMD CDNA cards the
fp32 matrix-core rate. A card without bf16 units (core.device.bf16_units of its arch) lists
bf16 = None: --precision auto takes fp16 there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hivetune.core.device import cuda_index
from hivetune.core.errors import UserError


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16_tflops: float | None
    fp16_tflops: float
    fp32_tflops: float
    bandwidth_gbs: float
    vendor: str = "nvidia"
    arch: str = ""  # sm_XY or gfxNNN: core.device.bf16_units reads it

    def tflops(self, precision: str) -> float:
        if precision == "fp32":
            return self.fp32_tflops
        if precision == "bf16":
            return self.bf16_tflops or self.fp32_tflops  # emulated: no faster than fp32
        return self.fp16_tflops


GPUS = [
    GPU("RTX 3090", 23.7, 71.0, 71.0, 35.6, 936, arch="sm_86"),
    GPU("RTX 4090", 23.6, 165.2, 165.2, 82.6, 1008, arch="sm_89"),
    GPU("RTX 5090", 31.4, 209.5, 209.5, 104.8, 1792, arch="sm_120"),
    GPU("Radeon AI PRO R9700", 31.9, 191.0, 191.0, 47.8, 644, "amd", arch="gfx1201"),
    GPU("RX 7900 XTX", 24.0, 122.8, 122.8, 61.4, 960, "amd", arch="gfx1100"),
    GPU("MI50", 32.0, None, 26.5, 13.3, 1024, "amd", arch="gfx906"),
    GPU("MI60", 32.0, None, 29.5, 14.7, 1024, "amd", arch="gfx906"),
    GPU("MI100", 32.0, 92.3, 184.6, 46.1, 1229, "amd", arch="gfx908"),
    GPU("MI210", 64.0, 181.0, 181.0, 45.3, 1638, "amd", arch="gfx90a"),
    GPU("MI250", 64.0, 181.0, 181.0, 45.3, 1638, "amd", arch="gfx90a"),  # one GCD: torch sees each as a GPU
    GPU("MI300X", 192.0, 1307.0, 1307.0, 163.4, 5300, "amd", arch="gfx942"),
    GPU("T4", 14.6, None, 65.0, 8.1, 320, arch="sm_75"),
    GPU("V100", 31.7, None, 125.0, 15.7, 900, arch="sm_70"),
    GPU("A10", 22.1, 125.0, 125.0, 31.2, 600, arch="sm_86"),
    GPU("L4", 22.0, 121.0, 121.0, 30.3, 300, arch="sm_89"),
    GPU("L40S", 44.4, 362.0, 362.0, 91.6, 864, arch="sm_89"),
    GPU("A100 40GB", 39.4, 312.0, 312.0, 19.5, 1555, arch="sm_80"),
    GPU("A100 80GB", 79.1, 312.0, 312.0, 19.5, 2039, arch="sm_80"),
    GPU("H100 SXM", 79.1, 989.0, 989.0, 67.0, 3350, arch="sm_90"),
    GPU("H100 PCIe", 79.1, 756.0, 756.0, 51.0, 2000, arch="sm_90"),
    GPU("H200", 139.8, 989.0, 989.0, 67.0, 4800, arch="sm_90"),
    GPU("B200", 178.4, 2250.0, 2250.0, 75.0, 8000, arch="sm_100"),
]


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def find_gpu(name: str) -> GPU:
    """A table entry by name, forgiving case, spaces and vendor words: 'NVIDIA GeForce RTX 4090',
    'A100-SXM4-80GB' and 'AMD Instinct MI300X' all work. Each entry's words are looked for in the
    name; its first word must be there; the entry matching most letters wins."""
    key = _key(name)
    best, best_score = None, 0
    for gpu in GPUS:
        words = [_key(w) for w in gpu.name.split()]
        if words[0] not in key and not (len(words) > 1 and "".join(words[:2]) in key):
            if not any(w in key for w in words if len(w) > 3 and w[-1].isdigit()):
                continue
        score = sum(len(w) for w in words if w in key)
        if score > best_score:
            best, best_score = gpu, score
    if best is None:
        raise UserError(f"--gpu: unknown GPU {name!r} (known: {', '.join(g.name for g in GPUS)}; "
                        f"or give --memory GIB)")
    return best


def gpu_for_device_name(name: str) -> GPU | None:
    """The table entry for torch.cuda.get_device_name(), or None."""
    try:
        return find_gpu(name)
    except UserError:
        return None


def device_memory_bytes(device) -> int:
    """What this process may hold on a CUDA device: its memory times the per-process fraction
    where one is set (bench --memory-cap), and no more than is free now plus what this process
    already holds (another process on the same GPU keeps its share); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    index = cuda_index(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)
    free, total = torch.cuda.mem_get_info(index)
    return int(min(total * fraction, free + torch.cuda.memory_reserved(index)))
