"""TRL's DPOTrainer + PEFT as `hivetune bench PW1 --baseline trl-dpo`: the same pairs (token ids)
and LoRA on the same model shape, random-init, trained and timed in this process.

TRL's defaults (beta 0.1, sigmoid loss, max_length 1024, padded rows of prompt + answer, the
reference as the base with the adapter disabled), batch 8 pairs, bf16 on GPUs, AdamW lr 2e-4 with
cosine decay as hivetune's run. The pairs arrive tokenised (DPOTrainer's own tokenising step is
skipped: ``_prepare_dataset`` returns them as they are), so both sides train on the same ids.
trl, peft and datasets load only here (hivetune[dev]).
"""

from __future__ import annotations

import importlib.util
import tempfile

import torch

from hivetune.workflows.hf_baseline import _release, peak_memory, peft_lora, random_hf_model, step_clock, timed_train
from hivetune.workflows.workloads import Workload


def trl_missing() -> str:
    """"" where trl, peft and datasets import, else the line saying which is missing."""
    missing = [name for name in ("trl", "peft", "datasets") if importlib.util.find_spec(name) is None]
    return f"--baseline trl-dpo needs {' and '.join(missing)} (pip install 'hivetune[dev]')" if missing else ""


def id_tokenizer(vocab: int):
    """A tokenizer that only names the pad and eos ids (0, 1): DPOTrainer pads with it."""
    from tokenizers import Tokenizer, models  # with transformers: the baseline only
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   model_max_length=1 << 30)


def run_trl_dpo(w: Workload, device: torch.device, timed_steps: int = 0, warmup_steps: int = 2) -> dict:
    """Train the preference workload with DPOTrainer + PEFT; the figures as hf_baseline's records.
    timed_steps > 0: warmup_steps + timed_steps optimizer steps, the last timed_steps timed and
    extrapolated to the workload's step count."""
    return run_trl_pairs(lambda: random_hf_model(w.args, device), w.examples(), w.lora, w.epochs,
                         w.examples_per_step, device, timed_steps, warmup_steps)


def run_trl_pairs(build_model, pairs: list, lora: dict, epochs: float, pairs_per_step: int, device: torch.device,
                  timed_steps: int = 0, warmup_steps: int = 2, lr: float = 2e-4, beta: float = 0.1,
                  max_steps: int = 0) -> dict:
    """DPOTrainer + PEFT on these EncodedPairs with the model build_model() makes (a workload's
    random one, or a job's pretrained folder), `max_steps` steps (0: the epochs) unless timed_steps;
    {"error": ...} when it runs out of memory."""
    try:
        record = _train_once(build_model, pairs, lora, epochs, pairs_per_step, device, timed_steps, warmup_steps,
                             lr, beta, max_steps)
    except torch.OutOfMemoryError:
        record = None
    _release(device)
    return record or {"error": f"out of memory at batch {pairs_per_step}"}


def _train_once(build_model, pairs: list, lora: dict, epochs: float, per_step: int, device: torch.device,
                timed_steps: int, warmup_steps: int, lr: float, beta: float, max_steps: int) -> dict:
    # optional dependencies (hivetune[dev]), loaded only for the baseline
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    class PreTokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    dataset = Dataset.from_dict({"prompt_ids": [p.prompt for p in pairs], "chosen_ids": [p.chosen for p in pairs],
                                 "rejected_ids": [p.rejected for p in pairs]})
    bf16 = device.type == "cuda"
    model = build_model()
    if bf16:
        model = model.to(torch.bfloat16)
    vocab = model.config.vocab_size
    lora = peft_lora(lora)
    stamps: list[float] = []
    Clock = step_clock(device, stamps)

    total_steps = max_steps or max(1, int(epochs * len(pairs)) // per_step)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, per_device_train_batch_size=per_step, num_train_epochs=epochs,
                         max_steps=warmup_steps + timed_steps if timed_steps else max_steps or -1, learning_rate=lr,
                         beta=beta,
                         lr_scheduler_type="cosine", warmup_steps=max(1, round(0.03 * total_steps)), bf16=bf16,
                         use_cpu=device.type != "cuda", logging_steps=10**9, save_strategy="no", report_to=[],
                         disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = PreTokenized(model=model, args=args, train_dataset=dataset, processing_class=id_tokenizer(vocab),
                               peft_config=lora, callbacks=[Clock()])
        output, t0, seconds = timed_train(trainer, device)
    del trainer, model
    # a pair's tokens: prompt, chosen and rejected once each, as hivetune's tokens/s counts them; TRL runs the
    # prompt twice (once with each answer), which tokens_run_per_s counts
    tokens = sum(len(p) for p in pairs) / len(pairs)
    run_tokens = sum(len(p.prompt) * 2 + len(p.chosen) + len(p.rejected) for p in pairs) / len(pairs)
    record = {"config": f"DPOTrainer defaults, batch {per_step}, {'bf16' if bf16 else 'fp32'}",
              "steps_run": len(stamps), "train_loss": round(output.training_loss, 6), **peak_memory(device)}
    if timed_steps:
        step_s = (stamps[-1] - stamps[warmup_steps - 1] if warmup_steps else stamps[-1] - t0) / timed_steps
        record.update(measured="extrapolated", timed_steps=timed_steps, seconds_per_step=round(step_s, 4),
                      seconds=round(step_s * total_steps, 1), extrapolated_to_steps=total_steps)
    else:
        step_s = seconds / len(stamps)
        record.update(measured="full", seconds=round(seconds, 3), seconds_per_step=round(step_s, 4))
    record.update(pairs_per_s=round(per_step / step_s, 2), tokens_per_s=round(per_step * tokens / step_s, 1),
                  tokens_run_per_s=round(per_step * run_tokens / step_s, 1),
                  tokens_per_s_note="pairs/s x mean tokens of prompt + chosen + rejected (hivetune's count); "
                                    "tokens_run_per_s: prompt + chosen and prompt + rejected, as TRL runs them")
    return record
