"""Scoring through llama.cpp: the version as it is served, a .gguf base (its own quant blocks) with
the LoRA GGUF that `llama-server --lora` loads, not hivetune's decoder on the dequantized weights.

`hivetune eval --candidate A --against B --engine llama.cpp` (and `hivetune cycle` on a .gguf base,
where llama-cpp-python is installed) scores each side with llama-cpp-python in this process:

- response loss: the example's prompt + reference evaluated once with every position's logits
  (``logits_all``); the loss of each response token from the logits of the position before it, in
  float64, summed as eval_scoring does for hivetune's decoder.
- greedy answer: llama.cpp's own sampling at top-k 1 from the prompt (the loss pass's KV cache is
  reused for the prompt, llama-cpp-python's longest-prefix match), up to max_new_tokens or an
  end-of-generation token.

The token ids are hivetune's (the tokenizer decoded from the same GGUF), so both engines score the
same sequences. The rows are eval_scoring.score_rows', so compare.json means the same either way.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from hivetune.core.errors import UserError
from hivetune.core.versions import LLAMA_CPP_INSTALL
from hivetune.workflows.eval_examples import EvalExample
from hivetune.workflows.eval_scoring import score_rows

ENGINES = ("hivetune", "llama.cpp")


def side_lora_gguf(adapter: Path, fresh: Path) -> Path:
    """The LoRA GGUF of an adapter: a registry version's lora-adapter.gguf (written with its adapter
    and never changed after), else one written to `fresh` from the adapter itself."""
    from hivetune.workflows.registry import LORA_GGUF, write_lora_gguf

    beside = adapter.parent / LORA_GGUF
    if beside.is_file() and adapter.parent.parent.name == "versions":
        return beside
    return write_lora_gguf(adapter, fresh)


def open_llama(model: Path, lora: Path | None, n_ctx: int):
    """llama_cpp.Llama of the .gguf `model` with the LoRA GGUF `lora`, every position's logits kept."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError(f"--engine llama.cpp: {LLAMA_CPP_INSTALL}") from None
    # every core: the eval runs alone (the cycle waits for it); on the 2-core CPU 20 held-out
    # examples of SmolLM2 (loss pass and 64-token answers) take 24.2 s on 2 threads, 41.3 s on 1
    threads = os.cpu_count() or 1
    try:
        llm = llama_cpp.Llama(model_path=str(model), lora_path=str(lora) if lora else None, n_ctx=n_ctx,
                              n_batch=min(n_ctx, 512), n_threads=threads, n_threads_batch=threads,
                              logits_all=True, verbose=False)
    except (ValueError, RuntimeError) as e:
        raise UserError(f"{lora or model}: llama.cpp cannot load it ({e})") from None
    if lora is not None and not getattr(llm, "_lora_adapter", None):  # see serve_engine.LlamaBackend
        llm.close()
        raise UserError(f"{lora}: llama.cpp refused this LoRA for the base {model.name} (another base's?)")
    return llm


def response_loss(llm, ids: list[int], mask: list[bool]) -> tuple[float, int]:
    """(summed loss of the masked tokens, their count) of one sequence under llm."""
    llm.reset()
    llm.eval(ids)
    targets = [t for t in range(1, len(ids)) if mask[t]]
    if not targets:
        return 0.0, 0
    logits = np.asarray(llm.scores[[t - 1 for t in targets]], dtype=np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_z = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
    picked = logits[np.arange(len(targets)), [ids[t] for t in targets]]
    return float((log_z - picked).sum()), len(targets)


def greedy_answer(llm, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if token in stop_ids:
            break
        out.append(int(token))
        if len(out) >= max_new_tokens:
            break
    return out


def losses_and_answers(model: Path, lora: Path | None, examples: list[EvalExample], max_new_tokens: int,
                       stop_ids: set[int]) -> tuple[list[tuple[float, int]], list[list[int]]]:
    """Each example's (summed response loss, token count) and greedy answer, by llama.cpp on
    `model` (+ `lora`)."""
    n_ctx = max(max(len(e.encoded.ids) for e in examples), max(len(e.prompt_ids) for e in examples) + max_new_tokens)
    llm = open_llama(model, lora, n_ctx + 8)
    try:
        losses = [response_loss(llm, e.encoded.ids, e.encoded.mask) for e in examples]
        answers = [greedy_answer(llm, e.prompt_ids, max_new_tokens, stop_ids) for e in examples]
    finally:
        llm.close()
    return losses, answers


def score_llama(model: Path, lora: Path | None, tokenizer, examples: list[EvalExample], max_new_tokens: int,
                stop_ids: set[int]) -> list[dict]:
    """eval_scoring.score_model's rows, computed by llama.cpp on `model` (+ `lora`)."""
    if not examples:
        return []
    losses, answers = losses_and_answers(model, lora, examples, max_new_tokens, stop_ids)
    return score_rows(tokenizer, examples, losses, answers)


def score_sides_llama(sides, sets: dict[str, Path], max_new_tokens: int, limit: int,
                      max_length: int) -> tuple[dict, dict]:
    """compare.score_sides for --engine llama.cpp: each side a .gguf (a base, or an adapter's
    .gguf base with its LoRA GGUF)."""
    from hivetune.model.load import load_args
    from hivetune.model.tokenizer import eos_ids, load_tokenizer
    from hivetune.workflows.eval_examples import read_examples

    for side in sides:
        if side.model.suffix.lower() != ".gguf":
            raise UserError(f"{side.flag} {side.arg}: --engine llama.cpp scores .gguf models (this side loads "
                            f"{side.model}); use --engine hivetune")
    rows: dict[str, dict] = {"candidate": {}, "against": {}}
    tokenizer = load_tokenizer(sides[0].model)
    examples = {name: read_examples(path, tokenizer, max_length, limit) for name, path in sets.items()}
    stop = eos_ids(tokenizer, load_args(sides[0].model))
    with tempfile.TemporaryDirectory(prefix="hivetune-eval-") as scratch:
        for role, side in zip(("candidate", "against"), sides):
            lora = side_lora_gguf(side.adapter, Path(scratch) / f"{role}.gguf") if side.kind == "adapter" else None
            for name in sets:
                rows[role][name] = score_llama(side.model, lora, tokenizer, examples[name], max_new_tokens, stop)
    return rows, examples
