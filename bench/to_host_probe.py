"""How long W2's adapter takes to come to the host (issue 10: the end of every fit, both sides of
the DDP ratio): lora.to_host (through a 16 MiB pinned stage; at 7077560, one copy
into a 323 MB pinned buffer) against one copy into pageable memory and a clone per tensor
(its path before session 15), three times each, after a first call of each (a pinned
allocation is in to_host's first time).

    python bench/to_host_probe.py      # prints one JSON line
"""

from __future__ import annotations

import json
import time

import torch

from hivetune.workflows.bench import WORKLOADS, environment
from hivetune.model.lora import to_host


def w2_adapter(device) -> dict[str, torch.Tensor]:
    """fp32 LoRA A and B of every W2 target (Qwen2.5-7B shape, r 32): 392 tensors, ~323 MB."""
    a = WORKLOADS["W2"].args
    kv = a.num_key_value_heads * (a.hidden_size // a.num_attention_heads)
    shapes = {"q": (a.hidden_size, a.hidden_size), "k": (kv, a.hidden_size), "v": (kv, a.hidden_size),
              "o": (a.hidden_size, a.hidden_size), "gate": (a.intermediate_size, a.hidden_size),
              "up": (a.intermediate_size, a.hidden_size), "down": (a.hidden_size, a.intermediate_size)}
    r = WORKLOADS["W2"].lora["r"]
    out = {}
    for layer in range(a.num_hidden_layers):
        for name, (n_out, n_in) in shapes.items():
            out[f"{layer}.{name}.A"] = torch.randn(r, n_in, device=device)
            out[f"{layer}.{name}.B"] = torch.randn(n_out, r, device=device)
    return out


def pageable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    flat = torch.cat([t.reshape(-1) for t in tensors.values()]).cpu()
    out, offset = {}, 0
    for key, t in tensors.items():
        out[key] = flat[offset:offset + t.numel()].view(t.shape).clone()
        offset += t.numel()
    return out


def seconds(fn, tensors) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(tensors)
    return round(time.perf_counter() - t0, 4)


def main() -> None:
    tensors = w2_adapter(torch.device("cuda"))
    mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    first = {"to_host": seconds(to_host, tensors), "pageable": seconds(pageable, tensors)}
    runs = {"to_host": [], "pageable": []}
    for _ in range(3):
        runs["to_host"].append(seconds(to_host, tensors))
        runs["pageable"].append(seconds(pageable, tensors))
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tensors": len(tensors),
                      "mb": round(mb, 1), "first_s": first, "s": runs,
                      "environment": environment(torch.device("cuda"))}))  # versions, commit


if __name__ == "__main__":
    main()
