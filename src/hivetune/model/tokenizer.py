"""Tokenizers from an HF folder, or from a GGUF file's metadata (converted once, then cached).

transformers builds a GGUF tokenizer in about 12–27 s; the result is saved as tokenizer.json
under the cache folder keyed by the file's name, size and mtime, and loads in ~0.3 s after.
"""

from __future__ import annotations

import json
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


# transformers' tokenizer classes without model-specific code: AutoTokenizer builds a folder that
# names one of these (and no remote code) with that class.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


@lru_cache(maxsize=4)
def load_tokenizer(model_path: str):
    """A transformers fast tokenizer for the model; local files only, no remote code."""
    _quiet_transformers()
    path = Path(model_path)
    if not path.exists():
        raise UserError(f"{path}: model path not found")
    if is_gguf(path):
        cached = file_cache_folder(path, "tokenizers")
        if (cached / "tokenizer.json").exists():
            return load_saved(cached)
        from transformers import AutoTokenizer  # the conversion, once a file

        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as e:
            raise UserError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
        fill_cache_folder(cached, lambda tmp: tok.save_pretrained(str(tmp)))
        return tok
    from transformers import AutoTokenizer  # a model folder's class may carry model-specific code

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


def load_saved(folder: str | Path):
    """A tokenizer hivetune saved (a GGUF file's, converted once): built by the generic class its
    tokenizer_config.json names, as AutoTokenizer would build it, without importing AutoTokenizer,
    whose module imports transformers' auto classes and with them torch._dynamo, scikit-learn and
    pyarrow (~12 s of a 19 s tiny job on the H200 host, docs/log.md); else by AutoTokenizer."""
    import transformers

    folder = Path(folder)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    name = config.get("tokenizer_class")
    cls = getattr(transformers, name, None) if name in GENERIC_CLASSES and "auto_map" not in config else None
    if cls is None:
        from transformers import AutoTokenizer as cls
    return cls.from_pretrained(str(folder), local_files_only=True)
