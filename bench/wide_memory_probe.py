"""Where W1's wide layout (wide_lora) reserves its extra ~0.4 GiB (issue 3): 4.30 against 3.90 GiB
reserved at ~3.68 allocated either way (H200, 8e425e8), and under a 4 GiB cap its graph capture
ran out of memory. One W1 fit of --steps steps, as `hivetune bench W1 --memory-cap CAP` runs
it, printing the allocator's reserved and allocated bytes at each stage (after assemble, after
the empty_cache that precedes the loop, when graphs turn off, at the end) and its segments by
pool (the graphs' private pool against the ordinary one): their size, what is allocated in
them, how many; after assemble also the large segments' blocks, named by the model tensor that
starts there (segment_layout). One JSON line at the end, with the device, versions and commit.

    python bench/wide_memory_probe.py --wide true --cap 4 [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.workflows.bench import WORKLOADS, allocator_counts, environment, random_model, workload_examples  # noqa: E402
from hivetune.core.config import load_config  # noqa: E402
from hivetune.data.dataset import TokenizedExamples  # noqa: E402
from hivetune.core.device import cap_memory  # noqa: E402
from hivetune.train import replay as graphs  # noqa: E402
from hivetune.train.loop import fit  # noqa: E402
from hivetune.train.setup import assemble  # noqa: E402

GIB = 2 ** 30


def segments_by_pool() -> dict:
    """The allocator's segments grouped by pool: count, reserved and allocated GiB."""
    pools = defaultdict(lambda: {"segments": 0, "reserved_gib": 0.0, "allocated_gib": 0.0})
    for seg in torch.cuda.memory_snapshot():
        pool = str(seg.get("segment_pool_id", (0, 0)))
        entry = pools["ordinary" if pool in ("(0, 0)", "[0, 0]") else f"private {pool}"]
        entry["segments"] += 1
        entry["reserved_gib"] += seg["total_size"] / GIB
        entry["allocated_gib"] += seg["allocated_size"] / GIB
    return {k: {n: round(v, 3) if isinstance(v, float) else v for n, v in e.items()} for k, e in pools.items()}


def tensor_names(model) -> dict[int, str]:
    """The model's CUDA tensors by their storage's device address: parameter and buffer names
    first, then tensors held (up to three levels down) by plain attributes of its modules (the
    fused groups' weights and storages) and by its CastCache (lora_casts)."""
    names: dict[int, str] = {}

    def add(name, value, depth=0):
        if torch.is_tensor(value):
            if value.is_cuda:
                storage = value.untyped_storage()
                whole = storage.nbytes() > value.numel() * value.element_size()
                label = f"{name} (in {storage.nbytes() / 2**20:.1f} MiB)" if whole else name
                names.setdefault(storage.data_ptr(), label)
        elif isinstance(value, (list, tuple)) and depth < 3:
            for i, v in enumerate(value):
                add(f"{name}[{i}]", v, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module) and depth < 3:
            for attr, v in vars(value).items():
                add(f"{name}.{attr}", v, depth + 1)

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        add(name, t)
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if not attr.startswith("_"):
                add(f"{name}.{attr}", value)
    add("lora_casts", getattr(model, "lora_casts", None))
    return names


def segment_layout(model) -> list[dict]:
    """The ordinary pool's large segments (over 2 MiB): each block's size, whether it is
    allocated, and the model tensor whose storage starts there (else '?'); the free bytes in
    segments that also hold allocated blocks (what empty_cache cannot hand back)."""
    names = tensor_names(model)
    out = []
    for seg in torch.cuda.memory_snapshot():
        if str(seg.get("segment_pool_id", (0, 0))) not in ("(0, 0)", "[0, 0]") or seg["total_size"] <= 2 * 2**20:
            continue
        blocks, address = [], seg["address"]
        for b in seg["blocks"]:
            live = b["state"] == "active_allocated"
            blocks.append([round(b["size"] / 2**20, 2), names.get(address, "?") if live else "free"])
            address += b["size"]
        out.append({"mib": round(seg["total_size"] / 2**20, 1),
                    "free_mib": round((seg["total_size"] - seg["allocated_size"]) / 2**20, 1), "blocks": blocks})
    return out


def stage(stages: list, name: str) -> None:
    torch.cuda.synchronize()
    stages.append({"stage": name, "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
                   "allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
                   "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
                   "pools": segments_by_pool()})
    print(json.dumps(stages[-1]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wide", choices=("true", "false"), default="true")
    parser.add_argument("--cap", type=float, default=4.0, help="allocator cap in GiB (0: none)")
    parser.add_argument("--steps", type=int, default=40)
    opts = parser.parse_args()
    w, device = WORKLOADS["W1"], torch.device("cuda", torch.cuda.current_device())
    examples = TokenizedExamples(workload_examples(w.n_examples, w.args.vocab_size, w.cap))
    cfg = load_config(None, {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda",
                             "epochs": w.epochs, "max_steps": opts.steps, "batch_size": w.examples_per_step,
                             "lr": 2e-4, "lora": w.lora, "eval_prompts": 0, "max_length": 4096, "log_every": 50,
                             "wide_lora": opts.wide})
    model = random_model(w.args, device, torch.bfloat16)
    stages: list = []
    turned_off = graphs.GraphedForwardBackward._turn_off

    def turn_off(self, reason):  # the pools at the moment the capture failed
        stage(stages, f"graphs off: {reason[:120]}")
        turned_off(self, reason)

    graphs.GraphedForwardBackward._turn_off = turn_off
    with tempfile.TemporaryDirectory() as tmp:
        run = assemble(cfg, model, examples, None, device, "bf16", Path(tmp) / "run", Path("random"))
        del model
        stage(stages, "after assemble")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        stage(stages, "after empty_cache")
        layout = segment_layout(run.model)
        print(json.dumps({"layout_after_assemble": layout}), flush=True)
        if opts.cap:
            cap_memory(device, opts.cap)
        t0 = time.perf_counter()
        fit(run, progress=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        stage(stages, "end")
    print(json.dumps({"probe": "wide_memory", "wide": opts.wide, "cap_gib": opts.cap, "steps": opts.steps,
                      "seconds": round(seconds, 3), "peak_reserved_gib": stages[-1]["peak_reserved_gib"],
                      "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
                      "wide_groups": sum(getattr(getattr(layer.mlp, "gate_up", None), "room", 0) > 0
                                         for layer in run.model.model.layers),
                      "cuda_graphs": dict(graphs.last_stats or {}), "allocator": allocator_counts(device),
                      "stages": stages, "layout_after_assemble": layout, "environment": environment(device)}))


if __name__ == "__main__":
    main()
