"""A quantized frozen base (base_quant): the layer against its dequantized weights, loading
(quantize on load; a GGUF's blocks kept), and the config's refusals with their exact lines."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from hivetune.cli import main
from hivetune.core.config import load_config
from hivetune.core.errors import UserError
from hivetune.model.load import load_model
from hivetune.model.lora import LoRALinear, apply_lora, LoRASpec
from hivetune.model.quant import GGUFBlocks, QuantLinear, dequantize_model, is_quantized, quant_name
from hivetune.ops import gguf_blocks, gguf_quantize, nf4

TOL = 1e-5
QUANTIZABLE = (2, 3, 6, 7, 8, 12, 14)  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (gguf package), Q4_K Q6_K (gguf_quantize)


def gguf_blocks_of(qtype: int, rows: int, cols: int, seed: int) -> GGUFBlocks:
    """Blocks of real data where a quantizer makes the type (the gguf package's, gguf_quantize's
    Q4_K / Q6_K), else (Q5_K) random bytes with finite f16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        raw = gguf_quantize.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    else:  # random bytes, finite f16 scales
        _, qk, nbytes = gguf_blocks.BLOCK_TYPES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // qk * nbytes), dtype=np.uint8)
        blocks = raw.reshape(-1, nbytes)
        for at in ((208,) if qtype == 14 else (0, 2)):
            halves = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
            blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return GGUFBlocks(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (rows, cols))


def quant_layer(kind: str, out_f: int = 96, in_f: int = 256, bias: bool = True) -> QuantLinear:
    torch.manual_seed(3)
    b = torch.randn(out_f) * 0.1 if bias else None
    if kind in ("nf4", "int8"):
        return QuantLinear.quantized(torch.randn(out_f, in_f) * 0.05, kind, b)
    qtype = next(t for t, (name, _, _) in gguf_blocks.BLOCK_TYPES.items() if name == kind)
    return QuantLinear.kept(gguf_blocks_of(qtype, out_f, in_f, qtype), b)


def dense_twin(layer: QuantLinear) -> nn.Linear:
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantized())
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    dense.requires_grad_(False)
    return dense


KINDS = ["nf4", "int8", *gguf_blocks.SUPPORTED]


@pytest.mark.parametrize("kind", KINDS)
def test_layer_forward_and_input_grad_equal_dequantized(kind):
    layer = quant_layer(kind)
    dense = dense_twin(layer)
    x = torch.randn(3, 5, layer.in_features, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = layer(x), dense(x2)
    torch.testing.assert_close(y, y2, rtol=0, atol=TOL)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=TOL)
    assert not any(p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("kind", ["nf4", "int8", "Q4_K"])
def test_lora_on_quantized_base_equals_dense_base(kind):
    layer = quant_layer(kind, bias=False)
    dense = dense_twin(layer)
    torch.manual_seed(1)
    lora_q = LoRALinear(layer, r=4, alpha=8, dropout=0.0, rslora=False)
    lora_d = LoRALinear(dense, r=4, alpha=8, dropout=0.0, rslora=False)
    with torch.no_grad():
        for a, b in ((lora_q.lora_A, lora_d.lora_A), (lora_q.lora_B, lora_d.lora_B)):
            a.weight.normal_(0, 0.1)
            b.weight.copy_(a.weight)
    x = torch.randn(7, layer.in_features, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = lora_q(x), lora_d(x2)
    torch.testing.assert_close(y, y2, rtol=0, atol=TOL)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=TOL)
    torch.testing.assert_close(lora_q.lora_A.weight.grad, lora_d.lora_A.weight.grad, rtol=0, atol=TOL)
    torch.testing.assert_close(lora_q.lora_B.weight.grad, lora_d.lora_B.weight.grad, rtol=0, atol=TOL)
    torch.testing.assert_close(lora_q.merged_weight(), lora_d.merged_weight(), rtol=0, atol=0)


def test_bf16_compute_dequantizes_into_bf16():
    layer = quant_layer("nf4")
    x = torch.randn(4, layer.in_features, dtype=torch.bfloat16)
    w = nf4.dequantize_parts(layer.packed, layer.q_absmax, layer.absmax2, layer.offset,
                             (layer.out_features, layer.in_features), torch.bfloat16)
    assert torch.equal(layer(x), nn.functional.linear(x, w, layer.bias.bfloat16()))


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_quantize_on_load(tiny_model_dir, quant):
    from safetensors.torch import load_file

    model = load_model(tiny_model_dir, base_quant=quant)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7 and quant_name(model) == quant
    for name, m in layers:
        expected = QuantLinear.quantized(weights[f"{name}.weight"].float(), quant)
        assert torch.equal(m.dequantized(), expected.dequantized()), name
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    dense_bytes = sum(4 * m.in_features * m.out_features for _, m in layers)
    assert sum(m.quantized_bytes() for _, m in layers) < dense_bytes * (0.3 if quant == "int8" else 0.15)
    ids = torch.randint(0, 384, (2, 9))
    with torch.no_grad():
        hidden = model(ids)
        assert dequantize_model(model) == 14 and not is_quantized(model)
        torch.testing.assert_close(model(ids), hidden, rtol=0, atol=TOL)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_decoder_layer_forward_and_input_grad_equal_dequantized(tiny_model_dir, quant):
    """A whole decoder layer with LoRA (B nonzero) on its quantized base against the same layer
    on the dequantized weights."""
    from hivetune.model.decoder import rope_cos_sin

    models = []
    for _ in range(2):
        model = load_model(tiny_model_dir, base_quant=quant)
        torch.manual_seed(0)
        apply_lora(model, LoRASpec(r=4, alpha=8, dropout=0.0))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
        models.append(model)
    assert dequantize_model(models[1]) == 14
    x = torch.randn(2, 13, 64)
    cos, sin = rope_cos_sin(models[0].inv_freq, torch.arange(13)[None].expand(2, -1), torch.float32)
    outs, grads = [], []
    for model in models:
        xi = x.clone().requires_grad_(True)
        y = model.model.layers[1](xi, cos, sin)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append(xi.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=TOL)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=TOL)


def test_quantize_on_load_holds_one_dense_weight_at_a_time(tiny_model_dir, monkeypatch):
    """Each dense linear weight read from the file is gone (quantized, then dropped) once the
    loader takes the next tensor (its loop variable holds the last one while the next is read):
    the dense base never exists whole."""
    import gc
    import weakref

    from hivetune.model import load

    read = load.safetensors_state_dict
    alive: list = []

    def watched(folder):
        for name, tensor in read(folder):
            gc.collect()
            assert [n for n, ref in alive[:-1] if ref() is not None] == []
            if name.endswith("_proj.weight"):
                alive.append((name, weakref.ref(tensor)))
            yield name, tensor

    monkeypatch.setattr(load, "safetensors_state_dict", watched)
    model = load_model(tiny_model_dir, base_quant="nf4")
    assert len(alive) == 14 and is_quantized(model)


def test_quantized_base_takes_lora_on_every_target(tiny_model_dir):
    model = load_model(tiny_model_dir, base_quant="nf4")
    wrapped = apply_lora(model, LoRASpec(r=4, alpha=8, dropout=0.0))
    assert len(wrapped) == 14
    assert all(isinstance(model.get_submodule(n).base_layer, QuantLinear) for n in wrapped)


# ------------------------------------------------------------------ GGUF keep

def write_quant_gguf(path, qtype, hidden: int = 256, inter: int = 256, vocab: int = 128) -> None:
    """A one-layer llama GGUF whose linear weights are `qtype` blocks (an int), or each its own
    type (a dict GGUF name -> type, e.g. "attn_q"); embeddings and norms F32."""
    import gguf

    rng = np.random.default_rng(qtype if isinstance(qtype, int) else len(qtype))
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_vocab_size, vocab), (w.add_context_length, 512), (w.add_embedding_length, hidden),
                       (w.add_block_count, 1), (w.add_feed_forward_length, inter), (w.add_head_count, 4),
                       (w.add_head_count_kv, 2), (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0)):
        add(value)
    dense = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
             "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,)}
    for name, shape in dense.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1 + (1 if len(shape) == 1 else 0)).astype(np.float32))
    kv = hidden // 2
    linears = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
               "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
               "ffn_down": (hidden, inter)}
    for name, (rows, cols) in linears.items():
        kind = qtype[name] if isinstance(qtype, dict) else qtype
        if kind in gguf_blocks.BLOCK_TYPES:
            raw = gguf_blocks_of(kind, rows, cols, rows + cols).raw.numpy()
        else:  # a type keep does not take, from the gguf package's quantizer
            from gguf.quants import quantize
            raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), gguf.GGMLQuantizationType(kind))
        w.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# A llama.cpp Q4_K_M-like mix: Q5_0 where a K-quant's 256 columns do not fit (hidden 96), Q8_0 /
# Q6_K for attn_v / ffn_down (llama.cpp's "more bits" layers), Q4_K elsewhere; plus Q5_1.
MIX = {"attn_q": 6, "attn_k": 6, "attn_v": 8, "attn_output": 7, "ffn_gate": 6, "ffn_up": 6, "ffn_down": 14}
MIX_256 = {"attn_q": 12, "attn_k": 6, "attn_v": 14, "attn_output": 7, "ffn_gate": 12, "ffn_up": 6, "ffn_down": 14}


def check_kept_equals_dense(path, kinds: str, vocab: int = 128) -> None:
    kept = load_model(path, base_quant="keep")
    dense = load_model(path)  # the gguf package's dequantization
    layers = {n: m for n, m in kept.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 7 and quant_name(kept) == kinds
    for name, m in layers.items():
        assert m.raw.dtype == torch.uint8
        assert torch.equal(m.dequantized(), dense.get_submodule(name).weight), name
    ids = torch.randint(0, vocab, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), dense(ids), rtol=0, atol=TOL)


@pytest.mark.parametrize("qtype", sorted(gguf_blocks.BLOCK_TYPES))
def test_gguf_keep_holds_the_files_blocks(qtype, tmp_path, monkeypatch):
    monkeypatch.setenv("HIVETUNE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_quant_gguf(path, qtype)
    check_kept_equals_dense(path, gguf_blocks.BLOCK_TYPES[qtype][0])


@pytest.mark.parametrize("mix,hidden,inter", [(MIX, 96, 256), (MIX_256, 256, 512)])
def test_gguf_keep_holds_a_mix_of_block_types(mix, hidden, inter, tmp_path, monkeypatch):
    """Q4_K_M-style files mix types tensor by tensor (a small model's 896 columns: Q5_0)."""
    monkeypatch.setenv("HIVETUNE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mix.gguf"
    write_quant_gguf(path, mix, hidden=hidden, inter=inter)
    names = sorted({gguf_blocks.BLOCK_TYPES[t][0] for t in mix.values()})
    check_kept_equals_dense(path, "+".join(names))
    kept = load_model(path, base_quant="keep")
    assert kept.model.layers[0].self_attn.q_proj.qtype == mix["attn_q"]
    assert kept.model.layers[0].mlp.down_proj.qtype == mix["ffn_down"]


def test_gguf_keep_refuses_an_unsupported_block_type(tmp_path, monkeypatch):
    monkeypatch.setenv("HIVETUNE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tq2_0.gguf"
    write_quant_gguf(path, 35)  # TQ2_0 (ternary)
    with pytest.raises(UserError) as e:
        load_model(path, base_quant="keep")
    assert str(e.value) == (f"base_quant: keep: {path}: blk.0.attn_q.weight is TQ2_0, not one of the supported "
                            "block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (or F32, F16, BF16); use "
                            "base_quant nf4 or int8 to requantize it")
    assert is_quantized(load_model(path, base_quant="nf4"))  # requantized from the dequantized TQ2_0


# ------------------------------------------------------------------ refusals

def test_unknown_base_quant_is_one_line(tiny_model_dir, capsys):
    with pytest.raises(UserError) as e:
        load_config(None, {"model": str(tiny_model_dir), "base_quant": "nf5"})
    assert str(e.value) == "base_quant: 'nf5' is not one of none, nf4, int8, keep"
    assert main(["train", "--model", str(tiny_model_dir), "--base-quant", "q4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hivetune: error: base_quant: 'q4' is not one of none, nf4, int8, keep")


def test_keep_on_an_hf_folder_is_refused(tiny_model_dir):
    with pytest.raises(UserError) as e:
        load_config(None, {"model": str(tiny_model_dir), "base_quant": "keep"})
    assert str(e.value) == (f"base_quant: keep needs a .gguf model (its blocks are kept); {tiny_model_dir} "
                            "is not one: use none, nf4 or int8")
    with pytest.raises(UserError) as e:
        load_model(tiny_model_dir, base_quant="keep")
    assert str(e.value) == (f"base_quant: keep needs a .gguf model (its blocks are kept); {tiny_model_dir} "
                            "is not one: use none, nf4 or int8")


def test_quantize_model_in_memory_equals_quantize_on_load(tiny_model_dir):
    from hivetune.model.quant import quantize_model

    loaded = load_model(tiny_model_dir, base_quant="nf4")
    built = load_model(tiny_model_dir)
    assert quantize_model(built, "nf4") == 14
    for (name, a), (_, b) in zip(loaded.named_modules(), built.named_modules()):
        if isinstance(a, QuantLinear):
            assert isinstance(b, QuantLinear) and torch.equal(a.dequantized(), b.dequantized()), name
