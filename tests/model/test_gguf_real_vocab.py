"""Tokenizers converted from real GGUF vocabularies split text as the models' own tokenizers do.

llama.cpp tests its tokenizer on vocab-only GGUF files of real models, each with test strings
(.inp) and the ids the model's original tokenizer gives them (.out). scripts/install_llama_cpp.sh
copies four of them from the llama-cpp-python source package: Llama 2's SentencePiece (Mistral
7B v0.1's too), Phi-3's, Qwen2's byte-level BPE and Llama 3's. hivetune trains a GGUF model
with the tokenizer it converts from the file (model.tokenizer.load_tokenizer): its ids must be
the original's, which llama.cpp reproduces when it serves the model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

VOCABS = ("llama-spm", "phi-3", "qwen2", "llama-bpe")
SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_folder() -> Path | None:
    """Where scripts/install_llama_cpp.sh put llama.cpp's vocabulary test files (the newest)."""
    root = Path(os.environ.get("HIVETUNE_WHEELS") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hivetune" / "wheels")
    found = sorted(p for p in root.glob("llama-vocab-*") if (p / "ggml-vocab-qwen2.gguf.out").is_file())
    return found[-1] if found else None


@pytest.fixture(scope="module")
def folder() -> Path:
    found = vocab_folder()
    if found is None:
        pytest.skip("llama.cpp's vocabulary test files are missing: `bash scripts/install_llama_cpp.sh` fetches them")
    return found


def cases(folder: Path, name: str) -> list[tuple[str, list[int]]]:
    texts = (folder / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = (folder / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(ids) >= len(texts) > 30
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]


@pytest.mark.parametrize("name", VOCABS)
def test_a_converted_gguf_tokenizer_gives_the_original_ids(folder, name):
    import gguf

    from hivetune.model.tokenizer import load_tokenizer

    path = folder / f"ggml-vocab-{name}.gguf"
    tok = load_tokenizer(str(path))
    n_tokens = len(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)
    assert len(tok) == n_tokens, "the tokenizer holds the file's tokens, none added past the model's rows"
    wrong = [(text, want, got) for text, want in cases(folder, name)
             if (got := tok.encode(text, add_special_tokens=False)) != want]
    assert not wrong, f"{len(wrong)} texts split otherwise, first: {wrong[:3]}"
    unread = [text for text, want in cases(folder, name) if tok.decode(want) != text]
    assert not unread, f"{len(unread)} texts decode otherwise, first: {unread[:3]}"



@pytest.mark.parametrize("name", VOCABS)
def test_special_tokens_split_as_llama_cpp_splits_them(folder, llama_cpp, name):
    """Text around the vocabulary's special tokens (chat markers, <s>, </s>): the ids llama.cpp
    gives with the file (Phi-3's drop the whitespace after them; SentencePiece puts ▁ after them)."""
    from hivetune.model.tokenizer import load_tokenizer

    path = folder / f"ggml-vocab-{name}.gguf"
    tok = load_tokenizer(str(path))
    specials = [t.content for _, t in sorted(tok.backend_tokenizer.get_added_tokens_decoder().items()) if t.special]
    picked = specials[:3] + specials[-3:]
    texts = [f"{s}\nHello" for s in picked] + [f"x{s} y" for s in picked] + [f" {s}  z\n" for s in picked]
    texts += ["".join(f"{s}turn {i}\n" for i, s in enumerate(picked))]
    reference = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    wrong = [(text, want, got) for text in texts
             if (got := tok.encode(text, add_special_tokens=False))
             != (want := reference.tokenize(text.encode(), add_bos=False, special=True))]
    assert not wrong, f"{len(wrong)} of {len(texts)} texts split otherwise, first: {wrong[:2]}"
