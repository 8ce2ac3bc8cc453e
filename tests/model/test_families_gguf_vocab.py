"""Each family's own tokenizer kind in its GGUF export, as llama.cpp (llama-cpp-python) reads it.

The tiny random models of test_families, each with a tokenizer built here in the shape its family
ships (trained on a small corpus, no network):
- Gemma 2 / Gemma 3: a SentencePiece BPE with byte fallback and no dummy prefix, <start_of_turn> /
  <end_of_turn> as pieces (tokenizer.model; transformers' GemmaTokenizer);
- Phi-3: Llama's SentencePiece (dummy prefix), the chat markers added past its pieces, and the
  tokenizer.json Phi-3 ships (a Prepend normalizer), which transformers reads as is for phi3;
- Phi-4-mini: a byte-level BPE split by GPT-4o's regex (llama.cpp's gpt-4o pre-tokenizer);
- Mistral: Llama's SentencePiece with [INST] / [/INST] as control pieces (v0.3's shape), which
  transformers builds from tokenizer.model as sentencepiece encodes (a ▁ before each stretch of
  text between special tokens, as llama.cpp does).

For each: the tokenizer.* keys (model, pre-tokenizer, add_space_prefix, the chat markers CONTROL),
llama.cpp's ids equal hivetune's tokenizer's on plain strings and on the chat template's text, and 10
greedy tokens from a chat prompt equal hivetune's (windows of 8 for Gemma, 64 for Mistral / Phi-3).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from test_families import CHAT, GEMMA2_TEMPLATE, GEMMA3_TEMPLATE, MISTRAL_TEMPLATE, PHI3_TEMPLATE, \
    PHI4MINI_TEMPLATE, make_hf

from conftest import CORPUS
from hivetune.model.gguf_write import write_model_gguf
from hivetune.model.load import load_model, open_gguf
from hivetune.model.tokenizer import load_tokenizer

WORDS = CORPUS + ["Restart nginx? systemctl restart nginx. And sshd? systemctl restart sshd.",
                  "user model assistant system Hello, how are you? I'm fine 0123456789"]
STRINGS = ["How do I restart the nginx service?", "héllo wörld, 世界 🦙 — ok", "0123456789 3.14 x86_64 1e-5",
           "tabs\tand  two   three    spaces\n\nnew lines\n", "I've been told he'll say 'RE you sure?'"]
CONTROL = 3  # gguf.TokenType
SPECIAL = {"gemma2": ["<start_of_turn>", "<end_of_turn>"], "gemma3": ["<start_of_turn>", "<end_of_turn>"],
           "phi3": ["<|user|>", "<|assistant|>", "<|end|>"], "phi4mini": ["<|user|>", "<|assistant|>", "<|end|>"],
           "mistral": ["[INST]", "[/INST]"]}


def added(tokens: dict[int, str], rstrip=()) -> dict:
    return {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": t in rstrip, "normalized": False,
                     "single_word": False} for i, t in tokens.items()}


def train_spm(**options) -> bytes:
    """A SentencePiece BPE with byte fallback, digits split, whitespace kept (Llama's and Gemma's)."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(WORDS * 5), model_writer=model, vocab_size=360, hard_vocab_limit=False,
        model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=1.0,
        remove_extra_whitespaces=False, normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        minloglevel=2, **options)
    return model.getvalue()


def write_config(folder: Path, **cfg) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def gemma_tokenizer(folder: Path, template: str) -> None:
    (folder / "tokenizer.model").write_bytes(train_spm(
        add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=["<start_of_turn>", "<end_of_turn>"]))
    write_config(folder, tokenizer_class="GemmaTokenizer", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                 pad_token="<pad>", add_bos_token=True, add_eos_token=False, chat_template=template,
                 added_tokens_decoder=added({0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<start_of_turn>",
                                             5: "<end_of_turn>"}))
    load_tokenizer(str(folder)).save_pretrained(str(folder))  # tokenizer.json beside, as Gemma ships it


def phi3_tokenizer(folder: Path, rstrip: bool = False) -> None:
    """Phi-3-mini's files: tokenizer.model, the markers as added tokens past its pieces, and a
    tokenizer.json whose normalizer puts the dummy prefix before every stretch of text; `rstrip`:
    </s> and the markers but <|endoftext|> drop the whitespace after them (Phi-3's first releases)."""
    import sentencepiece as spm

    proto = train_spm(unk_id=0, bos_id=1, eos_id=2)
    (folder / "tokenizer.model").write_bytes(proto)
    n = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
    markers = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
    cfg = dict(tokenizer_class="LlamaTokenizer", bos_token="<s>", eos_token="<|endoftext|>", unk_token="<unk>",
               pad_token="<|endoftext|>", add_bos_token=False, add_eos_token=False, legacy=False,
               chat_template=PHI3_TEMPLATE,
               added_tokens_decoder=added({0: "<unk>", 1: "<s>", 2: "</s>",
                                           **{n + i: t for i, t in enumerate(markers)}},
                                          rstrip=["</s>", *markers[1:]] if rstrip else ()))
    write_config(folder, **cfg)
    from transformers import LlamaTokenizer

    LlamaTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))  # vocab, merges, added tokens
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                             {"type": "Replace", "pattern": {"String": " "},
                                                              "content": "\u2581"}]}
    spec["pre_tokenizer"] = None
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    write_config(folder, **cfg)  # as Phi-3 has it, not as save_pretrained rewrote it


# o200k's split, as Phi-4-mini's tokenizer.json has it
UPPER, LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
CONTRACTION, NOT_LN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"[^\r\n\p{L}\p{N}]?"
GPT4O_REGEX = (f"{NOT_LN}{UPPER}*{LOWER}+{CONTRACTION}|{NOT_LN}{UPPER}+{LOWER}*{CONTRACTION}|"
               r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def phi4mini_tokenizer(folder: Path) -> None:
    """Phi-4-mini's: a byte-level BPE after GPT-4o's split regex, <|endoftext|> as bos / eos / pad."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT4O_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    markers = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
    bpe.train_from_iterator(WORDS * 20, trainers.BpeTrainer(
        vocab_size=370, special_tokens=markers, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(str(folder))
    write_config(folder, tokenizer_class="GPT2Tokenizer", bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                 pad_token="<|endoftext|>", unk_token="<|endoftext|>", add_bos_token=False, add_eos_token=False,
                 chat_template=PHI4MINI_TEMPLATE, added_tokens_decoder=added(dict(enumerate(markers))))


def mistral_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.model").write_bytes(train_spm(unk_id=0, bos_id=1, eos_id=2,
                                                       control_symbols=["[INST]", "[/INST]"]))
    write_config(folder, tokenizer_class="LlamaTokenizer", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                 add_bos_token=True, add_eos_token=False, chat_template=MISTRAL_TEMPLATE,
                 added_tokens_decoder=added({0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]"}))
    load_tokenizer(str(folder)).save_pretrained(str(folder))


BUILDERS = {"gemma2": lambda f: gemma_tokenizer(f, GEMMA2_TEMPLATE),
            "gemma3": lambda f: gemma_tokenizer(f, GEMMA3_TEMPLATE),
            "phi3": phi3_tokenizer, "phi4mini": phi4mini_tokenizer, "mistral": mistral_tokenizer}


class Export:
    def __init__(self, name, folder, tok, model, path):
        self.name, self.folder, self.tok, self.model, self.path = name, folder, tok, model, path


def export_family(folder: Path, name: str, gguf_name: str = "tiny") -> Export:
    """The family's tiny model (Mistral's and Phi-3's window 64: llama.cpp runs them without one)
    saved with its tokenizer, exported as an f32 GGUF under `gguf_name`."""
    windows = {"sliding_window": 64} if name in ("phi3", "mistral") else {}
    make_hf(name, seed=1, **windows).save_pretrained(folder)  # config.json first: it picks the tokenizer class
    BUILDERS[name](folder)
    tok = load_tokenizer(str(folder))
    model = load_model(folder, torch.float32, "cpu").eval()
    path = folder / "model-f32.gguf"
    write_model_gguf(path, model, "f32", gguf_name, tok, folder)
    return Export(name, folder, tok, model, path)


@pytest.fixture(scope="module", params=list(BUILDERS))
def exported(request, tmp_path_factory):
    return export_family(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llm(llama_cpp, exported):
    # an f32 KV cache: f16 keys turn near ties the other way
    model = llama_cpp.Llama(model_path=str(exported.path), n_ctx=64, n_threads=2, type_k=0, type_v=0, verbose=False)
    yield model
    model.close()


def keys(path: Path, *names: str) -> dict:
    fields = open_gguf(path).fields
    return {n: fields[n].contents() if n in fields else None for n in names}


# tokenizer.ggml.model, .pre, .add_space_prefix
KIND = {"gemma2": ("llama", "default", False), "gemma3": ("llama", "default", False),
        "phi3": ("llama", "default", True), "phi4mini": ("gpt2", "gpt-4o", None), "mistral": ("llama", "default", True)}


def test_tokenizer_keys_are_the_familys_kind(exported):
    tok = exported.tok
    got = keys(exported.path, "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_space_prefix",
               "tokenizer.ggml.token_type", "tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id",
               "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "general.name")
    assert (got["tokenizer.ggml.model"], got["tokenizer.ggml.pre"], got["tokenizer.ggml.add_space_prefix"]) \
        == KIND[exported.name]
    for marker in SPECIAL[exported.name]:
        i = tok.convert_tokens_to_ids(marker)
        assert (got["tokenizer.ggml.tokens"][i], got["tokenizer.ggml.token_type"][i]) == (marker, CONTROL)
    assert (got["tokenizer.ggml.bos_token_id"], got["tokenizer.ggml.eos_token_id"]) == \
        (tok.bos_token_id, tok.eos_token_id)
    assert got["tokenizer.ggml.add_bos_token"] == (tok("a")["input_ids"][0] == tok.bos_token_id)
    assert got["general.name"] == "tiny"


def llama_cpp_ids(llm, text: str, add_bos: bool) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=add_bos, special=True)


def test_llama_cpp_tokenizes_text_as_hivetune(exported, llm):
    """Plain text, bos added as the tokenizer adds it; a leading space (SentencePiece's dummy
    prefix then gives two ▁) too."""
    for text in STRINGS + ["  leading spaces"]:
        assert llama_cpp_ids(llm, text, add_bos=True) == exported.tok(text)["input_ids"], text


def chat_texts(tok) -> list[str]:
    return [tok.apply_chat_template(CHAT, tokenize=False),
            tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)]


def test_llama_cpp_tokenizes_the_chat_template_as_hivetune(exported, llm):
    """The chat template's text (special tokens in it, no bos added: the template writes its own),
    each marker one token."""
    tok = exported.tok
    for text in chat_texts(tok):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert llama_cpp_ids(llm, text, add_bos=False) == ids, text
        for marker in SPECIAL[exported.name]:
            assert ids.count(tok.convert_tokens_to_ids(marker)) == text.count(marker) > 0


def test_greedy_from_the_chat_prompt_equals_hivetune(exported, llm):
    from hivetune.workflows.generate import encode_prompt, greedy_ids

    prompt = encode_prompt(exported.tok, "Restart nginx?", chat=True)
    assert len(prompt) + 10 <= 64
    assert greedy_ids(exported.model, [prompt], 10, set())[0] == llama_greedy(llm, prompt, 10)


def llama_greedy(llm, prompt: list[int], n: int) -> list[int]:
    """n tokens of llama.cpp's greedy sampling (top-k 1, no penalties) after `prompt`."""
    llm.reset()
    out = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("rstrip, name, written", [
    (False, "Phi-3-mini-4k-instruct + hivetune LoRA", "Phi 3-mini-4k-instruct + hivetune LoRA"),
    (True, "tiny", "tiny (phi-3 tokenizer)"), (True, "phi3-run", "phi3-run")])
def test_phi3_name_makes_llama_cpp_strip_as_the_tokenizer_does(llama_cpp, tmp_path, rstrip, name, written):
    """llama.cpp drops the whitespace after special tokens when general.name holds "phi-3" / "phi3"
    (the export's name is the model folder's): the name written makes it do so exactly when the
    tokenizer's markers do."""
    windows = {"sliding_window": 64}
    make_hf("phi3", seed=1, **windows).save_pretrained(tmp_path)
    phi3_tokenizer(tmp_path, rstrip=rstrip)
    tok = load_tokenizer(str(tmp_path))
    path = tmp_path / "model-f32.gguf"
    write_model_gguf(path, load_model(tmp_path, torch.float32, "cpu").eval(), "f32", name, tok, tmp_path)
    assert keys(path, "general.name") == {"general.name": written}
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in chat_texts(tok):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert llama_cpp_ids(llm, text, add_bos=False) == ids, text
            newline_after_end = tok.convert_tokens_to_ids("<0x0A>") in ids  # the template's "<|end|>\n"
            assert newline_after_end != rstrip
    finally:
        llm.close()
