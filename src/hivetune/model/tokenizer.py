"""Tokenizers from an HF folder, or from a GGUF file's metadata (converted once, then cached).

A folder whose tokenizer_config.json names a generic class (GENERIC_CLASSES: transformers
builds those from tokenizer.json as written) loads as a FolderTokenizer, built with the
`tokenizers` library without importing transformers. Other folders go through transformers'
AutoTokenizer: SentencePiece or vocab files only, remote code, or a model-specific class, which
transformers 5 rebuilds from the vocabulary with the class's own normaliser and pre-tokenizer
(LlamaTokenizer's non-legacy Metaspace, Qwen2Tokenizer's NFC), not always what tokenizer.json
holds. transformers builds a GGUF tokenizer in about 12–27 s; the tokenizer it then builds from
its own saved files is cached as tokenizer.json with a generic class, under the cache folder
keyed by the file's name, size and mtime, and loads as a FolderTokenizer after.
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

# transformers' tokenizer classes without model-specific code: AutoTokenizer builds a folder that
# names one of these (and no remote code) from its tokenizer.json as written.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types (config.json) whose generic-class folders AutoTokenizer builds as written, checked
# against it (tests/model/test_folder_tokenizer.py). Others, qwen2 among them, it rebuilds with the
# model's own class whatever tokenizer_config.json names; a folder without config.json is generic.
AS_WRITTEN_MODEL_TYPES = (None, "llama", "mistral", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi3")


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")


@lru_cache(maxsize=4)
def load_tokenizer(model_path: str):
    """The model's tokenizer: a FolderTokenizer (a GGUF file's, or a folder of a generic class),
    else transformers' AutoTokenizer; local files only, no remote code."""
    path = Path(model_path)
    if not path.exists():
        raise UserError(f"{path}: model path not found")
    if is_gguf(path):
        cached = file_cache_folder(path, "tokenizers")
        if not (cached / "tokenizer.json").exists():
            _quiet_transformers()
            from transformers import AutoTokenizer  # the conversion, once a file

            try:
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
            except Exception as e:
                raise UserError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
            fill_cache_folder(cached, lambda tmp: save_generic(tok, tmp))
        return load_saved(cached)
    folder = path if path.is_dir() else path.parent
    if generic_folder(folder):
        return load_saved(folder)
    _quiet_transformers()
    from transformers import AutoTokenizer  # a model-specific class, SentencePiece / vocab files, remote code

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


def generic_folder(folder: Path) -> bool:
    """Whether the folder has tokenizer.json and a tokenizer_config.json naming a generic class
    (no auto_map), of a model type in AS_WRITTEN_MODEL_TYPES: AutoTokenizer builds it from
    tokenizer.json as written, as FolderTokenizer does."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        model = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    except (OSError, ValueError):
        return False
    model_type = model.get("model_type") if isinstance(model, dict) else "unknown"
    return (model_type in AS_WRITTEN_MODEL_TYPES and (folder / "tokenizer.json").is_file() and isinstance(config, dict)
            and config.get("tokenizer_class") in GENERIC_CLASSES and "auto_map" not in config)


def save_generic(tok, folder: Path) -> None:
    """`tok` saved, then rebuilt from its files as AutoTokenizer builds it on a later load (a
    model-specific class applies its own pipeline there) and saved again under a generic class:
    the tokenizer.json holds the pipeline that is used, and later loads skip transformers."""
    from transformers import AutoTokenizer

    tok.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(folder), local_files_only=True).save_pretrained(str(folder))
    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = GENERIC_CLASSES[0]
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_saved(folder: str | Path):
    """A folder of tokenizer.json and a generic class (generic_folder): a FolderTokenizer; any
    other (a cache written with a model-specific class) through transformers' AutoTokenizer."""
    folder = Path(folder)
    if not generic_folder(folder):
        _quiet_transformers()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    from hivetune.model.folder_tokenizer import FolderTokenizer

    try:
        return FolderTokenizer(folder)
    except UserError:
        raise
    except Exception as e:  # a tokenizer.json the tokenizers library refuses
        raise UserError(f"{folder}: no usable tokenizer files ({type(e).__name__}: {e})") from None
