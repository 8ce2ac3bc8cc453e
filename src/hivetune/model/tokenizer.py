"""Tokenizers from an HF folder, or from a GGUF file's metadata.

A folder whose tokenizer_config.json names a generic class (GENERIC_CLASSES: transformers
builds those from tokenizer.json as written) loads as a FolderTokenizer, built with the
`tokenizers` library without importing transformers. Any other source goes through transformers
once: a GGUF file (its metadata, 12-27 s), or a folder of SentencePiece or vocab files, or of a
model-specific class, which transformers 5 rebuilds from the vocabulary with the class's own
normaliser and pre-tokenizer (LlamaTokenizer's non-legacy Metaspace, Qwen2Tokenizer's NFC), not
always what tokenizer.json holds. The tokenizer AutoTokenizer builds is saved as tokenizer.json
with a generic class under the cache folder, keyed by the source files' names, sizes and mtimes,
and every load after that is a FolderTokenizer: transformers' import (1-3 s) is paid once. A
tokenizer converted from a GGUF file is then made to split text as llama.cpp does with that file
(follow_llama_cpp).
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
        cached = file_cache_folder(path, f"tokenizers/gguf-{GGUF_RULES}")
        build = lambda: auto_tokenizer(path.parent, f"{path}: cannot build a tokenizer from the GGUF metadata",
                                       gguf_file=path.name)
        return converted(cached, build, lambda folder: follow_llama_cpp(folder, path))
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


def converted(cached: Path, build, amend=None):
    """The FolderTokenizer saved in `cached`; the first time, build() converted and saved there
    (save_generic), then amend(folder) where given. A cache that cannot be written leaves build()'s
    tokenizer to use as it is."""
    if not (cached / "tokenizer.json").exists():
        tok = build()

        def write(tmp: Path) -> None:
            save_generic(tok, tmp)
            if amend is not None:
                amend(tmp)

        fill_cache_folder(cached, write)
        if not (cached / "tokenizer.json").exists():
            return tok
    return load_saved(cached)


# The version of the rules follow_llama_cpp applies: part of a GGUF tokenizer's cache key.
GGUF_RULES = 2
# llama.cpp's BPE pre-tokenizers that take a word found whole in the vocabulary before any merge
# (llama-vocab.cpp: ignore_merges), as the tokenizer.json they come from says (Llama 3's).
IGNORE_MERGES_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "minicpm5", "youtu", "glm4", "glm5", "tekken", "granite-embed-multi-97m")
SPACE = "\u2581"  # SentencePiece's visible space


def follow_llama_cpp(folder: Path, gguf_path: Path) -> None:
    """Make the tokenizer saved in `folder`, converted from a GGUF file's metadata, split text as
    llama.cpp does with that file, where transformers' conversion reads the file otherwise:
    - its tokens are the file's: one transformers adds past them (a Llama 3 file's
      <|endoftext|> as unknown token) is dropped, or the tokenizer would outgrow the model;
    - SentencePiece (tokenizer.ggml.model llama): llama.cpp puts a space before the text and
      after each special token when tokenizer.ggml.add_space_prefix says so (its default), then
      makes every space the visible one; a text that starts with a space keeps both (Llama 2's
      " Hello" is [▁, ▁Hello]). transformers 5 converts a llama file to a Metaspace that adds
      the first space only where none is there;
    - byte-level BPE (gpt2): the pre-tokenizers of IGNORE_MERGES_PRE take a word whole when the
      vocabulary has it (Llama 3's "Việt" is one token; its merges make two);
    - a general.name holding "phi3" or "phi-3": llama.cpp drops the whitespace after each special
      token but <unk>, <s> and <|endoftext|> (gguf_vocab.PHI3_NAME), as Phi-3's own tokenizer does
      ("<|user|>\nHello" is [<|user|>, ▁Hello]); GGUF keeps no per-token flag for it."""
    from hivetune.model.gguf_vocab import PHI3_NAME, RSTRIP_EXEMPT
    from hivetune.model.load import gguf_field, open_gguf

    reader = open_gguf(gguf_path)
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    model = gguf_field(reader, "tokenizer.ggml.model")
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    dropped = {t["content"] for t in spec.get("added_tokens", []) if t["id"] >= n_tokens}
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] < n_tokens]
    if isinstance(spec["model"].get("vocab"), dict):
        spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if i < n_tokens}
    if model == "llama":
        prefix = bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
        spec["normalizer"] = ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]}
                              if prefix else replace)
        spec["pre_tokenizer"] = None
        decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
                    {"type": "Fuse"}]
        if prefix:
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        spec["decoder"] = {"type": "Sequence", "decoders": decoders}
    elif model == "gpt2" and spec["model"].get("type") == "BPE":
        spec["model"]["ignore_merges"] = gguf_field(reader, "tokenizer.ggml.pre") in IGNORE_MERGES_PRE
    rstrip = bool(PHI3_NAME.search(str(gguf_field(reader, "general.name", "") or "")))
    for token in spec["added_tokens"]:
        if rstrip and token["content"] not in RSTRIP_EXEMPT:
            token["rstrip"] = True
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config_path = folder / "tokenizer_config.json"
    if (dropped or rstrip) and config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["added_tokens_decoder"] = {k: v for k, v in config.get("added_tokens_decoder", {}).items()
                                          if int(k) < n_tokens}
        for entry in config["added_tokens_decoder"].values():
            if rstrip and entry.get("content") not in RSTRIP_EXEMPT:
                entry["rstrip"] = True
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if config.get(key) in dropped:
                config[key] = None
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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
