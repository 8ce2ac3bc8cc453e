"""``hivetune doctor``: what this machine's torch stack is, whether it computes right, and how to
fix what is known to break.

Three steps, each usable alone:
- ``gather_environment()`` probes: versions, GPUs and the architectures the build has kernels
  for, which attention kernels run, and a short self-test against CPU float64 references.
- ``diagnose(env)`` is pure: it turns an ``Environment`` into ``Finding``s, each a known failure
  with its fix, so tests can build fake environments for every one.
- ``doctor()`` runs both, prints a readable report (or JSON) and returns the report as a dict.
"""

from __future__ import annotations

import copy
import ctypes
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

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
    bf16: bool


@dataclass
class CPUInfo:
    model: str = ""
    cores: int = 0  # usable by this process (its affinity mask)
    capability: str = ""  # the vector ISA torch's CPU kernels use: AVX2, AVX512, ...
    fast_bf16: bool = False  # AMX / AVX512-BF16 (hivetune.device.cpu_has_fast_bf16)


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


# ----------------------------------------------------------------------------- diagnosis (pure)

def diagnose(env: Environment) -> list[Finding]:
    """Every known failure this environment shows, each with its fix; errors first."""
    findings = []
    for rule in (_driver_findings, _visibility_findings, _arch_findings, _hsa_override_findings,
                 _precision_findings, _package_findings, _selftest_findings, _attention_findings):
        findings += rule(env)
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def _driver_findings(env: Environment) -> list[Finding]:
    out = []
    if env.build == "cuda" and env.cuda_version and env.driver_cuda_version:
        built, supported = major_minor(env.cuda_version), major_minor(env.driver_cuda_version)
        driver = f"NVIDIA driver {env.nvidia_driver}" if env.nvidia_driver else "NVIDIA driver"
        if built and supported and supported[0] < built[0]:
            out.append(Finding(
                "error", "cuda-driver-too-old",
                f"the {driver} supports CUDA up to {env.driver_cuda_version}, but torch {env.torch_version} "
                f"was built for CUDA {env.cuda_version}: torch cannot use the GPU "
                f"('The NVIDIA driver on your system is too old')",
                f"update the NVIDIA driver to one for CUDA {env.cuda_version} or newer, or install a torch "
                f"build for CUDA {env.driver_cuda_version} or older (https://download.pytorch.org/whl/)"))
        elif built and supported and supported < built:
            out.append(Finding(
                "warning", "cuda-driver-older-minor",
                f"the {driver} supports CUDA {env.driver_cuda_version}, older than the CUDA {env.cuda_version} "
                f"torch {env.torch_version} was built for: it runs through CUDA minor-version "
                f"compatibility, but kernels shipped only as PTX cannot be JIT-compiled",
                f"update the NVIDIA driver to one for CUDA {env.cuda_version} or newer"))
    if env.build == "rocm" and env.hip_version and env.system_rocm_version:
        built, system = major_minor(env.hip_version), major_minor(env.system_rocm_version)
        if built and system and built != system:
            b, s = ".".join(map(str, built)), ".".join(map(str, system))
            out.append(Finding(
                "error", "rocm-version-mismatch",
                f"torch {env.torch_version} was built for ROCm {b}, but the system ROCm is {s}: mixing "
                f"the two runtimes makes kernels fail ('illegal memory access')",
                f"install the torch build for ROCm {s} (pip install torch --index-url "
                f"https://download.pytorch.org/whl/rocm{s}), or install ROCm {b}"))
    return out


def _visibility_findings(env: Environment) -> list[Finding]:
    if env.build in ("cuda", "rocm") and not env.gpus:
        hiding = [(k, env.env_vars[k]) for k in VISIBILITY_VARS if env.env_vars.get(k) is not None]
        reason = f" ({env.gpu_error})" if env.gpu_error else ""
        build = f"CUDA {env.cuda_version}" if env.build == "cuda" else f"ROCm {env.hip_version}"
        if hiding:
            fix = "; ".join(f"check {k}={v!r}" for k, v in hiding) + ": unset it or list GPUs that exist"
        elif env.build == "cuda":
            fix = ("check that `nvidia-smi` lists the GPU; in a container pass it in "
                   "(podman run --device nvidia.com/gpu=all)")
        else:
            fix = ("check that `rocm-smi` lists the GPU and that you may open /dev/kfd and /dev/dri "
                   "(groups video and render); in a container pass --device /dev/kfd --device /dev/dri")
        return [Finding("warning", "gpu-not-visible",
                        f"torch {env.torch_version} is a {build} build but sees no GPU{reason}", fix)]
    if env.build == "cpu" and (env.nvidia_driver or env.driver_cuda_version):
        cuda = env.driver_cuda_version or "your driver's CUDA"
        driver = f" (driver {env.nvidia_driver})" if env.nvidia_driver else ""
        return [Finding("warning", "cpu-build-with-gpu",
                        f"torch {env.torch_version} is a CPU-only build, but this machine has an NVIDIA GPU{driver}",
                        f"install a CUDA build of torch for CUDA {cuda} or older "
                        f"(pip install torch --index-url https://download.pytorch.org/whl/cuXYZ)")]
    if env.build == "cpu" and env.kfd_archs:
        system = major_minor(env.system_rocm_version)
        rocm = f"{system[0]}.{system[1]}" if system else "X.Y"
        return [Finding("warning", "cpu-build-with-gpu",
                        f"torch {env.torch_version} is a CPU-only build, but this machine has an AMD GPU "
                        f"({', '.join(sorted(set(env.kfd_archs)))})",
                        f"install a ROCm build of torch (pip install torch --index-url "
                        f"https://download.pytorch.org/whl/rocm{rocm})")]
    return []


def _arch_findings(env: Environment) -> list[Finding]:
    out = []
    if not env.arch_list:
        return out
    for gpu in env.gpus:
        if arch_covered(gpu.arch, env.arch_list):
            continue
        if gpu.arch.startswith("gfx"):
            symptom = "'invalid device function'"
            kin = family_member(gpu.arch, env.arch_list)
            if kin and not env.env_vars.get("HSA_OVERRIDE_GFX_VERSION"):
                fix = (f"set HSA_OVERRIDE_GFX_VERSION={gfx_to_version(kin)} to run the {kin} kernels "
                       f"(the same instruction-set family), or install a torch build that includes {gpu.arch}")
            else:
                base = gpu.arch.split(":")[0]
                fix = (f"install a torch build compiled for {base}: an older ROCm wheel that still lists it, "
                       f"or build from source with PYTORCH_ROCM_ARCH={base}")
        else:
            symptom = "'no kernel image is available for execution on the device'"
            fix = (f"install a torch build whose torch.cuda.get_arch_list() includes {gpu.arch}: a newer CUDA "
                   f"wheel for a new GPU, an older one for a GPU that newer builds dropped")
        out.append(Finding("error", "gpu-arch-unsupported",
                           f"GPU {gpu.index} ({gpu.name}, {gpu.arch}) is not in the architectures torch "
                           f"{env.torch_version} was built for ({' '.join(env.arch_list)}): kernels fail with "
                           f"{symptom}", fix))
    return out


def _hsa_override_findings(env: Environment) -> list[Finding]:
    value = env.env_vars.get("HSA_OVERRIDE_GFX_VERSION")
    if env.build != "rocm" or not value:
        return []
    override = version_to_gfx(value)
    if override is None:
        return [Finding("error", "hsa-override-invalid",
                        f"HSA_OVERRIDE_GFX_VERSION={value!r} is not a MAJOR.MINOR.STEPPING version",
                        "unset HSA_OVERRIDE_GFX_VERSION, or write it like 10.3.0 (for gfx1030)")]
    out = []
    for real in sorted(set(env.kfd_archs)):
        if same_isa_family(real, override):
            continue
        if arch_covered(real, env.arch_list):
            fix = f"unset HSA_OVERRIDE_GFX_VERSION: this torch build has {real} kernels"
        elif kin := family_member(real, env.arch_list):
            fix = f"set HSA_OVERRIDE_GFX_VERSION={gfx_to_version(kin)} ({kin} is the same family as {real})"
        else:
            fix = f"unset HSA_OVERRIDE_GFX_VERSION and install a torch build compiled for {real}"
        out.append(Finding("error", "hsa-override-mismatch",
                           f"HSA_OVERRIDE_GFX_VERSION={value} makes ROCm run {override} code on the {real} GPU, "
                           f"a different instruction set: expect crashes or wrong results", fix))
    return out


def _precision_findings(env: Environment) -> list[Finding]:
    out = [Finding("warning", "no-bf16",
                   f"GPU {g.index} ({g.name}, {g.arch}) has no bf16: --precision bf16 fails and "
                   f"--precision auto trains in fp16 with loss scaling",
                   "use --precision fp16, or fp32 if fp16 losses overflow to inf / nan")
           for g in env.gpus if not g.bf16]
    if not env.gpus and not env.cpu.fast_bf16:
        out.append(Finding("info", "cpu-bf16-emulated",
                           f"this CPU ({env.cpu.model or 'unknown'}) has no AMX or AVX512-BF16: bf16 is emulated "
                           f"and slower than fp32, so --precision auto trains in fp32",
                           "keep --precision auto (or fp32); bf16 pays off only on CPUs with AMX / AVX512-BF16"))
    return out


def _package_findings(env: Environment) -> list[Finding]:
    out = []
    torchao = env.packages.get("torchao")
    if torchao and not env.torch_has_int1:
        out.append(Finding("error", "torchao-needs-newer-torch",
                           f"torchao {torchao} needs torch.int1, which torch {env.torch_version} lacks: importing "
                           f"it fails, and peft and transformers import it when it is installed",
                           "pip uninstall torchao (hivetune does not need it), or upgrade torch"))
    liger = env.packages.get("liger-kernel")
    if liger and not env.triton_version:
        why = env.triton_error or "not installed"
        out.append(Finding("warning", "liger-needs-triton",
                           f"liger-kernel {liger} is installed but Triton is not importable ({why}): "
                           f"importing liger_kernel fails",
                           "pip install the Triton that matches your torch (pytorch-triton-rocm on ROCm), "
                           "or pip uninstall liger-kernel"))
    return out


def _selftest_findings(env: Environment) -> list[Finding]:
    out = []
    for c in env.checks:
        if c.error:
            out.append(Finding("error", "selftest-failed", f"self-test {c.name} on {c.device} failed: {c.error}",
                               _crash_fix(c.error)))
        elif not c.passed:
            out.append(Finding("error", "selftest-mismatch",
                               f"self-test {c.name} on {c.device}: relative error {c.rel_error:.3g} against the "
                               f"CPU float64 reference (tolerance {c.tolerance:g})",
                               "the device computes wrong results: fix the findings above (runtime versions, "
                               "HSA_OVERRIDE_GFX_VERSION) and do not train on it until this passes"))
    return out


def _crash_fix(error: str) -> str:
    text = error.lower()
    if "no kernel image" in text or "invalid device function" in text:
        return "this torch build has no kernels for the GPU: install one whose arch list includes it"
    if "illegal memory access" in text or "memory access fault" in text:
        return ("usually a runtime mismatch: use the ROCm / CUDA driver that torch was built for, and unset a "
                "wrong HSA_OVERRIDE_GFX_VERSION")
    return "rerun with CUDA_LAUNCH_BLOCKING=1 (AMD_SERIALIZE_KERNEL=3 on ROCm) to see the failing kernel"


def _attention_findings(env: Environment) -> list[Finding]:
    if not env.gpus or not env.attention or any(env.attention.get(k) == "ok" for k in FUSED_SDPA):
        return []
    tried = "; ".join(f"{k}: {env.attention.get(k, 'missing')}" for k in FUSED_SDPA)
    if env.build == "rocm":
        fix = ("use a ROCm torch build with AOTriton flash attention; on RDNA GPUs try "
               "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1")
    else:
        fix = "flash attention needs sm_80 or newer; use a current torch build for this GPU"
    return [Finding("warning", "attention-math-only",
                    f"no fused SDPA kernel ran on GPU 0 ({tried}): attention falls back to the math path, "
                    f"which stores the whole [L, L] score matrix", fix)]


# ----------------------------------------------------------------------------- architectures

def major_minor(version: str | None) -> tuple[int, int] | None:
    """'12.8' -> (12, 8); '6.4.43482-0f2d60242' -> (6, 4); None when it is not a version."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _sm(entry: str) -> tuple[int, int, str] | None:
    """'sm_90a' -> (9, 0, 'a'); 'compute_120' -> (12, 0, ''): the last digit is the minor."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)(\d)([af]?)", entry)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def arch_covered(arch: str, arch_list: list[str]) -> bool:
    """Whether the build runs on this GPU.

    CUDA: a cubin sm_XY runs on any sm_XZ with Z >= Y (same major); PTX compute_XY is
    JIT-compiled for any newer GPU; 'a' (arch-specific) code runs on exactly that GPU.
    ROCm: exact gfx match, ignoring feature suffixes (gfx90a:sramecc+:xnack- is gfx90a).
    """
    if arch.startswith("gfx"):
        base = arch.split(":")[0]
        return any(a.split(":")[0] == base for a in arch_list)
    gpu = _sm(arch)
    if gpu is None:
        return False
    for entry in arch_list:
        code = _sm(entry)
        if code is None:
            continue
        major, minor, suffix = code
        if suffix == "a":
            ok = (major, minor) == gpu[:2]
        elif entry.startswith("compute_") and not suffix:
            ok = (major, minor) <= gpu[:2]
        else:
            ok = major == gpu[0] and minor <= gpu[1]
        if ok:
            return True
    return False


def version_to_gfx(value: str) -> str | None:
    """HSA_OVERRIDE_GFX_VERSION '11.0.0' -> 'gfx1100'; '9.0.10' -> 'gfx90a' (stepping in hex)."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\.(\d+)\s*", value)
    return f"gfx{int(m.group(1))}{int(m.group(2)):x}{int(m.group(3)):x}" if m else None


def gfx_to_version(gfx: str) -> str:
    """'gfx1030' -> '10.3.0', 'gfx90a' -> '9.0.10' (what HSA_OVERRIDE_GFX_VERSION takes)."""
    major, minor, stepping = _gfx_parts(gfx)
    return f"{major}.{minor}.{stepping}"


def _gfx_parts(gfx: str) -> tuple[int, int, int]:
    digits = gfx.split(":")[0][3:]  # major is all but the last two characters: gfx1201, gfx90a
    return int(digits[:-2]), int(digits[-2], 16), int(digits[-1], 16)


def same_isa_family(a: str, b: str) -> bool:
    """RDNA GPUs of one major.minor share an instruction set (gfx1031 runs gfx1030 code: the known
    HSA_OVERRIDE_GFX_VERSION=10.3.0 trick); GCN / CDNA (gfx9) steppings differ (gfx906 != gfx90a)."""
    try:
        pa, pb = _gfx_parts(a), _gfx_parts(b)
    except ValueError:  # not a gfx name we can read
        return a.split(":")[0] == b.split(":")[0]
    return pa == pb or (pa[0] >= 10 and pa[:2] == pb[:2])


def family_member(gfx: str, arch_list: list[str]) -> str | None:
    """An architecture in the build that shares gfx's instruction set, if any."""
    for entry in arch_list:
        base = entry.split(":")[0]
        if base.startswith("gfx") and same_isa_family(gfx, base):
            return base
    return None


# ----------------------------------------------------------------------------- probing

def gather_environment(selftest: bool = True) -> Environment:
    """Probe this machine. With ``selftest``, also run the attention probes and the self-test
    (a few seconds on a GPU, about two on a small CPU)."""
    from hivetune.device import cpu_has_fast_bf16

    env = Environment(
        torch_version=torch.__version__,
        build="rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu",
        cuda_version=torch.version.cuda, hip_version=torch.version.hip,
        cudnn_version=_quiet(torch.backends.cudnn.version),
        arch_list=_quiet(torch.cuda.get_arch_list) or [],
        cpu=CPUInfo(_cpu_model(), _usable_cores(), _quiet(torch.backends.cpu.get_cpu_capability) or "",
                    cpu_has_fast_bf16()),
        packages={name: _dist_version(name) for name in PACKAGES},
        torch_has_int1=hasattr(torch, "int1"),
        env_vars={k: os.environ.get(k) for k in ENV_VARS},
    )
    env.nvidia_driver, env.driver_cuda_version = _nvidia_driver()
    rocm_path = os.environ.get("ROCM_PATH", "/opt/rocm")
    env.system_rocm_version = _read(os.path.join(rocm_path, ".info", "version"))
    env.amdgpu_driver = _read("/sys/module/amdgpu/version")
    env.kfd_archs = kfd_archs()
    env.gpus, env.gpu_error = _gpus(env.build)
    env.triton_version, env.triton_error = _triton()
    if selftest:
        device = torch.device("cuda", 0) if env.gpus else torch.device("cpu")
        env.attention = probe_attention(device, torch.float32 if device.type == "cpu" else half_dtype(device, env))
        devices = [torch.device("cuda", g.index) for g in env.gpus] or [torch.device("cpu")]
        env.checks = [c for d in devices for c in correctness_checks(d, half_dtype(d, env))]
        env.speed = measure_speed(device, half_dtype(device, env))
    return env


def half_dtype(device: torch.device, env: Environment) -> torch.dtype:
    if device.type == "cpu":
        return torch.bfloat16
    return torch.bfloat16 if env.gpus[device.index].bf16 else torch.float16


def _quiet(fn):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except Exception:
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor()


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _nvidia_driver() -> tuple[str | None, str | None]:
    """(driver version, newest CUDA it supports), from the kernel module and libcuda; nvidia-smi
    only when those are missing (in some sandboxes /proc/driver/nvidia is not there)."""
    text = _read("/proc/driver/nvidia/version") or ""
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([\d.]+)", text)
    driver = m.group(1) if m else None
    cuda = None
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            cuda = f"{version.value // 1000}.{version.value % 1000 // 10}"  # 13000 -> 13.0
    except (OSError, AttributeError):
        pass
    if (driver is None or cuda is None) and shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=15).stdout
        except (OSError, subprocess.SubprocessError):
            smi = ""
        driver = driver or _search(r"Driver Version:\s*([\d.]+)", smi)
        cuda = cuda or _search(r"CUDA Version:\s*([\d.]+)", smi)
    return driver, cuda


def _search(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text)
    return m.group(1) if m else None


def kfd_archs(root: str = "/sys/class/kfd/kfd/topology/nodes") -> list[str]:
    """The AMD GPUs' real ISAs from the kernel driver's topology, which HSA_OVERRIDE_GFX_VERSION
    does not change: gfx_target_version 90010 is gfx90a (major * 10000 + minor * 100 + stepping)."""
    if not os.path.isdir(root):
        return []
    archs = []
    for node in sorted(os.listdir(root), key=lambda n: int(n) if n.isdigit() else -1):
        v = int(_search(r"gfx_target_version\s+(\d+)", _read(os.path.join(root, node, "properties")) or "") or 0)
        if v:  # CPU nodes have 0
            archs.append(f"gfx{v // 10000}{v // 100 % 100:x}{v % 100:x}")
    return archs


def _gpus(build: str) -> tuple[list[GPUInfo], str]:
    """The GPUs torch sees, or why it sees none (torch says why in a warning, e.g. 'The NVIDIA
    driver on your system is too old')."""
    if build == "cpu":
        return [], ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        reason = next((str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()), "")
        return [], reason or "torch.cuda.is_available() is False"
    gpus = []
    try:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            if build == "rocm":
                arch = getattr(props, "gcnArchName", "") or "gfx?"
                bf16 = True  # ROCm runs bf16 on every GPU it supports (so says torch.cuda.is_bf16_supported)
            else:
                arch, bf16 = f"sm_{props.major}{props.minor}", props.major >= 8
            gpus.append(GPUInfo(i, props.name, arch, props.total_memory, bf16))
    except Exception as e:  # a GPU that torch counts but cannot open
        return gpus, _first_line(e)
    return gpus, ""


def _triton() -> tuple[str | None, str]:
    try:
        triton = importlib.import_module("triton")
        return getattr(triton, "__version__", "?"), ""
    except Exception as e:  # ImportError, or a broken install raising anything
        return None, _first_line(e)


def _first_line(e: BaseException) -> str:
    """The exception's type and first sentence."""
    text = str(e).strip()
    line = re.split(r"(?<=\.)\s", text.splitlines()[0])[0] if text else ""
    return f"{type(e).__name__}: {line}"[:300]


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float64 on the CPU."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- attention probes

def probe_attention(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Each attention back-end on a tiny causal input, forward and backward, checked against the
    float64 math result: 'ok', 'forward only (...)', 'unsupported: ...', 'failed: ...', 'wrong
    result (...)' or 'missing' (not in this torch)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=gen) for _ in range(3))
    qkv = [t.double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*qkv, is_causal=True)
    out.square().sum().backward()
    ref = (out.detach(), torch.cat([t.grad.flatten() for t in qkv]))
    tol = 1e-4 if dtype == torch.float32 else 3e-2

    def sdpa(backend_name):
        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            return None

        def run(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run

    results = {}
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_efficient", "EFFICIENT_ATTENTION"),
                          ("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_math", "MATH")):
        results[name] = _probe(sdpa(backend), q, k, v, ref, device, dtype, tol)
    results["varlen_attn"] = _probe(_varlen(), q, k, v, ref, device, dtype, tol)
    results["flex_attention"] = _probe(_flex(device), q, k, v, ref, device, dtype, tol)
    results.update(_probe_flash_impls(sdpa("FLASH_ATTENTION"), q, k, v, ref, device, dtype, tol))
    return results


def _probe(fn, q, k, v, ref, device, dtype, tol) -> str:
    """Forward and backward against `ref` (output, flattened q / k / v gradients); a kernel that
    refuses gradients (flex attention on the CPU) is tried again without them, to tell 'forward
    only' from 'unsupported'."""
    if fn is None:
        return "missing"
    q, k, v = (t.to(device, dtype).clone().requires_grad_() for t in (q, k, v))
    backward_error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = fn(q, k, v)
            _sync(device)
            out.float().square().sum().backward()
            _sync(device)
        except Exception as e:
            backward_error = e
    if backward_error is not None:
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = fn(q.detach(), k.detach(), v.detach())
                _sync(device)
        except Exception:
            return _probe_error(backward_error)
    err = _rel_error(out, ref[0])
    if err > tol:
        return f"wrong result (relative error {err:.3g})"
    if backward_error is not None:
        return f"forward only ({_probe_error(backward_error)})"
    err = _rel_error(torch.cat([t.grad.flatten() for t in (q, k, v)]), ref[1])
    return "ok" if err <= tol else f"wrong gradients (relative error {err:.3g})"


def _probe_error(e: Exception) -> str:
    text = str(e)
    unsupported = ("No available kernel", "No viable backend", "not supported", "does not support",
                   "Could not run", "only supports", "requires")
    kind = "unsupported" if isinstance(e, NotImplementedError) or any(s in text for s in unsupported) else "failed"
    return f"{kind}: {_first_line(e)[:160]}"


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None

    def run(q, k, v):  # [1, H, L, D] -> packed [L, H, D], one sequence, causal
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        n = q.shape[0]
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        try:
            out = varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0))
        except TypeError:  # torch 2.9 / 2.10 spell causal as is_causal
            out = varlen_attn(q, k, v, cu, cu, n, n, is_causal=True)
        return out.transpose(0, 1)[None]
    return run


def _flex(device: torch.device):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None

    def run(q, k, v):
        # On a GPU the real path is the Triton kernel that torch.compile makes; eager flex
        # attention is a slow reference, so probe the compiled one.
        fn = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[2], k.shape[2],
                                 device=str(device))
        return fn(q, k, v, block_mask=mask)
    return run


def _probe_flash_impls(flash, q, k, v, ref, device, dtype, tol) -> dict[str, str]:
    """FA3 / FA4 through torch.nn.attention's flash implementation registry (torch 2.10+)."""
    import torch.nn.attention as attention

    list_impls = getattr(attention, "list_flash_attention_impls", None)
    if list_impls is None or flash is None:
        return {}
    active = attention.current_flash_attention_impl()
    out = {}
    for impl in list_impls():
        name = impl.lower()
        if device.type != "cuda" or torch.version.hip:
            out[name] = "unsupported: needs an NVIDIA GPU"
        elif active is not None:
            out[name] = "ok (active)" if impl == active else f"not probed ({active} is active)"
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    attention.activate_flash_attention_impl(impl)
            except Exception as e:
                out[name] = f"unsupported: {_first_line(e)[:160]}"
                continue
            try:
                out[name] = _probe(flash, q, k, v, ref, device, dtype, tol)
            finally:
                attention.restore_flash_attention_impl()
    return out


# ----------------------------------------------------------------------------- self-test

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
        return Check(name, device, _rel_error(out, ref), tolerance)
    except Exception as e:
        return Check(name, device, None, tolerance, _first_line(e))


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
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    calls = max(1, min(1000, int(budget / max(time.perf_counter() - start, 1e-6))))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


# ----------------------------------------------------------------------------- the report

def build_report(env: Environment, findings: list[Finding]) -> dict:
    """The report as plain JSON types: the environment grouped by topic, whether the build
    covers each GPU, the self-test, and the findings; ``ok`` is False when any is an error."""
    return {
        "torch": {"version": env.torch_version, "build": env.build, "cuda": env.cuda_version,
                  "hip": env.hip_version, "cudnn": env.cudnn_version, "arch_list": env.arch_list,
                  "has_int1": env.torch_has_int1},
        "driver": {"nvidia": env.nvidia_driver, "driver_cuda": env.driver_cuda_version,
                   "system_rocm": env.system_rocm_version, "amdgpu": env.amdgpu_driver, "kfd_archs": env.kfd_archs},
        "cpu": asdict(env.cpu),
        "gpus": [dict(asdict(g), memory_gib=round(g.memory_bytes / 2**30, 2),
                      arch_covered=arch_covered(g.arch, env.arch_list)) for g in env.gpus],
        "gpu_error": env.gpu_error,
        "triton": {"version": env.triton_version, "error": env.triton_error},
        "packages": env.packages,
        "env": env.env_vars,
        "attention": env.attention,
        "selftest": {"checks": [dict(asdict(c), passed=c.passed) for c in env.checks], "speed": env.speed},
        "findings": [asdict(f) for f in findings],
        "ok": not any(f.severity == "error" for f in findings),
    }


def format_report(report: dict) -> str:
    t, d = report["torch"], report["driver"]
    build = {"cuda": f"CUDA {t['cuda']}", "rocm": f"ROCm {t['hip']}", "cpu": "CPU-only"}[t["build"]]
    lines = [f"torch        {t['version']} ({build} build)"]
    if t["arch_list"]:
        lines.append(f"  built for  {' '.join(t['arch_list'])}")
    if d["nvidia"] or d["driver_cuda"]:
        lines.append(f"driver       NVIDIA {d['nvidia'] or '?'} (CUDA {d['driver_cuda'] or '?'})")
    if d["system_rocm"] or d["amdgpu"] or d["kfd_archs"]:
        lines.append(f"ROCm         system {d['system_rocm'] or '?'}, amdgpu driver {d['amdgpu'] or '?'}, "
                     f"GPUs {' '.join(d['kfd_archs']) or '?'}")
    cpu = report["cpu"]
    lines.append(f"CPU          {cpu['model']}, {cpu['cores']} cores, {cpu['capability']}, "
                 f"fast bf16: {'yes' if cpu['fast_bf16'] else 'no'}")
    for g in report["gpus"]:
        lines.append(f"GPU {g['index']:<9}{g['name']}, {g['arch']}, {g['memory_gib']:.1f} GiB, "
                     f"bf16 {'yes' if g['bf16'] else 'no'}, in build: {'yes' if g['arch_covered'] else 'NO'}")
    if report["gpu_error"]:
        lines.append(f"GPU          none usable: {report['gpu_error']}")
    triton = report["triton"]
    lines.append(f"triton       {triton['version'] or 'not importable (' + (triton['error'] or '?') + ')'}")
    lines.append("packages     " + ", ".join(f"{k} {v or '-'}" for k, v in report["packages"].items()))
    set_vars = " ".join(f"{k}={v}" for k, v in report["env"].items() if v is not None)
    lines.append(f"environment  {set_vars or '(none of the GPU variables set)'}")
    if report["attention"]:
        lines.append("attention")
        lines += [f"  {k:<15}{v}" for k, v in report["attention"].items()]
    checks, speed = report["selftest"]["checks"], report["selftest"]["speed"]
    if checks:
        lines.append("self-test")
    for c in checks:
        result = (f"ok (relative error {c['rel_error']:.2g})" if c["passed"]
                  else c["error"] or f"WRONG (relative error {c['rel_error']:.3g} > {c['tolerance']:g})")
        lines.append(f"  {c['name'] + ' ' + c['device']:<28}{result}")
    flops = ", ".join(f"{k.split('_')[1]} {v:.2f}" for k, v in speed.items() if k.endswith("_tflops"))
    if flops:
        lines.append(f"  {'matmul TFLOP/s':<28}{flops}")
    if "copy_gbps" in speed:
        lines.append(f"  {'copy GB/s (read + write)':<28}{speed['copy_gbps']:.1f}")
    lines.append("")
    for f in report["findings"]:
        lines += [f"{f['severity']}: [{f['code']}] {f['message']}", f"  fix: {f['fix']}"]
    if not report["findings"]:
        lines.append("no problems found")
    return "\n".join(lines)


def doctor(json_output: bool = False, quiet: bool = False) -> dict:
    """Probe, self-test and diagnose this machine; print the report (text, or JSON with
    ``json_output``) unless ``quiet``, and return it. ``report["ok"]`` is False when any
    finding is an error."""
    env = gather_environment()
    report = build_report(env, diagnose(env))
    if not quiet:
        print(json.dumps(report, indent=2) if json_output else format_report(report))
    return report
