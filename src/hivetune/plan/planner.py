"""`hivetune plan`: will this training config fit on that GPU, and how long will it take?

Reads the architecture only (config.json or GGUF metadata, no weights) and, when given, the
dataset's token lengths; everything else comes from plan/memory.py and plan/timing.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hivetune.core.config import TrainConfig, step_order
from hivetune.core.device import FP16_NO_GRAPHS, auto_gpu_precision, device_auto_precision
from hivetune.core.embedded import DEFAULT_DATA_DIR, default_train_data
from hivetune.core.hub import model_path as hub_model_path
from hivetune.core.errors import UserError
from hivetune.core.fallbacks import forced
from hivetune.core.fileio import atomic_write_with
from hivetune.data import shares
from hivetune.data.dataset import index_dataset
from hivetune.data.pairs import PAIR_FILES, index_pairs
from hivetune.data.sources import train_source
from hivetune.data.step_plan import data_plan
from hivetune.model.config import ModelArgs, checkpointed_count
from hivetune.model.load import GGUF_DENSE_TYPES, gguf_to_hf_name, is_gguf, load_args, open_gguf
from hivetune.model.quant import linear_shapes, quantizes
from hivetune.model.tokenizer import load_tokenizer
from hivetune.ops import attention, triton_util
from hivetune.ops.lora_group import fused_lora_usable
from hivetune.plan.gpus import GPU, find_gpu, gpu_for_device_name
from hivetune.plan.graph_sizes import bucket_tokens, launch_bound
from hivetune.plan.memory import (GIB, MemoryConfig, breakdown, keep_inputs_extra_bytes, largest_micro_batch,
                                  lora_parameter_count, base_parameter_count, quantized_base_change,
                                  resolve_keep_inputs)
from hivetune.plan.timing import REFERENCE_PASS, micro_batch_seconds

SCALING_EXAMPLES = (10_000, 50_000, 100_000)


@dataclass
class Plan:
    model: str
    gpu: str
    memory_gib: float
    precision: str
    batch_size: int
    grad_accum: int
    max_length: int
    gradient_checkpointing: bool
    lora_r: int
    lora_targets: list[str]
    packing: bool
    cuda_graphs: bool
    base_parameters: int
    lora_parameters: int
    micro_batch_tokens: int  # the largest micro-batch the run meets (what the peak is for)
    parts_gib: dict  # breakdown of the predicted peak
    activations_gib: dict  # {"checkpointing off": ..., "checkpointing on": ...} for this micro-batch
    peak_gib: float
    fits: bool
    largest_micro_batch_tokens: int  # with this config's checkpointing setting
    largest_micro_batch_tokens_checkpointing: int
    suggestion: str
    tokens_source: str  # "data FILE" or "max_length"
    examples: int | None = None
    tokens_per_epoch: int | None = None
    step_seconds: float | None = None
    epoch_seconds: float | None = None
    scaling: list[dict] = field(default_factory=list)  # examples, tokens, steps, seconds per epoch
    notes: list[str] = field(default_factory=list)
    activation_offload: int = 0  # decoder layers whose saved activations wait in host memory
    host_gib: dict = field(default_factory=dict)  # host memory the run holds (not GPU memory)


def memory_config(cfg: TrainConfig, precision: str, checkpointing: bool, cuda: bool = True,
                  graphs: bool = False, args: ModelArgs | None = None, tokens: int = 0,
                  memory_bytes: int = 0) -> MemoryConfig:
    """`args` and `tokens` (the largest micro-batch), `memory_bytes` (the device's): resolve
    lora_inputs auto as train does; without args and tokens auto counts as recompute."""
    fn, _, has_gqa = attention._varlen_fn()
    varlen = (cuda and precision != "fp32" and cfg.packing and fn is not None
              and cfg.attention != "sdpa")
    path = training_path(precision, cuda, cfg.distributed, cfg.fused_ops)
    mc = MemoryConfig(precision=precision, r=cfg.lora.r, targets=tuple(cfg.lora.targets), dropout=cfg.lora.dropout,
                      gradient_checkpointing=checkpointing, checkpoint_layers=getattr(cfg, "checkpoint_layers", 0),
                      fused_loss=cfg.fused_loss, packing=cfg.packing,
                      attention="varlen" if varlen else "sdpa", gqa_native=has_gqa,
                      mask_bytes=1 if cuda else (4 if precision == "fp32" else 2),
                      offload_layers=offload_in_force(cfg, cuda, graphs), **path)
    quant = getattr(cfg, "base_quant", "none")
    if quant != "none":  # joined groups too (train.setup), each dequantizing its weights per call
        mc = dataclasses.replace(mc, base_quant=quant)
    setting = getattr(cfg, "lora_inputs", "recompute")
    if setting == "auto" and (args is None or not tokens):
        setting = "recompute"
    return dataclasses.replace(mc, keep_inputs=resolve_keep_inputs(setting, args, mc, tokens, memory_bytes),
                               host_embeddings=bool(getattr(cfg, "host_embeddings", False)) and cuda
                               and cfg.distributed != "fsdp")


def offload_in_force(cfg: TrainConfig, cuda: bool, graphs: bool) -> int:
    """train's activation_offload where it applies: CUDA, eager micro-batches (a captured graph
    skips it), not FSDP (checkpointing: plan.memory.offload_layers)."""
    n = getattr(cfg, "activation_offload", 0)
    return n if cuda and not graphs and cfg.distributed != "fsdp" else 0


def training_path(precision: str, cuda: bool = True, distributed: str = "auto", fused_ops: bool = True) -> dict:
    """MemoryConfig's joined / fused_layers for the path train takes: LoRA groups joined
    (lora.fuse_projections) unless FSDP or HIVETUNE_REFERENCE=fused_lora; the Triton RMSNorm /
    SwiGLU on a GPU in bf16 / fp16 (ops.triton_util.fused_ok) unless fused_ops is off, where
    Triton is importable, or assumed when planning on a machine without a GPU (the CUDA and
    ROCm wheels ship it)."""
    fused_layers = cuda and precision != "fp32" and fused_ops and not forced("fused_layers")
    if fused_layers and triton_util.triton is None:
        fused_layers = not torch.cuda.is_available()
    return {"joined": fused_lora_usable() and distributed != "fsdp", "fused_layers": fused_layers}


def uses_graphs(cfg: TrainConfig, precision: str) -> bool:
    """train.cuda_graphs applies to bf16 packed runs (where the tree has it)."""
    return bool(getattr(cfg, "cuda_graphs", False)) and precision == "bf16" and cfg.packing


def bucketed(tokens: int, graphs: bool, args: ModelArgs | None = None, checkpointing: bool = False) -> int:
    """CUDA graphs pad each micro-batch to a graph size (plan.graph_sizes, on the fixed grid
    here); they switch themselves off for compute-bound micro-batches (launch_bound), which then
    run eagerly at their own size."""
    if not graphs:
        return tokens
    if args is not None and not launch_bound(args.linear_weight_count, tokens, checkpointing):
        return tokens
    return bucket_tokens(tokens)


def data_index(cfg: TrainConfig, model_path: Path):
    """The training data's index: .lengths and .n_targets of each example (dpo / orpo: of each
    pair's shared row, and .pairs)."""
    try:
        tokenizer = load_tokenizer(str(model_path))
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"--data: reading token lengths needs the model's tokenizer ({model_path}: {e}); "
                        f"give an HF folder or GGUF as --model, or leave out --data") from None
    if cfg.method != "sft":
        return index_pairs(train_source(cfg), tokenizer, cfg.max_length, cfg.format)
    return index_dataset(train_source(cfg), cfg.format, tokenizer, cfg.max_length, cfg.train_on_inputs)


class _Lengths:
    """Examples known by their lengths alone (what data.step_plan.data_plan reads)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)


def largest_planned_micro_batch(cfg: TrainConfig, lengths) -> int:
    """Tokens of the largest micro-batch the run's own step plan holds (data.step_plan.data_plan
    in the config's order, each step cut as data.shares.micro_parts cuts it): packed, their sum;
    padded, its rows times its longest. One process."""
    per_step = cfg.batch_size * cfg.grad_accum
    steps, _, _ = data_plan(_Lengths(lengths), per_step, cfg.epochs, cfg.max_steps, cfg.seed, cfg.val_split,
                            step_order(cfg))
    lens = np.asarray(lengths, dtype=np.int64)
    if cfg.grad_accum == 1 or not cfg.packing:  # consecutive runs of batch_size
        parts = lens[steps.rows()].reshape(len(steps), cfg.grad_accum, cfg.batch_size)
        sizes = parts.sum(-1) if cfg.packing else cfg.batch_size * parts.max(-1)
        return int(sizes.max())
    return max(sum(lengths[i] for i in part)
               for ids in steps for part in shares.micro_parts(ids, lengths, cfg.batch_size, True))


def preference_worst(cfg: TrainConfig, index) -> int:
    """Tokens of the largest preference micro-batch of a PairIndex: the batch_size longest shared
    rows, or with preference.shared_prompt false 2 x batch_size rows padded to the longest prompt
    + answer."""
    b = cfg.batch_size
    if cfg.preference.shared_prompt:
        return sum(sorted(index.lengths, reverse=True)[:b])
    widest = max(len(e.prompt) + max(len(e.chosen), len(e.rejected)) for e in index.pairs)
    return 2 * b * widest


def resolve_gpu(gpu: str | None, memory_gib: float | None) -> tuple[GPU | None, float, str]:
    """(table entry or None, memory GiB, label) from --gpu / --memory, else the present GPU."""
    if memory_gib is not None and memory_gib <= 0:
        raise UserError(f"--memory: must be > 0 GiB, got {memory_gib:g}")
    if gpu:
        entry = find_gpu(gpu)
        return entry, memory_gib or entry.memory_gib, entry.name
    if memory_gib:
        return None, memory_gib, f"{memory_gib:g} GiB"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        entry = gpu_for_device_name(props.name)
        return entry, props.total_memory / GIB, props.name
    raise UserError("plan: name a GPU (--gpu H100, --gpu 'RTX 4090', ...) or a size (--memory 24); "
                    "no GPU is present here")


def auto_precision(entry: GPU | None, memory_gib: float | None) -> tuple[str, str]:
    """What train's --precision auto takes on the GPU planned for (core.device.auto_gpu_precision):
    the named table entry, else this machine's GPU; bf16 where only a size is given."""
    if entry is not None:
        return auto_gpu_precision(entry.name, entry.arch)
    if memory_gib is None and torch.cuda.is_available():
        return device_auto_precision(torch.device("cuda", 0))
    return "bf16", "no GPU named: bf16 assumed"


def plan(cfg: TrainConfig, gpu: str | None = None, memory_gib: float | None = None,
         model_args: ModelArgs | None = None, index=None) -> Plan:
    """Predict peak memory, the largest micro-batch that fits and the time per epoch.

    `cfg` is a training config (model, data, batch_size, grad_accum, max_length, precision,
    gradient_checkpointing, lora.*, packing, fused_loss); `model_args` skips reading cfg.model,
    `index` (the examples' .lengths and .n_targets, as data_index gives) reading cfg.data.
    """
    model_path = hub_model_path(cfg.model)
    args = model_args or load_args(model_path)
    entry, mem_gib, label = resolve_gpu(gpu, memory_gib)
    precision = cfg.precision
    notes = []
    if precision == "auto":
        precision, why = auto_precision(entry if gpu else None, memory_gib)
        notes.append(f"precision auto -> {'fp16 with loss scaling' if precision == 'fp16' else precision} ({why})")
    if precision == "fp16" and getattr(cfg, "cuda_graphs", False):
        notes.append(f"CUDA graphs off ({FP16_NO_GRAPHS})")
    targets_known = [t for t in cfg.lora.targets if t in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                           "gate_proj", "up_proj", "down_proj")]
    if len(targets_known) != len(cfg.lora.targets):
        raise UserError(f"lora.targets: {', '.join(set(cfg.lora.targets) - set(targets_known))} matches no module "
                        f"(valid: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)")

    data = cfg.data
    preference = cfg.method != "sft"
    if preference and not data:  # dpo / orpo: empty data is the shipped preference pairs, as in train
        data = str(DEFAULT_DATA_DIR / PAIR_FILES[0])
        cfg = dataclasses.replace(cfg, data=data)
    if not data and not cfg.model:  # the embedded default job trains on the shipped dataset
        data = str(default_train_data())
        cfg = dataclasses.replace(cfg, data=data)
    # train.pair_graph replays a preference step from one graph (bf16, the shared-prompt rows, one process)
    pair_graphs = preference and bool(getattr(cfg, "cuda_graphs", False)) and precision == "bf16" \
        and cfg.preference.shared_prompt
    if preference:
        notes.append(f"method {cfg.method}: one row a pair, [prompt, chosen, rejected]; "
                     + ("steps replayed from one CUDA graph (timed as graphed; memory as for eager steps)"
                        if pair_graphs else "eager steps (no CUDA graphs)")
                     + ("; the reference pass (LoRA off, no gradient) adds a third to the step's work"
                        if cfg.method == "dpo" else ""))
    if data or index is not None:
        index = index if index is not None else data_index(cfg, model_path)
        lengths, n_targets = index.lengths, index.n_targets
        worst = preference_worst(cfg, index) if preference else largest_planned_micro_batch(cfg, lengths)
        target_fraction = sum(n_targets) / max(1, sum(lengths))
        source = f"data {cfg.data or 'given'} ({len(lengths)} examples, longest {max(lengths)} tokens)"
        avg_len = sum(lengths) / len(lengths)
        examples, tokens_epoch = len(lengths), sum(lengths)
    else:
        worst = cfg.batch_size * cfg.max_length
        target_fraction = 1.0
        source = "max_length (every example that long: an upper bound; --data gives real lengths)"
        avg_len, examples, tokens_epoch = cfg.max_length, None, None
    worst = min(worst, cfg.batch_size * cfg.max_length)

    ckpt = cfg.gradient_checkpointing
    graphs = uses_graphs(cfg, precision) and not preference
    tokens = bucketed(worst, graphs, args, ckpt)
    graphs = graphs and launch_bound(args.linear_weight_count, worst, ckpt)  # else eager at their own size
    mc = memory_config(cfg, precision, ckpt, graphs=graphs, args=args, tokens=tokens, memory_bytes=int(mem_gib * GIB))
    if mc.base_quant == "keep":
        mc = dataclasses.replace(mc, kept_bytes=kept_linear_bytes(model_path))
    if mc.base_quant != "none":
        dense = args.num_hidden_layers * sum(o * i for o, i in linear_shapes(args)) * mc.s
        notes.append(f"base_quant {mc.base_quant}: the decoder weights take "
                     f"{(dense + quantized_base_change(args, mc)) / GIB:.2f} GiB ({dense / GIB:.2f} GiB in {precision}); "
                     + ("q/k/v and gate/up are dequantized a group at a time" if mc.joined
                        else "one layer's weight is dequantized at a time"))
    if mc.keep_inputs and not ckpt:
        notes.append(f"lora_inputs {cfg.lora_inputs}: the LoRA groups keep their dropped inputs "
                     f"(+{keep_inputs_extra_bytes(args, mc, tokens) / GIB:.2f} GiB of activations)")
    b = breakdown(args, mc, tokens, max(1, int(tokens * target_fraction)))
    other = breakdown(args, memory_config(cfg, precision, not ckpt), tokens, max(1, int(tokens * target_fraction)))
    act = {("checkpointing on" if ckpt else "checkpointing off"): b.parts["activations"] / GIB,
           ("checkpointing off" if ckpt else "checkpointing on"): other.parts["activations"] / GIB}
    budget = int(mem_gib * GIB)
    fits = b.total <= budget
    # auto recomputes the LoRA inputs where keeping them would not fit: size the largest that way
    sizing = dataclasses.replace(mc, keep_inputs=False) if getattr(cfg, "lora_inputs", "") == "auto" else mc
    largest = largest_micro_batch(args, sizing, budget, target_fraction)
    largest_ckpt = largest if ckpt else largest_micro_batch(args, memory_config(cfg, precision, True), budget,
                                                            target_fraction)
    suggestion = _suggest(cfg, fits, ckpt, worst, largest, largest_ckpt, avg_len)
    if not fits and not ckpt:
        n = checkpoint_to_fit(args, cfg, precision, worst, target_fraction, budget)
        if n and n < args.num_hidden_layers:
            suggestion += (f"; or keep it and set gradient_checkpointing=true, checkpoint_layers={n} (the first {n} "
                           f"layers recompute their forward in backward, {100 * n / (2 * args.num_hidden_layers):.0f}% "
                           "more matmul work; CUDA graphs stay on, so the step does not wait on a slow host)")
    if not fits and not graphs and not ckpt:
        n = offload_to_fit(args, cfg, precision, tokens, target_fraction, budget)
        if n and n != getattr(cfg, "activation_offload", 0):
            layers = f"{n} layer{'s' if n > 1 else ''}"
            suggestion += (f"; or keep it and set activation_offload={n} (saved activations of {layers} wait in "
                           f"pinned host memory; on H200s, W2 with 8 ran 2.9-5.5% slower)")
    if not fits and not args.tie_word_embeddings and not mc.host_embeddings:
        table = args.vocab_size * args.hidden_size * mc.s
        suggestion += (f"; and with any of these, host_embeddings=true (the input embedding in pinned host memory: "
                       f"{table / GIB:.2f} GiB less)")

    p = Plan(model=str(model_path), gpu=label, memory_gib=round(mem_gib, 2), precision=precision,
             batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, max_length=cfg.max_length,
             gradient_checkpointing=ckpt, lora_r=cfg.lora.r, lora_targets=list(cfg.lora.targets),
             packing=cfg.packing, cuda_graphs=graphs, base_parameters=base_parameter_count(args),
             lora_parameters=lora_parameter_count(args, cfg.lora.r, cfg.lora.targets), micro_batch_tokens=tokens,
             parts_gib={k: v / GIB for k, v in b.parts.items()}, activations_gib=act, peak_gib=b.total / GIB,
             fits=fits, largest_micro_batch_tokens=largest, largest_micro_batch_tokens_checkpointing=largest_ckpt,
             suggestion=suggestion, tokens_source=source, examples=examples, tokens_per_epoch=tokens_epoch,
             notes=notes, activation_offload=mc.offload_layers, host_gib={k: v / GIB for k, v in b.host.items()})
    if ckpt and 0 < getattr(cfg, "checkpoint_layers", 0) < args.num_hidden_layers:
        notes.append(f"checkpoint_layers: the first {cfg.checkpoint_layers} of {args.num_hidden_layers} layers "
                     "checkpointed, the others keep their activations")
    if getattr(cfg, "activation_offload", 0) and not mc.offload_layers:
        notes.append("activation_offload does not apply here (" + ("CUDA-graphed micro-batches" if graphs else "FSDP")
                     + "): not counted")
    if entry is not None:
        tflops = entry.tflops(precision)
        micro_tokens = cfg.batch_size * avg_len
        layers = args.num_hidden_layers
        share = checkpointed_count(layers, ckpt, getattr(cfg, "checkpoint_layers", 0)) / layers
        p.step_seconds = cfg.grad_accum * micro_batch_seconds(args, micro_tokens, avg_len, share, precision, tflops,
                                                              graphs or pair_graphs) * (
            REFERENCE_PASS if cfg.method == "dpo" else 1.0)
        per_step = cfg.batch_size * cfg.grad_accum
        if examples:
            p.epoch_seconds = examples / per_step * p.step_seconds
        for n in SCALING_EXAMPLES:
            p.scaling.append({"examples": n, "tokens": int(n * avg_len), "steps": math.ceil(n / per_step),
                              "seconds": n / per_step * p.step_seconds})
    else:
        p.notes.append("no rates for this GPU: give --gpu NAME for the time estimate")
    return p


def kept_linear_bytes(path: Path) -> int:
    """base_quant keep: bytes of the GGUF's quantized decoder linear weights (dense ones, F32 /
    F16 / BF16, are not counted)."""
    if not is_gguf(path):
        return 0
    return sum(int(t.n_bytes) for t in open_gguf(path).tensors
               if quantizes(gguf_to_hf_name(t.name)) and int(t.tensor_type) not in GGUF_DENSE_TYPES)


def offload_to_fit(args: ModelArgs, cfg: TrainConfig, precision: str, tokens: int, target_fraction: float,
                   budget: int) -> int:
    """The fewest layers of activation_offload with which a micro-batch of `tokens` fits
    `budget` bytes (eager, on CUDA), or 0 when none does."""
    eager = memory_config(dataclasses.replace(cfg, activation_offload=args.num_hidden_layers), precision, False)
    if not eager.offload_layers:  # where train would not offload (FSDP)
        return 0
    targets = max(1, int(tokens * target_fraction))
    for n in range(1, args.num_hidden_layers + 1):
        if breakdown(args, dataclasses.replace(eager, offload_layers=n), tokens, targets).total <= budget:
            return n
    return 0


def checkpoint_to_fit(args: ModelArgs, cfg: TrainConfig, precision: str, tokens: int, target_fraction: float,
                      budget: int) -> int:
    """The fewest first layers under gradient checkpointing (checkpoint_layers) with which a
    micro-batch of `tokens` fits `budget` bytes with CUDA graphs on, or 0 where graphs would not
    run it (plan.graph_sizes.launch_bound; not bf16, packing or cuda_graphs off) or none fits."""
    if not uses_graphs(cfg, precision) or not launch_bound(args.linear_weight_count, tokens, True):
        return 0
    for n in range(1, args.num_hidden_layers + 1):
        if graphed_peak(args, cfg, precision, tokens, n, target_fraction) <= budget:
            return n
    return 0


def graphed_peak(args: ModelArgs, cfg: TrainConfig, precision: str, tokens: int, layers: int = 0,
                 target_fraction: float = 1.0) -> int:
    """Predicted peak bytes of a micro-batch of `tokens`, padded to its graph size, with CUDA
    graphs on and the first `layers` decoder layers checkpointed (0: none)."""
    padded = bucket_tokens(tokens)
    mc = memory_config(dataclasses.replace(cfg, checkpoint_layers=layers), precision, layers > 0, graphs=True)
    return breakdown(args, mc, padded, max(1, int(padded * target_fraction))).total


def _suggest(cfg, fits, ckpt, worst, largest, largest_ckpt, avg_len) -> str:
    per_example = max(1, min(cfg.max_length, round(avg_len)))
    if fits:
        spare = largest // max(1, per_example)
        return (f"fits; micro-batches up to {largest:,} tokens fit (about batch_size {spare} "
                f"at {per_example} tokens an example)")
    if largest >= per_example:
        b = max(1, largest // per_example)
        return (f"does not fit: lower batch_size to {b} (and raise grad_accum to keep "
                f"{cfg.batch_size * cfg.grad_accum} examples a step)"
                + ("" if ckpt else f", or turn on gradient_checkpointing (up to {largest_ckpt:,} tokens)"))
    if not ckpt and largest_ckpt >= per_example:
        return f"does not fit: turn on gradient_checkpointing (micro-batches up to {largest_ckpt:,} tokens fit)"
    return "does not fit even one example: use a GPU with more memory, a shorter max_length or bf16"


def format_plan(p: Plan) -> str:
    lines = [f"model      {p.model}: {p.base_parameters / 1e9:.2f}B parameters; LoRA r={p.lora_r} on "
             f"{','.join(p.lora_targets)}: {p.lora_parameters / 1e6:.1f}M",
             f"GPU        {p.gpu}, {p.memory_gib:g} GiB; {p.precision}, batch_size {p.batch_size} x grad_accum "
             f"{p.grad_accum}, max_length {p.max_length}, checkpointing {'on' if p.gradient_checkpointing else 'off'}"
             + (", CUDA graphs" if p.cuda_graphs else ""),
             f"micro-batch {p.micro_batch_tokens:,} tokens (from {p.tokens_source})", "",
             f"{'memory':<26}{'GiB':>8}"]
    for name, gib in p.parts_gib.items():
        if gib > 0:
            lines.append(f"  {name:<24}{gib:>8.2f}")
    lines.append(f"  {'predicted peak':<24}{p.peak_gib:>8.2f}   of {p.memory_gib:g} GiB: "
                 f"{'FITS' if p.fits else 'DOES NOT FIT'}")
    for name, gib in p.host_gib.items():
        lines.append(f"  {name:<24}{gib:>8.2f}   (host memory, not in the peak)")
    for name, gib in p.activations_gib.items():
        lines.append(f"  {'activations, ' + name.replace('checkpointing', 'ckpt'):<24}{gib:>8.2f}")
    lines += ["", f"largest micro-batch that fits: {p.largest_micro_batch_tokens:,} tokens "
              f"({p.largest_micro_batch_tokens_checkpointing:,} with checkpointing)", p.suggestion]
    if p.step_seconds is not None:
        lines += ["", f"time       {p.step_seconds:.3f} s per optimizer step (estimate)"]
        if p.epoch_seconds is not None:
            lines.append(f"           {_hms(p.epoch_seconds)} per epoch: {p.examples:,} examples, "
                         f"{p.tokens_per_epoch:,} tokens")
        lines.append(f"  {'examples':>9} {'tokens':>13} {'steps':>8} {'per epoch':>10}")
        for row in p.scaling:
            lines.append(f"  {row['examples']:>9,} {row['tokens']:>13,} {row['steps']:>8,} {_hms(row['seconds']):>10}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def plan_dict(p: Plan) -> dict:
    return dataclasses.asdict(p)


def plot_plan(p: Plan, path: str) -> None:
    """A horizontal stacked bar of the peak's parts against the GPU's memory."""
    try:  # an optional dependency (hivetune[plots])
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--png needs matplotlib: pip install 'hivetune[plots]'") from None
    fig, ax = plt.subplots(figsize=(9, 3.2))
    left = 0.0
    for name, gib in p.parts_gib.items():
        if gib <= 0:
            continue
        ax.barh([0], [gib], left=left, label=f"{name} {gib:.2f}")
        left += gib
    ax.axvline(p.memory_gib, color="red", linestyle="--", label=f"{p.gpu} {p.memory_gib:g} GiB")
    ax.set_yticks([])
    ax.set_xlabel("GiB")
    ax.set_title(f"{Path(p.model).name}: predicted peak {p.peak_gib:.1f} GiB "
                 f"({'fits' if p.fits else 'does not fit'})")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4)
    fig.tight_layout()
    atomic_write_with(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
