"""Gemma 2, Gemma 3 (text), Phi-3 / Phi-4-mini and Mistral's sliding window, in and out.

For each family a tiny random transformers model (fp32, windows of 8 tokens) is saved and read
back with ``load_model``; then:
- logits equal transformers' (eager attention) to 1e-4 on sequences of 5, 37 and 300 tokens
  (past the window; Phi-3's 300 past longrope's original 256, so its long factors are used);
- packed rows and KV-cache decoding reproduce single-sequence runs (1e-5) past the window;
- its real chat template (embedded in the test tokenizer_config) marks the assistant turns;
- a LoRA trained a few steps (through lora.fuse_projections' joined path) saves an adapter that
  PEFT loads onto the transformers model with equal logits (1e-4), Phi-3's under PEFT's names;
- Phi-3's joined qkv_proj / gate_up_proj quantize (int8) and compute as their dequantized values.
GGUF export and import: test_families_gguf.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma3TextConfig, MistralConfig,
                          Phi3Config)

from hivetune.core.errors import UserError
from hivetune.data.formats import chat_spans
from hivetune.model.config import ModelArgs
from hivetune.model.load import load_model
from hivetune.model.lora import LoRASpec, apply_lora, fuse_projections, lora_parameters, save_adapter
from hivetune.ops.attention import Packed
from tiny_hf import decoded_logits, our_logits, random_hf_model, rel_diff, saved_family

VOCAB = 384
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 8  # Gemma's; Phi-3's and Mistral's 24: llama.cpp runs them without one, so its test stays inside
NO_GGUF_WINDOW = 24
LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(6)],
                long_factor=[2.0 + i for i in range(6)])
FAMILIES = {
    "gemma2": (Gemma2Config, dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16)),
    "gemma3": (Gemma3TextConfig, dict(head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2,
                                      rope_local_base_freq=10000.0, query_pre_attn_scalar=16)),
    # Phi-4-mini's shape: partial rotary, longrope, tied embeddings
    "phi4mini": (Phi3Config, dict(partial_rotary_factor=0.75, rope_scaling=dict(LONGROPE),
                                  original_max_position_embeddings=256, tie_word_embeddings=True)),
    "phi3": (Phi3Config, dict(sliding_window=NO_GGUF_WINDOW)),  # Phi-3-mini's: full rotary, a window
    "mistral": (MistralConfig, dict(sliding_window=NO_GGUF_WINDOW)),
}
PARITY_TOL, LAYOUT_TOL = 1e-4, 1e-5  # relative to the largest reference logit

GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
PHI4MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] "
    "is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + "
    "'<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# template, special tokens (bos, eos, turn markers), the assistant spans of CHAT as rendered
CHAT = [{"role": "user", "content": "Restart nginx?"}, {"role": "assistant", "content": "systemctl restart nginx"},
        {"role": "user", "content": "And sshd?"}, {"role": "assistant", "content": "systemctl restart sshd"}]
TEMPLATES = {
    "gemma2": (GEMMA2_TEMPLATE, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
               ["systemctl restart nginx<end_of_turn>\n", "systemctl restart sshd<end_of_turn>\n"]),
    "gemma3": (GEMMA3_TEMPLATE, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
               ["systemctl restart nginx<end_of_turn>\n", "systemctl restart sshd<end_of_turn>\n"]),
    # the template ends a finished conversation with eos: only the last turn is a prefix-stable span
    "phi3": (PHI3_TEMPLATE, ["<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"],
             ["systemctl restart sshd<|end|>\n<|endoftext|>"]),
    "phi4mini": (PHI4MINI_TEMPLATE, ["<|bos|>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"],
                 ["systemctl restart sshd<|end|><|endoftext|>"]),
    "mistral": (MISTRAL_TEMPLATE, ["<s>", "</s>", "[INST]", "[/INST]"],
                ["systemctl restart nginx</s>", "systemctl restart sshd</s>"]),
}
CORPUS = ["How do I restart the nginx service? Run systemctl restart nginx as root.",
          "rpm-ostree status shows the deployments; bootc upgrade stages a new image 0123456789."]


def build_tokenizer(folder, family: str) -> None:
    """A byte-level BPE with the family's special tokens and chat template. Digits split one by
    one (the "smollm" pre-tokenizer, which llama.cpp knows)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, special, _ = TEMPLATES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<pad>", *special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[0], eos_token=special[1], pad_token="<pad>")
    fast.chat_template = template
    fast.save_pretrained(str(folder))


def make_hf(family: str, seed: int = 0, **overrides):
    gemma = family.startswith("gemma")

    def redraw(name, p, noise):  # weights at a scale where each visibly shapes the logits
        if name.endswith("norm.weight"):
            return 0.3 * noise + (0.0 if gemma else 1.0)
        if "embed" in name and gemma:  # scaled by sqrt(hidden) = 8 in forward
            return 0.05 * noise
        return 2 * noise / p.shape[-1] ** 0.5

    cls, extra = FAMILIES[family]
    return random_hf_model(cls, seed, seed + 1, redraw, **BASE, **{**extra, **overrides})


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    hf = make_hf(name, seed=list(FAMILIES).index(name))
    return saved_family(name, hf, tmp_path_factory.mktemp(name), build_tokenizer)


def ids_of(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------- parity


def test_config_fields(family):
    args = family.ours.args
    if family.name == "gemma2":
        assert args.layer_types == ["sliding_attention", "full_attention"] * 2
        assert (args.attn_logit_softcapping, args.final_logit_softcapping) == (50.0, 30.0)
        assert args.hidden_act == "gelu_pytorch_tanh" and args.tie_word_embeddings
    if family.name == "gemma3":
        assert args.qk_norm and args.rope_local_theta == 10000.0 and args.rope_theta == 1e6
        assert args.layer_types == ["sliding_attention", "full_attention"] * 2
    if family.name == "phi4mini":
        assert args.rotary_dim == 12 and args.rope_scaling["rope_type"] == "longrope"
    if family.name in ("phi3", "mistral"):
        assert args.sliding_window == NO_GGUF_WINDOW and args.layer_types is None


@pytest.mark.parametrize("length", [5, 37, 300])
def test_logits_match_transformers(family, length):
    ids = ids_of(length, seed=length)
    with torch.no_grad():
        ref = family.hf(ids).logits
    got = our_logits(family.ours, ids)
    scale = ref.abs().max().item()
    assert scale > 1.0
    diff = rel_diff(got, ref)
    print(f"{family.name} T={length}: max|ref| {scale:.3f} rel diff {diff:.3g}")
    assert diff <= PARITY_TOL


def test_gemma_query_scale_and_window_have_teeth(tmp_path):
    """A query_pre_attn_scalar other than head_dim (the scale rides in q) matches transformers,
    and dropping the window changes the logits past it."""
    cls, extra = FAMILIES["gemma3"]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cls(**BASE, **dict(extra, query_pre_attn_scalar=24)), dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path).eval()
    ids = ids_of(40, seed=3)
    with torch.no_grad():
        ref = hf.eval()(ids).logits
    assert rel_diff(our_logits(ours, ids), ref) <= PARITY_TOL
    for layer in ours.model.layers:
        layer.self_attn.window = None
    assert rel_diff(our_logits(ours, ids), ref) > 100 * PARITY_TOL


def test_packed_rows_match_single_past_the_window(family):
    lengths = [30, 11, 5]
    seqs = [ids_of(n, seed=20 + i)[0] for i, n in enumerate(lengths)]
    row = torch.cat(seqs + [torch.zeros(3, dtype=torch.long)])[None]  # a trailing pad segment
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(3, dtype=torch.long)])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = our_logits(family.ours, row, pos, Packed(cu, max(lengths), tuple(lengths)))
    start = 0
    for s in seqs:
        assert rel_diff(out[0, start:start + len(s)], our_logits(family.ours, s[None])[0]) <= LAYOUT_TOL
        start += len(s)


def test_kv_cache_decoding_past_the_window(family):
    model = family.ours
    ids = ids_of(36, seed=30)
    full = our_logits(model, ids)
    assert rel_diff(decoded_logits(model, ids, prefill=12, max_len=40)[0], full) <= LAYOUT_TOL


def test_unsupported_rope_type_is_refused():
    with pytest.raises(UserError) as info:
        ModelArgs.from_hf_dict(dict(BASE, model_type="phi3", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                               source="config.json")
    assert str(info.value) == ("config.json: rope type 'dynamic' is not supported "
                               "(default, llama3, linear, longrope)")


# ----------------------------------------------------------------------------------- chat template


def test_chat_template_marks_the_assistant_turns(family):
    tok = AutoTokenizer.from_pretrained(str(family.folder))
    text, spans = chat_spans(tok, CHAT)
    assert [text[a:b] for a, b in spans] == TEMPLATES[family.name][2]
    if family.name.startswith("gemma"):
        assert text.startswith("<bos><start_of_turn>user\nRestart nginx?<end_of_turn>\n<start_of_turn>model\n")


# ----------------------------------------------------------------------------------- LoRA


def test_trained_lora_loads_in_peft(family, tmp_path):
    peft = pytest.importorskip("peft")
    model = load_model(family.folder).train()
    spec = LoRASpec(r=4, alpha=8, dropout=0.0)  # the default targets, q_proj ... down_proj
    apply_lora(model, spec)
    if family.name.startswith("phi"):
        assert spec.targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    fuse_projections(model, wide=False)  # the joined LoRA path (Gemma's q/k/v and gate/up)
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    ids = ids_of(24, seed=5)
    for _ in range(3):
        logits = model.logits(model(ids[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    save_adapter(model, spec, tmp_path, base_model_path=str(family.folder))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == sorted(spec.targets)

    hf = AutoModelForCausalLM.from_pretrained(str(family.folder), dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    test_ids = ids_of(30, seed=6)
    with torch.no_grad():
        base = hf(test_ids).logits
        ref = peft.PeftModel.from_pretrained(hf, str(tmp_path)).eval()(test_ids).logits
    got = our_logits(model.eval(), test_ids)
    assert rel_diff(got, ref) <= PARITY_TOL
    assert rel_diff(base, ref) > 100 * PARITY_TOL  # training moved the logits


# ----------------------------------------------------------------------------------- quantized base


def test_phi3_joined_linears_quantize(family):
    if not family.name.startswith("phi"):
        pytest.skip("Phi-3's qkv_proj / gate_up_proj")
    from hivetune.model.quant import QuantLinear

    quantized = load_model(family.folder, base_quant="int8").eval()
    attn, mlp = quantized.model.layers[0].self_attn, quantized.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(mlp.gate_up_proj, QuantLinear)
    # it computes with the int8 weights: equal to the dense model holding their dequantized values
    dense = load_model(family.folder).eval()
    with torch.no_grad():
        for name, m in quantized.named_modules():
            if isinstance(m, QuantLinear):
                dense.get_submodule(name).weight.copy_(m.dequantized())
    ids = ids_of(20, seed=8)
    assert rel_diff(our_logits(quantized, ids), our_logits(dense, ids)) <= PARITY_TOL


def test_importance_matrix_has_an_entry_per_quantized_weight(family):
    """model.imatrix on each family's model: one entry for each 2-D weight the GGUF export writes
    (the names llama.cpp's quantizer looks its entries up by), as long as that weight's input; the
    token embeddings only where they are the output head too (a lookup has no input to weigh)."""
    from hivetune.model.gguf_write import plan_model_tensors
    from hivetune.model.imatrix import importance_matrix

    entries, tokens = importance_matrix(family.ours, [list(range(3, 40)), [5, 9, 300]])
    planned = {t.name: t.shape for t in plan_model_tensors(family.ours, "f16") if len(t.shape) == 2}
    if "output.weight" in planned:
        del planned["token_embd.weight"]
    assert tokens == 40 and sorted(entries) == sorted(planned)
    for name, values in entries.items():
        assert values.shape == (planned[name][-1],) and (values > 0).all(), name
