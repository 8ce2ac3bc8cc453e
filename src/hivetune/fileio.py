"""Atomic file writes: temp file in the same folder, fsync, rename; a crash leaves old or new."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def fsync_dir(folder: Path) -> None:
    """fsync a folder, so a rename or a new file in it survives a power loss."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_with(path: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_path), fsync it, then rename it to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(data))
