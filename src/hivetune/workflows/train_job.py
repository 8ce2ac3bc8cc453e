"""`hivetune train`: setup, fit, save; then base vs tuned on the held-out file, and summary.json."""

from __future__ import annotations

import json
import sys

from hivetune.core.config import TrainConfig
from hivetune.core.errors import UserError
from hivetune.core.fileio import atomic_write_bytes
from hivetune.data.formats import alpaca_messages, check_record, detect_format, iter_source
from hivetune.model.lora import lora_enabled
from hivetune.parallel import distributed
from hivetune.train.loop import fit
from hivetune.train.run import Run, TrainResult
from hivetune.train.setup import setup
from hivetune.workflows.eval_report import means_table
from hivetune.workflows.evaluate import heldout_ab
from hivetune.workflows.generate import generate_text
from hivetune.workflows.preference_eval import evaluate_pairs
from hivetune.workflows.report import environment


def train(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """`hivetune train`: setup, fit, save; then base vs tuned on the held-out file (heldout_eval)."""
    run = setup(cfg)
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    result = fit(run, progress)
    if run.parallel.enabled:  # rank 0 goes on alone: held-out answers, summary
        distributed.shutdown(run.parallel)
        if not run.parallel.is_main:
            return result
        if run.strategy == "fsdp":  # the sharded model cannot run on one rank
            cfg.eval_prompts = 0
    ab = heldout_eval(run)
    if ab is not None:
        result.samples = [{"question": r["question"], "reference": r["reference"], "base": r["base"]["generation"],
                           "tuned": r["tuned"]["generation"]} for r in ab["rows"][:cfg.eval_prompts]]
    else:
        result.samples = answer_heldout(run, cfg.eval_prompts, cfg.max_new_tokens)
    summary = {
        "adapter": str(result.adapter), "steps": result.steps, "final_loss": result.final_loss,
        "tokens_per_s": round(result.tokens_per_s, 1), "train_seconds": round(result.seconds, 2),
        **step_rates(run, result),
        "peak_memory_bytes": result.peak_memory_bytes, "device": str(run.device),
        "precision": run.precision, "examples": len(run.data), "data_format": run.data.format,
        "init_adapter": run.init_adapter,
        "samples": result.samples,
        "eval": None if ab is None else {"out": ab["out"], "examples": ab["examples"], "means": ab["means"],
                                         "seconds": ab["seconds"]["total"]},
        "environment": environment(str(run.device)),
    }
    atomic_write_bytes(run.folder / "summary.json", json.dumps(summary, indent=2).encode())
    return result


def step_rates(run: Run, result: TrainResult) -> dict:
    """samples/s and steps/s over the training loop's seconds (a resumed run's: all its parts)."""
    seconds = max(result.seconds, 1e-9)
    samples = sum(len(step) for step in run.steps[:result.steps])
    return {"samples_per_s": round(samples / seconds, 3), "steps_per_s": round(result.steps / seconds, 4)}


def answer_heldout(run: Run, n: int, max_new_tokens: int) -> list[dict]:
    """The first n held-out questions answered by the base (LoRA off) and the tuned model."""
    if run.val_path is None or n == 0 or run.cfg.method != "sft":  # pairs: heldout_eval scores them
        return []
    questions = []
    for _, where, _, _, record in iter_source(run.val_path):
        fmt = detect_format(record)
        check_record(record, fmt or "?", where)
        if fmt == "alpaca":
            messages = alpaca_messages(record)
        elif fmt == "chat":
            messages = record["messages"]
        else:
            continue
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        reference = next((m["content"] for m in messages[last_user:] if m["role"] == "assistant"), "")
        questions.append((messages[last_user]["content"], reference))
        if len(questions) == n:
            break
    run.model.eval()
    prompts = [q for q, _ in questions]
    with lora_enabled(run.model, False):
        base = generate_text(run.model, run.tokenizer, prompts, max_new_tokens)
    tuned = generate_text(run.model, run.tokenizer, prompts, max_new_tokens)
    return [{"question": q, "reference": r, "base": b, "tuned": t}
            for (q, r), b, t in zip(questions, base, tuned)]


def heldout_eval(run: Run) -> dict | None:
    """The end-of-run A/B: `hivetune eval` on the model still in memory, over the first
    eval_examples held-out examples, into RUN/eval/ (eval.json, eval.md); prints the means
    table. None when there is no held-out file, eval_examples or eval_prompts is 0, or the
    file has no prompt/response records (a note says so: the trained adapter is already saved)."""
    cfg = run.cfg
    if run.val_path is None or cfg.eval_examples == 0 or cfg.eval_prompts == 0:
        return None
    if cfg.method != "sft":  # preference pairs: how much more the tuned model prefers chosen (RUN/eval/)
        pairs = evaluate_pairs(run.model, run.tokenizer, run.val_path, run.folder / "eval", limit=cfg.eval_examples,
                               max_length=cfg.max_length)
        print(f"\nbase vs tuned on {pairs['pairs']} held-out pairs of {run.val_path}:\n{pairs['table']}")
        return None
    try:
        report = heldout_ab(run.model, run.tokenizer, run.val_path, run.folder / "eval", model_path=run.model_path,
                            adapter_folder=run.folder / "adapter", device=run.device, precision=run.precision,
                            max_new_tokens=cfg.max_new_tokens, limit=cfg.eval_examples, max_length=cfg.max_length)
    except UserError as e:
        print(f"note: no base vs tuned evaluation: {e}", file=sys.stderr)
        return None
    print(f"\nbase vs tuned on {report['examples']} held-out examples of {run.val_path} "
          f"({report['seconds']['total']:.0f} s; all rows in {report['out']}/eval.json):\n{means_table(report)}")
    return report
