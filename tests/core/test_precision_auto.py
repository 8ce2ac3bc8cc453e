"""--precision auto on GPUs with and without bf16 units: core.device decides from the device's
properties (faked here: name, gcnArchName on ROCm, compute capability on CUDA), and train
(resolve_precision), plan and doctor say the same."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hivetune.core import device as core_device
from hivetune.core import fallbacks
from hivetune.core.config import load_config
from hivetune.core.device import FP16_NO_GRAPHS, auto_gpu_precision, bf16_units, resolve_precision
from hivetune.core.errors import UserError
from hivetune.doctor import probe
from hivetune.doctor.diagnose import diagnose
from hivetune.doctor.environment import Environment
from hivetune.doctor.preflight import preflight
from hivetune.model.config import qwen25_shape
from hivetune.plan import plan
from hivetune.plan.gpus import GPUS
from hivetune.train import graph_plan

GPU0 = torch.device("cuda", 0)
MI50_WHY = "gfx906 (Vega 20, MI50, MI60, Radeon VII) has no bf16 units"
MI50_NOTE = f"hivetune: note: bf16 unavailable ({MI50_WHY}); using fp16 with loss scaling"


@pytest.mark.parametrize("name, arch, units", [
    ("AMD Instinct MI50/MI60", "gfx906:sramecc+:xnack-", False),
    ("AMD Instinct MI60", "", False),  # older ROCm torch: no gcnArchName, the name decides
    ("Radeon Instinct MI25", "gfx900", False),
    ("AMD Instinct MI100", "gfx908:sramecc+:xnack-", True),
    ("AMD Instinct MI250X", "gfx90a", True),
    ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", True),
    ("AMD Radeon RX 6700 XT", "gfx1031", False),
    ("AMD Radeon RX 7900 XTX", "gfx1100", True),
    ("AMD Radeon AI PRO R9700", "gfx1201", True),
    ("Tesla V100-SXM2-16GB", "sm_70", False),
    ("Tesla T4", "sm_75", False),
    ("Tesla T4", "", False),
    ("NVIDIA A100-SXM4-80GB", "sm_80", True),
    ("NVIDIA H200", "sm_90", True),
    ("NVIDIA GeForce RTX 5090", "sm_120", True),
    ("AMD Instinct MI250X", "", None),  # the name alone: not in the table, torch decides
    ("Some GPU", "gfx1300", None),
])
def test_bf16_units_by_architecture(name, arch, units):
    assert bf16_units(name, arch)[0] is units


def test_auto_precision_exact_choices_and_reasons():
    assert auto_gpu_precision("AMD Instinct MI50/MI60", "gfx906:sramecc+:xnack-") == ("fp16", MI50_WHY)
    assert auto_gpu_precision("Tesla T4", "sm_75") == ("fp16", "sm_75 (before Ampere) has no bf16 units")
    assert auto_gpu_precision("NVIDIA H200", "sm_90") == ("bf16", "sm_90 has bf16 tensor cores")
    assert auto_gpu_precision("AMD Instinct MI100", "gfx908") == ("bf16", "gfx908 (CDNA 1, MI100) has bf16 units")
    assert auto_gpu_precision("x", "gfx1300", lambda: True) == ("bf16", "gfx1300: torch reports bf16")
    assert auto_gpu_precision("x", "gfx1300", lambda: False) == ("fp16", "gfx1300: torch reports no bf16")


def test_the_gpu_table_lists_bf16_rates_exactly_where_there_are_units():
    for gpu in GPUS:
        units, _ = bf16_units(gpu.name, gpu.arch)
        assert units is not None, gpu.name
        assert (gpu.bf16_tflops is not None) == units, gpu.name


def fake_gpu(monkeypatch, name: str, hip: str | None, arch: str = "", major: int = 9, minor: int = 0,
             torch_bf16: bool = True) -> None:
    """One visible GPU with these properties; torch reports bf16 as `torch_bf16` (ROCm: always)."""
    props = SimpleNamespace(name=name, gcnArchName=arch, major=major, minor=minor, total_memory=32 * 2**30)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: torch_bf16 or bool(hip))
    monkeypatch.setattr(fallbacks, "NOTED", {})
    monkeypatch.delenv(fallbacks.FORCE_ENV, raising=False)


MI50 = dict(name="AMD Instinct MI50/MI60", hip="6.2.41133", arch="gfx906:sramecc+:xnack-")
T4 = dict(name="Tesla T4", hip=None, major=7, minor=5)  # torch emulates bf16 here: it reports it
H200 = dict(name="NVIDIA H200", hip=None, major=9, minor=0)


@pytest.mark.parametrize("gpu, expected, note", [
    (MI50, "fp16", MI50_NOTE),
    (T4, "fp16", "hivetune: note: bf16 unavailable (sm_75 (before Ampere) has no bf16 units); "
                 "using fp16 with loss scaling"),
    (H200, "bf16", ""),
    (dict(name="AMD Instinct MI100", hip="6.2.41133", arch="gfx908:sramecc+:xnack-"), "bf16", ""),
])
def test_train_plan_and_doctor_agree(monkeypatch, capsys, tmp_path, gpu, expected, note):
    fake_gpu(monkeypatch, **gpu)
    # train: setup calls resolve_precision; the note is one line on stderr
    assert resolve_precision("auto", GPU0) == expected
    assert capsys.readouterr().err.strip() == note
    reason = core_device.device_auto_precision(GPU0)[1]
    # plan, on this GPU
    model = tmp_path / "m"
    p = plan(load_config(None, {"model": str(model), "max_length": 256}),
             model_args=qwen25_shape(1000, 64, 128, 2, 4, 2, True))
    assert p.precision == expected
    shown = "fp16 with loss scaling" if expected == "fp16" else "bf16"
    assert f"precision auto -> {shown} ({reason})" in p.notes
    # doctor: what it probes and what it says
    [info], error = probe._gpus("rocm" if gpu["hip"] else "cuda")
    assert error == "" and info.bf16 is (expected == "bf16") and info.bf16_why == reason
    env = Environment(build="rocm" if gpu["hip"] else "cuda", gpus=[info], arch_list=[info.arch.split(":")[0]])
    found = [f for f in diagnose(env) if f.code == "no-bf16"]
    if expected == "fp16":
        assert found[0].message == (f"GPU 0 ({gpu['name']}): {reason}: --precision bf16 fails and "
                                    f"--precision auto trains in fp16 with loss scaling")
        assert [f.code for f in preflight(env, "auto", "bf16")][-1] == "bf16-unsupported"
        with pytest.raises(UserError, match="bf16 is not native"):
            resolve_precision("bf16", GPU0)
    else:
        assert found == [] and resolve_precision("bf16", GPU0) == "bf16"


def test_plan_for_a_named_gpu_without_bf16(tmp_path):
    cfg = load_config(None, {"model": str(tmp_path / "m"), "max_length": 256})
    args = qwen25_shape(1000, 64, 128, 2, 4, 2, True)
    mi50 = plan(cfg, gpu="MI50", model_args=args)
    assert mi50.precision == "fp16" and f"precision auto -> fp16 with loss scaling ({MI50_WHY})" in mi50.notes
    assert mi50.cuda_graphs is False
    if getattr(cfg, "cuda_graphs", False):
        assert f"CUDA graphs off ({FP16_NO_GRAPHS})" in mi50.notes
    assert plan(cfg, gpu="MI100", model_args=args).precision == "bf16"
    assert plan(cfg, gpu="V100", model_args=args).precision == "fp16"
    assert plan(cfg, gpu="H200", model_args=args).precision == "bf16"


def test_reference_switch_forces_fp16(monkeypatch, capsys):
    fake_gpu(monkeypatch, **H200)
    monkeypatch.setenv(fallbacks.FORCE_ENV, "gpu_bf16")
    assert resolve_precision("auto", GPU0) == "fp16"
    assert resolve_precision("bf16", GPU0) == "bf16"  # asked for explicitly: no fallback
    assert "HIVETUNE_REFERENCE asks for the reference" in capsys.readouterr().err


def test_fp16_runs_say_in_one_line_why_they_are_not_graphed(capsys):
    cfg = SimpleNamespace(cuda_graphs=True, packing=True, gradient_checkpointing=False)
    run = SimpleNamespace(cfg=cfg, device=GPU0, strategy="none", scaler=object(), precision="fp16")
    assert graph_plan.graphs_unsupported(run, None) == FP16_NO_GRAPHS
    step = graph_plan.micro_step_fn(run, None)
    assert step.__name__ == "eager"
    assert capsys.readouterr().err == f"hivetune: CUDA graphs off ({FP16_NO_GRAPHS}); eager steps\n"
