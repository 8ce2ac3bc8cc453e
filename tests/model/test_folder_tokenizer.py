"""FolderTokenizer (tokenizer.json + tokenizer_config.json through the `tokenizers` library)
against transformers' AutoTokenizer on the same folder: vocabulary, special tokens, ids and
offsets, decoding, and chat templates rendered for several conversations; and the routing of
model.tokenizer (generic classes to FolderTokenizer without importing transformers, the rest to
AutoTokenizer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import build_tokenizer
from hivetune.core.errors import UserError
from hivetune.model.folder_tokenizer import FolderTokenizer
from hivetune.model.tokenizer import GENERIC_CLASSES, load_saved, load_tokenizer

SRC = Path(__file__).resolve().parents[2] / "src"
TEXTS = ["How do I restart nginx?", "  spaces\tand tabs \n newline ", "ünïcödé 日本語 🙂 résumé",
         "<|im_start|>user\nhi<|im_end|>", "", "Hello world. Don't  stop ,ok ?", "<pad><tool> x"]
CHATS = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "restart sshd"},
          {"role": "assistant", "content": "Run `systemctl restart sshd`."}],
         [{"role": "user", "content": "hi"}],
         [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "think"},
          {"role": "user", "content": "c ünï <&>"}]]
# What transformers gives a template: tojson's options, namespace, loop controls, raise_exception,
# strftime_now, the special tokens as variables, the {% generation %} block, trim/lstrip_blocks.
FEATURES = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'system' and not loop.first %}{{ raise_exception('system first') }}{% endif %}
    {% set ns.n = ns.n + 1 %}
    <{{ m.role }} n={{ ns.n }}>{{ m.content | tojson }}{{ m | tojson(indent=2, sort_keys=True) }}
    {% if m.reasoning_content %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}
    {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% endif %}
    {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{{ strftime_now('%Y') }}{{ pad_token }}{% endif %}"""


def edit_config(folder: Path, **changes) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def variant(folder: Path, name: str) -> Path:
    build_tokenizer(folder)
    if name == "bos_eos":  # ignored beside tokenizer.json (its post-processor decides)
        edit_config(folder, add_bos_token=True, add_eos_token=True)
    elif name == "new_specials":  # tokens the vocabulary lacks are added
        edit_config(folder, pad_token="<pad>", extra_special_tokens=["<tool>"], image_token="<img>",
                    clean_up_tokenization_spaces=True)
    elif name == "jinja_file":  # chat_template.jinja wins over the config's template
        (folder / "chat_template.jinja").write_text(FEATURES)
        edit_config(folder, chat_template="{{ 'unused' }}")
    elif name == "added_tokens_decoder":  # dict-form special tokens, named in added_tokens_decoder
        token = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                 "rstrip": True, "single_word": False, "special": True}
        edit_config(folder, eos_token=token, added_tokens_decoder={"2": token}, chat_template=FEATURES)
    return folder


def assert_same(ours, auto) -> None:
    assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "special_tokens_map", "all_special_ids", "chat_template"):
        assert getattr(ours, name) == getattr(auto, name), name
    assert ({i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()}
            == {i: (t.content, t.special) for i, t in auto.added_tokens_decoder.items()})
    for text in TEXTS:
        for special in (True, False):
            a = ours(text, add_special_tokens=special, return_offsets_mapping=True)
            b = auto(text, add_special_tokens=special, return_offsets_mapping=True)
            assert (a["input_ids"], a["offset_mapping"]) == (b["input_ids"], [tuple(o) for o in b["offset_mapping"]])
            for skip in (True, False):
                assert ours.decode(a["input_ids"], skip_special_tokens=skip) == auto.decode(
                    b["input_ids"], skip_special_tokens=skip)
    for chat in CHATS:
        for prompt in (True, False):
            assert templated(ours, chat, prompt) == templated(auto, chat, prompt)


def templated(tok, chat, prompt: bool):
    """The chat's text and ids, or the template's own error (Mistral's templates refuse a system
    turn or roles that do not alternate: both tokenizers must refuse alike)."""
    from jinja2 import TemplateError

    try:
        return (tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt),
                tok.apply_chat_template(chat, add_generation_prompt=prompt)["input_ids"])
    except TemplateError as e:
        return f"TemplateError: {e}"


@pytest.mark.parametrize("name", ["plain", "bos_eos", "new_specials", "jinja_file", "added_tokens_decoder"])
def test_folder_tokenizer_equals_autotokenizer(tmp_path, name):
    from transformers import AutoTokenizer

    folder = variant(tmp_path, name)
    ours = load_tokenizer.__wrapped__(str(folder))
    assert type(ours) is FolderTokenizer
    assert_same(ours, AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    if name == "bos_eos":
        assert ours("hi")["input_ids"] == ours("hi", add_special_tokens=False)["input_ids"]
    if name == "new_specials":
        assert ours.convert_tokens_to_ids(["<pad>", "<img>", "<tool>"]) == [384, 385, 386]


def test_chat_template_errors_are_transformers_errors(tmp_path):
    from transformers import AutoTokenizer

    folder = variant(tmp_path, "jinja_file")
    ours, auto = FolderTokenizer(folder), AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    chat = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    errors = []
    for tok in (ours, auto):
        with pytest.raises(Exception) as e:
            tok.apply_chat_template(chat, tokenize=False)
        errors.append((type(e.value).__name__, str(e.value)))
    assert errors[0] == errors[1] == ("TemplateError", "system first")


def test_saved_folder_loads_in_transformers_the_same(tmp_path):
    from transformers import AutoTokenizer

    ours = FolderTokenizer(variant(tmp_path / "src", "new_specials"))
    ours.save_pretrained(tmp_path / "saved")
    assert_same(FolderTokenizer(tmp_path / "saved"), AutoTokenizer.from_pretrained(str(tmp_path / "saved")))


def cached_real_tokenizers() -> list[Path]:
    """Tokenizers converted from real GGUF files (the embedded SmolLM2's) in the test cache."""
    root = Path(os.environ["HIVETUNE_CACHE"]) / "tokenizers"
    return sorted(p for p in root.glob("*") if (p / "tokenizer.json").exists()
                  and json.loads((p / "tokenizer.json").read_text())["model"].get("vocab", {}).__len__() > 1000)


def test_real_tokenizer_equals_autotokenizer():
    from transformers import AutoTokenizer

    folders = cached_real_tokenizers()
    if not folders:
        pytest.skip("no real tokenizer in the test cache (tests/workflows build the embedded one)")
    for folder in folders:
        assert_same(load_saved(folder), AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


@pytest.mark.parametrize("cls", ["GPT2Tokenizer", "Qwen2Tokenizer", "LlamaTokenizer", "qwen2-generic"])
def test_model_specific_class_is_converted_once_and_loads_without_transformers(tmp_path, monkeypatch, cls):
    """A folder of a model-specific class (or of qwen2, which AutoTokenizer rebuilds whatever class
    it names) goes through AutoTokenizer once; what it builds is cached as a generic folder, and
    every load is a FolderTokenizer equal to AutoTokenizer, the later ones without transformers."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("HIVETUNE_CACHE", str(tmp_path / "cache"))
    folder = variant(tmp_path / "tok", "new_specials")
    if cls == "qwen2-generic":
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    else:
        edit_config(folder, tokenizer_class=cls, chat_template=FEATURES)
    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    first = load_tokenizer.__wrapped__(str(folder))
    assert isinstance(first, FolderTokenizer)
    assert_same(first, auto)
    [cached] = (tmp_path / "cache" / "tokenizers").iterdir()
    assert json.loads((cached / "tokenizer_config.json").read_text())["tokenizer_class"] == GENERIC_CLASSES[0]
    assert_same(load_tokenizer.__wrapped__(str(folder)), auto)
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    code = (f"import sys\nsys.path.insert(0, {str(SRC)!r})\nfrom hivetune.model.tokenizer import load_tokenizer\n"
            f"tok = load_tokenizer({str(folder)!r})\nprint(type(tok).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HIVETUNE_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["FolderTokenizer", "False"]
    edit_config(folder, model_max_length=77)  # a rewritten source file: converted again
    load_tokenizer.__wrapped__(str(folder))
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2


def test_an_unwritable_cache_leaves_the_autotokenizer(tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("HIVETUNE_CACHE", str(blocker))
    build_tokenizer(tmp_path / "tok")
    edit_config(tmp_path / "tok", tokenizer_class="GPT2Tokenizer")
    tok = load_tokenizer.__wrapped__(str(tmp_path / "tok"))
    assert type(tok).__name__ == "GPT2Tokenizer" and tok.encode("restart nginx") == FolderTokenizer(
        tmp_path / "tok").encode("restart nginx")


def test_a_folder_without_tokenizer_files_is_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError) as e:
        load_tokenizer.__wrapped__(str(tmp_path / "m"))
    assert str(e.value) == (f"{tmp_path / 'm'}: no usable tokenizer files (none of tokenizer.json, tokenizer.model, "
                            f"vocab.json, vocab.txt)")


def test_folder_tokenizer_imports_no_transformers(tmp_path):
    build_tokenizer(tmp_path)
    code = (f"import sys\nsys.path.insert(0, {str(SRC)!r})\nfrom hivetune.model.tokenizer import load_tokenizer\n"
            f"tok = load_tokenizer({str(tmp_path)!r})\n"
            "text = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
            "print(type(tok).__name__, len(tok(text)['input_ids']), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    name, n, transformers_loaded = out.stdout.split()[-3:]
    assert (name, transformers_loaded) == ("FolderTokenizer", "False") and int(n) > 3


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3", "qwen2"])
def test_model_type_routes_where_auto_tokenizer_builds_the_same(tmp_path, model_type):
    """A generic-class folder of a model type AutoTokenizer builds as written loads as a
    FolderTokenizer of the folder with AutoTokenizer's ids; qwen2, which AutoTokenizer rebuilds as
    Qwen2Tokenizer (NFC, Qwen's regex), is a FolderTokenizer of the conversion in the cache."""
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours, auto = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(ours, FolderTokenizer)
    assert (ours.name_or_path == str(tmp_path)) == (model_type != "qwen2")
    texts = ["Hello wörld 12345 naïve  spaces\n\nnew", "systemctl restart nginx; ÀÉÎ café", "it's 2024-01-01"]
    assert [ours.encode(t) for t in texts] == [auto.encode(t) for t in texts]
