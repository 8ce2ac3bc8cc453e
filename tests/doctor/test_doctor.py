"""hivetune doctor: every diagnosis on a faked environment (exact codes, messages and fixes), the
architecture rules, a real run on this machine's CPU, and the CLI's exit codes and JSON."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import hivetune.doctor as doctor_module
from hivetune.cli import main
from hivetune.doctor import (ENV_VARS, Check, CPUInfo, Environment, Finding, GPUInfo, arch_covered, diagnose,
                             doctor, gfx_to_version, kfd_archs, same_isa_family, version_to_gfx)
from hivetune.doctor.preflight import preflight

GIB = 2**30
NO_VARS = {k: None for k in ENV_VARS}
H100 = GPUInfo(0, "NVIDIA H100 80GB HBM3", "sm_90", 80 * GIB, True)
RX9070 = GPUInfo(0, "AMD Radeon RX 9070 XT", "gfx1201", 16 * GIB, True)
ROCM7_ARCHS = ["gfx908", "gfx90a", "gfx942", "gfx950", "gfx1030", "gfx1100", "gfx1101", "gfx1200", "gfx1201"]


def cuda_env(**changes) -> Environment:
    env = Environment(torch_version="2.8.0+cu128", build="cuda", cuda_version="12.8",
                      arch_list=["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"],
                      nvidia_driver="570.86.10", driver_cuda_version="12.8", gpus=[H100],
                      cpu=CPUInfo("Intel(R) Xeon(R) Platinum 8480+", 16, "AVX512", True), triton_version="3.4.0",
                      packages={"transformers": "4.56.0", "peft": "0.17.0", "torchao": None, "liger-kernel": None},
                      env_vars=dict(NO_VARS),
                      attention={"sdpa_flash": "ok", "sdpa_efficient": "ok", "sdpa_cudnn": "ok", "sdpa_math": "ok"},
                      checks=[Check("matmul_fp32", "cuda:0", 2e-4, 1e-3)])
    return replace(env, **changes)


def rocm_env(**changes) -> Environment:
    env = Environment(torch_version="2.9.0+rocm6.4", build="rocm", hip_version="6.4.43482-0f2d60242",
                      arch_list=list(ROCM7_ARCHS), system_rocm_version="6.4.1-120", kfd_archs=["gfx1201"],
                      gpus=[RX9070], cpu=CPUInfo("AMD Ryzen 9 9950X", 32, "AVX512", True), triton_version="3.5.0",
                      env_vars=dict(NO_VARS), attention={"sdpa_flash": "ok", "sdpa_math": "ok"})
    return replace(env, **changes)


def with_vars(env: Environment, **values) -> Environment:
    return replace(env, env_vars={**env.env_vars, **values})


def test_healthy_environments_have_no_findings():
    assert diagnose(cuda_env()) == []
    assert diagnose(rocm_env()) == []
    # A same-family override (RX 6700 XT as gfx1030) is the known working trick: no finding.
    assert diagnose(with_vars(rocm_env(kfd_archs=["gfx1031"], gpus=[replace(RX9070, arch="gfx1030")]),
                              HSA_OVERRIDE_GFX_VERSION="10.3.0")) == []


# ----------------------------------------------------------------------------- drivers and runtimes

def test_cuda_driver_older_than_the_build_major():
    assert diagnose(cuda_env(cuda_version="13.0", torch_version="2.9.0+cu130", driver_cuda_version="12.4",
                             nvidia_driver="550.54.15")) == [Finding(
        "error", "cuda-driver-too-old",
        "the NVIDIA driver 550.54.15 supports CUDA up to 12.4, but torch 2.9.0+cu130 was built for CUDA 13.0: "
        "torch cannot use the GPU ('The NVIDIA driver on your system is too old')",
        "update the NVIDIA driver to one for CUDA 13.0 or newer, or install a torch build for CUDA 12.4 or older "
        "(https://download.pytorch.org/whl/)")]


def test_cuda_driver_older_minor_is_a_warning():
    assert diagnose(cuda_env(driver_cuda_version="12.4", nvidia_driver=None)) == [Finding(
        "warning", "cuda-driver-older-minor",
        "the NVIDIA driver supports CUDA 12.4, older than the CUDA 12.8 torch 2.8.0+cu128 was built for: it runs "
        "through CUDA minor-version compatibility, but kernels shipped only as PTX cannot be JIT-compiled",
        "update the NVIDIA driver to one for CUDA 12.8 or newer")]
    assert diagnose(cuda_env(driver_cuda_version="13.0")) == []  # a newer driver is fine


def test_rocm_build_on_another_system_rocm():
    # The seeds' case: torch built for ROCm 7.11 on a system with ROCm 7.12 -> illegal memory access.
    assert diagnose(rocm_env(hip_version="7.11.25444-2f1c1d2b3", system_rocm_version="7.12.0-30")) == [Finding(
        "error", "rocm-version-mismatch",
        "torch 2.9.0+rocm6.4 was built for ROCm 7.11, but the system ROCm is 7.12: mixing the two runtimes makes "
        "kernels fail ('illegal memory access')",
        "install the torch build for ROCm 7.12 (pip install torch --index-url https://download.pytorch.org/whl/"
        "rocm7.12), or install ROCm 7.11")]
    assert diagnose(rocm_env(system_rocm_version="6.4.3-71")) == []  # patch releases match


# ----------------------------------------------------------------------------- GPUs the build does not cover

def test_mi50_dropped_by_a_new_rocm_build():
    mi50 = GPUInfo(0, "AMD Instinct MI50/MI60", "gfx906:sramecc+:xnack-", 32 * GIB, True)
    assert diagnose(rocm_env(gpus=[mi50], kfd_archs=["gfx906"])) == [Finding(
        "error", "gpu-arch-unsupported",
        "GPU 0 (AMD Instinct MI50/MI60, gfx906:sramecc+:xnack-) is not in the architectures torch 2.9.0+rocm6.4 "
        f"was built for ({' '.join(ROCM7_ARCHS)}): kernels fail with 'invalid device function'",
        "install a torch build compiled for gfx906: an older ROCm wheel that still lists it, or build from "
        "source with PYTORCH_ROCM_ARCH=gfx906")]


def test_rdna_gpu_missing_from_the_build_gets_the_family_override():
    rx6700 = GPUInfo(0, "AMD Radeon RX 6700 XT", "gfx1031", 12 * GIB, True)
    [finding] = diagnose(rocm_env(gpus=[rx6700], kfd_archs=["gfx1031"]))
    assert (finding.severity, finding.code) == ("error", "gpu-arch-unsupported")
    assert finding.fix == ("set HSA_OVERRIDE_GFX_VERSION=10.3.0 to run the gfx1030 kernels (the same "
                           "instruction-set family), or install a torch build that includes gfx1031")


def test_cuda_gpu_newer_than_the_build():
    rtx5090 = GPUInfo(1, "NVIDIA GeForce RTX 5090", "sm_120", 32 * GIB, True)
    assert diagnose(cuda_env(gpus=[H100, rtx5090], arch_list=["sm_80", "sm_90"])) == [Finding(
        "error", "gpu-arch-unsupported",
        "GPU 1 (NVIDIA GeForce RTX 5090, sm_120) is not in the architectures torch 2.8.0+cu128 was built for "
        "(sm_80 sm_90): kernels fail with 'no kernel image is available for execution on the device'",
        "install a torch build whose torch.cuda.get_arch_list() includes sm_120: a newer CUDA wheel for a new "
        "GPU, an older one for a GPU that newer builds dropped")]


@pytest.mark.parametrize("arch,arch_list,covered", [
    ("sm_90", ["sm_80", "sm_90"], True),
    ("sm_86", ["sm_80"], True),  # cubins run on later minors of their major
    ("sm_89", ["sm_90"], False),
    ("sm_90", ["sm_80"], False),  # ... but not on a new major
    ("sm_90", ["sm_75", "compute_75"], True),  # PTX is JIT-compiled for newer GPUs
    ("sm_120", ["sm_90", "compute_90"], True),
    ("sm_80", ["compute_90"], False),
    ("sm_90", ["sm_90a"], True),  # arch-specific code runs on exactly its GPU
    ("sm_100", ["sm_90a", "compute_90a"], False),
    ("sm_103", ["sm_100f"], True),  # family code runs across the family
    ("gfx90a:sramecc+:xnack-", ["gfx908", "gfx90a"], True),  # feature suffixes ignored
    ("gfx1201", ["gfx1201:xnack-"], True),
    ("gfx906:sramecc+:xnack-", ["gfx908", "gfx90a"], False),
    ("gfx1031", ["gfx1030"], False),  # exact match on ROCm
])
def test_arch_covered(arch, arch_list, covered):
    assert arch_covered(arch, arch_list) is covered


@pytest.mark.parametrize("version,gfx", [("11.0.0", "gfx1100"), ("10.3.0", "gfx1030"), ("12.0.1", "gfx1201"),
                                         ("9.0.6", "gfx906"), ("9.0.10", "gfx90a"), ("9.4.2", "gfx942")])
def test_hsa_override_versions_and_gfx_names(version, gfx):
    assert version_to_gfx(version) == gfx
    assert gfx_to_version(gfx) == version


def test_isa_families():
    assert same_isa_family("gfx1031", "gfx1030") and same_isa_family("gfx1201", "gfx1200")
    assert not same_isa_family("gfx1201", "gfx1100")
    assert not same_isa_family("gfx90a", "gfx906")  # gfx9 steppings are different instruction sets
    assert same_isa_family("gfx90a:xnack-", "gfx90a")


def test_kfd_topology_gives_the_real_architectures(tmp_path):
    for node, version in (("0", 0), ("1", 120001), ("2", 90010), ("10", 90006)):  # node 0 is the CPU
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {version}\n")
    assert kfd_archs(str(tmp_path)) == ["gfx1201", "gfx90a", "gfx906"]
    assert kfd_archs(str(tmp_path / "missing")) == []


# ----------------------------------------------------------------------------- HSA_OVERRIDE_GFX_VERSION

def test_hsa_override_for_another_family_on_a_covered_gpu():
    env = with_vars(rocm_env(gpus=[replace(RX9070, arch="gfx1100")]), HSA_OVERRIDE_GFX_VERSION="11.0.0")
    assert diagnose(env) == [Finding(
        "error", "hsa-override-mismatch",
        "HSA_OVERRIDE_GFX_VERSION=11.0.0 makes ROCm run gfx1100 code on the gfx1201 GPU, a different instruction "
        "set: expect crashes or wrong results",
        "unset HSA_OVERRIDE_GFX_VERSION: this torch build has gfx1201 kernels")]


def test_hsa_override_of_a_gfx9_stepping():
    mi210 = GPUInfo(0, "AMD Instinct MI210", "gfx906", 64 * GIB, True)
    env = with_vars(rocm_env(gpus=[mi210], kfd_archs=["gfx90a"], arch_list=["gfx906", "gfx1030"]),
                    HSA_OVERRIDE_GFX_VERSION="9.0.6")
    assert diagnose(env) == [Finding(
        "error", "hsa-override-mismatch",
        "HSA_OVERRIDE_GFX_VERSION=9.0.6 makes ROCm run gfx906 code on the gfx90a GPU, a different instruction set: "
        "expect crashes or wrong results",
        "unset HSA_OVERRIDE_GFX_VERSION and install a torch build compiled for gfx90a")]


def test_hsa_override_for_the_wrong_family_suggests_the_right_one():
    env = with_vars(rocm_env(gpus=[replace(RX9070, arch="gfx1100")], kfd_archs=["gfx1031"]),
                    HSA_OVERRIDE_GFX_VERSION="11.0.0")
    [finding] = diagnose(env)
    assert finding.code == "hsa-override-mismatch"
    assert finding.fix == "set HSA_OVERRIDE_GFX_VERSION=10.3.0 (gfx1030 is the same family as gfx1031)"


def test_hsa_override_that_is_not_a_version():
    assert diagnose(with_vars(rocm_env(), HSA_OVERRIDE_GFX_VERSION="gfx1030")) == [Finding(
        "error", "hsa-override-invalid",
        "HSA_OVERRIDE_GFX_VERSION='gfx1030' is not a MAJOR.MINOR.STEPPING version",
        "unset HSA_OVERRIDE_GFX_VERSION, or write it like 10.3.0 (for gfx1030)")]
    assert diagnose(with_vars(cuda_env(), HSA_OVERRIDE_GFX_VERSION="gfx1030")) == []  # CUDA ignores it


# ----------------------------------------------------------------------------- precision, packages

def test_gpu_without_bf16():
    v100 = GPUInfo(0, "Tesla V100-SXM2-16GB", "sm_70", 16 * GIB, False)
    assert diagnose(cuda_env(gpus=[v100], arch_list=["sm_70", "sm_80", "sm_90"],
                             attention={"sdpa_efficient": "ok"})) == [Finding(
        "warning", "no-bf16",
        "GPU 0 (Tesla V100-SXM2-16GB): sm_70 has no bf16 units: --precision bf16 fails and --precision auto "
        "trains in fp16 with loss scaling",
        "use --precision fp16, or fp32 if fp16 losses overflow to inf / nan")]


def test_cpu_without_fast_bf16():
    env = Environment(torch_version="2.13.0+cpu", cpu=CPUInfo("Intel(R) Core(TM) i7-8700", 12, "AVX2", False),
                      env_vars=dict(NO_VARS))
    assert diagnose(env) == [Finding(
        "info", "cpu-bf16-emulated",
        "this CPU (Intel(R) Core(TM) i7-8700) has no AMX or AVX512-BF16: bf16 is emulated and slower than fp32, "
        "so --precision auto trains in fp32",
        "keep --precision auto (or fp32); bf16 pays off only on CPUs with AMX / AVX512-BF16")]


def test_torchao_that_needs_a_newer_torch():
    env = cuda_env(torch_version="2.5.1+cu124", packages={"torchao": "0.12.0"}, torch_has_int1=False)
    assert diagnose(env) == [Finding(
        "error", "torchao-needs-newer-torch",
        "torchao 0.12.0 needs torch.int1, which torch 2.5.1+cu124 lacks: importing it fails, and peft and "
        "transformers import it when it is installed",
        "pip uninstall torchao (hivetune does not need it), or upgrade torch")]
    assert diagnose(replace(env, torch_has_int1=True)) == []


def test_torch_compiled_at_each_start():
    env = cuda_env(bytecode="compiled at each import")
    assert diagnose(env) == [Finding(
        "warning", "torch-compiled-each-start",
        "Python compiles torch's modules from source in every process (no bytecode beside them, and it writes "
        "none: PYTHONDONTWRITEBYTECODE or a read-only site-packages): 2-4 s of each command",
        "let hivetune keep it in its cache (HIVETUNE_BYTECODE_CACHE unset, HIVETUNE_CACHE writable: "
        "docs/config.md), or run `python -m compileall -q` on torch's folder once")]
    for kept in ("beside the sources", "prefix /home/u/.cache/hivetune/bytecode", ""):
        assert diagnose(replace(env, bytecode=kept)) == []
    assert preflight(env, "cuda") == []  # a warning: train goes on


def test_liger_kernel_without_triton():
    env = rocm_env(packages={"liger-kernel": "0.6.2"}, triton_version=None,
                   triton_error="ModuleNotFoundError: No module named 'triton'")
    assert diagnose(env) == [Finding(
        "warning", "liger-needs-triton",
        "liger-kernel 0.6.2 is installed but Triton is not importable (ModuleNotFoundError: No module named "
        "'triton'): importing liger_kernel fails",
        "pip install the Triton that matches your torch (pytorch-triton-rocm on ROCm), or pip uninstall "
        "liger-kernel")]


# ----------------------------------------------------------------------------- GPUs torch does not see

def test_gpu_build_that_sees_no_gpu():
    env = cuda_env(gpus=[], gpu_error="RuntimeError: Found no NVIDIA driver on your system.")
    assert diagnose(env) == [Finding(
        "warning", "gpu-not-visible",
        "torch 2.8.0+cu128 is a CUDA 12.8 build but sees no GPU (RuntimeError: Found no NVIDIA driver on your "
        "system.)",
        "check that `nvidia-smi` lists the GPU; in a container pass it in (podman run --device nvidia.com/gpu=all)")]
    [hidden] = diagnose(with_vars(replace(env, gpu_error=""), CUDA_VISIBLE_DEVICES=""))
    assert hidden.message == "torch 2.8.0+cu128 is a CUDA 12.8 build but sees no GPU"
    assert hidden.fix == "check CUDA_VISIBLE_DEVICES='': unset it or list GPUs that exist"
    [amd] = diagnose(rocm_env(gpus=[]))
    assert amd.message == "torch 2.9.0+rocm6.4 is a ROCm 6.4.43482-0f2d60242 build but sees no GPU"
    assert amd.fix == ("check that `rocm-smi` lists the GPU and that you may open /dev/kfd and /dev/dri (groups "
                       "video and render); in a container pass --device /dev/kfd --device /dev/dri")


def test_cpu_build_on_a_gpu_machine():
    cpu = Environment(torch_version="2.13.0+cpu", cpu=CPUInfo("x", 8, "AVX512", True), env_vars=dict(NO_VARS))
    assert diagnose(replace(cpu, nvidia_driver="580.159.04", driver_cuda_version="13.0")) == [Finding(
        "warning", "cpu-build-with-gpu",
        "torch 2.13.0+cpu is a CPU-only build, but this machine has an NVIDIA GPU (driver 580.159.04)",
        "install a CUDA build of torch for CUDA 13.0 or older "
        "(pip install torch --index-url https://download.pytorch.org/whl/cuXYZ)")]
    assert diagnose(replace(cpu, kfd_archs=["gfx1100", "gfx1100"], system_rocm_version="6.4.1-120")) == [Finding(
        "warning", "cpu-build-with-gpu",
        "torch 2.13.0+cpu is a CPU-only build, but this machine has an AMD GPU (gfx1100)",
        "install a ROCm build of torch (pip install torch --index-url https://download.pytorch.org/whl/rocm6.4)")]


# ----------------------------------------------------------------------------- self-test and attention

def test_selftest_crash_and_wrong_results():
    checks = [Check("matmul_fp32", "cuda:0", None, 1e-3, "RuntimeError: HIP error: an illegal memory access was "
                                                        "encountered"),
              Check("lora_fwd_bwd_fp32", "cuda:0", 0.41, 1e-3),
              Check("matmul_bf16", "cuda:0", float("inf"), 1e-2),
              Check("matmul_fp16", "cuda:0", 1e-3, 2e-3)]  # passes
    wrong_fix = ("the device computes wrong results: fix the findings above (runtime versions, "
                 "HSA_OVERRIDE_GFX_VERSION) and do not train on it until this passes")
    assert diagnose(rocm_env(checks=checks)) == [
        Finding("error", "selftest-failed",
                "self-test matmul_fp32 on cuda:0 failed: RuntimeError: HIP error: an illegal memory access was "
                "encountered",
                "usually a runtime mismatch: use the ROCm / CUDA driver that torch was built for, and unset a "
                "wrong HSA_OVERRIDE_GFX_VERSION"),
        Finding("error", "selftest-mismatch", "self-test lora_fwd_bwd_fp32 on cuda:0: relative error 0.41 against "
                "the CPU float64 reference (tolerance 0.001)", wrong_fix),
        Finding("error", "selftest-mismatch", "self-test matmul_bf16 on cuda:0: relative error inf against "
                "the CPU float64 reference (tolerance 0.01)", wrong_fix)]
    [no_image] = diagnose(cuda_env(checks=[Check("matmul_fp32", "cuda:0", None, 1e-3, "RuntimeError: CUDA error: "
                                                 "no kernel image is available for execution on the device")]))
    assert no_image.fix == "this torch build has no kernels for the GPU: install one whose arch list includes it"


def test_gpu_where_only_math_attention_runs():
    env = rocm_env(attention={"sdpa_flash": "unsupported: RuntimeError: No available kernel.",
                              "sdpa_efficient": "failed: RuntimeError: HIP error: invalid device function",
                              "sdpa_math": "ok"})
    assert diagnose(env) == [Finding(
        "warning", "attention-math-only",
        "no fused SDPA kernel ran on GPU 0 (sdpa_flash: unsupported: RuntimeError: No available kernel.; "
        "sdpa_efficient: failed: RuntimeError: HIP error: invalid device function; sdpa_cudnn: missing): "
        "attention falls back to the math path, which stores the whole [L, L] score matrix",
        "use a ROCm torch build with AOTriton flash attention; on RDNA GPUs try "
        "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1")]


def test_errors_come_first():
    env = with_vars(cuda_env(gpus=[GPUInfo(0, "Tesla T4", "sm_75", 16 * GIB, False)], arch_list=["sm_80"],
                             attention={}), CUDA_VISIBLE_DEVICES="0")
    assert [f.code for f in diagnose(env)] == ["gpu-arch-unsupported", "no-bf16"]


# ----------------------------------------------------------------------------- a real run, the CLI

@pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None, reason="a CPU-only torch")
def test_doctor_on_this_cpu():
    report = doctor(quiet=True)
    json.dumps(report)  # the report is plain JSON
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["build"] == "cpu" and report["gpus"] == []
    checks = {c["name"]: c for c in report["selftest"]["checks"]}
    assert set(checks) == {"matmul_fp32", "matmul_bf16", "lora_fwd_bwd_fp32"}
    assert checks["matmul_fp32"]["passed"] and checks["matmul_fp32"]["rel_error"] < 1e-5
    assert checks["lora_fwd_bwd_fp32"]["passed"] and checks["matmul_bf16"]["passed"]
    speed = report["selftest"]["speed"]
    assert speed["matmul_fp32_tflops"] > 0 and speed["matmul_bf16_tflops"] > 0 and speed["copy_gbps"] > 0
    assert report["attention"]["sdpa_math"] == "ok"
    assert report["cpu"]["cores"] >= 1
    assert report["ok"] is not any(f["severity"] == "error" for f in report["findings"])


def fake_gather(env):
    return lambda selftest=True: env


def test_cli_healthy_exits_0_with_a_readable_report(monkeypatch, capsys):
    env = cuda_env(speed={"matmul_bf16_tflops": 612.3, "copy_gbps": 2950.0})
    monkeypatch.setattr(doctor_module, "gather_environment", fake_gather(env))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch        2.8.0+cu128 (CUDA 12.8 build)\n" in out
    assert "GPU 0        NVIDIA H100 80GB HBM3, sm_90, 80.0 GiB, bf16 yes, in build: yes\n" in out
    assert "  matmul_fp32 cuda:0          ok (relative error 0.0002)\n" in out
    assert "  matmul TFLOP/s              bf16 612.30\n" in out
    assert out.endswith("no problems found\n")


def test_cli_error_exits_1_and_json(monkeypatch, capsys):
    env = cuda_env(arch_list=["sm_80"], gpus=[GPUInfo(0, "NVIDIA GeForce RTX 5090", "sm_120", 32 * GIB, True)])
    monkeypatch.setattr(doctor_module, "gather_environment", fake_gather(env))
    assert main(["doctor"]) == 1
    assert "error: [gpu-arch-unsupported] GPU 0 (NVIDIA GeForce RTX 5090, sm_120)" in capsys.readouterr().out
    assert main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert [f["code"] for f in report["findings"]] == ["gpu-arch-unsupported"]
    assert report["gpus"][0]["arch_covered"] is False
    # A warning alone does not fail the command.
    monkeypatch.setattr(doctor_module, "gather_environment", fake_gather(cuda_env(driver_cuda_version="12.4")))
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"][0]["severity"] == "warning"
