"""hivetune export on tiny random models (llama with tied embeddings, qwen2 with qkv bias, qwen3):
merged HF folders and GGUF files against our own base + adapter, read back by our loader and by
transformers; the LoRA-only GGUF; the Modelfile; bad input and nothing half-written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import build_tiny_model, build_tokenizer
from hivetune.cli import main
from hivetune.core.errors import UserError
from hivetune.workflows.export import export, modelfile
from hivetune.model.gguf_write import gguf_arch
from hivetune.model.load import load_model, permute_rope_rows
from hivetune.model.lora import LoRASpec, apply_lora, lora_modules, save_adapter

VOCAB = 384
# max |logit difference| / max |logit| against base + adapter in fp32, per written dtype
TOL = {"f32": 1e-5, "f16": 3e-3, "bf16": 2e-2, "q8_0": 5e-2}


def make_run(root: Path, model_type: str, rslora: bool = False, **config) -> tuple[Path, Path]:
    """A tiny base model folder (`config`: more config.json fields) and a run folder whose adapter
    has a non-zero update."""
    base, run = root / "base", root / "run"
    base.mkdir(parents=True)
    build_tokenizer(base, VOCAB)
    build_tiny_model(base, model_type, VOCAB, seed=3, tie_word_embeddings=model_type == "llama", **config)
    net = load_model(base)
    spec = LoRASpec(r=4, alpha=8.0, dropout=0.0, rslora=rslora)
    apply_lora(net, spec)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in lora_modules(net):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    save_adapter(net, spec, run / "adapter", str(base))
    (run / "summary.json").write_text(json.dumps({"steps": 7, "final_loss": 1.25}))
    return base, run


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    base, run = make_run(root, request.param)
    return request.param, base, run


def reference_logits(base: Path, run: Path, ids: torch.Tensor) -> torch.Tensor:
    """Our base + adapter (LoRA unmerged) in fp32: the oracle for every export."""
    from hivetune.model.lora import load_adapter

    net = load_model(base)
    load_adapter(net, run / "adapter")
    with torch.no_grad():
        return net.eval().logits(net(ids))


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


IDS = torch.randint(3, VOCAB, (2, 48), generator=torch.Generator().manual_seed(5))


# ------------------------------------------------------------------------------ merged


def test_merged_folder_loads_in_transformers_with_equal_logits(tiny_run, tmp_path):
    model_type, base, run = tiny_run
    out = tmp_path / "merged"
    result = export(run, "merged", out, shard_bytes=60_000)  # small shards: exercise the index
    ref = reference_logits(base, run, IDS)
    assert ref.abs().max() > 0.5

    files = set(result.files)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json", "README.md"} <= files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((out / s).exists() for s in shards)
    assert ("lm_head.weight" in index["weight_map"]) == (model_type != "llama")  # tied: left out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["dtype"] == "float32"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"].startswith("{% for message")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(IDS).logits
    assert rel_diff(got, ref) <= 1e-4
    ours = load_model(out).eval()
    with torch.no_grad():
        assert rel_diff(ours.logits(ours(IDS)), ref) <= 1e-5
    # the merge is real: the base alone is far from it
    plain = load_model(base).eval()
    with torch.no_grad():
        assert rel_diff(plain.logits(plain(IDS)), ref) > 1e-2

    tok = AutoTokenizer.from_pretrained(str(out))
    src = AutoTokenizer.from_pretrained(str(base))
    msgs = [{"role": "user", "content": "restart nginx"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == src.apply_chat_template(msgs, tokenize=False)
    assert tok("systemctl restart sshd")["input_ids"] == src("systemctl restart sshd")["input_ids"]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_merged_half_precision_dtype(tiny_run, tmp_path, dtype):
    _, base, run = tiny_run
    export(run, "merged", tmp_path / "m", dtype=dtype)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {TORCH_DTYPE[dtype]}
    ours = load_model(tmp_path / "m").eval()
    with torch.no_grad():
        assert rel_diff(ours.logits(ours(IDS)), reference_logits(base, run, IDS)) <= TOL[dtype]


TORCH_DTYPE = {"f16": torch.float16, "bf16": torch.bfloat16}


# ------------------------------------------------------------------------------ gguf


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_reads_back_in_our_loader_and_transformers(tiny_run, tmp_path, dtype):
    import gguf

    model_type, base, run = tiny_run
    out = tmp_path / "g"
    result = export(run, "gguf", out, dtype=dtype)
    path = out / f"model-{dtype}.gguf"
    assert {path.name, "lora-adapter.gguf", "Modelfile", "Modelfile.adapter", "llama-server.sh",
            "README.md"} <= set(result.files)
    assert f"llama-server -m {path.absolute()}" in result.commands
    assert f"llama-server -m {path.absolute()}" in (out / "llama-server.sh").read_text()

    reader = gguf.GGUFReader(str(path))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == model_type
    assert field(f"{model_type}.block_count") == 2 and field(f"{model_type}.attention.head_count_kv") == 2
    assert field("tokenizer.ggml.model") == "gpt2" and len(field("tokenizer.ggml.tokens")) == VOCAB
    assert field("tokenizer.ggml.eos_token_id") == 2 and field("tokenizer.ggml.bos_token_id") == 1
    assert field("tokenizer.chat_template").startswith("{% for message")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.ffn_down.weight"] == dtype.upper()
    assert ("blk.0.attn_q.bias" in types) == (model_type == "qwen2")
    assert ("output.weight" in types) == (model_type != "llama")

    ref = reference_logits(base, run, IDS)
    ours = load_model(path).eval()
    with torch.no_grad():
        got = ours.logits(ours(IDS))
    assert rel_diff(got, ref) <= TOL[dtype]
    if dtype == "f32":  # the loader's un-permutation restores the merged weights bit for bit
        export(run, "merged", tmp_path / "m")
        merged = dict(load_model(tmp_path / "m").named_parameters())
        for name, p in ours.named_parameters():
            assert torch.equal(p, merged[name]), name

    hf = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_diff(hf(IDS).logits, ref) <= TOL[dtype]


def test_gguf_tokenizer_reads_back_in_transformers(tiny_run, tmp_path):
    _, base, run = tiny_run
    export(run, "gguf", tmp_path / "g", dtype="f16")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "g"), gguf_file="model-f16.gguf")
    src = AutoTokenizer.from_pretrained(str(base))
    text = "How do I restart the nginx service? Run systemctl restart nginx as root. 0123 ```x```"
    assert tok(text)["input_ids"] == src(text)["input_ids"]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == src.apply_chat_template(msgs, tokenize=False)
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_gguf_adapter_reconstructs_the_merged_weights(tmp_path, rslora):
    """W_merged (llama.cpp order) == W_base (llama.cpp order) + alpha / r * lora_b @ lora_a,
    as llama.cpp applies `--lora`: lora_b carries the q/k row permutation."""
    import gguf

    base, run = make_run(tmp_path, "llama", rslora=rslora)
    export(run, "gguf", tmp_path / "g", dtype="f32")
    adapter = gguf.GGUFReader(str(tmp_path / "g" / "lora-adapter.gguf"))
    assert adapter.fields["general.type"].contents() == "adapter"
    assert adapter.fields["adapter.type"].contents() == "lora"
    assert adapter.fields["general.architecture"].contents() == "llama"
    alpha = adapter.fields["adapter.lora.alpha"].contents()
    assert alpha == pytest.approx(8.0 * 2.0 if rslora else 8.0)  # rsLoRA: alpha / sqrt(4) == alpha' / 4
    lora = {t.name: np.array(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))
            for t in adapter.tensors}
    assert len(lora) == 2 * 7 * 2 and lora["blk.1.attn_k.weight.lora_a"].shape == (4, 64)
    assert lora["blk.1.attn_k.weight.lora_b"].shape == (32, 4)
    merged = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "g" / "model-f32.gguf")).tensors}
    plain = dict(load_model(base).named_parameters())
    for layer in range(2):
        for gname, hname, heads in (("attn_q", "self_attn.q_proj", 4), ("attn_k", "self_attn.k_proj", 2),
                                    ("ffn_down", "mlp.down_proj", 0)):
            w = plain[f"model.layers.{layer}.{hname}.weight"]
            w = permute_rope_rows(w, heads) if heads else w
            a, b = lora[f"blk.{layer}.{gname}.weight.lora_a"], lora[f"blk.{layer}.{gname}.weight.lora_b"]
            rebuilt = w.numpy() + alpha / 4 * (b @ a)
            np.testing.assert_allclose(merged[f"blk.{layer}.{gname}.weight"], rebuilt, rtol=0, atol=1e-5)
            assert np.abs(b @ a).max() > 1e-3


def test_qwen3_gguf_round_trip(tmp_path):
    base, run = make_run(tmp_path, "qwen3")
    export(run, "gguf", tmp_path / "g", dtype="f32")
    ours = load_model(tmp_path / "g" / "model-f32.gguf").eval()
    with torch.no_grad():
        assert rel_diff(ours.logits(ours(IDS)), reference_logits(base, run, IDS)) <= TOL["f32"]


def test_gguf_refuses_other_architectures():
    from hivetune.model.config import ModelArgs

    args = ModelArgs(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, model_type="gemma")
    with pytest.raises(UserError) as e:
        gguf_arch(args, "m/config.json")
    assert str(e.value) == ("m/config.json: GGUF export supports llama, mistral, qwen2, qwen3, gemma2, "
                            "gemma3_text, phi3 models, not 'gemma'")


def test_modelfile_translates_chatml_and_llama3():
    smol = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")
    text = modelfile("./model-f16.gguf", smol, "<|im_end|>")
    assert text.startswith("FROM ./model-f16.gguf\nTEMPLATE \"\"\"{{- if .System }}<|im_start|>system\n")
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM"""' in text
    assert text.count('PARAMETER stop "<|im_end|>"') == 1
    llama3 = modelfile("/m/base.gguf", "{{ '<|start_header_id|>' + message['role'] }}", "<|end_of_text|>",
                       "./lora-adapter.gguf")
    assert llama3.splitlines()[:2] == ["FROM /m/base.gguf", "ADAPTER ./lora-adapter.gguf"]
    assert 'PARAMETER stop "<|eot_id|>"' in llama3 and 'PARAMETER stop "<|end_of_text|>"' in llama3
    other = modelfile("./m.gguf", "{{ messages }}", "</s>")
    assert "TEMPLATE" not in other.replace("# TEMPLATE not derived", "") and 'PARAMETER stop "</s>"' in other


# ------------------------------------------------------------------------------ adapter


def test_adapter_export_copies_the_peft_files_with_a_model_card(tmp_path):
    base, run = make_run(tmp_path, "llama")
    out = tmp_path / "a"
    result = export(run, "adapter", out)
    assert result.files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (run / "adapter" / name).read_bytes()
    card = (out / "README.md").read_text()
    assert card.startswith(f"---\nbase_model: {base}\nlibrary_name: peft\n")
    assert "r=4, alpha=8.0" in card and "7 steps, final loss 1.2500" in card
    from peft import PeftModel

    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(out)).eval()
    with torch.no_grad():
        assert rel_diff(peft_model(IDS).logits, reference_logits(base, run, IDS)) <= 1e-5


# ------------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("bad-input"), "llama")


def error_of(**kw) -> str:
    with pytest.raises(UserError) as e:
        export(**kw)
    return str(e.value)


def test_bad_format_and_dtype_messages(llama_run, tmp_path):
    _, run = llama_run
    out = tmp_path / "o"
    assert error_of(run=run, format="onnx", out=out) == "--format: unknown format 'onnx' (adapter, merged, gguf)"
    assert error_of(run=run, format="gguf", out=out, dtype="q4_k") == \
        "--dtype: unknown dtype 'q4_k' (f32, f16, bf16, q8_0)"
    assert error_of(run=run, format="merged", out=out, dtype="q8_0") == \
        "--dtype: q8_0 is not available for --format merged (f32, f16, bf16)"
    assert error_of(run=run, format="adapter", out=out, dtype="f16") == \
        "--dtype: not used with --format adapter (the adapter is copied as trained)"
    assert not out.exists()


def test_run_without_finished_adapter(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "config.yaml").write_text("model: x\n")
    assert error_of(run=run, format="gguf", out=tmp_path / "o") == (
        f"{run}: no finished adapter (adapter/adapter_config.json and adapter_model.safetensors); "
        f"finish the run with `hivetune train --resume {run}`")
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}")  # weights never written
    assert error_of(run=run, format="merged", out=tmp_path / "o").startswith(f"{run}: no finished adapter")
    assert error_of(run=tmp_path / "nope", format="merged", out=tmp_path / "o") == \
        f"{tmp_path / 'nope'}: run folder not found"
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_force(llama_run, tmp_path):
    _, run = llama_run
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.txt").write_text("old")
    assert error_of(run=run, format="adapter", out=out) == f"{out}: already exists; pass --force to replace it"
    assert (out / "old.txt").read_text() == "old"
    export(run, "adapter", out, force=True)
    assert not (out / "old.txt").exists() and (out / "adapter_model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no temp or old folder left


def test_not_enough_disk_writes_nothing(llama_run, tmp_path, monkeypatch):
    _, run = llama_run
    out = tmp_path / "o"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10 * 2**20))
    message = error_of(run=run, format="gguf", out=out, dtype="f16")
    assert message == (f"{out}: not enough free disk space: the export needs about 64.2 MiB, "
                       f"{tmp_path} has 10.0 MiB free")
    assert list(tmp_path.iterdir()) == []


def test_failure_midway_leaves_nothing(llama_run, tmp_path, monkeypatch):
    import hivetune.workflows.export as ex

    _, run = llama_run

    def boom(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr(ex, "write_safetensors_shards", boom)
    with pytest.raises(OSError):
        export(run, "merged", tmp_path / "o")
    assert list(tmp_path.iterdir()) == []


def test_cli_export_and_errors(llama_run, tmp_path, capsys):
    _, run = llama_run
    out = tmp_path / "g"
    assert main(["export", str(run), "--format", "gguf", "--dtype", "q8_0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"exported {run} as gguf (q8_0) to {out}: ")
    assert f"llama-server -m {(out / 'model-q8_0.gguf').absolute()}" in printed
    assert main(["export", str(run), "--format", "gguf", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"hivetune: error: {out}: already exists; pass --force to replace it\n"
