"""A transformers tokenizer as GGUF tokenizer.* keys, through the gguf package's vocab classes.

The kinds llama.cpp's convert_hf_to_gguf.py writes, picked the way it picks them:

- SentencePiece (Llama 2, Mistral, Gemma): ``tokenizer.model`` read by ``gguf.SentencePieceVocab``
  (or, without it or the sentencepiece package, the BPE-with-byte-fallback ``tokenizer.json``
  through ``gguf.LlamaHfVocab``, scored by merge rank); ``tokenizer.ggml.model = llama``,
  pre-tokenizer ``default``, and ``add_space_prefix`` as the tokenizer does it (Llama's and
  Mistral's ``▁`` before the text; Gemma's none).
- byte-level BPE (Llama 3, Qwen, SmolLM2): ``gguf.BpeVocab``; ``tokenizer.ggml.model = gpt2`` and the
  pre-tokenizer named as llama.cpp names it: the sha256 of the token ids of CHECK_TEXT looked up in
  PRE_TOKENIZER_HASHES. A tokenizer with a vocabulary of its own (its hash in no table) whose
  pre-tokenizer is exactly one llama.cpp implements (GPT-2's, Qwen 2's, Llama 3's, GPT-4o's) gets
  that name; any other unknown hash is refused.

Added tokens get llama.cpp's types (CONTROL when special or shaped like ``<|...|>``, else
USER_DEFINED), embedding rows past the tokenizer become ``[PAD<i>]`` (UNUSED), and
``gguf.SpecialVocab`` adds the merges, special token ids and chat template. llama.cpp strips the
whitespace after special tokens when general.name holds "phi3" or "phi-3"; ``llama_cpp_name`` writes
the name so that it does so exactly when the tokenizer's special tokens strip it.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from hashlib import sha256
from pathlib import Path

from hivetune.core.errors import UserError

# llama.cpp's check string (convert_hf_to_gguf.py, get_vocab_base_pre): whitespace runs, emoji, digit
# runs, Khmer, CJK, Cyrillic, quotes and contractions, where pre-tokenizers differ.
CHECK_TEXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis '
              'concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 '
              'កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български '
              '\'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? '
              '\'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')

# sha256(str(tokenizer.encode(CHECK_TEXT))) -> tokenizer.ggml.pre, llama.cpp's table (a later entry
# of a repeated hash wins, as there).
_HASHES = """
b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b chatglm-bpe
81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516 chatglm-bpe
a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2 glm4
9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902 glm4
cdf5f35325780597efd76153d4d1c16778f766173908894c04afc20108536267 glm4
1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35 minerva-7b
7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664 hunyuan
bba3b3366b646dbdded5dbc42d59598b849371afc42f7beafa914afaa5b70aa6 hunyuan-dense
a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6 falcon-h1
60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86 falcon-h1
3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896 falcon-h1
48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b falcon-h1
81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890 kimi-k2
d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c qwen2
66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273 grok-2
b3d1dd861f1d4c5c0d2569ce36baf3f90fe8a102db3de50dd71ff860d91be3df jina-v2-de
0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4 gpt-2
0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5 llama-bpe
049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754 deepseek-llm
347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821 deepseek-coder
8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed falcon
0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f bert-bge
9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e falcon3
8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7 bert-bge-large
b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166 mpt
35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34 starcoder
3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454 gpt-2
32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3 stablelm2
6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff refact
9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8 command-r
d772b220ace2baec124bed8cfafce0ead7d6c38a4b65ef11261cf9d5d62246d1 tiny_aya
e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea qwen2
b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166 olmo
a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e dbrx
c7699093ba4255a91e702aa38a596aa81669f3525dae06c2953267dde580f448 jina-v1-en
0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f jina-v2-en
171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643 jina-v2-es
27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6 jina-v2-de
a023e9fdc5a11f034d3ef515b92350e56fb2af1f66c6b6811a4444ea9bf8763d jina-v5-nano
c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d smaug-bpe
c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360 poro-chat
7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a jina-v2-code
7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee viking
b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901 jais
bc5108ee1eb6a3d600cadd065f63190fbd0554dbc9e4bbd6a0d977970afc8d2a jais-2
7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f codeshell
63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e tekken
855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249 smollm
3c30d3ad1d6b64202cd222813e7736c2db6e1bd6d67197090fc1211fbc612ae7 bloom
bc01ce58980e1db43859146dc51b1758b3b88729b217a74792e9f8d43e479d21 gpt3-finnish
4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae exaone
fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085 phi-2
60824e3c0d9401f89943cbb2fff727f0e2d4c545ba4df2d6e4f09a6db0f5b450 chameleon
8b5a93ed704057481f240da0be7e7dca721d7f8f4755263b6807227a2cbeae65 roberta-bpe
ad851be1dba641f2e3711822f816db2c265f788b37c63b4e1aeacb9ee92de8eb gigachat
d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1 megrez
877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5 deepseek-v3
b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5 deepseek-r1-qwen
ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e gpt-4o
7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f superbpe
1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15 trillion
96a5f08be6259352137b512d4157e333e21df7edd3fcd152990608735a65b224 bailingmoe
d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406 llama4
0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3 pixtral
d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec seed-coder
b0a6b1c0bd5998ebd9df08611efde34a4ff03faed45ae09c43e6b31ebd4b94cf a.x-4.0
f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4 midm-2.0
169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51 lfm2
2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb exaone4
a1e163ecab2e718a4c829d1148b6e86824ec36163bb71941c3dca9cd5ac25756 mellum
a0b64b4385f123663873756336c085744376d015ff328bb1d901598f63c44152 modern-bert
49fc0303c9e0d2c2c565c510f64b2d9b271276acdcdadff733249eda9f7d59df afmoe
9b1be57e70d20d9501b2b3186e792d81181ae36ada3903c26f9fea418cf87206 bailingmoe2
53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e granite-docling
f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95 minimax-m2
4a2e2abae11ca2b86d570fc5b44be4d5eb5e72cc8f22dd136a94b37da83ab665 kormo
9d70134b369a70e5735009b6de918f7581b5211f7c074d1f89f753aea8248af1 youtu
16389f0a1f51ee53e562ffd51c371dc508639ab0e4261502071836e50e223e91 solar-open
6c81ce329e0802883b22eabab0d3fa48357337ef1ecb45443828bf1f6254833f exaone-moe
d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4 qwen35
b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d joyai-llm
e4d54df1ebc1f2b91acd986c5b51aa50837d5faf7c7398e73c1f9e9ee5d19869 kanana2
862f827721df956049dff5ca81a57f29e575280bc622e290d3bf4e35eca29015 f2llmv2
"""
PRE_TOKENIZER_HASHES = dict(line.split() for line in _HASHES.strip().splitlines())
GPT2_PRE = "gpt-2"  # llama.cpp's name for GPT-2's own pre-tokenizer regex
SMOLLM_PRE = "smollm"  # GPT-2's regex after splitting digits one by one (SmolLM / SmolLM2)


def check_hash(tokenizer) -> str:
    """llama.cpp's fingerprint of a pre-tokenizer: sha256 of the token ids of CHECK_TEXT."""
    return sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()


# Pre-tokenizers llama.cpp implements under a name, recognised by their spec for tokenizers whose
# vocabulary is their own (their hash is then in no table): a Split on the family's regex before a
# regex-less ByteLevel (NFC, as Qwen's tokenizer adds it, is left out by llama.cpp for Qwen too).
SPLIT_REGEX_PRE = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+": "gpt-4o",  # o200k (Phi-4-mini)
}


def pre_tokenizer_by_spec(spec: dict) -> str | None:
    """llama.cpp's name for a tokenizer.json pre-tokenizer it implements exactly, else None: a bare
    ByteLevel with GPT-2's regex (gpt-2), single digits then that ByteLevel (smollm), or a
    SPLIT_REGEX_PRE regex then a regex-less ByteLevel."""
    pre = spec.get("pre_tokenizer") or {}
    if (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)):
        return GPT2_PRE
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else []
    if (spec.get("normalizer") is None and len(steps) == 2 and steps[0].get("type") == "Digits"
            and steps[0].get("individual_digits") and steps[1].get("type") == "ByteLevel"
            and steps[1].get("use_regex", True) and not steps[1].get("add_prefix_space", False)):
        return SMOLLM_PRE
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert") and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True) and not steps[1].get("add_prefix_space", False)
            and (spec.get("normalizer") or {"type": "NFC"}).get("type") == "NFC"):
        return SPLIT_REGEX_PRE.get((steps[0].get("pattern") or {}).get("Regex"))
    return None


def bpe_pre_tokenizer(tokenizer, source: str) -> str:
    """tokenizer.ggml.pre of a byte-level BPE tokenizer, or a UserError when llama.cpp lacks it."""
    digest = check_hash(tokenizer)
    if digest in PRE_TOKENIZER_HASHES:
        return PRE_TOKENIZER_HASHES[digest]
    by_spec = pre_tokenizer_by_spec(json.loads(tokenizer.backend_tokenizer.to_str()))
    if by_spec:
        return by_spec
    raise UserError(f"{source}: llama.cpp does not know the pre-tokenizer of this {type(tokenizer).__name__} "
                    f"(sha256 of its ids on llama.cpp's check string: {digest}); its GGUF would split text "
                    f"differently, so GGUF export refuses it")


def looks_special(token: str) -> bool:
    """llama.cpp's does_token_look_special: added tokens typed CONTROL although not marked special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def tokenizer_folder(tokenizer, source: Path, tmp: Path) -> Path:
    """The folder holding the tokenizer's files: the model folder itself when it has them, else the
    tokenizer saved into `tmp`."""
    folder = source if source.is_dir() else source.parent
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        return folder
    tokenizer.save_pretrained(str(tmp))
    return tmp


def vocab_kind(folder: Path, source: str) -> str:
    """spm | hfft | bpe, as llama.cpp's converter tries them for a llama-family model."""
    import importlib.util

    spec = {}
    if (folder / "tokenizer.json").is_file():
        spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    byte_fallback_bpe = model.get("type") == "BPE" and model.get("byte_fallback", False)
    if (folder / "tokenizer.model").is_file():
        if importlib.util.find_spec("sentencepiece") is not None:
            return "spm"
        if not byte_fallback_bpe:
            raise UserError(f"{source}: the SentencePiece tokenizer.model needs the sentencepiece package "
                            f"for GGUF export (pip install sentencepiece)")
    if byte_fallback_bpe:
        return "hfft"
    if model.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        return "bpe"
    raise UserError(f"{source}: GGUF export writes SentencePiece and byte-level BPE tokenizers; this one is "
                    f"{model.get('type')!r} with a {(spec.get('decoder') or {}).get('type')!r} decoder")


def vocab_tokens(kind: str, folder: Path) -> tuple[list, list[float] | None, list[int]]:
    """(tokens, scores or None, types) from the gguf package's vocab class of `kind`."""
    import gguf

    cls = {"spm": gguf.SentencePieceVocab, "hfft": gguf.LlamaHfVocab, "bpe": gguf.BpeVocab}[kind]
    tokens, scores, types = [], [], []
    for text, score, toktype in cls(folder).all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(int(toktype))
    if kind == "hfft":
        scores = merge_rank_scores(folder, tokens, scores)
    return tokens, (None if kind == "bpe" else scores), types


def merge_rank_scores(folder: Path, tokens: list, scores: list[float]) -> list[float]:
    """Scores for a SentencePiece-style BPE read from tokenizer.json (LlamaHfVocab gives every piece
    -1000): llama.cpp's llama tokenizer merges the adjacent pair whose result scores highest, so the
    piece made by merge k scores -k, which replays the merges in their order."""
    merges = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"].get("merges", [])
    rank: dict[str, int] = {}
    for k, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, k)
    text = [t.decode("utf-8") if isinstance(t, bytes) else t for t in tokens]
    return [float(-rank[t]) if t in rank else score for t, score in zip(text, scores)]


def typed_vocab(tokenizer, kind: str, folder: Path, n_vocab: int, source: str):
    """Tokens, scores and types for `n_vocab` embedding rows: added tokens typed as llama.cpp
    types them, rows past the tokenizer padded as [PAD<i>] (UNUSED)."""
    import gguf

    tokens, scores, types = vocab_tokens(kind, folder)
    if len(tokens) > n_vocab:
        raise UserError(f"{source}: the tokenizer has {len(tokens)} tokens, the model's embedding {n_vocab} rows")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
        if scores is not None:
            scores.append(-1000.0)
    for i, added in tokenizer.added_tokens_decoder.items():
        if i >= n_vocab:
            continue
        text = added.content
        if added.special or looks_special(text):
            types[i] = int(gguf.TokenType.CONTROL)
        else:
            text = text.replace("\u2581", " ")  # llama.cpp matches user-defined tokens pre-normalized
            types[i] = int(gguf.TokenType.USER_DEFINED)
        tokens[i] = text
        if scores is not None:
            scores[i] = -1000.0
    return tokens, scores, types


def add_tokenizer(writer, tokenizer, n_vocab: int, source: Path, eos_fallback: int | None = None) -> str:
    """Write the tokenizer.* keys of `tokenizer` (loaded from the model at `source`) for a model of
    `n_vocab` embedding rows. Returns the tokenizer.ggml.pre written."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="hivetune-vocab-") as tmp:
        folder = tokenizer_folder(tokenizer, Path(source), Path(tmp))
        kind = vocab_kind(folder, str(source))
        pre = bpe_pre_tokenizer(tokenizer, str(source)) if kind == "bpe" else "default"
        tokens, scores, types = typed_vocab(tokenizer, kind, folder, n_vocab, str(source))
        quiet_warnings = logging.getLogger("gguf.vocab")  # its guesses are replaced below
        level = quiet_warnings.level
        quiet_warnings.setLevel(logging.ERROR)
        try:
            special = gguf.SpecialVocab(folder, load_merges=kind == "bpe", n_vocab=n_vocab)
        finally:
            quiet_warnings.setLevel(level)
    writer.add_tokenizer_model("gpt2" if kind == "bpe" else "llama")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    if kind != "bpe":
        writer.add_add_space_prefix(adds_space_prefix(tokenizer))
    fill_special_tokens(special, tokenizer, eos_fallback)
    special.add_to_gguf(writer, quiet=True)
    return pre


# llama.cpp (llama-vocab.cpp) gives every special token but these RSTRIP (the whitespace after it is
# dropped) when general.name, lowercased, holds "phi-3" or "phi3"; no tokenizer key says it.
PHI3_NAME = re.compile(r"(phi)-?(3)", re.IGNORECASE)
RSTRIP_EXEMPT = ("<unk>", "<s>", "<|endoftext|>")


def llama_cpp_name(name: str, tokenizer) -> str:
    """general.name for a model with `tokenizer`: "phi" and "3" written apart when its special tokens
    keep the whitespace after them, " (phi-3 tokenizer)" added when they all strip it, so that
    llama.cpp's Phi-3 rule applies exactly when the tokenizer strips."""
    specials = [t for t in tokenizer.added_tokens_decoder.values()
                if t.special and t.content not in RSTRIP_EXEMPT]
    strips = bool(specials) and all(t.rstrip for t in specials)
    named = bool(PHI3_NAME.search(name))
    if named and not strips:
        return PHI3_NAME.sub(r"\1 \2", name)
    if strips and not named:
        return f"{name} (phi-3 tokenizer)"
    return name


def adds_space_prefix(tokenizer) -> bool:
    """Whether a SentencePiece-style tokenizer puts ``▁`` before the text (its dummy prefix), probed
    on "a"; llama.cpp adds it unless tokenizer.ggml.add_space_prefix is false (Gemma's)."""
    ids = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bool(ids) and tokenizer.convert_ids_to_tokens(ids[0]).startswith("\u2581")


def fill_special_tokens(special, tokenizer, eos_fallback: int | None) -> None:
    """What SpecialVocab leaves unset or guesses, from the loaded tokenizer: the special ids, whether
    encoding adds bos / eos (probed), the chat template."""
    for typ in ("bos", "eos", "pad", "unk"):
        tid = getattr(tokenizer, f"{typ}_token_id", None)
        if typ not in special.special_token_ids and tid is not None:
            special.special_token_ids[typ] = int(tid)
    if "eos" not in special.special_token_ids and eos_fallback is not None:
        special.special_token_ids["eos"] = int(eos_fallback)
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    for typ, at in (("bos", 0), ("eos", -1)):
        tid = special.special_token_ids.get(typ)
        special.add_special_token[typ] = bool(tid is not None and probe and probe[at] == tid)
    if special.chat_template is None and getattr(tokenizer, "chat_template", None):
        special.chat_template = tokenizer.chat_template
