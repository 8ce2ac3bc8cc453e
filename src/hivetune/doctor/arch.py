"""GPU architecture names and the rules for which builds run on which GPUs (pure functions)."""

from __future__ import annotations

import re


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

