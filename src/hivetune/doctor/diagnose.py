"""``diagnose(env)``: pure rules that turn an ``Environment`` into known failures with their fixes.

Each rule reads only the Environment, so every diagnosis is tested on a faked machine."""

from __future__ import annotations

from hivetune.doctor.arch import (arch_covered, family_member, gfx_to_version, major_minor, same_isa_family,
                                  version_to_gfx)
from hivetune.doctor.environment import FUSED_SDPA, SEVERITIES, VISIBILITY_VARS, Environment, Finding


def diagnose(env: Environment) -> list[Finding]:
    """Every known failure this environment shows, each with its fix; errors first."""
    findings = []
    for rule in (_driver_findings, _visibility_findings, _arch_findings, _hsa_override_findings,
                 _precision_findings, _package_findings, _bytecode_findings, _selftest_findings,
                 _attention_findings):
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
                   f"GPU {g.index} ({g.name}): {g.bf16_why or g.arch + ' has no bf16 units'}: --precision bf16 "
                   f"fails and --precision auto trains in fp16 with loss scaling",
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


def _bytecode_findings(env: Environment) -> list[Finding]:
    if env.bytecode != "compiled at each import":
        return []
    return [Finding("warning", "torch-compiled-each-start",
                    "Python compiles torch's modules from source in every process (no bytecode beside them, "
                    "and it writes none: PYTHONDONTWRITEBYTECODE or a read-only site-packages): 2-4 s of each command",
                    "let hivetune keep it in its cache (HIVETUNE_BYTECODE_CACHE unset, HIVETUNE_CACHE "
                    "writable: docs/config.md), or run `python -m compileall -q` on torch's folder once")]


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

