"""Start-up work begun in threads before a GPU command imports torch: Triton's, and reading torch's libraries.

A process's first Triton kernel launch first imports Triton (~0.5 s), hashes Triton's installation
for its cache key (~0.4-0.9 s on the device's hosts) and builds or loads the driver's C
utilities (a C compiler run on a fresh machine, ~0.5 s). None of that needs torch, which takes
2-6 s to import (6 s on a fresh machine's cold disk), so the CLI starts it here first for the
commands that run a model (``EARLY_COMMANDS``) and ops.prewarm joins the thread before its own
Triton work. Nothing where no GPU device node exists, where Triton is not installed, or where
``HIVETUNE_REFERENCE`` forces the PyTorch layers. This module imports neither torch nor Triton
at its own import.

On a fresh machine most of torch's import is its shared libraries coming off a cold disk (~6 s
of a W1 process on an H200 host, page by page as the loader touches them): ``prefetch`` asks
the kernel to read them ahead (posix_fadvise WILLNEED, no waiting), torch's own first, then the
CUDA libraries it loads.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

from hivetune.core.fallbacks import forced

EARLY_COMMANDS = ("train", "bench", "cycle", "eval", "generate", "chat")
# the backend whose device nodes exist -> its driver module and C utilities class
DRIVERS = {"/dev/nvidiactl": ("triton.backends.nvidia.driver", "CudaUtils"),
           "/dev/kfd": ("triton.backends.amd.driver", "HIPUtils")}

_THREAD: threading.Thread | None = None
DONE: dict = {}  # what warm finished: {"key": True, "utils": True} (tests read it)


def driver_utils():
    """(module, class name) of the driver utilities of the GPU this host has, or None."""
    for node, utils in DRIVERS.items():
        if os.path.exists(node):
            return utils
    return None


def start(command: str | None) -> None:
    """Start the thread for `command` if it runs a model and this host has a GPU and Triton."""
    global _THREAD
    if _THREAD is not None or command not in EARLY_COMMANDS:
        return
    utils = driver_utils()
    if utils is None or forced("fused_layers") or importlib.util.find_spec("triton") is None:
        return
    threading.Thread(target=prefetch, name="hivetune-prefetch", daemon=True).start()
    _THREAD = threading.Thread(target=warm, args=(utils,), name="hivetune-triton", daemon=True)
    _THREAD.start()


def library_files() -> list[Path]:
    """torch's shared libraries, then those of the CUDA wheels beside it (nvidia/*/lib)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted((root / "lib").glob("*.so*")) + sorted(root.parent.glob("nvidia/*/lib/*.so*"))


def prefetch() -> int:
    """Ask the kernel to read torch's libraries into the page cache; the files asked for."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    asked = 0
    for path in library_files():
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                asked += 1
            finally:
                os.close(fd)
        except OSError:
            pass
    return asked


def warm(utils: tuple[str, str] | None = None) -> None:
    """What Triton does at its first kernel launch without torch: its cache key (lru_cached: the
    first launch's cache lookup then finds it done), its gluon modules and, given `utils` (module,
    class), the driver's C utilities. ops.prewarm calls it too, where the CLI did not start it."""
    try:
        from triton.runtime.cache import triton_key

        triton_key()
        DONE["key"] = True
        import triton.experimental.gluon  # noqa: F401 - imported at the first launch

        if utils is not None:
            module, name = utils
            getattr(importlib.import_module(module), name)()  # a singleton: the driver's own reuses it
            DONE["utils"] = True
    except Exception:  # noqa: BLE001 - a Triton without these parts: the first launch does it
        pass


def join(timeout: float = 30.0) -> None:
    """Wait for the thread if it still runs: Triton's cache key is an lru_cache without a lock,
    so a second caller beside it would hash the installation again."""
    if _THREAD is not None and _THREAD.is_alive():
        _THREAD.join(timeout)
