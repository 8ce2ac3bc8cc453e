"""The training config's schema: ``TrainConfig`` and its sections, one field per config key.

Each field carries its type, its default and, in the docstring written under it, what it does;
``field_doc`` reads that docstring, of which docs/config.md's reference is made
(``hivetune.workflows.config_reference``). Values are coerced onto these fields by
``config_apply`` and checked by ``config_validate``; ``config.load_config`` does both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The fields of a record hivetune reads, which data_columns maps to the data's own column names.
COLUMN_FIELDS = ("instruction", "input", "output", "messages", "text", "conversations")


@dataclass
class LoRAConfig:
    r: int = 16
    """Rank of the update B A."""
    alpha: float = 32.0
    """Scale numerator: the update is multiplied by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.0
    """Dropout on the LoRA input path during training (PEFT's default is 0 too)."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Short names of the linear layers to adapt; one that matches nothing is an error."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""


@dataclass
class PreferenceConfig:
    beta: float = 0.1
    """DPO's beta: the strength of the pull towards the reference model (the base with LoRA off);
    rewards are beta x (log-prob of the answer - the reference's)."""
    loss: str = "sigmoid"
    """DPO's loss of z = beta x the reward margin: sigmoid (-log sigmoid(z), the DPO paper) or ipo
    ((h - 1/(2 beta))^2 of the log-ratio margin h, the IPO paper; sums of token log-probs)."""
    label_smoothing: float = 0.0
    """Conservative DPO: the share eps of pairs assumed mislabelled, loss -(1-eps) log sigmoid(z) -
    eps log sigmoid(-z) (sigmoid loss only); in [0, 0.5)."""
    orpo_lambda: float = 0.1
    """ORPO's weight of the odds-ratio term beside the chosen answer's mean token NLL."""
    shared_prompt: bool = True
    """Run each pair as one row [prompt, chosen, rejected] (both answers attend to the prompt, not to
    each other) with the fused per-token log-probs; false: the reference path, the prompt run twice
    and plain logits."""


@dataclass
class TrainConfig:
    model: str = ""
    """HF model folder (config.json + safetensors), a .gguf file, or a Hugging Face Hub id ORG/NAME[@REVISION]
    (from the Hub's cache, fetched when online; a local path of that name wins); empty: the embedded
    SmolLM2-135M-Instruct."""
    data: str = ""
    """Training data: a JSONL, JSONL.gz, JSON array, parquet or CSV file, a folder of these, or a Hugging
    Face Hub dataset id ORG/NAME[@REVISION] (read through the datasets library); empty: the shipped
    Linux / GPU ops dataset. In YAML also a mapping {path, columns, split, config} of this key and the
    three below (--set data.columns.output=answer)."""
    data_columns: dict[str, str] = field(default_factory=dict)
    """The data's column for a field hivetune reads (instruction, input, output, messages, text,
    conversations), e.g. {output: answer}; applied to data and val_data."""
    data_split: str = ""
    """The split of a Hub dataset (or of a dataset folder in the Hub's layout) to train on; empty: train.
    A Hub dataset as val_data reads its test split."""
    data_config: str = ""
    """The configuration (subset) of a Hub dataset; empty: its default."""
    val_data: str = ""
    """Held-out data for the end-of-run A/B (a file or source as for data); empty with the default
    data: the shipped held-out split."""
    val_split: float = 0.0
    """Fraction of the training data held out (deterministically, by seed) for validation loss; 0: none."""
    eval_every: int = 0
    """Validation loss every this many optimizer steps and at the end, when there is a validation
    set (val_split, or val_data given explicitly); 0: at the end only."""
    early_stopping_patience: int = 0
    """Stop when the validation loss has not improved for this many evaluations in a row, and keep
    the adapter of the best evaluation; 0: off."""
    format: str = "auto"
    """alpaca (instruction/input/output), chat (messages), text, or auto-detected per file."""
    max_length: int = 1024
    """Examples longer than this many tokens are truncated (and counted)."""
    train_on_inputs: bool = False
    """Put loss on prompt tokens too (default: response tokens only)."""
    packing: bool = True
    """Pack the examples of a micro-batch into one row with per-example attention (no padding)."""
    batch_order: str = "auto"
    """random: each step draws its examples from the epoch's shuffled order. balanced: the same
    epochs, each step's examples dealt by length so that every step holds about the same number of
    tokens (one from each length stratum, still at random): CUDA graphs then need fewer sizes and
    pad less, and the largest micro-batch (the memory peak) is near the mean. auto: balanced with
    packing, random without (a padded micro-batch would hold a long example every step). A run
    folder whose config.yaml predates this key resumes as random (step_order)."""
    output_dir: str = ""
    """Run folder; empty: runs/<date>-<time>. An existing run folder of the same config is
    resumed from its newest valid checkpoint; any other non-empty folder is refused."""
    init_adapter: str = ""
    """Start LoRA from an earlier adapter (a run folder or a PEFT adapter folder) instead of a fresh
    init: its A and B weights loaded, the optimizer and schedule fresh. Its base model, lora.r,
    lora.alpha, lora.targets and lora.rslora must be this run's. summary.json names it (path and
    weights' sha256). Empty: a fresh LoRA."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    method: str = "sft"
    """sft (supervised: loss on the response tokens), dpo (Direct Preference Optimization against the
    base with LoRA off) or orpo (odds-ratio preference, no reference model); dpo and orpo read
    preference pairs {prompt | messages, chosen, rejected} (docs/preference.md); empty data: the
    shipped preference pairs."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    epochs: float = 1.0
    """Passes over the data (fractions allowed); ignored when max_steps > 0."""
    max_steps: int = 0
    """Optimizer steps to run; 0: derived from epochs."""
    batch_size: int = 8
    """Examples per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; effective batch = batch_size * grad_accum examples."""
    lr: float = 2e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    schedule: str = "cosine"
    """cosine, linear or constant, after warmup."""
    warmup_steps: int = -1
    """Linear warmup steps; -1: 3% of the steps (at least 1)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr (cosine and linear)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    precision: str = "auto"
    """bf16, fp16 (with loss scaling), fp32, or auto: bf16 where the device runs it fast."""
    gradient_checkpointing: bool = False
    """Recompute layer activations in backward to save memory."""
    checkpoint_layers: int = 0
    """With gradient_checkpointing: checkpoint the first N decoder layers only; the others keep
    their activations for backward (less recompute, more memory: W2, a 7B model, ~0.35 GiB a
    layer at 2,900 tokens; `hivetune plan` shows the total). Unlike activation_offload it keeps
    CUDA graphs on: where a micro-batch does not fit, `hivetune plan` names the fewest N that make
    it fit graphed (W2 in 24 GiB: 4, 7% more matmul work, a step that does not wait on the host).
    0: all layers."""
    activation_offload: int = 0
    """Keep the saved activations of the first N decoder layers in pinned CPU memory between
    forward and backward: less GPU memory (W2, a 7B model: ~0.34 GiB a layer at 3,400 tokens),
    the PCIe copies overlapped with compute. CUDA only; not with gradient_checkpointing, FSDP or
    inside CUDA-graphed micro-batches; at most the model's layer count. 0: off."""
    host_embeddings: bool = False
    """Keep the frozen input embedding table in pinned host memory and gather each micro-batch's
    rows from it over PCIe (a Triton kernel; W2, a 7B model: 1.02 GiB less GPU memory for ~0.4 ms
    a step). CUDA with Triton; not for models whose LM head shares the table (tied embeddings)
    nor under FSDP: there it stays on the GPU, with one line saying why."""
    lora_inputs: str = "auto"
    """With LoRA dropout on a GPU (the seeded Triton dropout): keep each LoRA group's dropped
    input from forward for its backward, or recompute it there from tensors saved anyway (the
    norm's input, the attention output, the gate/up output). keep runs ~150 fewer kernels a W1
    step and costs memory (W1: 0.84 GiB at 2,496 tokens; W2: ~5.3 GiB); auto keeps when that costs
    at most 1 GiB at the step plan's largest micro-batch (the planner's figure), or when the
    planner's peak with them kept is at most 60% of the GPU memory this process can use (free
    plus its own, under any per-process cap: train.device_memory_bytes; W2 under DDP on 80 GB
    cards: ~2.5% faster for 2.35 GiB more; on a 24 GB card W2 recomputes), and never where that
    peak would not fit. Where an out-of-memory error follows, its message names
    lora_inputs=recompute first."""
    attention: str = "auto"
    """Attention of packed rows on a GPU: flash (flash varlen attention; an error where this
    GPU, torch build or dtype has no working kernel), sdpa (SDPA over a padded view, the
    reference), or auto: flash where a tiny probe runs it and matches float32, else sdpa with
    one line saying why."""
    fused_ops: bool = True
    """On a GPU with Triton (bf16 / fp16): RMSNorm, RoPE, SwiGLU and the LoRA dropout as fused
    Triton kernels; false: their plain PyTorch references."""
    base_quant: str = "none"
    """The frozen base's decoder weights kept quantized in memory, each layer dequantized as its
    matmul runs (LoRA, its gradients and the optimizer as without): nf4 (QLoRA's 4-bit
    NormalFloat, double-quantized scales, ~0.52 bytes a weight), int8 (per-row absmax, ~1 byte),
    keep (a .gguf base's own blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), or none.
    An HF base is quantized as it loads, layer by layer."""
    fused_loss: bool = True
    """Chunked LM head + cross-entropy with the gradient taken in forward (one chunk of logits
    alive at a time); false: the plain reference path."""
    wide_lora: str = "auto"
    """On CUDA, for graph-sized micro-batches: q/k/v's and gate/up's weights stored beside their
    LoRA B, so the base matmul carries the LoRA update and its gradient. true, false, or auto (the
    default): on, but not under FSDP. W1 under its 4 GiB cap: ~5% faster for the same reserved
    memory; W2 on 2 x H100: ~4% faster (docs/log.md)."""
    cuda_graphs: bool = True
    """On CUDA (bf16, packing): replay each micro-batch's forward + loss + backward from a CUDA
    graph, one per token-count bucket (256 tokens), captured on first use; eager otherwise."""
    compile_workers: int = -1
    """On CUDA with Triton: the fused kernels that Triton's on-disk cache lacks (a fresh machine,
    a new shape) are compiled by this many worker processes at once, ahead of the first step's
    real pass, instead of one after the other at their first launches (ops.compile_ahead); where
    the cache lacks this model's kernels, a two-layer twin of the model finds them before the
    weights load, so that they compile during the load (train.twin); -1: the host's cores less
    two, 2 to 12; 0: off."""
    seed: int = 0
    """Seeds LoRA init, dropout and the data order."""
    device: str = "auto"
    """cuda when available, else cpu."""
    threads: int = 0
    """CPU threads for torch; 0: all cores."""
    skip_doctor: bool = False
    """Start even when the doctor's quick checks find a stack known to fail (a driver older than
    torch's CUDA, a GPU missing from the build, a wrong HSA_OVERRIDE_GFX_VERSION...)."""
    log_every: int = 1
    """Write a metrics.jsonl line every this many optimizer steps."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files in RUN/tensorboard/ (needs the
    tensorboard package: pip install 'hivetune[tensorboard]')."""
    report_to: list[str] = field(default_factory=list)
    """Also send metrics.jsonl's records to these trackers: tensorboard, mlflow (MLFLOW_TRACKING_URI,
    MLFLOW_EXPERIMENT_NAME), wandb (WANDB_PROJECT, WANDB_MODE); pip install 'hivetune[trackers]'."""
    save_every: int = 0
    """Checkpoint (adapter, optimizer, RNG...) every this many optimizer steps and at the end,
    in checkpoints/step-N/; 0: only the final adapter (and a checkpoint on SIGINT / SIGTERM)."""
    save_every_minutes: float = 10.0
    """Also checkpoint every this many minutes of training, and at the end, so that a run that
    dies (an exception, a kill, a power cut) keeps its progress; 0: off. In one process only:
    under torchrun the ranks' clocks could disagree on when, so save_every counts there."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep."""
    max_bad_steps: int = 5
    """A step whose loss or gradients are not finite is skipped (no update); after this many in a
    row, on_bad_steps decides."""
    on_bad_steps: str = "stop"
    """stop: end the run with an error, the last checkpoint intact; rollback: go back to the last
    checkpoint and go on with the learning rate times rollback_lr_factor (at most max_rollbacks times)."""
    rollback_lr_factor: float = 0.5
    """Learning-rate multiplier applied at each rollback."""
    max_rollbacks: int = 3
    """Rollbacks allowed before the run stops with an error."""
    distributed: str = "auto"
    """Under torchrun with several processes: ddp (LoRA replicated, base on every GPU), fsdp (FSDP2
    shards the base too), or auto: ddp when the planner says the run fits one GPU, else fsdp."""
    auto: bool = False
    """Micro-batch from the planner; on a CUDA out-of-memory error, halve the micro-batch (the
    examples per optimizer step stay the same) and retry the step instead of stopping."""
    eval_prompts: int = 1
    """Held-out questions answered by the base and the tuned model at the end (0: none)."""
    max_new_tokens: int = 96
    """Generation length for those answers."""
    eval_examples: int = 200
    """End of run, with a held-out file (val_data, or the shipped split with the default data):
    base vs tuned on its first this many examples as `hivetune eval` scores them (response
    loss, answers, F1 / ROUGE-L / command hits), written to RUN/eval/; 0: only eval_prompts answers."""


def field_doc(cls, name: str) -> str:
    """The docstring written under a dataclass field (docs/config.md's text for the key)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    for i, node in enumerate(body[:-1]):
        nxt = body[i + 1]
        if (isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name
                and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)):
            return str(nxt.value.value)
    return ""
