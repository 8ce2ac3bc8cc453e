"""Installed package versions, read from their metadata: no import of the package itself
(importing transformers or peft to read a version string costs seconds, and pulls in
scikit-learn and torch.distributed's tensor-parallel modules)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

# what a command that needs llama-cpp-python says when it is missing
LLAMA_CPP_INSTALL = "pip install llama-cpp-python (or bash scripts/install_llama_cpp.sh)"


def installed_version(name: str) -> str | None:
    """The distribution's version, or None where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python can be imported (found, not imported: it loads its library)."""
    return importlib.util.find_spec("llama_cpp") is not None
