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
    """Greedy continuations (token ids, stop token excluded) for a batch of prompts."""
    device = model.lm_head.weight.device
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((batch, width + max_new_tokens), dtype=torch.bool, device=device)
    for row, p in enumerate(prompts):  # left padding keeps every prompt's last token aligned
        ids[row, width - len(p):] = torch.tensor(p, device=device)
        valid[row, width - len(p):] = True
    cache = KVCache(model.args, batch, width + max_new_tokens, device, model.lm_head.weight.dtype)
    outputs = [[] for _ in range(batch)]
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
        for row in range(batch):
            if not done[row]:
                token = int(next_ids[row])
                if token in stop_ids:
                    done[row] = True
                else:
                    outputs[row].append(token)
        if bool(done.all()):
            break
        valid[:, total] = True
        step_ids = next_ids[:, None]
    return outputs


def generate_text(model: CausalLM, tokenizer, prompts: list[str], max_new_tokens: int = 128,
                  chat: bool = True, batch_size: int = 8) -> list[str]:
    stop = eos_ids(tokenizer, model.args)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    for i in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p, chat) for p in prompts[i:i + batch_size]]
        for ids in greedy_ids(model, encoded, max_new_tokens, stop, pad):
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


def generate(model: str = "", prompt: str = "", adapter: str = "", max_new_tokens: int = 128,
             chat: bool = True, device: str = "auto", precision: str = "auto") -> str:
    """`hivetune generate`: load the model (and adapter), answer one prompt greedily."""
    from hivetune.device import DTYPES, resolve_device, resolve_precision
    from hivetune.embedded import embedded_model_path
    from hivetune.model.load import load_model
    from hivetune.model.lora import load_adapter
    from hivetune.model.tokenizer import load_tokenizer

    if not prompt:
        raise UserError("generate: give a prompt")
    model_path = Path(model) if model else embedded_model_path()
    dev = resolve_device(device)
    dtype = DTYPES[resolve_precision(precision, dev)]
    adapter_folder = resolve_adapter_folder(adapter) if adapter else None
    tokenizer = load_tokenizer(str(model_path))
    net = load_model(model_path, dtype=dtype, device=dev)
    if adapter_folder is not None:
        load_adapter(net, adapter_folder, param_dtype=dtype)
    net.eval()
    return generate_text(net, tokenizer, [prompt], max_new_tokens, chat)[0]
