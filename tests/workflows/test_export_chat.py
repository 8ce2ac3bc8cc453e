"""`hivetune generate` and `hivetune chat` on every kind of model an export gives: the base, base +
adapter, the merged HF folder and the GGUF file (fp32 on a tiny random llama)."""

from __future__ import annotations

import io

import pytest
import torch

from hivetune.workflows.chat import chat, load_for_generation
from hivetune.cli import main
from hivetune.data.formats import render_chat
from hivetune.workflows.export import export
from hivetune.workflows.generate import generate, greedy_ids
from test_export import make_run

PROMPTS = ["How do I restart nginx?", "Show the logs of sshd", "rpm-ostree status"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    base, run = make_run(root, "llama")
    export(run, "merged", root / "merged")
    export(run, "gguf", root / "gguf", dtype="f32")
    return base, run, root / "merged", root / "gguf" / "model-f32.gguf"


def test_generate_agrees_across_base_adapter_merged_and_gguf(exported):
    base, run, merged, gguf_file = exported
    kw = dict(max_new_tokens=12, device="cpu", precision="fp32")
    tuned = [generate(model=str(base), adapter=str(run), prompt=p, **kw) for p in PROMPTS]
    assert [generate(model=str(merged), prompt=p, **kw) for p in PROMPTS] == tuned
    assert [generate(model=str(gguf_file), prompt=p, **kw) for p in PROMPTS] == tuned
    # the adapter matters, so the equalities above are not vacuous
    assert [generate(model=str(base), prompt=p, **kw) for p in PROMPTS] != tuned


def expected_conversation(model: str, adapter: str, lines: list[str], max_new: int) -> list[dict]:
    """The conversation chat() should produce, turn by turn with the template, built by hand."""
    from hivetune.model.tokenizer import eos_ids

    net, tok = load_for_generation(model, adapter, "cpu", "fp32")
    messages = []
    for line in lines:
        messages.append({"role": "user", "content": line})
        ids = tok(render_chat(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        out = greedy_ids(net, [ids], max_new, eos_ids(tok, net.args))[0]
        messages.append({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True).strip()})
    return messages


@pytest.mark.parametrize("kind", ["base", "adapter", "merged", "gguf"])
def test_chat_keeps_the_conversation(exported, kind):
    base, run, merged, gguf_file = exported
    model, adapter = {"base": (base, ""), "adapter": (base, run), "merged": (merged, ""),
                      "gguf": (gguf_file, "")}[kind]
    stdin = io.StringIO("How do I restart nginx?\n\nand sshd?\n/exit\nnever read\n")
    stdout = io.StringIO()
    messages = chat(model=str(model), adapter=str(adapter), max_new_tokens=8, device="cpu", precision="fp32",
                    input=stdin, output=stdout)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages[::2]] == ["How do I restart nginx?", "and sshd?"]
    assert stdout.getvalue() == "".join(m["content"] + "\n" for m in messages[1::2])
    tuned = expected_conversation(str(base), str(run) if kind != "base" else "", ["How do I restart nginx?",
                                                                                  "and sshd?"], 8)
    assert messages == tuned


def test_chat_reset_system_and_eof(exported):
    base, run, merged, _ = exported
    stdout = io.StringIO()
    messages = chat(model=str(merged), system="Be brief.", max_new_tokens=4, device="cpu", precision="fp32",
                    input=io.StringIO("first\n/reset\nsecond\n"), output=stdout)  # EOF ends it
    assert [(m["role"], m["content"]) for m in messages[:2]] == [("system", "Be brief."), ("user", "second")]
    assert len(messages) == 3 and len(stdout.getvalue().splitlines()) == 2


def test_chat_cli_reads_stdin(exported, monkeypatch, capsys):
    _, _, merged, _ = exported
    monkeypatch.setattr("sys.stdin", io.StringIO("How do I restart nginx?\n"))
    assert main(["chat", "--model", str(merged), "--max-new-tokens", "6", "--device", "cpu",
                 "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    answer = generate(model=str(merged), prompt="How do I restart nginx?", max_new_tokens=6, device="cpu",
                      precision="fp32")
    assert out == answer + "\n"
    assert main(["chat", "--model", str(merged), "--max-new-tokens", "0"]) == 2
    assert capsys.readouterr().err == "hivetune: error: --max-new-tokens: must be > 0, got 0\n"


def test_chat_drops_old_turns_to_fit_the_context(exported):
    _, _, merged, _ = exported
    net, tok = load_for_generation(str(merged), "", "cpu", "fp32")
    net.args.max_position_embeddings = 40  # a tiny context: only the newest turn fits
    from hivetune.workflows.chat import reply

    long = [{"role": "user", "content": "restart nginx " * 3}, {"role": "assistant", "content": "ok " * 5},
            {"role": "user", "content": "and sshd?"}]
    with torch.no_grad():
        assert reply(net, tok, long, 8) == reply(net, tok, long[2:], 8)
