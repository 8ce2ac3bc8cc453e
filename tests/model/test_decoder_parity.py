"""Our decoder against transformers' own implementation, and our batch layouts against themselves.

For each family a tiny random transformers model (fp32, fixed seed, weights re-drawn at unit-ish
scale so that the logits are O(1) and every parameter matters) is written with
``save_pretrained`` and read back with ``hivetune.model.load.load_model``. Then:

- logits equal transformers' (eager attention) to 1e-4 relative to the largest reference logit;
- a sharded save (several files + index) loads to the identical model;
- right padding, packing (``Packed``), KV-cache decoding and left-padded batched decoding
  (``Masked``) each reproduce single-sequence runs to 1e-5.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

from hivetune.model.config import ModelArgs
from hivetune.model.decoder import KVCache, rope_inv_freq
from hivetune.model.load import load_model
from hivetune.ops.attention import Masked, Packed
from tiny_hf import decoded_logits, our_logits, random_hf_model, rel_diff, saved_family

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            max_position_embeddings=1024)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

FAMILIES = {
    "llama2": (LlamaConfig, dict(rope_theta=10000.0)),
    "llama3": (LlamaConfig, dict(rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))),
    "qwen2": (Qwen2Config, dict(rope_theta=1000000.0)),
    "qwen3": (Qwen3Config, dict(head_dim=32, rope_theta=1000000.0)),
    "mistral": (MistralConfig, dict(rope_theta=10000.0)),
    "smollm2": (LlamaConfig, dict(rope_theta=100000.0, tie_word_embeddings=True)),
}
EXPECTED_ARGS = {  # what from_hf_dict must read from each save
    "llama2": dict(model_type="llama", attention_bias=False, qk_norm=False, head_dim=16,
                   tie_word_embeddings=False, rope_theta=10000.0),
    "llama3": dict(model_type="llama", attention_bias=False, qk_norm=False, head_dim=16,
                   tie_word_embeddings=False, rope_theta=500000.0),
    "qwen2": dict(model_type="qwen2", attention_bias=True, qk_norm=False, head_dim=16,
                  tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", attention_bias=False, qk_norm=True, head_dim=32,
                  tie_word_embeddings=False, rope_theta=1000000.0),
    "mistral": dict(model_type="mistral", attention_bias=False, qk_norm=False, head_dim=16,
                    tie_word_embeddings=False, rope_theta=10000.0),
    "smollm2": dict(model_type="llama", attention_bias=False, qk_norm=False, head_dim=16,
                    tie_word_embeddings=True, rope_theta=100000.0),
}
SEQ_LEN = 208  # past original_max_position_embeddings=64, so llama3 scaling changes the result
PARITY_TOL = 1e-4
LAYOUT_TOL = 1e-5


def unit_scale(name: str, p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Every parameter at a scale where it visibly shapes the logits."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.2 * noise
    if name.endswith(".bias"):
        return 0.2 * noise
    return noise / p.shape[1] ** 0.5  # nn.Linear [out, in] and the embedding [vocab, hidden] (tied to lm_head)


def make_hf_model(family: str, seed: int = 0):
    cls, extra = FAMILIES[family]
    return random_hf_model(cls, seed, seed, unit_scale, **BASE, **extra)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    hf = make_hf_model(name, seed=1234 + list(FAMILIES).index(name))
    return saved_family(name, hf, tmp_path_factory.mktemp(f"hf_{name}"))


def ids_of(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


# ----------------------------------------------------------------------------------- config


def test_config_read_from_save(family):
    cfg = json.loads((family.folder / "config.json").read_text())
    args = ModelArgs.from_hf_dict(cfg)
    for key, value in EXPECTED_ARGS[family.name].items():
        assert getattr(args, key) == value, key
    assert args.num_key_value_heads == 2 and args.num_attention_heads == 4
    if family.name == "llama3":
        assert args.rope_scaling["factor"] == 8.0
        assert args.rope_scaling["original_max_position_embeddings"] == 64
        assert args.rope_scaling["low_freq_factor"] == 1.0
        assert args.rope_scaling["high_freq_factor"] == 4.0
    else:
        assert args.rope_scaling is None


def test_config_legacy_rope_scaling_key():
    """A transformers 4 style config.json (rope_theta + rope_scaling at top level) reads the same."""
    cfg = dict(BASE, model_type="llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    args = ModelArgs.from_hf_dict(cfg)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling["factor"] == 8.0
    cfg5 = dict(BASE, model_type="llama", rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))
    assert torch.equal(rope_inv_freq(args), rope_inv_freq(ModelArgs.from_hf_dict(cfg5)))


def test_to_hf_dict_reads_back_in_transformers(family):
    """Our exported config.json builds the same architecture (and RoPE) in transformers."""
    out = family.ours.args.to_hf_dict()
    json.dumps(out)  # serialisable
    config = AutoConfig.for_model(**out)
    assert type(config) is type(family.hf.config)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(family.hf.config, key), key
    assert config.rope_parameters == family.hf.config.rope_parameters
    rebuilt = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in family.hf.state_dict().items()}
    torch.testing.assert_close(rebuilt.model.rotary_emb.inv_freq, family.hf.model.rotary_emb.inv_freq,
                               rtol=0, atol=0)


def test_inv_freq_matches_transformers(family):
    ref = family.hf.model.rotary_emb.inv_freq.float()
    ours = family.ours.inv_freq
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------- parity


def test_logits_match_transformers(family):
    ids = ids_of(SEQ_LEN, seed=1)
    with torch.no_grad():
        ref = family.hf(ids).logits
    ours = our_logits(family.ours, ids)
    assert ours.shape == ref.shape == (1, SEQ_LEN, VOCAB)
    scale = ref.abs().max().item()
    assert scale > 1.0  # the randomisation did its job: logits are not all ~0
    diff = (ours - ref).abs().max().item()
    print(f"{family.name}: max|ref logit| {scale:.3f} max abs diff {diff:.3g}")
    assert diff / scale <= PARITY_TOL, f"{family.name}: max abs diff {diff:.3g}, scale {scale:.3g}"
    assert diff <= PARITY_TOL * max(1.0, scale)


@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_llama3_scaling_matters_at_test_length(family):
    """Without the llama3 rope scaling the logits would differ: the parity test has teeth."""
    ids = ids_of(SEQ_LEN, seed=1)
    with torch.no_grad():
        ref = family.hf(ids).logits
    unscaled = load_model(family.folder)
    unscaled.inv_freq = rope_inv_freq(unscaled.args.replace(rope_scaling=None))
    assert not torch.allclose(unscaled.inv_freq, family.ours.inv_freq)
    assert rel_diff(our_logits(unscaled, ids), ref) > 100 * PARITY_TOL


def test_tied_embeddings(family):
    tied = family.ours.lm_head.weight is family.ours.model.embed_tokens.weight
    assert tied == (family.name == "smollm2")


def test_sharded_save_loads_identically(family, tmp_path):
    family.hf.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(shards) >= 3, [s.name for s in shards]
    sharded = load_model(tmp_path, torch.float32, "cpu")
    ours = dict(family.ours.named_parameters())
    theirs = dict(sharded.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    ids = ids_of(32, seed=2)
    assert torch.equal(our_logits(sharded, ids), our_logits(family.ours, ids))


# ----------------------------------------------------------------------------------- layouts


def test_right_padding_matches_single(family):
    lengths = (24, 15)
    seqs = [ids_of(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    batch = torch.zeros(2, max(lengths), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s
    out = our_logits(family.ours, batch)
    for i, s in enumerate(seqs):
        alone = our_logits(family.ours, s[None])
        diff = (out[i, :len(s)] - alone[0]).abs().max().item()
        print(f"{family.name} right padding row {i}: {diff:.3g}")
        assert diff <= LAYOUT_TOL, f"row {i}: {diff:.3g}"
    # and the padded batch still matches transformers on the real positions
    with torch.no_grad():
        ref = family.hf(batch, attention_mask=(torch.arange(batch.shape[1]) < torch.tensor(lengths)[:, None]).long()).logits
    for i, n in enumerate(lengths):
        assert rel_diff(out[i, :n], ref[i, :n]) <= PARITY_TOL


def test_packed_matches_single(family):
    lengths = [19, 11, 7]
    seqs = [ids_of(n, seed=20 + i)[0] for i, n in enumerate(lengths)]
    pad = 3  # trailing padding after the last example, as a packer may leave
    row = torch.cat(seqs + [torch.zeros(pad, dtype=torch.long)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(pad, dtype=torch.long)])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = our_logits(family.ours, row, position_ids=pos, layout=Packed(cu, max(lengths)))
    assert torch.isfinite(out).all()
    start = 0
    for s in seqs:
        alone = our_logits(family.ours, s[None])[0]
        diff = (out[0, start:start + len(s)] - alone).abs().max().item()
        print(f"{family.name} packed example at {start}: {diff:.3g}")
        assert diff <= LAYOUT_TOL, f"example at {start}: {diff:.3g}"
        start += len(s)
    # Without the Packed layout the second example would see the first: the test has teeth.
    leaky = our_logits(family.ours, row, position_ids=pos)
    assert (leaky[0, lengths[0]:sum(lengths)] - out[0, lengths[0]:sum(lengths)]).abs().max() > 1e-2


def test_kv_cache_decoding_matches_full_forward(family):
    model = family.ours
    ids = ids_of(28, seed=30)
    full = our_logits(model, ids)
    inc, cache = decoded_logits(model, ids, prefill=16, max_len=32)
    assert cache.length == 28
    diff = (inc - full).abs().max().item()
    print(f"{family.name} kv cache: {diff:.3g}")
    assert diff <= LAYOUT_TOL, f"{diff:.3g}"


def test_kv_cache_chunked_prefill_matches_full_forward(family):
    """Prefill in chunks of several tokens on top of a non-empty cache (speculative / chunked)."""
    model = family.ours
    ids = ids_of(40, seed=31)
    full = our_logits(model, ids)
    cache = KVCache(model.args, batch=1, max_len=40, device="cpu", dtype=torch.float32)
    steps = [our_logits(model, ids[:, a:b], cache=cache) for a, b in ((0, 10), (10, 17), (17, 18), (18, 40))]
    inc = torch.cat(steps, dim=1)
    diff = (inc - full).abs().max().item()
    print(f"{family.name} kv cache chunked: {diff:.3g}")
    assert diff <= LAYOUT_TOL, f"{diff:.3g}"


def left_padded_masks(attn: torch.Tensor):
    """From a [B, T] 0/1 attention mask: position ids and the [B, 1, T, T] prefill mask.

    Padding queries may attend to themselves so no row of the mask is empty (an empty row gives
    NaN, which would leak through 0 * NaN into the real rows of the next layer).
    """
    t = attn.shape[1]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask = causal[None] & attn.bool()[:, None, :]
    mask = mask | torch.eye(t, dtype=torch.bool)[None]
    return position_ids, mask[:, None]


def test_left_padded_batched_decoding(family):
    model = family.ours
    prompt_lengths = [13, 6]
    new_tokens = 8
    prompts = [ids_of(n, seed=40 + i)[0] for i, n in enumerate(prompt_lengths)]
    continuation = ids_of(new_tokens, seed=50, batch=2)  # teacher-forced next tokens
    t0 = max(prompt_lengths)
    batch = torch.zeros(2, t0, dtype=torch.long)
    attn = torch.zeros(2, t0, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, t0 - len(p):] = p
        attn[i, t0 - len(p):] = 1
    position_ids, mask = left_padded_masks(attn)
    cache = KVCache(model.args, batch=2, max_len=t0 + new_tokens, device="cpu", dtype=torch.float32)
    prefill = our_logits(model, batch, position_ids, Masked(mask), cache)
    step_logits = [prefill[:, -1:]]
    next_pos = position_ids[:, -1:] + 1
    for step in range(new_tokens):
        attn = torch.cat([attn, torch.ones(2, 1, dtype=torch.long)], dim=1)
        step_mask = attn.bool()[:, None, None, :]
        out = our_logits(model, continuation[:, step:step + 1], next_pos, Masked(step_mask), cache)
        step_logits.append(out)
        next_pos = next_pos + 1
    batched = torch.cat(step_logits, dim=1)  # [2, 1 + new_tokens, V]: last prompt pos + each new one
    for i, p in enumerate(prompts):
        seq = torch.cat([p, continuation[i]])[None]
        alone = our_logits(model, seq)[0]
        expected = alone[len(p) - 1:]
        diff = (batched[i] - expected).abs().max().item()
        print(f"{family.name} left-padded decode row {i}: {diff:.3g}")
        assert diff <= LAYOUT_TOL, f"row {i}: {diff:.3g}"
        # prefill logits on the real prompt positions match too
        diff = (prefill[i, t0 - len(p):] - alone[:len(p)]).abs().max().item()
        assert diff <= LAYOUT_TOL, f"row {i} prefill: {diff:.3g}"
