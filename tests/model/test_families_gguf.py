"""GGUF of Gemma 2, Gemma 3 (text), Phi-3 / Phi-4-mini and Mistral, out and back in.

The tiny random models of test_families (windows of 8 or 24 tokens) are exported with
``write_model_gguf`` and then:
- read back by hivetune (f32): the architecture fields and the logits past the window equal the
  source model's (Mistral goes as llama, whose GGUF has no window: inside it; Mistral's and Phi-3's
  context length is their window, which llama.cpp does not run), again from the
  decoded-weights cache, and a q8_0 export under base_quant=keep computes as its dequantized self;
- read by transformers' own GGUF loader, where it knows the architecture: its logits equal ours;
- loaded in llama-cpp-python: 3 prompts x 10 greedy tokens as hivetune continues them; Gemma's
  past its window, Mistral (as llama) and Phi-3 inside theirs (llama.cpp runs both without one).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_families import BASE, NO_GGUF_WINDOW, WINDOW, family, ids_of  # noqa: F401
from tiny_hf import our_logits, rel_diff
from transformers import AutoModelForCausalLM, AutoTokenizer

from hivetune.core.errors import UserError
from hivetune.model.config import ModelArgs
from hivetune.model.gguf_write import write_model_gguf
from hivetune.model.load import load_model

ROUND_TRIP_TOL = 1e-5  # f32 weights; Gemma's norms go through 1 + w and back
ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "rope_theta", "qk_norm", "hidden_act", "sliding_window", "layer_types",
               "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta",
               "rotary_dim")


def arch(args: ModelArgs, skip=()) -> dict:
    """The ARCH_FIELDS of args, floats as GGUF stores them (float32)."""
    return {f: float(np.float32(v)) if isinstance(v, float) else v
            for f in ARCH_FIELDS if f not in skip for v in [getattr(args, f)]}


def export(family, folder, dtype="f32"):
    path = folder / f"model-{dtype}.gguf"
    write_model_gguf(path, family.ours, dtype, "tiny", AutoTokenizer.from_pretrained(str(family.folder)),
                     family.folder)
    return path


def round_trip_length(family) -> int:
    """Past the window that survives the trip; Phi-4-mini's past longrope's original 256 too."""
    if family.name == "mistral":
        return NO_GGUF_WINDOW - 4
    return 300 if family.name == "phi4mini" else 40


def test_gguf_round_trip_keeps_the_architecture_and_the_logits(family, tmp_path):
    path = export(family, tmp_path)
    ours = family.ours.args
    for attempt in ("decoded", "cached"):  # the second load reads the decoded-weights cache
        back = load_model(path).eval()
        args = back.args
        if family.name == "mistral":  # as llama.cpp's converter: llama, no window
            assert (args.model_type, args.sliding_window) == ("llama", None)
            assert arch(args, skip=("sliding_window",)) == arch(ours, skip=("sliding_window",)), attempt
        else:
            assert args.model_type == ours.model_type
            assert arch(args) == arch(ours), attempt
        # llama.cpp runs Mistral and Phi-3 without their window: the context written is the window
        context = NO_GGUF_WINDOW if family.name in ("mistral", "phi3") else ours.max_position_embeddings
        assert (ours.max_position_embeddings, args.max_position_embeddings) == (1024, context), attempt
        if family.name == "phi4mini":
            rope, src = args.rope_scaling, ours.rope_scaling
            assert rope["rope_type"] == "longrope"
            assert rope["original_max_position_embeddings"] == src["original_max_position_embeddings"]
            for which in ("long_factor", "short_factor"):
                assert rope[which] == pytest.approx(src[which], rel=1e-7)
        ids = ids_of(round_trip_length(family), seed=11)
        diff = rel_diff(our_logits(back, ids), our_logits(family.ours, ids))
        print(f"{family.name} {attempt} T={ids.shape[1]}: rel diff {diff:.3g}")
        assert diff <= ROUND_TRIP_TOL, attempt


def test_gguf_q8_0_kept_blocks_compute_as_dequantized(family, tmp_path):
    from hivetune.model.quant import QuantLinear

    path = export(family, tmp_path, "q8_0")
    kept = load_model(path, base_quant="keep").eval()
    dense = load_model(path).eval()  # the blocks dequantized into plain weights
    joined = ("qkv_proj", "gate_up_proj") if family.name.startswith("phi") else ("q_proj", "up_proj")
    layer = kept.model.layers[0]
    assert isinstance(getattr(layer.self_attn, joined[0]), QuantLinear)
    assert isinstance(getattr(layer.mlp, joined[1]), QuantLinear)
    ids = ids_of(round_trip_length(family), seed=12)
    assert rel_diff(our_logits(kept, ids), our_logits(dense, ids)) <= ROUND_TRIP_TOL
    # the dequantized weights are the source's, each within q8_0's step (block amax / 127; the
    # step itself stored as f16) of it
    source = dict(family.ours.named_parameters(remove_duplicate=False))  # a tied lm_head too
    for name, p in dense.named_parameters():
        if p.dim() == 2:
            w = source[name].detach().reshape(-1, 32)
            step = w.abs().amax(dim=1, keepdim=True) / 127
            assert ((p.reshape(-1, 32) - w).abs() <= 0.6 * step).all(), name


def test_transformers_reads_the_gguf_export_to_the_source_weights(family, tmp_path):
    """transformers' GGUF loader as an oracle of the tensor layout (names, Gemma's 1 + w norms,
    q/k rows, Phi-3's joined tensors). Its GGUF config mapping drops what llama.cpp infers
    (query_pre_attn_scalar) or reads and transformers does not (windows, partial rotary,
    longrope), so the weights are compared, not the logits."""
    export(family, tmp_path)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model-f32.gguf", dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:
        pytest.skip(f"transformers does not read this GGUF architecture ({type(e).__name__})")
    assert hf.config.model_type == ("llama" if family.name == "mistral" else family.hf.config.model_type)
    theirs = hf.state_dict()
    for name, w in family.hf.state_dict().items():  # exact, but Gemma's norms: w + 1 - 1 in fp32
        assert torch.allclose(theirs[name], w, rtol=0, atol=1e-7 if "norm" in name else 0), name


def test_gguf_export_greedy_equals_llama_cpp(family, tmp_path):
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or an OSError from a broken shared library
        pytest.skip(f"llama-cpp-python cannot be imported ({type(e).__name__})")
    from hivetune.workflows.generate import greedy_ids

    tok = AutoTokenizer.from_pretrained(str(family.folder))
    path = export(family, tmp_path)
    # an f32 KV cache: f16 keys turn near ties (a 0.008 logit gap) the other way
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, type_k=0, type_v=0, verbose=False)
    windowless = family.name in ("mistral", "phi3")  # in llama.cpp: prompt + 10 tokens inside the window
    for prompt in ["How do I restart the nginx service? Run systemctl", "rpm-ostree status shows",
                   "bootc upgrade stages a new image 0123456789"]:
        ids = tok(prompt)["input_ids"]
        ids = ids[:NO_GGUF_WINDOW - 10] if windowless else ids
        assert len(ids) + 10 > WINDOW
        ours = greedy_ids(family.ours, [ids], 10, set())[0]
        llm.reset()
        theirs = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            theirs.append(token)
            if len(theirs) == 10:
                break
        assert ours == theirs, prompt


def test_gguf_export_refuses_a_gemma_scale_llama_cpp_lacks():
    from hivetune.model.decoder import CausalLM
    from hivetune.model.gguf_write import add_family_hparams

    args = ModelArgs.from_hf_dict(dict(BASE, model_type="gemma2", head_dim=16, query_pre_attn_scalar=24))
    assert math.isclose(CausalLM(args).model.layers[0].self_attn.scale, 24 ** -0.5)
    with pytest.raises(UserError) as info:
        add_family_hparams(None, args)
    assert str(info.value) == ("query_pre_attn_scalar 24: llama.cpp's Gemma scales attention by head_dim (16), "
                               "by hidden_size / heads in the 27B shape (46 layers); this model would not run "
                               "as trained")
    # the 27B shape: hidden_size / heads (64 / 4) goes, head_dim does not
    wide = dict(BASE, model_type="gemma2", head_dim=8, num_hidden_layers=46)
    add_family_hparams(None, ModelArgs.from_hf_dict(dict(wide, query_pre_attn_scalar=16)))
    with pytest.raises(UserError, match="query_pre_attn_scalar 8: "):
        add_family_hparams(None, ModelArgs.from_hf_dict(dict(wide, query_pre_attn_scalar=8)))


def test_gguf_of_another_architecture_is_refused(tmp_path):
    import gguf

    from hivetune.model.load import load_args

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(UserError) as info:
        load_args(path)
    assert str(info.value) == (f"{path}: GGUF architecture 'falcon' is not supported "
                               "(llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3)")
