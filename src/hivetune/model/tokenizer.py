"""Tokenizers from an HF folder, or from a GGUF file's metadata.

A folder whose tokenizer_config.json names a generic class (GENERIC_CLASSES: transformers
builds those from tokenizer.json as written) loads as a FolderTokenizer, built with the
`tokenizers` library without importing transformers. Any other source goes through transformers
once: a GGUF file (its metadata, 12-27 s), or a folder of SentencePiece or vocab files, or of a
model-specific class, which transformers 5 rebuilds from the vocabulary with the class's own
normaliser and pre-tokenizer (LlamaTokenizer's non-legacy Metaspace, Qwen2Tokenizer's NFC), not
always what tokenizer.json holds. The tokenizer AutoTokenizer builds is saved as tokenizer.json
with a generic class under the cache folder, keyed by the source files' names, sizes and mtimes,
and every load after that is a FolderTokenizer: transformers' import (1-3 s) is paid once.
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


# The files a folder's tokenizer is built from: the cache of a converted one is keyed by them.
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                "chat_template.json", "config.json")


@lru_cache(maxsize=4)
def load_tokenizer(model_path: str):
    """The model's tokenizer: a FolderTokenizer (a folder of a generic class, or the cached
    conversion of any other source), else transformers' AutoTokenizer where the cache cannot be
    written; local files only, no remote code."""
    path = Path(model_path)
    if not path.exists():
        raise UserError(f"{path}: model path not found")
    if is_gguf(path):
        cached = file_cache_folder(path, "tokenizers")
        build = lambda: auto_tokenizer(path.parent, f"{path}: cannot build a tokenizer from the GGUF metadata",
                                       gguf_file=path.name)
        return converted(cached, build)
    folder = path if path.is_dir() else path.parent
    if generic_folder(folder):
        return load_saved(folder)
    sources = sorted(folder / name for name in SOURCE_FILES if (folder / name).is_file())
    sources += sorted(p for p in (folder / "additional_chat_templates").glob("*") if p.is_file())
    if not sources:
        raise UserError(f"{folder}: no usable tokenizer files (none of tokenizer.json, tokenizer.model, "
                        f"vocab.json, vocab.txt)")
    cached = file_cache_folder(sources[0], "tokenizers", *sources[1:])
    return converted(cached, lambda: auto_tokenizer(folder, f"{folder}: no usable tokenizer files"))


def auto_tokenizer(folder: Path, failure: str, **kwargs):
    """transformers' AutoTokenizer for `folder`, local files only, no remote code; a failure is a
    UserError starting with `failure`."""
    _quiet_transformers()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False, **kwargs)
    except Exception as e:
        raise UserError(f"{failure} ({type(e).__name__}: {e})") from None


def converted(cached: Path, build):
    """The FolderTokenizer saved in `cached`; the first time, build() converted and saved there
    (save_generic). A cache that cannot be written leaves build()'s tokenizer to use as it is."""
    if not (cached / "tokenizer.json").exists():
        tok = build()
        fill_cache_folder(cached, lambda tmp: save_generic(tok, tmp))
        if not (cached / "tokenizer.json").exists():
            return tok
    return load_saved(cached)


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
