"""``gather_environment()``: versions, drivers, GPUs and their real architectures, Triton, the
packages hivetune meets and the GPU environment variables; optionally the attention probes and
the self-test."""

from __future__ import annotations

import ctypes
import importlib
import os
import re
import shutil
import subprocess
import warnings

import torch

from hivetune.core import bytecode
from hivetune.core.device import device_auto_precision
from hivetune.core.versions import installed_version
from hivetune.doctor.environment import ENV_VARS, PACKAGES, CPUInfo, Environment, GPUInfo, first_line


def gather_environment(selftest: bool = True, triton: bool = True) -> Environment:
    """Probe this machine. With ``selftest``, also run the attention probes and the self-test
    (a few seconds on a GPU, about two on a small CPU); without it, about 30 ms on a CPU.
    ``triton=False`` skips importing Triton (up to a second; only the liger-kernel warning needs it)."""
    from hivetune.core.device import cpu_has_fast_bf16
    from hivetune.doctor.attention_probes import probe_attention
    from hivetune.doctor.selftest import correctness_checks, measure_speed

    env = Environment(
        torch_version=torch.__version__,
        build="rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu",
        cuda_version=torch.version.cuda, hip_version=torch.version.hip,
        cudnn_version=_quiet(torch.backends.cudnn.version),
        arch_list=_quiet(torch.cuda.get_arch_list) or [],
        cpu=CPUInfo(_cpu_model(), _usable_cores(), _quiet(torch.backends.cpu.get_cpu_capability) or "",
                    cpu_has_fast_bf16()),
        packages={name: installed_version(name) for name in PACKAGES},
        torch_has_int1=hasattr(torch, "int1"),
        env_vars={k: os.environ.get(k) for k in ENV_VARS},
    )
    env.bytecode = bytecode.state()
    env.nvidia_driver, env.driver_cuda_version = _nvidia_driver()
    rocm_path = os.environ.get("ROCM_PATH", "/opt/rocm")
    env.system_rocm_version = _read(os.path.join(rocm_path, ".info", "version"))
    env.amdgpu_driver = _read("/sys/module/amdgpu/version")
    env.kfd_archs = kfd_archs()
    env.gpus, env.gpu_error = _gpus(env.build)
    if triton:
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
            else:
                arch = f"sm_{props.major}{props.minor}"
            precision, why = device_auto_precision(torch.device("cuda", i))
            gpus.append(GPUInfo(i, props.name, arch, props.total_memory, precision == "bf16", why))
    except Exception as e:  # a GPU that torch counts but cannot open
        return gpus, first_line(e)
    return gpus, ""


def _triton() -> tuple[str | None, str]:
    try:
        triton = importlib.import_module("triton")
        return getattr(triton, "__version__", "?"), ""
    except Exception as e:  # ImportError, or a broken install raising anything
        return None, first_line(e)


