"""Mistral's real vocabularies in the GGUF export, as llama.cpp reads them: v0.1's SentencePiece
tokenizer.model (32,000 pieces, [INST] plain text), v0.3's (32,768, [INST] / [/INST] control
pieces) and Tekken (Mistral NeMo's 131,072: 1,000 special tokens, then a byte-level BPE), taken
from mistral-common's wheel (scripts/setup.sh puts it in .venv/test-data, off sys.path), each on a
tiny random Mistral of that vocabulary. Tekken's tokenizer.json is made here as Mistral's HF
releases have it: transformers' TikTokenConverter over tekken.json's ranks (shifted past the
special tokens), bos added by the post-processor; llama.cpp's check-string fingerprint of it is
llama.cpp's "tekken" entry, so the converted tokenizer splits as NeMo's does. For each: llama.cpp's ids equal
hivetune's tokenizer's on plain strings (byte fallback, digits, spaces, CJK, emoji) and on the chat
template's text, and 10 greedy tokens from a chat prompt equal hivetune's.

The tokenizers are "legacy" (a ▁ before each stretch of text after a special token), as llama.cpp's
SentencePiece tokenizer always is: a folder with legacy false tokenizes " Restart" after [INST] as
▁Restart where llama.cpp makes ▁ ▁Restart (measured on v0.3's vocabulary), a difference of
llama.cpp's that the export cannot express."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_families import MISTRAL_TEMPLATE
from test_families_gguf_vocab import STRINGS, added, chat_texts, keys, llama_cpp_ids, llama_greedy
from tiny_hf import random_hf_model

from hivetune.model.gguf_write import write_model_gguf
from hivetune.model.load import load_model
from hivetune.model.tokenizer import load_tokenizer

DATA = Path(sys.prefix) / "test-data" / "mistral_common" / "data"
VERSIONS = {"v0.1": ("tokenizer.model.v1", 32000, {0: "<unk>", 1: "<s>", 2: "</s>"}),
            "v0.3": ("mistral_instruct_tokenizer_240323.model.v3", 32768,
                     {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]"}),
            "tekken": ("tekken_240911.json", 131072, {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]"})}
PRE = {"v0.1": ("llama", "default"), "v0.3": ("llama", "default"), "tekken": ("gpt2", "tekken")}
MORE = ["[INST] Restart nginx? [/INST] systemctl restart nginx</s>", "Ünïcödé ﬁ ligatures ½ ²", "    indented code()"]


def tekken_tokenizer_json(source: Path) -> dict:
    """tokenizer.json of a tekken.json: BPE ids past its special tokens, which take ids 0-999."""
    import base64

    from transformers.convert_slow_tokenizer import TikTokenConverter

    tekken = json.loads(source.read_text())
    n_special, size = tekken["config"]["default_num_special_tokens"], tekken["config"]["default_vocab_size"]
    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] + n_special for v in tekken["vocab"][:size - n_special]}

    class Tekken(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_):
            return ranks

    spec = json.loads(Tekken(vocab_file=str(source), pattern=tekken["config"]["pattern"]).converted().to_str())
    names = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"] + [f"<SPECIAL_{i}>" for i in range(5, n_special)]
    spec["model"]["vocab"].update({name: i for i, name in enumerate(names)})
    spec["added_tokens"] = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, name in enumerate(names)]
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    return spec


def mistral_folder(folder: Path, version: str) -> Path:
    """A tiny random Mistral (window 64, which llama.cpp runs without) with the version's vocabulary."""
    from transformers import MistralConfig

    source, vocab, special = VERSIONS[version]
    if not (DATA / source).is_file():
        pytest.skip(f"{DATA / source} missing: scripts/setup.sh fetches mistral-common's wheel into .venv/test-data")
    model = random_hf_model(MistralConfig, 3, 4, lambda name, p, noise: (0.3 * noise + 1.0) if name.endswith(
        "norm.weight") else 2 * noise / p.shape[-1] ** 0.5, vocab_size=vocab, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(folder)
    common = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=MISTRAL_TEMPLATE,
                  added_tokens_decoder=added(special))
    if version == "tekken":
        (folder / "tokenizer.json").write_text(json.dumps(tekken_tokenizer_json(DATA / source), ensure_ascii=False))
        (folder / "tokenizer_config.json").write_text(json.dumps(dict(tokenizer_class="PreTrainedTokenizerFast",
                                                                      **common)))
        return folder
    shutil.copyfile(DATA / source, folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="LlamaTokenizer", add_bos_token=True, add_eos_token=False, legacy=True, **common)))
    load_tokenizer(str(folder)).save_pretrained(str(folder))  # tokenizer.json beside, as Mistral ships it
    return folder


@pytest.fixture(scope="module", params=list(VERSIONS))
def exported(request, tmp_path_factory):
    folder = mistral_folder(tmp_path_factory.mktemp(request.param.replace(".", "")), request.param)
    tok = load_tokenizer(str(folder))
    model = load_model(folder, torch.float32, "cpu").eval()
    path = folder / "model-f32.gguf"
    write_model_gguf(path, model, "f32", "tiny", tok, folder)
    return request.param, tok, model, path


@pytest.fixture(scope="module")
def llm(llama_cpp, exported):
    model = llama_cpp.Llama(model_path=str(exported[3]), n_ctx=64, n_threads=2, type_k=0, type_v=0, verbose=False)
    yield model
    model.close()


def test_vocabulary_and_markers_as_the_version_has_them(exported):
    version, tok, _, path = exported
    got = keys(path, "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    assert (got["tokenizer.ggml.model"], got["tokenizer.ggml.pre"]) == PRE[version]
    assert len(got["tokenizer.ggml.tokens"]) == VERSIONS[version][1] == len(tok)
    control = [got["tokenizer.ggml.tokens"][i] for i, t in enumerate(got["tokenizer.ggml.token_type"]) if t == 3]
    assert {"[INST]", "[/INST]"} <= set(control) if version != "v0.1" else "[INST]" not in control


def test_llama_cpp_tokenizes_text_and_the_chat_template_as_hivetune(exported, llm):
    _, tok, _, _ = exported
    for text in STRINGS + MORE + ["  leading spaces"]:
        assert llama_cpp_ids(llm, text, add_bos=True) == tok(text)["input_ids"], text
    for text in chat_texts(tok):
        assert llama_cpp_ids(llm, text, add_bos=False) == tok(text, add_special_tokens=False)["input_ids"], text


def test_greedy_from_the_chat_prompt_equals_hivetune(exported, llm):
    from hivetune.workflows.generate import encode_prompt, greedy_ids

    _, tok, model, _ = exported
    prompt = encode_prompt(tok, "Restart nginx?", chat=True)
    assert greedy_ids(model, [prompt], 10, set())[0] == llama_greedy(llm, prompt, 10)
