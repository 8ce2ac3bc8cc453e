"""`hivetune eval`: the base model (LoRA off) against the tuned one (adapter on) on held-out data.

For each prompt/response example, and for each of base and tuned:
- response loss: summed -log p over the response tokens / their count, with training's own
  encoding and mask (``encode_record``) and loss op (``target_loss_sum``); the mean over the
  file is token-weighted, sum(loss sums) / sum(token counts), and perplexity = exp(mean loss);
- a greedy answer (KV cache, left-padded batches of prompts of similar length), scored
  against the reference by exact match, token F1 and ROUGE-L (all on SQuAD-normalised
  whitespace tokens), and by a command hit (``command_hit``).

Results go to ``eval.json`` (every row and the means) and ``eval.md`` (the means, base vs tuned,
and a few examples side by side), by default in the run folder's ``eval/``.

This module holds the command: its arguments checked, the base and adapter found and loaded,
and ``heldout_ab``, the same eval on the model still in memory at the end of `hivetune train`.
The parts live beside it: ``eval_examples`` (reading and encoding the held-out records),
``eval_scoring`` (the model passes and each example's row), ``eval_metrics`` (the text scores
and their means) and ``eval_report`` (eval.json and eval.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hivetune.core.errors import UserError
from hivetune.data.sources import held_out_source
from hivetune.model.decoder import CausalLM
from hivetune.workflows.eval_examples import read_examples
from hivetune.workflows.eval_report import write_eval
from hivetune.workflows.eval_scoring import score_base_and_tuned
from hivetune.workflows.generate import resolve_adapter_folder, trained_base_quant


def default_out_dir(adapter_arg: str | Path, adapter_folder: Path) -> Path:
    """RUN/eval for a run folder (or its adapter/ folder); ADAPTER/eval for any other adapter
    folder (a checkpoint's step-N/, say), so results sit beside what they measured."""
    if Path(adapter_arg).resolve() != adapter_folder.resolve() or adapter_folder.name == "adapter":
        return adapter_folder.parent / "eval"
    return adapter_folder / "eval"


DEFAULT_MAX_NEW_TOKENS = 96


def run_max_new_tokens(adapter_folder: Path) -> int:
    """The max_new_tokens of the run the adapter belongs to (RUN/config.yaml beside RUN/adapter),
    so that `hivetune eval --adapter RUN` answers as long as the run's own A/B did (64 in the
    default job); DEFAULT_MAX_NEW_TOKENS for any other adapter folder."""
    from hivetune.core.config import adapter_run_config, read_yaml

    config = adapter_run_config(adapter_folder)
    if config is None:
        return DEFAULT_MAX_NEW_TOKENS
    value = read_yaml(config).get("max_new_tokens")
    return value if isinstance(value, int) and value > 0 else DEFAULT_MAX_NEW_TOKENS


def base_model_path(model: str, adapter_folder: Path) -> Path:
    """--model, else the base the adapter names (base_model_name_or_path), else the embedded model."""
    from hivetune.core.hub import model_path, split_hub_id

    if model:
        return model_path(model)
    config = adapter_folder / "adapter_config.json"
    try:
        named = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{config}: unreadable adapter config ({e})") from None
    if named and not Path(named).exists() and split_hub_id(named) is None:
        raise UserError(f"{config}: base model {named} not found; pass --model PATH")
    return model_path(named)


def evaluate(model: str = "", adapter: str = "", data: str = "", max_new_tokens: int = 0, limit: int = 0,
             out: str = "", force: bool = False, batch_size: int = 96, max_length: int = 1024,
             device: str = "auto", precision: str = "auto", report_examples: int = 3) -> dict:
    """`hivetune eval`: score base and tuned on `data`; write eval.json and eval.md; return the
    eval.json content. max_new_tokens 0: the run's (``run_max_new_tokens``). Everything is
    checked before a weight is loaded."""
    from hivetune.core.device import DTYPES, resolve_device, resolve_precision
    from hivetune.core.embedded import default_heldout_data
    from hivetune.model.load import load_model
    from hivetune.model.lora import fuse_projections, load_adapter
    from hivetune.model.tokenizer import load_tokenizer
    from hivetune.workflows.preference_eval import evaluate_pairs, is_pair_source

    for name, value, low in (("max_new_tokens", max_new_tokens, 0), ("limit", limit, 0),
                             ("batch_size", batch_size, 1), ("max_length", max_length, 2)):
        if value < low:
            raise UserError(f"--{name.replace('_', '-')}: must be >= {low}, got {value}")
    if not adapter:
        raise UserError("eval: give --adapter RUN (a run folder or an adapter folder)")
    t_start = time.perf_counter()
    adapter_folder = resolve_adapter_folder(adapter)
    max_new_tokens = max_new_tokens or run_max_new_tokens(adapter_folder)
    model_path = base_model_path(model, adapter_folder)
    data_path = held_out_source(data) if data else default_heldout_data()  # a file, folder or Hub dataset
    out_dir = Path(out) if out else default_out_dir(adapter, adapter_folder)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out: {out_dir} is a file, expected a folder")
    existing = [p.name for p in (out_dir / "eval.json", out_dir / "eval.md") if p.exists()]
    if existing and not force:
        raise UserError(f"--out: {out_dir} already holds {' and '.join(existing)}; pass --force to overwrite")
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    tokenizer = load_tokenizer(str(model_path))
    pairs = is_pair_source(data_path)  # preference pairs: workflows.preference_eval scores them
    examples = [] if pairs else read_examples(data_path, tokenizer, max_length, limit)

    quant = trained_base_quant(adapter_folder, model_path)  # the base the adapter trained on
    net = load_model(model_path, dtype=DTYPES[prec], device=dev, base_quant=quant)
    load_adapter(net, adapter_folder, param_dtype=DTYPES[prec])
    # q/k/v and gate/up as one matmul each (base off, or merged: both plain linears): SmolLM2's
    # five projections, bf16 on the 2-core CPU, 1.09 -> 0.96 ms at 67 rows, 24.9 -> 21.4 at 4,000.
    if quant == "none":
        fuse_projections(net)
    load_seconds = time.perf_counter() - t_start
    if pairs:
        return evaluate_pairs(net, tokenizer, data_path, out_dir, limit=limit, batch_size=batch_size,
                              max_length=max_length, header={"model": str(model_path), "adapter": str(adapter_folder)})
    report = score_base_and_tuned(net, tokenizer, examples, max_new_tokens, batch_size)
    report["seconds"] = {"load": round(load_seconds, 2), **report["seconds"],
                         "total": round(time.perf_counter() - t_start, 2)}
    report = {"model": str(model_path), "adapter": str(adapter_folder), "data": str(data_path), "device": str(dev),
              "precision": prec, "max_new_tokens": max_new_tokens, "max_length": max_length,
              "batch_size": batch_size, **report}
    write_eval(report, out_dir, report_examples)
    report["out"] = str(out_dir)
    return report


def heldout_ab(net: CausalLM, tokenizer, data_path: Path, out_dir: Path, *, model_path: Path, adapter_folder: Path,
               device: torch.device, precision: str, max_new_tokens: int = 96, limit: int = 200,
               batch_size: int = 96, max_length: int = 1024) -> dict:
    """The end of `hivetune train`: `hivetune eval` on the model still in memory (no reload),
    into out_dir (RUN/eval). The LoRA weights are cast to the base's dtype first, as
    `hivetune eval` loads them, so both give the same numbers for the same run."""
    from hivetune.model.lora import lora_modules

    t_start = time.perf_counter()
    dtype = net.lm_head.weight.dtype
    for _, module in lora_modules(net):
        module.lora_A.to(dtype)
        module.lora_B.to(dtype)
    examples = read_examples(data_path, tokenizer, max_length, limit)
    report = score_base_and_tuned(net, tokenizer, examples, max_new_tokens, batch_size)
    report["seconds"]["total"] = round(time.perf_counter() - t_start, 2)
    report = {"model": str(model_path), "adapter": str(adapter_folder), "data": str(data_path), "device": str(device),
              "precision": precision, "max_new_tokens": max_new_tokens, "max_length": max_length,
              "batch_size": batch_size, **report}
    write_eval(report, out_dir)
    report["out"] = str(out_dir)
    return report
