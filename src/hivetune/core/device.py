"""Choosing the device and the precision by capability, not by vendor name."""

from __future__ import annotations

import os
import re
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


# GPU architectures by whether they have bf16 arithmetic units. torch reports bf16 "supported" on
# every ROCm GPU and, by emulation, on CUDA GPUs before sm_80; on the GPUs listed False it runs
# bf16 by conversion to fp32, while fp16 is native, so --precision auto takes fp16 there.
BF16_UNITS = {
    "gfx803": (False, "GCN 4, RX 470 / 480 / 580"),
    "gfx900": (False, "Vega 10, MI25, RX Vega 56 / 64"),
    "gfx902": (False, "Vega APU"),
    "gfx906": (False, "Vega 20, MI50, MI60, Radeon VII"),
    "gfx909": (False, "Vega APU"),
    "gfx90c": (False, "Vega APU"),
    "gfx908": (True, "CDNA 1, MI100"),
    "gfx90a": (True, "CDNA 2, MI210, MI250"),
    "gfx942": (True, "CDNA 3, MI300X, MI325X"),
    "gfx950": (True, "CDNA 4, MI350X, MI355X"),
    "gfx10": (False, "RDNA 1 / 2, RX 5000 / 6000, PRO W6800"),  # every gfx10xx
    "gfx11": (True, "RDNA 3, RX 7000, PRO W7900"),  # every gfx11xx
    "gfx12": (True, "RDNA 4, RX 9000, AI PRO R9700"),  # every gfx12xx
}
# The architecture of GPUs named by torch's device name where it reports none (older ROCm builds
# of torch have no gcnArchName) or where a plan names a GPU: whole words of the lower-cased name.
NAME_ARCHS = (("mi25", "gfx900"), ("mi50", "gfx906"), ("mi60", "gfx906"), ("radeon vii", "gfx906"),
              ("mi100", "gfx908"), ("v100", "sm_70"), ("t4", "sm_75"), ("p100", "sm_60"))


def gpu_arch(name: str = "", arch: str = "") -> str:
    """The architecture to decide by: `arch` (gcnArchName "gfx906:sramecc+:xnack-" -> "gfx906",
    or "sm_75"), else one NAME_ARCHS knows from the device name, else ""."""
    if arch.split(":")[0].startswith(("gfx", "sm_")):
        return arch.split(":")[0]
    words = re.sub(r"[^a-z0-9]+", " ", name.lower())
    return next((a for key, a in NAME_ARCHS if re.search(rf"\b{key}\b", words)), "")


def bf16_units(name: str = "", arch: str = "") -> tuple[bool | None, str]:
    """(whether the GPU has bf16 arithmetic units, the reason in words), or (None, "") for an
    architecture this table does not know. CUDA: sm_80 (Ampere) and newer have bf16 tensor cores;
    ROCm: BF16_UNITS, by exact gfx name, else by major (gfx10, gfx11, gfx12)."""
    base = gpu_arch(name, arch)
    m = re.fullmatch(r"sm_(\d+)(\d)[af]?", base)
    if m:
        if int(m.group(1)) >= 8:
            return True, f"{base} has bf16 tensor cores"
        return False, f"{base} (before Ampere) has no bf16 units"
    known = BF16_UNITS.get(base) or BF16_UNITS.get(base[:5]) if base.startswith("gfx") else None
    if known is None:
        return None, ""
    units, gpus = known
    if units:
        return True, f"{base} ({gpus}) has bf16 units"
    return False, f"{base} ({gpus}) has no bf16 units"


def auto_gpu_precision(name: str = "", arch: str = "", torch_bf16=lambda: True) -> tuple[str, str]:
    """What --precision auto picks on a GPU, and why: ("bf16", reason) where it has bf16 units,
    ("fp16", reason) where it has none (fp16 with loss scaling). `torch_bf16()` decides for an
    architecture bf16_units does not know. train (resolve_precision), plan and doctor all ask here."""
    units, why = bf16_units(name, arch)
    if units is None:
        units = bool(torch_bf16())
        why = f"{gpu_arch(name, arch) or name or 'this GPU'}: torch reports " + ("bf16" if units else "no bf16")
    if forced("gpu_bf16"):
        return "fp16", f"{FORCE_ENV} asks for the reference"
    return ("bf16" if units else "fp16"), why


# Why an fp16 run is not CUDA-graphed: its GradScaler's scale and skipped steps are outside
# what the graphed step is captured and checked for (train.graph_plan, plan.planner say this).
FP16_NO_GRAPHS = "fp16 with loss scaling: graphed steps are bf16 only"


def device_gpu(device: torch.device) -> tuple[str, str]:
    """(device name, architecture) of a CUDA device: gcnArchName on ROCm, sm_XY on CUDA."""
    props = torch.cuda.get_device_properties(cuda_index(device))
    if torch.version.hip:
        return props.name, getattr(props, "gcnArchName", "") or ""
    return props.name, f"sm_{props.major}{props.minor}"


def device_auto_precision(device: torch.device) -> tuple[str, str]:
    """auto_gpu_precision of a present CUDA / ROCm device: (precision, why)."""
    return auto_gpu_precision(*device_gpu(device), lambda: torch.cuda.is_bf16_supported(including_emulation=False))


def resolve_precision(name: str, device: torch.device) -> str:
    if device.type == "cuda" and name in ("auto", "bf16"):
        choice, why = device_auto_precision(device)
        if name == "bf16" and choice == "fp16" and not forced("gpu_bf16"):
            raise UserError(f"precision: bf16 is not native on this GPU ({why}); use fp16, fp32 or auto")
        if name == "auto" and choice == "fp16":
            note_fallback("gpu_bf16", "bf16", why, "fp16 with loss scaling")
        return choice if name == "auto" else name
    if name != "auto":
        return name
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
