"""CPU benchmark: hivetune vs HF Trainer + PEFT on the embedded SmolLM2-135M-Instruct.

Same examples in the same order, same effective batch, same LoRA (r 16, alpha 32, 7 targets,
dropout 0), fp32 on both sides, same number of optimizer steps. Tokens/s counts real tokens
(no padding) over the steps after the first (the first step pays one-off warm-up on both sides).

    python benchmarks/cpu_vs_hf.py [--steps 12] [--batch 8] [--results benchmarks/results] [--commit C]

Prints the ratio and appends a line to benchmarks/results/smollm2-cpu.jsonl (the device,
versions and commit with the figures of both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hivetune.core.config import load_config  # noqa: E402
from hivetune.data.dataset import load_example  # noqa: E402
from hivetune.core.embedded import default_train_data, embedded_model_path  # noqa: E402
from hivetune.train.loop import fit  # noqa: E402
from hivetune.train.setup import setup  # noqa: E402
from hivetune.workflows.bench import environment  # noqa: E402
from hivetune.workflows.bench_results import append_result  # noqa: E402


def hivetune_run(steps: int, batch: int, out: Path) -> tuple[object, dict]:
    cfg = load_config(None, {"model": str(embedded_model_path()), "data": str(default_train_data()),
                             "output_dir": str(out), "precision": "fp32", "device": "cpu", "max_steps": steps,
                             "batch_size": batch, "lr": 1e-3, "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
                             "eval_prompts": 0, "max_length": 512, "warmup_steps": 1, "save_every_minutes": 0})
    run = setup(cfg)
    fit(run, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = [sum(run.data.lengths[i] for i in step) for step in run.steps]
    seconds = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]
    return run, {"tokens_per_s": sum(tokens[1:]) / seconds, "seconds_after_first_step": seconds,
                 "total_seconds": rows[-1]["elapsed_s"], "losses": [r["loss"] for r in rows],
                 "tokens": sum(tokens)}


def hf_peft_run(run, steps: int, batch: int, out: Path) -> dict:
    """The HF + PEFT baseline on exactly hivetune's examples, in hivetune's order."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    transformers.logging.set_verbosity_error()
    # HF Trainer refuses a model loaded from GGUF ("quantized ... does not support training"),
    # so hand it the same dequantised fp32 weights as a plain safetensors folder.
    from safetensors.torch import save_file

    from hivetune.model.load import load_model

    folder = out / "smollm2-fp32"
    folder.mkdir(parents=True)
    base = load_model(embedded_model_path(), dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in base.state_dict().items()
               if not (base.args.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(base.args.to_hf_dict()))
    del base
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"]))
    order = [i for step in run.steps for i in step]
    rows = []
    for i in order:
        e = load_example(run.data, i, run.tokenizer, run.cfg.max_length, False)
        rows.append({"input_ids": e.ids, "attention_mask": [1] * len(e.ids),
                     "labels": [t if m else -100 for t, m in zip(e.ids, e.mask)]})

    class Timer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter())

    class InOrder(Trainer):  # the planned order, not the Trainer's own shuffle
        def _get_train_sampler(self, *a, **kw):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    timer = Timer()
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                             max_steps=steps, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=1,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    run.tokenizer.pad_token_id = pad
    trainer = InOrder(model=model, args=args, train_dataset=rows,
                      data_collator=DataCollatorForSeq2Seq(run.tokenizer, padding=True, label_pad_token_id=-100),
                      callbacks=[timer])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    tokens = [sum(len(rows[s * batch + j]["input_ids"]) for j in range(batch)) for s in range(steps)]
    seconds = timer.times[-1] - timer.times[0]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"tokens_per_s": sum(tokens[1:]) / seconds, "seconds_after_first_step": seconds,
            "total_seconds": total, "losses": losses, "tokens": sum(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternate hivetune and HF this many times; each side's best round counts "
                             "(a shared machine's load comes and goes: alternating exposes both to it)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"),
                        help="folder of the JSONL results files")
    parser.add_argument("--commit", default="", help="the commit measured (default: git rev-parse HEAD)")
    opts = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(opts.rounds):
            load = os.getloadavg()[0]
            run, ours = hivetune_run(opts.steps, opts.batch, Path(tmp) / f"hivetune-{k}")
            ours["load_before"] = round(load, 2)
            load = os.getloadavg()[0]
            theirs = hf_peft_run(run, opts.steps, opts.batch, Path(tmp) / f"hf-{k}")
            theirs["load_before"] = round(load, 2)
            rounds.append((ours, theirs))
            print(f"round {k + 1}: hivetune {ours['tokens_per_s']:.1f} tok/s, HF+PEFT {theirs['tokens_per_s']:.1f} tok/s")
    ours = max((r[0] for r in rounds), key=lambda r: r["tokens_per_s"])
    theirs = max((r[1] for r in rounds), key=lambda r: r["tokens_per_s"])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    env = environment(torch.device("cpu"), opts.commit)
    env["cpu"] = f"CPU: {cpu}, {torch.get_num_threads()} threads"
    record = {
        "workload": "smollm2", "device": "cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "commit": env["commit"], "setting": f"fp32, {opts.steps} steps of {opts.batch}", "environment": env,
        "max_steps": opts.steps, "overrides": {},
        "hivetune": {"steps": opts.steps, "seconds": round(ours["total_seconds"], 3),
                     "seconds_after_first_step": round(ours["seconds_after_first_step"], 3),
                     "tokens_per_s": round(ours["tokens_per_s"], 1), "tokens": ours["tokens"],
                     "losses_logged": [round(x, 6) for x in ours["losses"]]},
        "baseline": {"name": "HF + PEFT", "seconds": round(theirs["total_seconds"], 3),
                     "tokens_per_s": round(theirs["tokens_per_s"], 1),
                     "measured": f"same run, steps 2-{opts.steps}"},
        "speedup_vs_baseline": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 2),  # best round against best
        "rounds": [{"hivetune_tokens_per_s": round(a["tokens_per_s"], 1), "hivetune_load_before": a["load_before"],
                    "hf_peft_tokens_per_s": round(b["tokens_per_s"], 1), "hf_peft_load_before": b["load_before"]}
                   for a, b in rounds],
    }
    path = append_result(Path(opts.results), record)
    print(f"hivetune {ours['tokens_per_s']:.1f} tok/s, HF+PEFT {theirs['tokens_per_s']:.1f} tok/s, "
          f"speedup {record['speedup_vs_baseline']:.2f}x -> {path}")


if __name__ == "__main__":
    main()
