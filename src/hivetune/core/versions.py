"""Installed package versions, read from their metadata: no import of the package itself
(importing transformers or peft to read a version string costs seconds, and pulls in
scikit-learn and torch.distributed's tensor-parallel modules)."""

from __future__ import annotations

import importlib.metadata


def installed_version(name: str) -> str | None:
    """The distribution's version, or None where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
