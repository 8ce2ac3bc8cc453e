"""The doctor's report: the environment and findings as plain JSON types, and as readable text."""

from __future__ import annotations

from dataclasses import asdict

from hivetune.doctor.arch import arch_covered
from hivetune.doctor.environment import Environment, Finding


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
        "bytecode": env.bytecode,
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
    if report.get("bytecode"):
        lines.append(f"bytecode     torch's: {report['bytecode']}")
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


