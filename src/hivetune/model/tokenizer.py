"""Tokenizers from an HF folder, or from a GGUF file's metadata (converted once, then cached).

transformers builds a GGUF tokenizer in about 12–27 s; the result is saved as tokenizer.json
under the cache folder keyed by the file's name, size and mtime, and loads in ~0.3 s after.
"""

from __future__ import annotations

import logging
import warnings
from functools import lru_cache
from pathlib import Path

from hivetune.core.errors import UserError
from hivetune.core.fileio import fill_cache_folder, file_cache_folder
from hivetune.model.load import is_gguf


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")


@lru_cache(maxsize=4)
def load_tokenizer(model_path: str):
    """A transformers fast tokenizer for the model; local files only, no remote code."""
    _quiet_transformers()
    from transformers import AutoTokenizer

    path = Path(model_path)
    if not path.exists():
        raise UserError(f"{path}: model path not found")
    if is_gguf(path):
        cached = file_cache_folder(path, "tokenizers")
        if (cached / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as e:
            raise UserError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
        fill_cache_folder(cached, lambda tmp: tok.save_pretrained(str(tmp)))
        return tok
    folder = path if path.is_dir() else path.parent
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        raise UserError(f"{folder}: no usable tokenizer files ({type(e).__name__}: {e})") from None


def eos_ids(tokenizer, args=None) -> set[int]:
    """Token ids that end generation: the tokenizer's eos plus the model config's eos list."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if args is not None and args.eos_token_id is not None:
        e = args.eos_token_id
        ids.update(int(x) for x in (e if isinstance(e, list) else [e]))
    return ids
