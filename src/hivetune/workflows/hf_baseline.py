"""HF Trainer + PEFT as `hivetune bench`'s baseline: the same examples and LoRA on the same model
shape (a workload, random-init) or model folder (the user's job), trained and timed in this process.

transformers and peft load only here (hivetune[dev]); without them the baseline is one line:
`baseline_missing()` names what is absent.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import tempfile
import time
from dataclasses import dataclass, field

import torch

from hivetune.data.formats import Encoded
from hivetune.model.config import ModelArgs
from hivetune.workflows.workloads import Workload

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# base_quant -> what bitsandbytes loads the same base as (QLoRA's recipe: NF4, double-quantized
# scales, bf16 compute; int8: LLM.int8)
QUANT_BASES = {"nf4": "4-bit nf4, double quant", "int8": "8-bit LLM.int8"}
HF_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def baseline_missing(base_quant: str = "none") -> str:
    """"" where transformers and peft (and, for a quantized base, bitsandbytes) import, else the
    line saying which is missing."""
    needed = ("transformers", "peft") + (("bitsandbytes",) if base_quant in QUANT_BASES else ())
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if not missing:
        return ""
    return f"--baseline hf-peft needs {' and '.join(missing)} (pip install 'hivetune[dev]')"


@dataclass
class HFJob:
    """What the Trainer runs: examples, the LoRA and the optimizer's settings."""

    examples: list[Encoded]
    examples_per_step: int
    epochs: float
    lora: dict  # r, alpha, dropout; targets (default all 7)
    precision: str  # bf16 | fp16 | fp32
    lr: float = 2e-4
    schedule: str = "cosine"
    warmup_steps: int = -1  # -1: 3% of the steps, as hivetune's default
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    batches: list[int] = field(default_factory=lambda: [2])  # micro-batches tried, largest first
    log_losses: bool = False  # every step's loss (a host sync each step): final and per-epoch loss
    max_steps: int = 0  # > 0: stop after this many optimizer steps
    base_quant: str = "none"  # nf4 | int8: the model comes quantized by bitsandbytes (QLoRA's recipe)

    @property
    def total_steps(self) -> int:  # hivetune's plan for the same work
        return self.max_steps or max(1, int(self.epochs * len(self.examples)) // self.examples_per_step)


def random_hf_model(args: ModelArgs, device: torch.device):
    """A transformers model of this shape, random-init (the workloads'), SDPA attention."""
    import transformers  # optional dependency: the baseline only

    config = getattr(transformers, HF_CONFIGS[args.model_type])(**{
        k: v for k, v in args.to_hf_dict().items() if k not in ("architectures", "model_type", "rope_scaling")})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config)


def quantized_hf_model(build_model, device: torch.device, base_quant: str):
    """build_model()'s weights loaded again through bitsandbytes (a workload's random model is
    written to a temp folder in bf16 first, as from_pretrained quantizes on load)."""
    import transformers  # optional dependency: the baseline only

    model = build_model().to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        _release(device)
        if base_quant == "nf4":
            bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
        else:
            bnb = transformers.BitsAndBytesConfig(load_in_8bit=True)
        key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # renamed in 5
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=bnb, attn_implementation="sdpa", device_map={"": "cpu" if device.type == "cpu" else device.index or 0},
            **{key: torch.bfloat16})


def pretrained_hf_model(folder: str, device: torch.device, precision: str = "fp32"):
    """The user's HF model folder, SDPA: in bf16 for a bf16 job (as _train_once casts it), else
    fp32 (fp16 jobs keep fp32 weights under the Trainer's autocast and loss scaling)."""
    import transformers  # optional dependency: the baseline only

    transformers.utils.logging.disable_progress_bar()  # the summary lines stay readable
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # renamed in 5
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", **{key: dtype})
    return model.to(device)


def run_hf_job(build_model, job: HFJob, device: torch.device, timed_steps: int = 0, warmup_steps: int = 2) -> dict:
    """Train `job` with HF Trainer + PEFT on build_model(), trying job.batches in turn (each
    micro-batch with the gradient accumulation that makes up examples_per_step) until one fits;
    the record says which ran and which ran out of memory. timed_steps > 0: warmup_steps +
    timed_steps optimizer steps, the last timed_steps timed and extrapolated to the job's steps."""
    tried = []
    for batch in job.batches:
        setting = f"{batch} x {job.examples_per_step // batch}"
        try:
            record = _train_once(build_model, job, batch, device, timed_steps, warmup_steps)
        except torch.OutOfMemoryError:
            record = None  # released below, once the exception's frames (and their tensors) are gone
        _release(device)
        if record is not None:
            return {**record, "batches_tried": tried + [f"{setting}: ran"]}
        tried.append(f"{setting}: out of memory")
    return {"error": f"out of memory at every micro-batch tried ({', '.join(tried)})", "batches_tried": tried}


def _train_once(build_model, job: HFJob, batch: int, device: torch.device, timed_steps: int,
                warmup_steps: int) -> dict:
    # optional dependencies (hivetune[dev]), loaded only for the baseline
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.precision)
    if job.base_quant in QUANT_BASES:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(quantized_hf_model(build_model, device, job.base_quant),
                                                use_gradient_checkpointing=job.gradient_checkpointing)
    else:
        model = build_model()
        if half is torch.bfloat16:  # bf16 weights, as the workloads' figures were taken; fp16 keeps fp32 masters
            model = model.to(half)
    model = get_peft_model(model, peft_lora(job.lora))
    features = [{"input_ids": e.ids, "labels": [t if m else -100 for t, m in zip(e.ids, e.mask)]}
                for e in job.examples]
    stamps: list[float] = []
    Clock = step_clock(device, stamps)

    accum = job.examples_per_step // batch
    warmup = job.warmup_steps if job.warmup_steps >= 0 else max(1, round(0.03 * job.total_steps))
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
            num_train_epochs=job.epochs, max_steps=warmup_steps + timed_steps if timed_steps else job.max_steps or -1,
            learning_rate=job.lr, lr_scheduler_type=job.schedule, warmup_steps=warmup,
            weight_decay=job.weight_decay, max_grad_norm=job.max_grad_norm,
            bf16=half is torch.bfloat16, fp16=half is torch.float16, use_cpu=device.type != "cuda",
            gradient_checkpointing=job.gradient_checkpointing,
            logging_steps=1 if job.log_losses else 10**9, save_strategy="no", report_to=[],
            disable_tqdm=True, remove_unused_columns=False, seed=0, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=features, data_collator=collate,
                          callbacks=[Clock()])
        output, t0, seconds = timed_train(trainer, device)
        history = list(trainer.state.log_history)
    del trainer, model
    optim = getattr(args.optim, "value", args.optim)
    quant = f", bitsandbytes {QUANT_BASES[job.base_quant]}" if job.base_quant in QUANT_BASES else ""
    checkpointing = ", gradient checkpointing" if job.gradient_checkpointing else ""
    record = {"config": f"batch {batch} x accum {accum}, {job.precision}, sdpa, {optim}{quant}{checkpointing}",
              "steps_run": len(stamps), "train_loss": round(output.training_loss, 6),
              **peak_memory(device)}
    if job.log_losses:
        losses = [(h["epoch"], h["loss"]) for h in history if "loss" in h and "epoch" in h]
        record["final_loss"] = losses[-1][1] if losses else None
        record["epoch_losses"] = epoch_means([(math.ceil(e - 1e-9) - 1, v) for e, v in losses])
    mean_tokens = sum(len(e.ids) for e in job.examples) / len(job.examples)
    if timed_steps:
        timed = stamps[-1] - stamps[warmup_steps - 1] if warmup_steps else stamps[-1] - t0
        per_step = timed / timed_steps
        record.update(measured="extrapolated", timed_steps=timed_steps, seconds_per_step=round(per_step, 4),
                      seconds=round(per_step * job.total_steps, 1), extrapolated_to_steps=job.total_steps,
                      tokens_per_s=round(job.examples_per_step * mean_tokens / per_step, 1),
                      tokens_per_s_note="steps/s x examples per step x mean example length")
    else:
        record.update(measured="full", seconds=round(seconds, 3), seconds_per_step=round(seconds / len(stamps), 4),
                      tokens_per_s=round(job.examples_per_step * len(stamps) * mean_tokens / seconds, 1))
    return record


def timed_train(trainer, device: torch.device) -> tuple:
    """(trainer.train()'s output, its start, its seconds): the clock starts once the GPU is idle and
    its peak memory reset; the Trainer's printer (per-step log lines, an end-of-run dict on
    stdout) is off, the record holds the figures."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    output = trainer.train()
    return output, t0, time.perf_counter() - t0


def peft_lora(lora: dict):
    """PEFT's LoraConfig of a workload's or job's LoRA (r, alpha, dropout, targets)."""
    from peft import LoraConfig

    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=list(lora.get("targets") or TARGETS), task_type="CAUSAL_LM")


def step_clock(device: torch.device, stamps: list[float]):
    """A TrainerCallback class appending each optimizer step's end (the GPU's, on CUDA) to `stamps`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())

    return Clock


def collate(batch: list[dict]) -> dict:
    """Right-padded rows: input_ids, labels (-100 on pads and prompts), attention_mask."""
    width = max(len(f["input_ids"]) for f in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, f in enumerate(batch):
        n = len(f["input_ids"])
        ids[row, :n] = torch.tensor(f["input_ids"])
        labels[row, :n] = torch.tensor(f["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def epoch_means(losses: list[tuple[int, float]]) -> list[float]:
    """The mean loss of each epoch from (epoch index, step loss) pairs, in epoch order."""
    by_epoch: dict[int, list[float]] = {}
    for epoch, loss in losses:
        if loss is not None and math.isfinite(loss):
            by_epoch.setdefault(max(0, epoch), []).append(loss)
    return [round(sum(v) / len(v), 6) for _, v in sorted(by_epoch.items())]


def peak_memory(device: torch.device) -> dict:
    """Peak GiB the CUDA caching allocator had allocated and reserved; None off CUDA."""
    cuda = device.type == "cuda"
    return {"peak_memory_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None,
            "peak_memory_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3) if cuda else None}


def workload_job(w: Workload, device: torch.device, overrides: dict | None = None) -> HFJob:
    """A workload as HFJob: its examples and LoRA, bf16 on GPUs (fp32 on the CPU), AdamW lr 2e-4,
    cosine; micro-batches w.hf_batches (largest that fits), else the seeds' batch 2. Of hivetune's
    overrides, base_quant and gradient_checkpointing apply to the baseline too."""
    overrides = overrides or {}
    return HFJob(w.examples(), w.examples_per_step, w.epochs, dict(w.lora),
                 "bf16" if device.type == "cuda" else "fp32", batches=list(w.hf_batches or (2,)),
                 base_quant=str(overrides.get("base_quant", "none")),
                 gradient_checkpointing=bool(overrides.get("gradient_checkpointing", False)))


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
