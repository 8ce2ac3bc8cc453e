"""``hivetune doctor``: what this machine's torch stack is, whether it computes right, and how to
fix what is known to break.

The steps, each usable alone:
- ``gather_environment()`` (probe.py) probes versions, GPUs and the architectures the build has
  kernels for; with the self-test, also which attention kernels run (attention_probes.py) and a
  short check against CPU float64 references (selftest.py).
- ``diagnose(env)`` (diagnose.py) is pure: it turns an ``Environment`` into ``Finding``s, each a
  known failure with its fix, so tests can build fake environments for every one.
- ``doctor()`` runs both, prints a readable report (or JSON; report.py) and returns it as a dict.
- ``preflight()`` (preflight.py) is the cheap part that ``hivetune train`` runs before it starts.
"""

from __future__ import annotations

import json

from hivetune.doctor.arch import (arch_covered, family_member, gfx_to_version, major_minor, same_isa_family,
                                  version_to_gfx)
from hivetune.doctor.diagnose import diagnose
from hivetune.doctor.environment import (ENV_VARS, PACKAGES, SEVERITIES, Check, CPUInfo, Environment, Finding,
                                         GPUInfo)
from hivetune.doctor.probe import gather_environment, kfd_archs
from hivetune.doctor.report import build_report, format_report

__all__ = ["ENV_VARS", "PACKAGES", "SEVERITIES", "CPUInfo", "Check", "Environment", "Finding", "GPUInfo",
           "arch_covered", "build_report", "diagnose", "doctor", "family_member", "format_report",
           "gather_environment", "gfx_to_version", "kfd_archs", "major_minor", "same_isa_family", "version_to_gfx"]


def doctor(json_output: bool = False, quiet: bool = False) -> dict:
    """Probe, self-test and diagnose this machine; print the report (text, or JSON with
    ``json_output``) unless ``quiet``, and return it. ``report["ok"]`` is False when any
    finding is an error."""
    env = gather_environment()
    report = build_report(env, diagnose(env))
    if not quiet:
        print(json.dumps(report, indent=2) if json_output else format_report(report))
    return report
