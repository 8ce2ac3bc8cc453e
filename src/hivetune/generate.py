"""Greedy generation with a KV cache, batched with left padding."""

from __future__ import annotations

from pathlib import Path

import torch

from hivetune.data.formats import render_chat
from hivetune.errors import UserError
from hivetune.model.decoder import CausalLM, KVCache
from hivetune.model.tokenizer import eos_ids
from hivetune.ops.attention import Masked


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        text = render_chat(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


@torch.no_grad()
def greedy_ids(model: CausalLM, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
               pad_id: int = 0) -> list[list[int]]:
    """Greedy continuations (token ids, stop token excluded) of a batch of prompts, left-padded,
    on a KV cache. `hivetune generate`, `hivetune chat` and `hivetune eval` all decode here.

    Rows that have reached a stop token leave the batch: once at least an eighth of the live
    rows (and at least one) are done, the live rows' KV cache, mask and tokens are gathered
    into a smaller batch. A decode step's cost grows with its rows, and answers end at very
    different lengths (SmolLM2 on the shipped held-out set: 12 to 96 tokens), so without this
    the batch runs at full width until its longest answer ends. One host sync per step.
    """
    device = model.lm_head.weight.device
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((batch, width + max_new_tokens), dtype=torch.bool, device=device)
    for row, p in enumerate(prompts):  # left padding keeps every prompt's last token aligned
        ids[row, width - len(p):] = torch.tensor(p, device=device)
        valid[row, width - len(p):] = True
    cache = KVCache(model.args, batch, width + max_new_tokens, device, model.lm_head.weight.dtype)
    stop = torch.tensor(sorted(stop_ids) or [-1], device=device)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    rows = list(range(batch))  # the prompt index of each live row
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    step_ids = ids
    for _ in range(max_new_tokens):
        start, q = cache.length, step_ids.shape[1]
        total = start + q
        positions = (valid[:, :total].long().cumsum(-1) - 1).clamp(min=0)[:, start:total]
        keys = torch.arange(total, device=device)
        query_pos = (start + torch.arange(q, device=device))[:, None]
        # A pad query may see only itself: a row with no visible key would make SDPA return NaN,
        # and 0 * NaN in the next layer's attention would leak into the real tokens.
        mask = ((keys[None, :] <= query_pos)[None] & valid[:, None, :total]) | (keys[None, :] == query_pos)[None]
        hidden = model(step_ids, positions, Masked(mask[:, None]), cache)
        next_ids = model.logits(hidden[:, -1]).argmax(-1)
        done |= torch.isin(next_ids, stop)
        for row, token, finished in zip(rows, next_ids.tolist(), done.tolist()):
            if not finished:
                outputs[row].append(token)
        n_done = int(done.sum())
        if n_done == len(rows):
            break
        valid[:, total] = True
        step_ids = next_ids[:, None]
        if n_done >= max(1, len(rows) // 8):
            keep = (~done).nonzero().squeeze(1)
            rows = [rows[i] for i in keep.tolist()]
            valid, step_ids, done = valid[keep], step_ids[keep], done[keep]
            for layer in range(len(cache.k)):
                cache.k[layer] = cache.k[layer].index_select(0, keep)
                cache.v[layer] = cache.v[layer].index_select(0, keep)
    return outputs


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else 0 (pad positions are masked: any id does)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def generate_text(model: CausalLM, tokenizer, prompts: list[str], max_new_tokens: int = 128,
                  chat: bool = True, batch_size: int = 8) -> list[str]:
    stop = eos_ids(tokenizer, model.args)
    out = []
    for i in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p, chat) for p in prompts[i:i + batch_size]]
        for ids in greedy_ids(model, encoded, max_new_tokens, stop, pad_token_id(tokenizer)):
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


def load_for_generation(model: str = "", adapter: str = "", device: str = "auto", precision: str = "auto"):
    """(model, tokenizer) in eval mode: an HF folder or .gguf (default: embedded), adapter optional
    (a run folder or an adapter folder). `hivetune generate` and `hivetune chat` load with it."""
    from hivetune.device import DTYPES, resolve_device, resolve_precision
    from hivetune.embedded import embedded_model_path
    from hivetune.model.load import load_model
    from hivetune.model.lora import load_adapter
    from hivetune.model.tokenizer import load_tokenizer

    model_path = Path(model) if model else embedded_model_path()
    dev = resolve_device(device)
    dtype = DTYPES[resolve_precision(precision, dev)]
    adapter_folder = resolve_adapter_folder(adapter) if adapter else None
    tokenizer = load_tokenizer(str(model_path))
    net = load_model(model_path, dtype=dtype, device=dev)
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
