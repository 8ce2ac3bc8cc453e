"""Time `hivetune tune` on the W1 shape on this GPU (goal: under 2 minutes).

Usage (one device call):
    python benchmarks/tune_w1.py --results "$OUT/results" --commit <short hash>

W1 (hivetune.workflows.workloads.WORKLOADS, benchmarks/README.md): Qwen2.5-0.5B's shape, 8 examples an
optimizer step, LoRA r 8 / alpha 16 / dropout 0.05 on all seven projections, bf16 on a GPU. Its
config.json goes to a temporary folder (tune reads the architecture only and trains a random-init
model). tune runs every example at one length (--length); W1's examples (workloads.workload_examples)
are 47 to 496 tokens, 199 on average, so by default each candidate trains 8 examples of the mean
length a step: W1's tokens per step. The candidates: micro-batches of 1, 2, 4, 8 examples (grad_accum
keeping 8), checkpointing off / on, flash varlen or SDPA attention; 3 steps each.

Prints tune's table and the wall seconds, and appends a line to
benchmarks/results/tune-w1-<device>.jsonl: device, versions, commit (--commit, else git), wall
seconds (tune itself, and the process from its start), the table's rows and the chosen config.
``--tiny`` swaps in a 2-layer shape: a CPU check of the script, not a measurement (its line goes
to tune-w1-tiny-<device>.jsonl).
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402


def hf_config(args) -> dict:
    """The config.json keys ModelArgs.from_hf_dict reads, for a bench ModelArgs."""
    return {"model_type": args.model_type, "architectures": ["Qwen2ForCausalLM"], "vocab_size": args.vocab_size,
            "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
            "num_hidden_layers": args.num_hidden_layers, "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": args.num_key_value_heads, "rms_norm_eps": args.rms_norm_eps,
            "rope_theta": args.rope_theta, "max_position_embeddings": args.max_position_embeddings,
            "tie_word_embeddings": args.tie_word_embeddings}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="benchmarks/results", help="folder of the JSONL results files")
    ap.add_argument("--length", type=int, default=None, help="tokens per example (default: W1's mean)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per candidate (tune's default)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    ns = ap.parse_args()

    import torch

    from hivetune.workflows.bench import environment
    from hivetune.workflows.bench_results import append_result, device_kind
    from hivetune.workflows.workloads import WORKLOADS, qwen25_shape, workload_examples
    from hivetune.core.config import load_config
    from hivetune.workflows.tune import format_tune, tune

    w = WORKLOADS["W1"]
    args = qwen25_shape(512, 64, 128, 2, 4, 2, True) if ns.tiny else w.args
    lengths = [len(e.ids) for e in workload_examples(w.n_examples, w.args.vocab_size, w.cap)]
    length = ns.length or round(statistics.mean(lengths))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, ns.commit)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "qwen2.5-0.5b-shape"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(hf_config(args), indent=2))
        cfg = load_config(None, {"model": str(model), "batch_size": w.examples_per_step, "grad_accum": 1,
                                 "precision": "bf16" if device.type == "cuda" else "fp32", "device": device.type,
                                 "max_length": max(lengths), "lora": w.lora})
        print(f"hivetune tune on the W1 shape ({'tiny stand-in' if ns.tiny else 'Qwen2.5-0.5B'}), {device.type} "
              f"{env.get('gpu') or ''}: {w.examples_per_step} examples of {length} tokens a step "
              f"(W1: {min(lengths)}-{max(lengths)}, mean {statistics.mean(lengths):.0f}), {ns.steps} steps a candidate",
              flush=True)
        t0 = time.perf_counter()
        result = tune(cfg, steps=ns.steps, length=length, out=str(Path(tmp) / "tune.yaml"))
        wall = time.perf_counter() - t0
        written = (Path(tmp) / "tune.yaml").read_text() if result.best else None
    table = format_tune(result)
    process_wall = time.perf_counter() - START
    print(table)
    print("wall per candidate (model build, warm-up, steps): " + ", ".join(
        f"{r.batch_size}x{r.grad_accum} {'ckpt' if r.gradient_checkpointing else 'plain'} {r.attention} {r.wall_seconds} s"
        for r in result.rows if r.wall_seconds is not None))
    print(f"wall: {wall:.1f} s for tune ({len(result.rows)} candidates, "
          f"{sum(r.step_seconds is not None for r in result.rows)} measured); {process_wall:.1f} s for the process "
          f"(goal: under 120 s)")

    record = {"workload": "tune-w1-tiny" if ns.tiny else "tune-w1", "device": device_kind(env.get("gpu")),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "commit": env["commit"],
              "setting": f"{ns.steps} steps a candidate, {length} tokens an example", "environment": env,
              "wall_s": round(wall, 2),
              "process_wall_s": round(process_wall, 2), "goal_s": 120, "length": length, "steps": ns.steps,
              "examples_per_step": w.examples_per_step, "lora": w.lora, "tiny": ns.tiny,
              "cap_gib": result.cap_gib, "rows": [dataclasses.asdict(r) for r in result.rows], "table": table,
              "chosen": ({**result.overrides, "attention": result.best.attention,
                          "step_seconds": result.best.step_seconds, "tokens_per_s": result.best.tokens_per_s}
                         if result.best else None),
              "tune_yaml": written}
    print(f"appended to {append_result(Path(ns.results), record)}")
    return 0 if result.best else 1


if __name__ == "__main__":
    sys.exit(main())
