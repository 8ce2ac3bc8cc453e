"""A bytecode cache for interpreters that keep none: hivetune's own, under HIVETUNE_CACHE/bytecode.

Python compiles a module's source at each import unless it finds the module's bytecode beside
it (``__pycache__``) or under ``sys.pycache_prefix``. An environment that installs torch without
bytecode (uv's default) and forbids writing it (``PYTHONDONTWRITEBYTECODE=1``, common in
containers, or a read-only site-packages) pays for compiling torch's ~700 modules in every
process: 3-4 s of a `hivetune train` on the device's H200 hosts, where the training of a small job
takes 2 s. There ``enable`` points ``sys.pycache_prefix`` at hivetune's cache and lets this
process write there, leaving site-packages as they are; child processes (the compile workers,
torchrun's ranks) read and write the same cache (``PYTHONPYCACHEPREFIX`` set,
``PYTHONDONTWRITEBYTECODE`` unset in their environment). Where that cache holds no torch yet
(the first command on a machine), ``precompile`` compiles the sources of torch, numpy and Triton
into it in a background process pool while this process imports torch, which then finds most of
its modules compiled: a fresh machine's first import takes ~8 s on those hosts, the compilation
~3 s of it.

Nothing changes where the interpreter already keeps bytecode for torch or will write it, where
the user chose a prefix (``PYTHONPYCACHEPREFIX``), or with ``HIVETUNE_BYTECODE_CACHE=0``. This
module imports neither torch nor anything heavy.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from hivetune.core.fileio import cache_dir

OFF = "HIVETUNE_BYTECODE_CACHE"
PACKAGES = ("torch", "numpy", "triton")  # what a model-running command imports first


def package_dir(package: str) -> Path | None:
    """Where an installed package's __init__.py lives, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith("__init__.py"):
        return None
    return Path(spec.origin).parent


def keeps_no_bytecode(folder: Path) -> bool:
    """Whether this interpreter compiles the package in `folder` at each import: no bytecode of its
    __init__ beside it, and Python will not write one (dont_write_bytecode, or a folder it cannot
    write to)."""
    init = folder / "__init__.py"
    if Path(importlib.util.cache_from_source(str(init))).exists():
        return False
    return sys.dont_write_bytecode or not os.access(folder, os.W_OK)


def enable(packages: tuple[str, ...] = PACKAGES, workers: int | None = None) -> Path | None:
    """Keep bytecode under HIVETUNE_CACHE/bytecode when the first of `packages` would be compiled
    at each import (keeps_no_bytecode); where the cache lacks it, start compiling `packages`
    there (precompile, `workers` processes: default the cores less two, at most 8). The prefix,
    or None where nothing changed."""
    if sys.pycache_prefix is not None or os.environ.get(OFF, "1") == "0":
        return None
    folder = package_dir(packages[0])
    if folder is None or not keeps_no_bytecode(folder):
        return None
    prefix = cache_dir() / "bytecode"
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable cache: compile as before
        return None
    if not os.access(prefix, os.W_OK):
        return None
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    init = folder / "__init__.py"
    if not Path(importlib.util.cache_from_source(str(init))).exists() and first_claim(prefix, init):
        folders = [f for f in map(package_dir, packages) if f is not None]
        precompile(folders, prefix, workers if workers is not None else min(8, (os.cpu_count() or 1) - 2))
    return prefix


def first_claim(prefix: Path, init: Path) -> bool:
    """Whether this process is the first to precompile into `prefix` for this interpreter and this
    installation of the package (`init`'s mtime): processes started together on a cold cache (a
    test suite, several runs) start one pool, not one each."""
    try:
        stamp = f"{sys.implementation.cache_tag}-{init.stat().st_mtime_ns}"
        os.close(os.open(prefix / f"precompile-{stamp}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except OSError:
        return False


def precompile(folders: list[Path], prefix: Path, workers: int) -> subprocess.Popen | None:
    """Compile the sources under `folders` into `prefix` with `workers` processes (compileall), in
    a process of its own that outlives this one if need be (each file is written whole, as an
    import writes it); None with fewer than 2 workers, where the pool would take the cores this
    process imports on."""
    if workers < 2 or not folders:
        return None
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(prefix)
    try:
        return subprocess.Popen([sys.executable, "-m", "compileall", "-q", "-j", str(workers), *map(str, folders)],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None


def state(package: str = "torch") -> str:
    """Where this process finds `package`'s bytecode, for the doctor: "prefix <folder>" (a
    pycache prefix: hivetune's or the user's), "compiled at each import", "beside the sources",
    or "" where the package is not installed."""
    folder = package_dir(package)
    if folder is None:
        return ""
    if sys.pycache_prefix is not None:
        return f"prefix {sys.pycache_prefix}"
    return "compiled at each import" if keeps_no_bytecode(folder) else "beside the sources"
