"""What the doctor knows about a machine: the ``Environment`` it probes, the ``Check``s of its
self-test and the ``Finding``s it diagnoses. Plain dataclasses, so tests fake any machine."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PACKAGES = ("transformers", "peft", "gguf", "liger-kernel", "accelerate", "torchao")
ENV_VARS = ("HSA_OVERRIDE_GFX_VERSION", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
            "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
FUSED_SDPA = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn")
SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    severity: str  # "error" (doctor exits 1) | "warning" | "info"
    code: str  # stable name, e.g. "gpu-arch-unsupported"
    message: str  # what is wrong and what it breaks
    fix: str  # what to do about it


@dataclass
class GPUInfo:
    index: int
    name: str
    arch: str  # sm_90, or the gfx name ROCm reports (HSA_OVERRIDE_GFX_VERSION already applied)
    memory_bytes: int
    bf16: bool  # bf16 units: what --precision auto takes (core.device.auto_gpu_precision)
    bf16_why: str = ""  # its reason, as train and plan print it


@dataclass
class CPUInfo:
    model: str = ""
    cores: int = 0  # usable by this process (its affinity mask)
    capability: str = ""  # the vector ISA torch's CPU kernels use: AVX2, AVX512, ...
    fast_bf16: bool = False  # AMX / AVX512-BF16 (hivetune.core.device.cpu_has_fast_bf16)


@dataclass
class Check:
    """One self-test result: a computation on the device against a CPU float64 reference."""

    name: str
    device: str
    rel_error: float | None = None  # max |out - ref| / max |ref|; None when it raised
    tolerance: float = 0.0
    error: str = ""  # the exception, when it raised

    @property
    def passed(self) -> bool:
        return not self.error and self.rel_error is not None and self.rel_error <= self.tolerance


@dataclass
class Environment:
    torch_version: str = ""
    build: str = "cpu"  # "cuda" | "rocm" | "cpu"
    cuda_version: str | None = None  # torch.version.cuda: the CUDA runtime torch was built for
    hip_version: str | None = None  # torch.version.hip
    cudnn_version: int | None = None
    arch_list: list[str] = field(default_factory=list)  # torch.cuda.get_arch_list()
    nvidia_driver: str | None = None  # e.g. "580.159.04"
    driver_cuda_version: str | None = None  # newest CUDA the NVIDIA driver supports, e.g. "13.0"
    system_rocm_version: str | None = None  # $ROCM_PATH/.info/version
    amdgpu_driver: str | None = None  # /sys/module/amdgpu/version (DKMS driver)
    kfd_archs: list[str] = field(default_factory=list)  # real AMD GPU ISAs, from the kernel driver
    gpus: list[GPUInfo] = field(default_factory=list)
    gpu_error: str = ""  # why a GPU build of torch sees no GPU
    cpu: CPUInfo = field(default_factory=CPUInfo)
    triton_version: str | None = None
    triton_error: str = ""
    packages: dict[str, str | None] = field(default_factory=dict)
    torch_has_int1: bool = True
    env_vars: dict[str, str | None] = field(default_factory=dict)
    attention: dict[str, str] = field(default_factory=dict)  # back-end -> "ok" | "unsupported: ..." | ...
    checks: list[Check] = field(default_factory=list)
    speed: dict[str, float] = field(default_factory=dict)  # matmul_bf16_tflops, copy_gbps, ...
    bytecode: str = ""  # where torch's bytecode comes from (core.bytecode.state)



def first_line(e: BaseException) -> str:
    """The exception's type and first sentence."""
    text = str(e).strip()
    line = re.split(r"(?<=\.)\s", text.splitlines()[0])[0] if text else ""
    return f"{type(e).__name__}: {line}"[:300]
