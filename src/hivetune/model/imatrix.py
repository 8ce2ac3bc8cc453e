"""Importance matrix for llama.cpp's quantizer, measured with hivetune's own model.

For each weight llama.cpp quantizes, the mean square of each input column over calibration tokens:
what llama.cpp's ``llama-imatrix`` tool collects (its ``in_sum2 / counts``), keyed by the GGUF
tensor name. The quantizer weighs each column's rounding error by it, so the columns that carry the
largest activations on the calibration text keep the most precision. The output head's entry
is the final norm's output, as llama-imatrix records it for the output matmul: under
``token_embd.weight`` where the GGUF ties the head to the embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from hivetune.model.gguf_write import hf_to_gguf_name, model_tensors
from hivetune.model.lora import LoRALinear

TOKENS = 8192  # calibration tokens: 30 s for SmolLM2-135M in fp32 on the 2-core CPU (docs/deploy.md)


def weight_inputs(net: nn.Module) -> dict[str, list[nn.Module]]:
    """GGUF weight name -> the modules whose first input is that weight's input: each plain linear
    layer of the decoder layers, each LoRA layer and its base layer (the groups that share one
    input call the base layer alone, a layer that adds the residual in its matmul the LoRA layer
    alone)."""
    found = {}
    for name, module in net.named_modules():
        if not name.startswith("model.layers.") or name.endswith((".base_layer", ".lora_A", ".lora_B")):
            continue
        if isinstance(module, LoRALinear):
            found[hf_to_gguf_name(f"{name}.weight", net.args.model_type)] = [module, module.base_layer]
        elif isinstance(module, nn.Linear):
            found[hf_to_gguf_name(f"{name}.weight", net.args.model_type)] = [module]
    return found


@torch.no_grad()
def importance_matrix(net: nn.Module, sequences: Iterable[list[int]]) -> tuple[dict[str, np.ndarray], int]:
    """({GGUF name: float32 mean square per input column}, tokens seen) over `sequences` of token
    ids, each run alone through `net` in eval mode on its own device."""
    sums: dict[str, torch.Tensor] = {}
    seen: set[str] = set()  # the weights counted in this forward (a LoRA layer and its base see one input)
    tokens = 0

    def add(key: str, x: torch.Tensor) -> None:
        if key in seen:
            return
        seen.add(key)
        x = x.detach().float().reshape(-1, x.shape[-1])
        square = (x * x).sum(0)
        sums[key] = square if key not in sums else sums[key] + square

    hooks = [module.register_forward_pre_hook(lambda m, inputs, key=key: add(key, inputs[0]))
             for key, modules in weight_inputs(net).items() for module in modules]
    # the output head as the GGUF holds it: output.weight, or the token embeddings where tied
    untied = any(name == "lm_head.weight" for name, _, _ in model_tensors(net))
    head = "output.weight" if untied else "token_embd.weight"
    hooks.append(net.model.norm.register_forward_hook(lambda m, inputs, out: add(head, out)))
    device = next(net.parameters()).device
    was_training = net.training
    net.eval()
    try:
        for ids in sequences:
            seen.clear()
            net(torch.tensor([ids], device=device))
            tokens += len(ids)
    finally:
        for hook in hooks:
            hook.remove()
        net.train(was_training)
    return {key: (value / max(tokens, 1)).cpu().numpy().astype(np.float32) for key, value in sums.items()}, tokens

