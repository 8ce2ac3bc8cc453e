"""Tiny random transformers models, saved with ``save_pretrained`` and read back with
``load_model``: the builder that the family tests share (test_decoder_parity, test_families and,
through it, test_families_gguf), and the two measures they compare logits with."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM

from hivetune.model.decoder import CausalLM, KVCache
from hivetune.model.load import load_model

# (parameter name, parameter, standard normal noise of its shape) -> the parameter's new value
Redraw = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


class Family:
    """One family's tiny model: transformers' (`hf`), its save (`folder`) and ours read from it."""

    def __init__(self, name: str, hf, folder: Path, ours: CausalLM):
        self.name, self.hf, self.folder, self.ours = name, hf, folder, ours


def random_hf_model(config_cls, seed: int, redraw_seed: int, redraw: Redraw, **config):
    """config_cls(**config) as an fp32 transformers model with eager attention (built under
    torch.manual_seed(seed)), every parameter then redrawn as redraw(name, p, noise) with noise
    from a generator seeded with `redraw_seed`, in eval mode."""
    torch.manual_seed(seed)
    hf_config = config_cls(**config)
    hf_config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    g = torch.Generator().manual_seed(redraw_seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(redraw(name, p, torch.randn(p.shape, generator=g)))
    return model.eval()


def saved_family(name: str, hf, folder: Path, write_extra: Callable[[Path, str], None] | None = None) -> Family:
    """`hf` saved into `folder` (then write_extra(folder, name): a tokenizer), and read back as ours
    (fp32, CPU, eval mode)."""
    hf.save_pretrained(folder)
    if write_extra is not None:
        write_extra(folder, name)
    return Family(name, hf, folder, load_model(folder, torch.float32, "cpu").eval())


@torch.no_grad()
def our_logits(model: CausalLM, ids, position_ids=None, layout=None, cache=None) -> torch.Tensor:
    return model.logits(model(ids, position_ids=position_ids, layout=layout, cache=cache))


def decoded_logits(model: CausalLM, ids: torch.Tensor, prefill: int, max_len: int) -> tuple[torch.Tensor, KVCache]:
    """The logits of `ids` [1, T] through a KV cache of max_len (fp32, CPU): the first `prefill`
    tokens in one call, then one token a call; and the cache."""
    cache = KVCache(model.args, batch=1, max_len=max_len, device="cpu", dtype=torch.float32)
    steps = [our_logits(model, ids[:, :prefill], cache=cache)]
    steps += [our_logits(model, ids[:, t:t + 1], cache=cache) for t in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1), cache


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| relative to the largest |ref|."""
    return ((a - ref).abs().max() / ref.abs().max()).item()
