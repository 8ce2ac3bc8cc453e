"""Greedy generation with a KV cache, batched with left padding."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import yaml

from hivetune.data.formats import render_chat
from hivetune.core.errors import UserError
from hivetune.model.decoder import CausalLM, KVCache
from hivetune.model.tokenizer import eos_ids
from hivetune.ops.attention import Masked, Packed
from hivetune.workflows import decode_graph


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


@torch.no_grad()
def greedy_ids(model: CausalLM, prompts: list[list[int]], max_new_tokens: int,
               stop_ids: set[int]) -> list[list[int]]:
    """Greedy continuations (token ids, stop token excluded) of a batch of prompts on a KV cache.
    `hivetune generate`, `hivetune chat` and `hivetune eval` all decode here.

    - Prefill: the prompts go through the model packed in one row (``Packed`` with a cache), so
      no pad token is computed; each prompt's keys and values land in its own cache row, left-
      padded to the longest, so that every row's next token goes to the same cache column.
      (Left-padded prompts cost 16.2k token positions for the 10.9k tokens of 200 eval prompts.)
    - Decode: one token per live row per step; the additive mask (0 on a row's real keys, -inf
      on its left padding) is kept up to date in place, not rebuilt each step or each layer.
    - Rows that have reached a stop token leave the batch: once at least an eighth of the live
      rows (and at least one) are done, the live rows' KV cache, mask and tokens are gathered
      into a smaller batch. A decode step's cost grows with its rows, and answers end at very
      different lengths (SmolLM2 on the shipped held-out set: 12 to 96 tokens), so without this
      the batch runs at full width until its longest answer ends. One host sync per step.

    Every row's tokens are those of greedy decoding of that prompt alone, without a cache: exactly
    in fp32 (tests/workflows/test_generate.py); in bf16 a matmul's rounding may change with the number of
    rows, as in any batched decoding.
    """
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    lengths = tuple(len(p) for p in prompts)
    cache = KVCache(model.args, len(prompts), max(lengths) + max_new_tokens, device, dtype)
    packed = torch.tensor([[t for p in prompts for t in p]], device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    hidden = model(packed, positions, Packed(cu, max(lengths), lengths), cache)
    first = model.logits(hidden[0].index_select(0, (cu[1:] - 1).long())).argmax(-1)  # at each prompt's end
    return greedy_decode(model, cache, lengths, first, max_new_tokens, stop_ids)


@torch.no_grad()
def greedy_decode(model: CausalLM, cache: KVCache, lengths: tuple[int, ...], first: torch.Tensor,
                  max_new_tokens: int, stop_ids: set[int]) -> list[list[int]]:
    """The decode loop of ``greedy_ids`` after a packed prefill (on CUDA a graph replays its steps:
    workflows.decode_graph): `cache` holds prompt e's
    `lengths[e]` keys and values in row e, right-aligned at column max(lengths) = cache.length,
    and `first` [rows] the tokens its last positions chose. ``hivetune.workflows.eval_scoring`` prefills with
    its loss pass over prompt + reference (``KVCache.prefix``) and decodes from there."""
    if decode_graph.usable(model, cache, max_new_tokens):
        return decode_graph.decode(model, cache, lengths, first, max_new_tokens, stop_ids)
    device, dtype = first.device, cache.k[0].dtype
    batch, width = len(lengths), max(lengths)
    # bias[row, column]: 0 where the row has a real token, -inf on its left padding
    bias = torch.zeros((batch, cache.k[0].shape[2]), dtype=dtype, device=device)
    for row, n in enumerate(lengths):
        bias[row, :width - n] = float("-inf")
    position = torch.tensor(lengths, device=device)  # the position of each row's next token
    stop = torch.tensor(sorted(stop_ids) or [-1], device=device)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    rows = list(range(batch))  # the prompt index of each live row
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    next_ids = first
    for step in range(max_new_tokens):
        if step:  # step 0's tokens came from the prefill
            total = cache.length + 1
            hidden = model(next_ids[:, None], position[:, None], Masked(bias[:, None, None, :total]), cache)
            next_ids = model.logits(hidden[:, -1]).argmax(-1)
            position += 1
        done |= torch.isin(next_ids, stop)
        for row, token, finished in zip(rows, next_ids.tolist(), done.tolist()):
            if not finished:
                outputs[row].append(token)
        n_done = int(done.sum())
        if n_done == len(rows):
            break
        if n_done >= max(1, len(rows) // 8):
            keep = (~done).nonzero().squeeze(1)
            rows = [rows[i] for i in keep.tolist()]
            bias, next_ids, position, done = bias[keep], next_ids[keep], position[keep], done[keep]
            for layer in range(len(cache.k)):
                cache.k[layer] = cache.k[layer].index_select(0, keep)
                cache.v[layer] = cache.v[layer].index_select(0, keep)
    return outputs


def generate_text(model: CausalLM, tokenizer, prompts: list[str], max_new_tokens: int = 128,
                  chat: bool = True, batch_size: int = 8) -> list[str]:
    stop = eos_ids(tokenizer, model.args)
    out = []
    for i in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p, chat) for p in prompts[i:i + batch_size]]
        for ids in greedy_ids(model, encoded, max_new_tokens, stop):
            out.append(tokenizer.decode(ids, skip_special_tokens=True).strip())
    return out


def resolve_adapter_folder(path: str | Path) -> Path:
    """A run folder (its adapter/ subfolder) or an adapter folder itself."""
    path = Path(path)
    if (path / "adapter" / "adapter_config.json").exists():
        return path / "adapter"
    if (path / "adapter_config.json").exists():
        return path
    if not path.exists():
        raise UserError(f"{path}: adapter or run folder not found")
    raise UserError(f"{path}: no finished adapter (adapter_config.json) in this folder")


def run_base_quant(adapter: Path) -> str:
    """base_quant of the run that wrote `adapter` (RUN/adapter beside RUN/config.yaml): the base
    its LoRA trained on; none for an adapter folder alone."""
    from hivetune.core.config import adapter_run_config

    config = adapter_run_config(adapter)
    if config is None:
        return "none"
    try:
        values = yaml.safe_load(config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "none"
    quant = values.get("base_quant", "none") if isinstance(values, dict) else "none"
    return quant if quant in ("nf4", "int8", "keep") else "none"


def trained_base_quant(adapter: Path | None, model_path: Path) -> str:
    """The base_quant to load `model_path` with for `adapter`: its run's (run_base_quant), but
    keep only on a .gguf."""
    quant = run_base_quant(adapter) if adapter is not None else "none"
    return "none" if quant == "keep" and not str(model_path).lower().endswith(".gguf") else quant


def load_for_generation(model: str = "", adapter: str = "", device: str = "auto", precision: str = "auto"):
    """(model, tokenizer) in eval mode: an HF folder or .gguf (default: embedded), adapter optional
    (a run folder or an adapter folder). `hivetune generate` and `hivetune chat` load with it."""
    from hivetune.core.device import DTYPES, resolve_device, resolve_precision
    from hivetune.core.hub import model_path as hub_model_path
    from hivetune.model.load import load_model
    from hivetune.model.lora import load_adapter
    from hivetune.model.tokenizer import load_tokenizer

    model_path = hub_model_path(model)
    dev = resolve_device(device)
    dtype = DTYPES[resolve_precision(precision, dev)]
    adapter_folder = resolve_adapter_folder(adapter) if adapter else None
    tokenizer = load_tokenizer(str(model_path))
    # the base the adapter trained on: quantized as in training
    net = load_model(model_path, dtype=dtype, device=dev, base_quant=trained_base_quant(adapter_folder, model_path))
    if adapter_folder is not None:
        load_adapter(net, adapter_folder, param_dtype=dtype)
    return net.eval(), tokenizer


def generate(model: str = "", prompt: str = "", adapter: str = "", max_new_tokens: int = 128,
             chat: bool = True, device: str = "auto", precision: str = "auto") -> str:
    """`hivetune generate`: load the model (and adapter), answer one prompt greedily."""
    if not prompt:
        raise UserError("generate: give a prompt")
    net, tokenizer = load_for_generation(model, adapter, device, precision)
    return generate_text(net, tokenizer, [prompt], max_new_tokens, chat)[0]
