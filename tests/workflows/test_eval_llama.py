"""`hivetune eval --candidate A --against B --engine llama.cpp`: the versions scored as llama.cpp
serves them (the embedded SmolLM2 GGUF and a LoRA GGUF), against hivetune's decoder on the same
weights: the same response losses to llama.cpp's rounding, the adapter moving them the same way."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import write_jsonl
from hivetune.cli import main
from hivetune.model.load import load_model
from hivetune.model.lora import LoRASpec, apply_lora, lora_parameters, save_adapter
from hivetune.workflows.compare import compare
from serve_client import embedded

QUESTIONS = ["How do I restart nginx?", "List the files in /etc.", "What is my IP address?", "Show disk usage."]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalllama")
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"Run `{c}`."}]}
               for q, c in zip(QUESTIONS, ["systemctl restart nginx", "ls /etc", "ip addr", "df -h"])]
    data = write_jsonl(root / "heldout.jsonl", records)
    model = load_model(embedded(), dtype=torch.float32)
    spec = LoRASpec(r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj", "down_proj"))
    apply_lora(model, spec)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B non-zero: the adapter changes what the model says
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    save_adapter(model, spec, root / "adapter", embedded())
    return root, data


def test_llama_cpp_scores_equal_hivetune_scores(llama_cpp, files, tmp_path):
    root, data = files
    kw = dict(data=str(data), max_new_tokens=12, precision="fp32", device="cpu", model=embedded())
    ours = compare(str(root / "adapter"), "base", out=str(tmp_path / "ours"), **kw)
    theirs = compare(str(root / "adapter"), "base", out=str(tmp_path / "theirs"), engine="llama.cpp", **kw)
    assert (ours["engine"], theirs["engine"]) == ("hivetune", "llama.cpp")
    rows = {name: json.loads((tmp_path / name / "compare.json").read_text())["sets"]["heldout"]
            for name in ("ours", "theirs")}
    for role in ("candidate", "against"):
        a, b = rows["ours"][role], rows["theirs"][role]
        # the embedded GGUF is Q4_1: llama.cpp's dot products quantize the activations to 8 bits
        # (measured: 3.519 against hivetune's 3.443 on the base, 2.2%), hivetune's decoder does not
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-2), role
    # the adapter moves the loss by the same amount in both engines (measured: +2.015 and +2.009)
    moved = {name: rows[name]["candidate"]["loss"] - rows[name]["against"]["loss"] for name in rows}
    assert moved["ours"] > 1.0 and moved["theirs"] == pytest.approx(moved["ours"], rel=5e-2), moved
    md_ours, md_theirs = ((tmp_path / n / "compare.md").read_text() for n in ("ours", "theirs"))
    assert md_ours.count("systemctl") == md_theirs.count("systemctl")


def test_engine_llama_cpp_refuses_an_hf_folder(files, tiny_model_dir, tmp_path, capsys):
    _, data = files
    code = main(["eval", "--candidate", str(tiny_model_dir), "--against", "base", "--model", str(tiny_model_dir),
                 "--data", str(data), "--engine", "llama.cpp", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"hivetune: error: --candidate {tiny_model_dir}: --engine llama.cpp scores .gguf "
                                 f"models (this side loads {tiny_model_dir}); use --engine hivetune"]
    assert not (tmp_path / "o").exists()


def test_engine_llama_cpp_without_llama_cpp_python_is_one_line(files, tmp_path, capsys, monkeypatch):
    import importlib.util

    root, data = files
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    code = main(["eval", "--candidate", str(root / "adapter"), "--against", "base", "--model", embedded(),
                 "--data", str(data), "--engine", "llama.cpp", "--out", str(tmp_path / "o")])
    assert code == 2 and capsys.readouterr().err == ("hivetune: error: --engine llama.cpp: pip install "
                                                     "llama-cpp-python (or bash scripts/install_llama_cpp.sh)\n")
    assert not (tmp_path / "o").exists()
