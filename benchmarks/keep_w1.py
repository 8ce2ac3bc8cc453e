"""Time W1 on a base kept as GGUF blocks (base_quant keep) against W1 on its bf16 base, in one process.

Usage (one device call):
    python benchmarks/keep_w1.py --results "$OUT/results" --commit <short hash>

W1 (hivetune.workflows.workloads.WORKLOADS, benchmarks/README.md): Qwen2.5-0.5B's shape, 3 epochs of
1,500 examples, 8 a step, LoRA r 8 on the seven projections. Three settings, each the whole workload
timed by workflows.bench.run_hivetune (the clock covers the training loop only):

    bf16           W1 as `hivetune bench W1` runs it (random_model; q/k/v and gate/up joined)
    Q8_0           every decoder linear of the same random model as Q8_0 blocks
    Q4_K_M mix     llama.cpp's Q4_K_M choice, simplified: Q4_K, with Q6_K for attn_v and ffn_down of
                   the layers llama.cpp's use_more_bits picks (the first and last eighth, every third
                   between: 12 of W1's 24); a type whose 256-weight super-blocks do not divide the
                   in-features (W1's hidden 896) falls back as llama.cpp does: Q4_K -> Q5_0, Q6_K ->
                   Q8_0. W1: q/k/o/gate/up Q5_0, v Q5_0 or Q8_0, down (in 4864) Q4_K or Q6_K.

The blocks are made in memory from the random model's weights (gguf.quants for Q5_0 / Q8_0,
ops.gguf_quantize for Q4_K / Q6_K), outside the clock; embeddings, LM head and norms stay dense.
A kept base runs q/k/v and gate/up layer by layer (train.setup), each matmul dequantizing its
weight (ops.gguf_blocks' Triton kernel on a GPU). The config says base_quant none (keep needs a
.gguf path): the planner counts a dense base, which changes nothing on a card W1 fits on.

Appends one line per setting to <results>/W1-<device>.jsonl (bench_results.append_result), the
kept ones with "ratio_vs_bf16" (their seconds over the bf16 run's). --max-steps N: N optimizer
steps each (a check, not the workload). --tiny: a 4-layer stand-in (hidden 96, intermediate 256,
vocab 4096, 64 examples), a CPU check of the script; its lines go to W1-tiny-<device>.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14
FALLBACK = {Q4_K: Q5_0, Q6_K: Q8_0}  # llama.cpp's, where in-features % 256 != 0


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in its _M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layer: int, layers: int, in_features: int) -> int:
    """The ggml type of decoder linear `name` (q_proj ... down_proj) in the Q4_K_M-like mix."""
    qtype = Q6_K if name in ("v_proj", "down_proj") and use_more_bits(layer, layers) else Q4_K
    return FALLBACK[qtype] if in_features % 256 else qtype


def all_q8_0(name: str, layer: int, layers: int, in_features: int) -> int:
    return Q8_0


def kept_model(args, device, dtype, choose) -> tuple:
    """random_model's W1 (the bf16 run's weights), its decoder linears replaced by QuantLinears
    holding the blocks `choose(name, layer, layers, in_features)` picks; returns (model, facts)."""
    import torch

    from hivetune.model.quant import GGUFBlocks, QuantLinear, quantizes
    from hivetune.ops import gguf_blocks, gguf_quantize
    from hivetune.workflows.workloads import random_model

    t0 = time.perf_counter()
    model = random_model(args, device, dtype)
    counts: Counter = Counter()
    kept_bytes = dense_weights = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or not quantizes(f"{name}.weight"):
            continue
        layer, short = int(name.split(".")[2]), name.rpartition(".")[2]
        qtype = choose(short, layer, args.num_hidden_layers, module.in_features)
        raw = gguf_quantize.quantize(module.weight.detach().float().cpu().numpy(), qtype)
        blocks = GGUFBlocks(torch.from_numpy(raw).to(device), qtype, tuple(module.weight.shape))
        parent, _, _ = name.rpartition(".")
        setattr(model.get_submodule(parent), short, QuantLinear.kept(blocks, module.bias))
        counts[gguf_blocks.BLOCK_TYPES[qtype][0]] += 1
        kept_bytes += raw.nbytes
        dense_weights += module.weight.numel()
    facts = {"types": dict(sorted(counts.items())), "kept_bytes": kept_bytes,
             "bits_per_weight": round(8 * kept_bytes / dense_weights, 3),
             "build_s": round(time.perf_counter() - t0, 2)}
    return model, facts


SETTINGS = {"Q8_0": ("base_quant keep: Q8_0 blocks", all_q8_0),
            "Q4_K_M": ("base_quant keep: Q4_K_M-like mix (Q4_K/Q6_K, Q5_0/Q8_0 where 256 does not divide)",
                       q4_k_m_type)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    ap.add_argument("--max-steps", type=int, default=0, help="optimizer steps each (0: the whole workload)")
    ap.add_argument("--settings", default="bf16,Q8_0,Q4_K_M", help="which to run, comma-separated")
    ap.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)

    import torch

    from hivetune.core.device import DTYPES
    from hivetune.workflows.bench import environment, run_hivetune
    from hivetune.workflows.bench_results import append_result, device_kind
    from hivetune.workflows.workloads import WORKLOADS, qwen25_shape

    w = WORKLOADS["W1"]
    if ns.tiny:
        w = dataclasses.replace(w, name="W1-tiny", args=qwen25_shape(4096, 96, 256, 4, 4, 2, True),
                                n_examples=64)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES["bf16" if device.type == "cuda" else "fp32"]
    env = environment(device, ns.commit)
    bf16_seconds = None
    for setting in ns.settings.split(","):
        base = None
        if setting == "bf16":
            text, model = f"base_quant none: dense {'bf16' if device.type == 'cuda' else 'fp32'} base", None
        elif setting in SETTINGS:
            text, choose = SETTINGS[setting]
            model, base = kept_model(w.args, device, dtype, choose)
        else:
            ap.error(f"--settings: unknown {setting!r} (bf16, {', '.join(SETTINGS)})")
        figures = run_hivetune(w, device, max_steps=ns.max_steps, model=model)
        record = {"workload": w.name, "device": device_kind(env["gpu"]),
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": env["commit"],
                  "setting": text + (f"; max_steps {ns.max_steps}" if ns.max_steps else ""), "environment": env,
                  "max_steps": ns.max_steps, "overrides": {}, "hivetune": figures}
        if base is not None:
            record["kept_base"] = base
            if bf16_seconds:
                record["ratio_vs_bf16"] = round(figures["seconds"] / bf16_seconds, 3)
        else:
            bf16_seconds = figures["seconds"]
        path = append_result(Path(ns.results), record)
        print(f"{text}: {figures['steps']} steps in {figures['seconds']} s, {figures['tokens_per_s']} tokens/s, "
              f"final loss {figures['final_loss']}" + (f", {base}" if base else "")
              + (f", {record['ratio_vs_bf16']} x bf16's time" if "ratio_vs_bf16" in record else "")
              + f" -> {path}", flush=True)
        del model, figures
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
