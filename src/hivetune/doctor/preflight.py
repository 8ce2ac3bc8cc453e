"""The doctor's quick checks before training: refuse to start on a stack known to fail.

``hivetune train`` calls ``check_stack`` before it loads anything. It probes without the
self-test (about 30 ms on a CPU: versions, drivers, GPUs, architectures, environment variables)
and refuses, with the doctor's message and fix in one line, when a finding that breaks training
on the chosen device is an error: a CUDA driver older than torch's CUDA, a ROCm runtime other
than torch's, a GPU the build has no kernels for, a wrong HSA_OVERRIDE_GFX_VERSION, torchao
without torch.int1, bf16 asked of a GPU without it, or device cuda with no GPU visible. GPU
findings do not stop a run on the CPU. ``skip_doctor`` (``--no-doctor``) trains anyway.
"""

from __future__ import annotations

from hivetune.doctor.diagnose import diagnose
from hivetune.doctor.environment import Environment, Finding
from hivetune.core.errors import UserError

# Findings that matter whatever the device: importing transformers / peft fails.
ANY_DEVICE = ("torchao-needs-newer-torch",)
OVERRIDE = "train anyway with --no-doctor (or --set skip_doctor=true)"


def probe_stack() -> Environment:
    """The environment without the self-test or Triton: the cheap part of ``hivetune doctor``."""
    from hivetune.doctor.probe import gather_environment

    return gather_environment(selftest=False, triton=False)


def training_device(env: Environment, device: str) -> str:
    """'cpu' or 'cuda', as hivetune.core.device.resolve_device will choose it on this machine."""
    if device == "auto":
        return "cuda" if env.gpus else "cpu"
    return device


def preflight(env: Environment, device: str = "auto", precision: str = "auto") -> list[Finding]:
    """The error findings that would make training with this device and precision fail."""
    target = training_device(env, device)
    found = [f for f in diagnose(env) if f.severity == "error" and (target == "cuda" or f.code in ANY_DEVICE)]
    if target == "cuda" and not env.gpus:
        visible = [f for f in diagnose(env) if f.code == "gpu-not-visible"]
        message = visible[0].message if visible else f"torch {env.torch_version} is a CPU-only build"
        fix = visible[0].fix if visible else "install a CUDA or ROCm build of torch, or use --device cpu"
        found.append(Finding("error", "no-gpu", f"device cuda was asked for, but {message}", fix))
    if target == "cuda" and precision == "bf16":
        found += [Finding("error", "bf16-unsupported",
                          f"precision bf16 was asked for, but GPU {g.index} ({g.name}): "
                          f"{g.bf16_why or g.arch + ' has no bf16 units'}",
                          "use --precision fp16 (with loss scaling) or fp32, or --precision auto")
                  for g in env.gpus[:1] if not g.bf16]
    return found


def check_stack(device: str = "auto", precision: str = "auto", env: Environment | None = None) -> None:
    """Raise a one-line UserError naming the first blocking finding and its fix, if any."""
    found = preflight(env if env is not None else probe_stack(), device, precision)
    if found:
        first = found[0]
        more = f" (and {len(found) - 1} more: run hivetune doctor)" if len(found) > 1 else ""
        raise UserError(f"this torch / GPU stack is known to fail: [{first.code}] {first.message}; "
                        f"fix: {first.fix}{more}; {OVERRIDE}")
