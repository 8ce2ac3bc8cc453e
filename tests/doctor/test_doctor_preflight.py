"""`hivetune train` runs the doctor's quick checks first: a known-bad stack (faked here) stops it with
the doctor's message and fix in one line, before anything is loaded or written; --no-doctor (or
skip_doctor=true) trains anyway; GPU findings do not stop a run on the CPU."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

import hivetune.doctor.preflight as preflight_module
from hivetune.cli import main
from hivetune.doctor import GPUInfo
from hivetune.doctor.preflight import check_stack, preflight, probe_stack
from hivetune.core.errors import UserError
from test_doctor import GIB, NO_VARS, RX9070, cuda_env, rocm_env, with_vars

RTX5090 = GPUInfo(0, "NVIDIA GeForce RTX 5090", "sm_120", 32 * GIB, True)
V100 = GPUInfo(0, "Tesla V100-SXM2-16GB", "sm_70", 16 * GIB, False)
OVERRIDE = "train anyway with --no-doctor (or --set skip_doctor=true)"


def codes(findings):
    return [f.code for f in findings]


def test_healthy_stacks_pass():
    assert preflight(cuda_env()) == []
    assert preflight(rocm_env()) == []
    assert preflight(cuda_env(gpus=[], gpu_error="x"), "cpu") == []  # a GPU build used on the CPU


def test_known_bad_gpu_stacks_stop_a_gpu_run_not_a_cpu_run():
    bad = {
        "cuda-driver-too-old": cuda_env(cuda_version="13.0", driver_cuda_version="12.4"),
        "rocm-version-mismatch": rocm_env(hip_version="7.11.25444", system_rocm_version="7.12.0"),
        "gpu-arch-unsupported": cuda_env(arch_list=["sm_80", "sm_90"], gpus=[RTX5090]),
        "hsa-override-mismatch": with_vars(rocm_env(gpus=[replace(RX9070, arch="gfx1100")]),
                                           HSA_OVERRIDE_GFX_VERSION="11.0.0"),
        "hsa-override-invalid": with_vars(rocm_env(), HSA_OVERRIDE_GFX_VERSION="gfx1030"),
    }
    for code, env in bad.items():
        assert codes(preflight(env, "auto")) == [code], code
        assert codes(preflight(env, "cuda")) == [code], code
        assert preflight(env, "cpu") == [], code
    # warnings (an older driver minor, no fused attention) never stop a run
    assert preflight(cuda_env(driver_cuda_version="12.4")) == []


def test_torchao_stops_any_run():
    env = cuda_env(torch_version="2.5.1+cu124", packages={"torchao": "0.12.0"}, torch_has_int1=False)
    assert codes(preflight(env, "cpu")) == ["torchao-needs-newer-torch"]


def test_bf16_asked_of_a_gpu_without_it():
    env = cuda_env(gpus=[V100], arch_list=["sm_70", "sm_80"])
    assert preflight(env, "auto", "auto") == []  # auto picks fp16 there
    [finding] = preflight(env, "auto", "bf16")
    assert (finding.code, finding.message, finding.fix) == (
        "bf16-unsupported", "precision bf16 was asked for, but GPU 0 (Tesla V100-SXM2-16GB): sm_70 has no bf16 units",
        "use --precision fp16 (with loss scaling) or fp32, or --precision auto")
    assert preflight(env, "cpu", "bf16") == []


def test_device_cuda_without_a_visible_gpu():
    env = with_vars(cuda_env(gpus=[]), CUDA_VISIBLE_DEVICES="")
    [finding] = preflight(env, "cuda")
    assert finding.code == "no-gpu"
    assert finding.message == "device cuda was asked for, but torch 2.8.0+cu128 is a CUDA 12.8 build but sees no GPU"
    assert finding.fix == "check CUDA_VISIBLE_DEVICES='': unset it or list GPUs that exist"
    assert preflight(env, "auto") == []  # auto trains on the CPU
    cpu_only = cuda_env(build="cpu", cuda_version=None, gpus=[], arch_list=[], nvidia_driver=None,
                        driver_cuda_version=None, env_vars=dict(NO_VARS))
    [finding] = preflight(cpu_only, "cuda")
    assert finding.message == "device cuda was asked for, but torch 2.8.0+cu128 is a CPU-only build"


def test_check_stack_message_is_one_line_with_the_fix():
    env = cuda_env(arch_list=["sm_80", "sm_90"], gpus=[RTX5090])
    with pytest.raises(UserError) as e:
        check_stack("auto", "auto", env)
    assert str(e.value) == (
        "this torch / GPU stack is known to fail: [gpu-arch-unsupported] GPU 0 (NVIDIA GeForce RTX 5090, sm_120) is "
        "not in the architectures torch 2.8.0+cu128 was built for (sm_80 sm_90): kernels fail with 'no kernel "
        "image is available for execution on the device'; fix: install a torch build whose "
        "torch.cuda.get_arch_list() includes sm_120: a newer CUDA wheel for a new GPU, an older one for a GPU that "
        f"newer builds dropped; {OVERRIDE}")
    two = replace(env, packages={"torchao": "0.12.0"}, torch_has_int1=False)
    with pytest.raises(UserError) as e:
        check_stack("auto", "auto", two)
    assert "(and 1 more: run hivetune doctor)" in str(e.value) and "\n" not in str(e.value)


def test_the_real_probe_is_quick_and_passes_here():
    start = time.perf_counter()
    env = probe_stack()
    assert time.perf_counter() - start < 1.0  # measured ~30 ms on the 2-core CI machine
    assert env.checks == [] and env.attention == {}  # no self-test
    assert preflight(env, "cpu", "fp32") == []


def test_train_refuses_a_known_bad_stack_and_no_doctor_overrides(tiny_model_dir, alpaca_file, tmp_path,
                                                                  monkeypatch, capsys):
    env = cuda_env(torch_version="2.5.1+cu124", packages={"torchao": "0.12.0"}, torch_has_int1=False)
    monkeypatch.setattr(preflight_module, "probe_stack", lambda: env)
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(alpaca_file), "--output", str(out),
            "--device", "cpu", "--precision", "fp32", "--max-steps", "1", "--threads", "1", "--quiet",
            "--set", "eval_prompts=0"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hivetune: error: this torch / GPU stack is known to fail: [torchao-needs-newer-torch] torchao 0.12.0 needs "
        "torch.int1, which torch 2.5.1+cu124 lacks: importing it fails, and peft and transformers import it when it "
        "is installed; fix: pip uninstall torchao (hivetune does not need it), or upgrade torch; " + OVERRIDE]
    assert not out.exists()
    assert main(args + ["--no-doctor"]) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert main(args[:6] + [str(tmp_path / "run2")] + args[7:] + ["--set", "skip_doctor=true"]) == 0
