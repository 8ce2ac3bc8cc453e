"""model.imatrix: the importance matrix hivetune hands llama.cpp's quantizer, against the mean squares
of each weight's inputs recorded with hooks on transformers' own model; with LoRA layers (the
q/k/v and gate/up groups share one input); `export --imatrix` through llama.cpp's quantizer; bad
input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import build_tiny_model, build_tokenizer, ops_records, write_jsonl
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.model.gguf_write import hf_to_gguf_name
from hivetune.data.dataset import calibration_sequences
from hivetune.model.imatrix import importance_matrix
from hivetune.model.load import load_model
from hivetune.model.lora import LoRASpec, apply_lora, lora_modules
from hivetune.model.tokenizer import load_tokenizer
from hivetune.workflows.export import export

sys.path.insert(0, str(Path(__file__).parents[1] / "workflows"))
from test_export import make_run  # noqa: E402  (the tiny run builder of the export tests)

VOCAB = 384
SEQUENCES = [[3, 17, 250, 9, 41, 8, 120, 77], list(range(5, 60)), [300, 2, 2, 2, 19]]


def hf_importance(folder: Path, tied: bool) -> dict[str, np.ndarray]:
    """The mean square per input column of every linear layer of transformers' model, and of the
    final norm's output under the output head's name."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    sums: dict[str, torch.Tensor] = {}

    def add(key, x):
        sums[key] = sums.get(key, 0) + x.reshape(-1, x.shape[-1]).double().pow(2).sum(0)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            module.register_forward_pre_hook(lambda m, a, key=hf_to_gguf_name(f"{name}.weight"): add(key, a[0]))
    head = "token_embd.weight" if tied else "output.weight"
    model.model.norm.register_forward_hook(lambda m, a, out: add(head, out))
    with torch.no_grad():
        for ids in SEQUENCES:
            model(torch.tensor([ids]))
    tokens = sum(len(s) for s in SEQUENCES)
    return {k: (v / tokens).float().numpy() for k, v in sums.items()}


@pytest.mark.parametrize("model_type, tied", [("llama", True), ("qwen2", False)])
def test_importance_matches_transformers_hooks(tmp_path, model_type, tied):
    build_tiny_model(tmp_path, model_type, VOCAB, seed=5, tie_word_embeddings=tied)
    expected = hf_importance(tmp_path, tied)
    ours, tokens = importance_matrix(load_model(tmp_path), SEQUENCES)
    assert tokens == 68
    assert sorted(ours) == sorted(expected) and len(ours) == 2 * 7 + 1
    for key, value in expected.items():
        assert ours[key].dtype == np.float32 and ours[key].shape == value.shape, key
        np.testing.assert_allclose(ours[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


def test_lora_layers_count_each_input_once(tmp_path):
    """With LoRA on all 7 layers (a nonzero update), each weight's entry is its input's mean square
    once per token: the LoRA layer and its base see the same input, counted once."""
    build_tiny_model(tmp_path, "llama", VOCAB, seed=5, tie_word_embeddings=True)
    plain, _ = importance_matrix(load_model(tmp_path), SEQUENCES)
    net = load_model(tmp_path)
    apply_lora(net, LoRASpec(r=4, alpha=8.0, dropout=0.1, rslora=False))
    with torch.no_grad():
        for _, m in lora_modules(net):
            m.lora_B.weight.normal_(0, 0.5)
    net.train()  # importance_matrix runs it in eval mode (no dropout) and puts training back
    lora, _ = importance_matrix(net, SEQUENCES)
    assert net.training and sorted(lora) == sorted(plain)
    embed = net.model.embed_tokens.weight.detach()
    norm = net.model.layers[0].input_layernorm
    with torch.no_grad():
        first = torch.cat([norm(embed[torch.tensor(ids)]) for ids in SEQUENCES]).pow(2).mean(0).numpy()
    for name in ("attn_q", "attn_k", "attn_v"):  # layer 0's inputs are before any update
        np.testing.assert_allclose(lora[f"blk.0.{name}.weight"], first, rtol=1e-5)
        np.testing.assert_allclose(plain[f"blk.0.{name}.weight"], first, rtol=1e-5)
    assert not np.allclose(lora["blk.1.attn_q.weight"], plain["blk.1.attn_q.weight"])  # the update reached layer 1


def test_calibration_sequences_stop_at_the_budget(tmp_path):
    build_tokenizer(tmp_path, VOCAB)
    data = write_jsonl(tmp_path / "d.jsonl", ops_records(30))
    tok = load_tokenizer(str(tmp_path))
    every = list(calibration_sequences(data, tok, 512, tokens=10**9))
    assert len(every) == 30
    lengths = np.cumsum([len(s) for s in every])
    budget = int(lengths[3]) - 1  # reached inside the fourth record
    assert [len(s) for s in calibration_sequences(data, tok, 512, tokens=budget)] == [len(s) for s in every[:4]]
    (tmp_path / "bad.jsonl").write_text('{"instruction": "a", "output": "b"}\nnot json\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2"):
        list(calibration_sequences(tmp_path / "bad.jsonl", tok, 512, tokens=10**9))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # tied, untied
def test_export_imatrix_reaches_llama_cpps_quantizer(llama_cpp, tmp_path, capsys, model_type):
    """The quantizer finds an entry for each tensor it weighs (no line naming one without) and its
    rounding changes: the Q4_0 files with and without the importance matrix differ."""
    _, run = make_run(tmp_path / "tiny", model_type)
    data = write_jsonl(tmp_path / "calib.jsonl", ops_records(12))
    plain = export(run, "gguf", tmp_path / "plain", quant="q4_0")
    weighed = export(run, "gguf", tmp_path / "weighed", quant="q4_0", imatrix=str(data))
    err = capsys.readouterr().err
    assert "hivetune: export: importance matrix from " in err and f" tokens of {data} (" in err
    assert "no importance matrix entry" not in err
    a, b = (p.out / "model-q4_0.gguf" for p in (plain, weighed))
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    assert "with an importance matrix" in (weighed.out / "README.md").read_text()
    llm = llama_cpp.Llama(model_path=str(b), n_ctx=64, verbose=False)
    try:
        assert int(llm.metadata["general.file_type"]) == llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    finally:
        llm.close()


def test_export_imatrix_train_reads_the_runs_data(llama_cpp, tmp_path, capsys):
    _, run = make_run(tmp_path / "tiny", "llama")
    data = write_jsonl(tmp_path / "train.jsonl", ops_records(8))
    (run / "config.yaml").write_text(json.dumps({"data": str(data), "max_length": 128}))
    export(run, "gguf", tmp_path / "o", quant="q4_k_m", imatrix="train")
    assert f" tokens of {data} (" in capsys.readouterr().err


def test_imatrix_errors_one_line_nothing_written(tmp_path, capsys):
    _, run = make_run(tmp_path / "tiny", "llama")
    capsys.readouterr()
    out = tmp_path / "o"
    cases = [(["--quant", "q8_0", "--imatrix", "x.jsonl"],
              "--imatrix: only with --quant q4_k_m, q5_k_m, q6_k, q4_0 (llama.cpp's quantizer weighs by it)"),
             (["--quant", "q4_k_m", "--imatrix", str(tmp_path / "none.jsonl")],
              f"--imatrix: {tmp_path / 'none.jsonl'}: data not found"),
             (["--quant", "q4_k_m", "--imatrix", "train"],
              f"--imatrix train: {run / 'config.yaml'} not found (an adapter folder alone names no training "
              f"data): pass --imatrix DATA")]
    for extra, message in cases:
        assert main(["export", str(run), "--format", "gguf", "--out", str(out), *extra]) == 2
        assert capsys.readouterr().err == f"hivetune: error: {message}\n"
        assert not out.exists() and not list(tmp_path.glob(".o.tmp-*"))
