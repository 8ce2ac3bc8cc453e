"""A tokenizer hivetune saved (a GGUF file's, converted once) loads through its generic class
without transformers' AutoTokenizer module, and equals what AutoTokenizer builds from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import build_tokenizer
from hivetune.model.tokenizer import GENERIC_CLASSES, load_saved

SRC = Path(__file__).resolve().parents[2] / "src"
TEXTS = ["How do I restart nginx?", "  spaces\tand tabs \n newline ", "ünïcödé 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", ""]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "restart sshd"},
            {"role": "assistant", "content": "Run `systemctl restart sshd`."}]


def test_saved_tokenizer_equals_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] in GENERIC_CLASSES
    ours, auto = load_saved(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert [ours(t)["input_ids"] for t in TEXTS] == [auto(t)["input_ids"] for t in TEXTS]
    assert ours.apply_chat_template(MESSAGES, tokenize=False) == auto.apply_chat_template(MESSAGES, tokenize=False)
    assert (ours.apply_chat_template(MESSAGES[:2], add_generation_prompt=True)
            == auto.apply_chat_template(MESSAGES[:2], add_generation_prompt=True))
    assert (ours.eos_token_id, ours.pad_token_id, ours.all_special_ids) == (
        auto.eos_token_id, auto.pad_token_id, auto.all_special_ids)


def test_saved_tokenizer_skips_the_auto_classes(tmp_path):
    build_tokenizer(tmp_path)
    code = (f"import sys\nsys.path.insert(0, {str(SRC)!r})\nfrom hivetune.model.tokenizer import load_saved\n"
            f"tok = load_saved({str(tmp_path)!r})\nprint(type(tok).__name__, "
            "'transformers.models.auto.tokenization_auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    name, auto_loaded = out.stdout.split()[-2:]
    assert name in GENERIC_CLASSES and auto_loaded == "False"
