"""GPU memory of one hivetune training step, term by term, from the architecture alone.

The model describes OUR implementation (train.fit, model/decoder.py, model/lora.py,
ops/lora_group.py, ops/fused_ce.py, ops/attention.py), not transformers'. Per token and per
decoder layer, what autograd saves for backward (measured op by op with saved_tensors_hooks, see
plan/measure.py; s = bytes of the compute dtype, 2 under bf16/fp16 autocast, 4 in fp32):

    RMSNorm x2           2 * (4h + 4)          fp32 copy of x and the [T, 1] rsqrt, each norm
                         2 * (s h + 4)         the Triton kernel (fused_layers): x and 1/rms
    attention (varlen)   s(2q + 2kv) + 4H       q, k after RoPE, v, the output, fp32 log-sum-exp
                                                (4 s q + 4H where varlen_attn has no enable_gqa,
                                                as in torch 2.11: K/V repeated to H heads)
    attention (SDPA)     4 s q + 4H             padded q, K/V repeated to H heads, output,
                                                (+ s q: the un-padded copy o_proj reads)
    MLP                  3 s I                  gate, silu(gate), up (the joined path: the
                                                [T, 2I] gate|up output and silu(gate))
                         2 s I                  the Triton SwiGLU (fused_layers): gate and up only
    LoRA, per group      s * dim (dropout 0: the shared input; its dropout mask and dropped
                         copy otherwise) + s * r per adapted layer (the rank-r activations)

A LoRA group is q/k/v or gate/up when all of it is adapted (one dropout draw, one input), else
each adapted layer alone. The training path (``joined``, lora.fuse_projections, every run but
FSDP's) runs each group through one ops.lora_group Function: its dropout mask is bool (1 byte,
``torch.native_dropout``, CPU and CUDA alike) and it saves, per group call, A_all [n r, d] and
the block-diagonal B [O, n r] (zeros included; one layer's B itself in fp32) in the compute
dtype: the "LoRA casts". The layer-by-layer path (``joined=False``) saves autocast's cached
low-precision copies of every LoRA weight instead, and its mask is the input dtype on the CPU.

The first layer's input norm saves nothing (no gradient flows into the frozen embedding), nor
do the layer-by-layer q/k/v their dropout masks (lora_group's Function saves its mask anyway).
With gradient checkpointing a layer keeps only its input (s h per token) and one layer is
recomputed in backward (its LoRA casts are the forward's, kept for every layer). The fused LM-head loss keeps
d loss/d hidden for the N target rows (N h s); inside it, the PyTorch chunk (CPU, fp32, no
Triton) holds a chunk of fp32 logits (256 MiB) with one more of its size (logsumexp's x - max;
each chunk's gradient is freed before the next chunk's logits): 512 MiB for a 152k vocabulary,
Gemma 2's capped logits alike (capped in place). The Triton chunk (fused_layers) holds only its logits in the compute
dtype, 256 MiB, turned into their gradient in place.

Peaks (measured on an H200, benchmarks/results/plan-grid-h200.json): without checkpointing at the
loss, everything saved + the chunk buffers; the backward pass adds less (about 1.7 s I per token).
With checkpointing, in backward: the recomputed layer + about 1.7 s I per token of gradient
buffers; or in forward, a layer's gate, up, silu and product (4 s I per token).

Activation offload (train's activation_offload = N, ops.offload): the first N layers' saved
storages of at least 1 MiB wait in pinned host memory ("pinned host memory", outside the GPU
totals); in backward they come back ahead of their layers, at most N + 1 layers' worth at once
(ops.offload.peak_resident_layers), which adds to the backward phase only when N >= L / 2
("offloaded, fetched back").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hivetune.model.config import ModelArgs, checkpointed_count
from hivetune.model.quant import (dequant_workspace_elements, layer_weight_elements, linear_shapes,
                                  quantized_weight_bytes)
from hivetune.ops.fused_ce import CHUNK_BYTES, chunk_rows_for
from hivetune.ops.offload import THRESHOLD_BYTES as OFFLOAD_THRESHOLD, peak_resident_layers

GIB = 1 << 30
MIB = 1 << 20
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))

# A layer's backward holds about BACKWARD_I buffers of [T, intermediate] in the compute dtype
# (gradients of down's input, silu(gate) and up) on top of what is saved; a checkpointed layer's
# forward holds FORWARD_I of them. Calibrated on an H200 over 0.5B / 1.5B / 7B shapes in bf16 and
# fp32 (1.67-1.70 measured; benchmarks/plan_grid.py, benchmarks/results/plan-grid-h200.json).
BACKWARD_I = 1.75
FORWARD_I = 4.0
RECOMPUTE_I = 1.0  # seeded dropout: down_proj's dropped input, recomputed in its backward
# PyTorch chunk (ops.fused_ce.chunk_ce), capped or not: its fp32 logits and logsumexp's x - max (the
# loop frees each chunk's gradient before the next chunk's logits)
LOSS_CHUNK_COPIES = 2
# cuBLAS / cuBLASLt workspaces and the allocator's 2 MiB pages (expandable segments).
ALLOCATOR_SLACK_BYTES = 96 * MIB
ALLOCATOR_SLACK_FRACTION = 0.02
CUDA_CONTEXT_BYTES = 512 * MIB  # driver context + kernels; outside torch's allocator


@dataclass
class MemoryConfig:
    """The training settings that change memory."""

    precision: str = "bf16"  # bf16 | fp16 | fp32
    r: int = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dropout: float = 0.0
    gradient_checkpointing: bool = False
    checkpoint_layers: int = 0  # train's checkpoint_layers: the first N layers checkpointed (0: all)
    fused_loss: bool = True
    packing: bool = True
    attention: str = "varlen"  # varlen (flash, packed bf16/fp16 on CUDA) | sdpa (everything else)
    gqa_native: bool = True  # varlen_attn takes enable_gqa (else K/V are repeated to every head)
    mask_bytes: int = 1  # layer-by-layer dropout mask element: bool on CUDA, the input dtype on the CPU
    joined: bool = True  # LoRA groups through ops.lora_group (training's path); False: layer by layer (FSDP)
    fused_layers: bool = False  # the Triton RMSNorm / SwiGLU save less (CUDA, bf16 / fp16, Triton present)
    offload_layers: int = 0  # train's activation_offload: the first N layers' saved tensors in host memory
    keep_inputs: bool = False  # train's lora_inputs resolved: the seeded groups keep their dropped inputs
    host_embeddings: bool = False  # train's host_embeddings: the untied input embedding in pinned host memory
    base_quant: str = "none"  # train's base_quant: the decoder layers' linear weights quantized (model.quant)
    kept_bytes: int = 0  # base_quant keep: the bytes of the GGUF's blocks of those weights

    @property
    def s(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass
class Breakdown:
    """Bytes of each part of the peak, and the peak itself."""

    tokens: int
    targets: int
    parts: dict = field(default_factory=dict)  # name -> bytes (the rows of the table)
    peak_phase: str = ""  # "loss" or "backward": where the peak falls
    host: dict = field(default_factory=dict)  # name -> bytes of host memory (not in the totals)

    @property
    def reserved(self) -> int:
        """What torch.cuda.max_memory_reserved() should read: everything but the CUDA context."""
        return sum(v for k, v in self.parts.items() if k != "CUDA context")

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def dims(args: ModelArgs) -> dict:
    hd = args.head_dim
    return {"q_proj": (args.hidden_size, args.num_attention_heads * hd),
            "k_proj": (args.hidden_size, args.num_key_value_heads * hd),
            "v_proj": (args.hidden_size, args.num_key_value_heads * hd),
            "o_proj": (args.num_attention_heads * hd, args.hidden_size),
            "gate_proj": (args.hidden_size, args.intermediate_size),
            "up_proj": (args.hidden_size, args.intermediate_size),
            "down_proj": (args.intermediate_size, args.hidden_size)}


def base_parameter_count(args: ModelArgs) -> int:
    """Every parameter of CausalLM(args), the tied head counted once."""
    h, hd, layers = args.hidden_size, args.head_dim, args.num_hidden_layers
    q, kv = args.num_attention_heads * hd, args.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * args.intermediate_size + 2 * h
    if args.attention_bias:
        per_layer += q + 2 * kv + (h if args.model_type != "qwen2" else 0)
    if args.qk_norm:
        per_layer += 2 * hd
    embed = args.vocab_size * h
    return layers * per_layer + embed + (0 if args.tie_word_embeddings else embed) + h


def lora_parameter_count(args: ModelArgs, r: int, targets) -> int:
    d = dims(args)
    return args.num_hidden_layers * sum(r * (d[t][0] + d[t][1]) for t in targets if t in d)


def norm_saved_bytes_per_token(args: ModelArgs, mc: MemoryConfig) -> int:
    """One RMSNorm: an fp32 copy of x and 1/rms (the reference), or x itself and 1/rms (Triton)."""
    return (mc.s if mc.fused_layers else 4) * args.hidden_size + 4


def lora_groups(mc: MemoryConfig) -> list[tuple[str, ...]]:
    """The LoRA calls of one layer: q/k/v and gate/up as one group when all of it is adapted
    (project_shared_input / FusedProjections), else each adapted layer alone."""
    calls = []
    for group in GROUPS:
        adapted = tuple(t for t in group if t in mc.targets)
        calls += [adapted] if adapted == group else [(t,) for t in adapted]
    return calls


def layer_saved_items(args: ModelArgs, mc: MemoryConfig) -> list[tuple[float, bool]]:
    """Per token, the bytes of each distinct storage autograd saves in one decoder layer (not the
    first: see module doc), each with whether it scales with the padded token count (the SDPA
    attention tensors): the pack hook of ops.offload moves the large ones."""
    s, h, hd = mc.s, args.hidden_size, args.head_dim
    q, kv, heads, inter = args.num_attention_heads * hd, args.num_key_value_heads * hd, args.num_attention_heads, args.intermediate_size
    norm_x = (mc.s if mc.fused_layers else 4) * h
    items = [(norm_x, False), (4, False)] * 2  # each norm: x and 1/rms (norm_saved_bytes_per_token)
    if mc.attention == "varlen" and mc.gqa_native:  # q, k, v, the output; the log-sum-exp
        items += [(s * q, False), (s * kv, False), (s * kv, False), (s * q, False)]
    else:  # K / V repeated to every head; SDPA pads each example to the longest
        items += [(s * q, mc.attention != "varlen")] * 4
    items.append((4 * heads, False))
    if mc.fused_layers:
        items.append((2 * s * inter, False))  # the Triton SwiGLU: the gate|up output
    else:
        items += [(2 * s * inter, False), (s * inter, False)] if mc.joined else [(s * inter, False)] * 3
    d = dims(args)
    mask = 1 if mc.joined else mc.mask_bytes  # lora_group: torch.native_dropout's bool mask
    seeded = seeded_dropout(mc)
    for group in GROUPS:
        adapted = [t for t in group if t in mc.targets]
        if not adapted:
            continue
        dim = d[group[0]][0]
        shared = len(adapted) == len(group)  # project_shared_input: one dropout draw for the group
        draws = 1 if shared else len(adapted)
        if mc.dropout > 0 and seeded:
            # no mask; o_proj keeps the attention output (saved by varlen already), down_proj
            # the gate/up output (SwiGLU's), and a whole q/k/v or gate/up group the norm's
            # input (RMSNorm.source), each recomputing its dropped input in backward; with
            # keep_inputs each keeps its dropped input (down_proj's dropout in the A matmuls:
            # its undropped input), the same size
            if mc.keep_inputs:
                items += [(s * dim, False)] * draws
            elif group == ("down_proj",) or (group == ("o_proj",) and mc.attention == "varlen") or shared:
                pass
            else:
                items += [(s * dim, False)] * draws
        elif mc.dropout > 0:
            items += [(mask * dim, False), (s * dim, False)] * draws
        elif group != ("o_proj",) or mc.attention != "varlen":
            items.append((s * dim, False))  # varlen: o_proj's input is the attention output, saved already
        # the rank-r activations: one [T, n r] tensor for a shared group, one [T, r] per layer alone
        items += [(s * mc.r * len(adapted), False)] if shared else [(s * mc.r, False)] * len(adapted)
    return items


def layer_saved_bytes_per_token(args: ModelArgs, mc: MemoryConfig) -> float:
    """Bytes autograd saves per token in one decoder layer (not the first: see module doc)."""
    return sum(b for b, _ in layer_saved_items(args, mc))


def seeded_dropout(mc: MemoryConfig) -> bool:
    """Whether lora_group draws dropout masks from a seed in Triton (ops.dropout, a GPU in
    bf16 / fp16): no mask saved, and down_proj / o_proj recompute their dropped input."""
    return mc.joined and mc.fused_layers and mc.dropout > 0


KEEP_INPUTS_MAX_BYTES = 2**30  # lora_inputs auto: keep the dropped inputs when they cost at most this,
KEEP_INPUTS_ROOM = 0.6  # or when the predicted peak with them kept stays within this share of the device
# (and never where that peak would not fit: resolve_keep_inputs)


def keep_inputs_extra_bytes(args: ModelArgs, mc: MemoryConfig, tokens: int) -> int:
    """What keeping the LoRA groups' dropped inputs adds to the saved activations of a
    micro-batch of `tokens` (0 where nothing is recomputed: no seeded dropout)."""
    if not seeded_dropout(mc):
        return 0
    keep, plain = replace(mc, keep_inputs=True), replace(mc, keep_inputs=False)
    return activation_bytes(args, keep, tokens) - activation_bytes(args, plain, tokens)


def resolve_keep_inputs(setting: str, args: ModelArgs, mc: MemoryConfig, tokens: int, memory_bytes: int = 0) -> bool:
    """train's lora_inputs: keep, recompute, or auto. auto, at the largest micro-batch (`tokens`)
    and with `memory_bytes` what the process can use of the device (plan.gpus.device_memory_bytes;
    0: unknown): recompute where the predicted peak with the inputs kept (the allocator's part,
    Breakdown.reserved, which is what a per-process cap bounds) would not fit; else keep where
    that peak is at most KEEP_INPUTS_ROOM of the memory, or where keeping costs at most
    KEEP_INPUTS_MAX_BYTES. Keeping is ~2.5% faster on W2 under DDP on 2 x H200 for +2.35 GiB a
    rank (docs/log.md); the 0.6 leaves a 24 GB card (W2 on one: 24 GiB with activation_offload)
    recomputing, and W1 (+0.84 GiB, 3.79 GiB predicted) keeps under its 4 GiB cap. False where
    it changes nothing (no seeded dropout)."""
    if not seeded_dropout(mc) or setting == "recompute":
        return False
    if setting == "keep":
        return True
    if memory_bytes:
        peak = breakdown(args, replace(mc, keep_inputs=True), tokens).reserved
        if peak > memory_bytes:
            return False
        if peak <= KEEP_INPUTS_ROOM * memory_bytes:
            return True
    return keep_inputs_extra_bytes(args, mc, tokens) <= KEEP_INPUTS_MAX_BYTES


def first_layer_items(args: ModelArgs, mc: MemoryConfig) -> list[float]:
    """Per token, the storages the first layer does not save (first_layer_saving)."""
    items = [4]  # the input norm's 1/rms
    if not (seeded_dropout(mc) and not mc.keep_inputs and all(t in mc.targets for t in GROUPS[0])):
        items.append(norm_saved_bytes_per_token(args, mc) - 4)  # its x (the seeded q/k/v keep that)
    if mc.dropout > 0 and not mc.joined:
        adapted = [t for t in GROUPS[0] if t in mc.targets]
        draws = 1 if len(adapted) == len(GROUPS[0]) else len(adapted)
        items += [mc.mask_bytes * args.hidden_size] * draws
    return items


def first_layer_saving(args: ModelArgs, mc: MemoryConfig) -> int:
    """Per token, what the first layer does not save: its input norm (no gradient flows into
    the frozen embedding; but under the seeded dropout q/k/v keep that input themselves), and
    layer by layer the dropout masks of q/k/v (needed only for d loss / d input; lora_group's
    Function saves its mask regardless)."""
    return sum(first_layer_items(args, mc))


def offload_layers(args: ModelArgs, mc: MemoryConfig) -> int:
    """Decoder layers whose saved activations ops.offload keeps in host memory (none with
    gradient checkpointing, where train turns it off)."""
    return 0 if mc.gradient_checkpointing else min(mc.offload_layers, args.num_hidden_layers)


def offloaded_layer_bytes(args: ModelArgs, mc: MemoryConfig, tokens: int, padded_tokens: int | None = None,
                          threshold: int = OFFLOAD_THRESHOLD) -> int:
    """What the pack hook of ops.offload moves out of one layer (not the first): its saved
    storages of at least `threshold` bytes (W2 at 3,400 tokens: all but 1/rms, the attention's
    log-sum-exp and the rank-r activations)."""
    total = 0
    for b, padded in layer_saved_items(args, mc):
        size = b * ((padded_tokens or tokens) if padded else tokens)
        total += size if size >= threshold else 0
    return int(total)


def offloaded_bytes(args: ModelArgs, mc: MemoryConfig, tokens: int, padded_tokens: int | None = None,
                    threshold: int = OFFLOAD_THRESHOLD) -> int:
    """Saved bytes of one micro-batch that wait in host memory between forward and backward:
    offload_layers layers' large storages, less what the first layer does not save."""
    n = offload_layers(args, mc)
    if not n:
        return 0
    first = sum(b * tokens for b in first_layer_items(args, mc) if b * tokens >= threshold)
    return n * offloaded_layer_bytes(args, mc, tokens, padded_tokens, threshold) - int(first)


def offload_fetched_bytes(args: ModelArgs, mc: MemoryConfig, tokens: int, padded_tokens: int | None = None) -> int:
    """The offloaded layers back on the GPU during backward beyond the layers that never left
    (ops.offload.peak_resident_layers): nonzero only when N >= L / 2."""
    n = offload_layers(args, mc)
    if not n:
        return 0
    extra = peak_resident_layers(n, args.num_hidden_layers) - (args.num_hidden_layers - n)
    return max(0, extra) * offloaded_layer_bytes(args, mc, tokens, padded_tokens)


def layer_cast_bytes(args: ModelArgs, mc: MemoryConfig) -> int:
    """lora_group's per-call copies in the compute dtype, one layer: A_all [n r, d] and the
    block-diagonal B [O, n r] (zeros included) of a group; alone, a layer's B is cast only
    below fp32 (in fp32 it is the parameter itself)."""
    d = dims(args)
    total = 0
    for call in lora_groups(mc):
        n, d_in, out = len(call), d[call[0]][0], sum(d[t][1] for t in call)
        total += mc.s * n * mc.r * d_in
        if n > 1:
            total += mc.s * out * n * mc.r
        elif mc.s < 4:
            total += mc.s * out * mc.r
    return total


def lora_cast_bytes(args: ModelArgs, mc: MemoryConfig) -> int:
    """Low-precision or concatenated copies of the fp32 LoRA weights held for backward.

    Joined (lora_group): layer_cast_bytes for every layer (the CastCache's buffers, which a
    checkpointed layer's recompute reads too: lora_casts.SeedTape). Layer by layer: autocast's
    cached copies of every LoRA weight (held through backward), or in fp32 the concatenated A
    of each shared group."""
    if mc.joined:
        return layer_cast_bytes(args, mc) * args.num_hidden_layers
    if mc.s == 2:
        return 2 * lora_parameter_count(args, mc.r, mc.targets)
    d = dims(args)
    per_layer = sum(4 * mc.r * d[g[0]][0] * len(g) for g in GROUPS
                    if len(g) > 1 and all(t in mc.targets for t in g))
    return args.num_hidden_layers * per_layer


def breakdown(args: ModelArgs, mc: MemoryConfig, tokens: int, targets: int | None = None,
              padded_tokens: int | None = None) -> Breakdown:
    """Peak memory of a training step whose largest micro-batch holds `tokens` tokens
    (`targets` of them with a loss; default all) in one packed row."""
    n = tokens if targets is None else targets
    t_attn = padded_tokens or tokens  # the SDPA paths pad each example to the longest
    s, h, layers = mc.s, args.hidden_size, args.num_hidden_layers
    n_lora = lora_parameter_count(args, mc.r, mc.targets)
    parts = {
        "base weights": base_parameter_count(args) * s + args.head_dim // 2 * 4,
        "LoRA params": 4 * n_lora,
        "LoRA grads": 4 * n_lora,
        "optimizer state": 8 * n_lora,
        "LoRA casts": lora_cast_bytes(args, mc),
    }
    if mc.base_quant != "none":
        parts["base weights"] += quantized_base_change(args, mc)
        parts["dequantization workspace"] = dequant_workspace_bytes(args, mc)
    per_layer = layer_saved_bytes_per_token(args, mc)
    if mc.attention != "varlen":  # the attention part scales with the padded token count
        per_layer_real = per_layer - 4 * s * args.num_attention_heads * args.head_dim
        attn = 4 * s * args.num_attention_heads * args.head_dim
    else:
        per_layer_real, attn = per_layer, 0
    rope = 2 * args.head_dim * s
    final_norm = norm_saved_bytes_per_token(args, mc)
    loss_saved = n * h * s if mc.fused_loss else n * args.vocab_size * 4
    if mc.gradient_checkpointing:  # a checkpointed layer keeps its input; the others (the last) all
        c = checkpointed_count(layers, True, mc.checkpoint_layers)
        kept = c * s * h * tokens + (layers - c) * (per_layer_real * tokens + attn * t_attn)
        recompute = per_layer_real * tokens + attn * t_attn  # one layer, in backward
    else:
        kept = (layers * per_layer_real - first_layer_saving(args, mc)) * tokens + layers * attn * t_attn
        recompute = 0
    moved = offloaded_bytes(args, mc, tokens, t_attn)  # to host memory until backward (ops.offload)
    parts["activations"] = int(kept + (rope + final_norm) * tokens + loss_saved - moved)
    hidden = s * h * tokens  # fit's `hidden` (final norm output) lives through backward
    loss_transient = hidden + n * h * s + loss_chunk_bytes(args, mc, n)
    if not mc.fused_loss:
        loss_transient = hidden + min(n, 4096) * args.vocab_size * (2 + 4)
    if mc.gradient_checkpointing:  # a layer's forward under checkpoint: its MLP intermediates
        loss_transient = max(loss_transient, FORWARD_I * s * args.intermediate_size * tokens)
    recomputes = seeded_dropout(mc) and not mc.keep_inputs and "down_proj" in mc.targets
    backward_i = BACKWARD_I + (RECOMPUTE_I if recomputes else 0.0)
    fetched = offload_fetched_bytes(args, mc, tokens, t_attn)
    backward = hidden + recompute + backward_i * s * args.intermediate_size * tokens + fetched
    parts["logits / loss buffers"] = int(loss_transient if loss_transient >= backward else 0)
    parts["backward buffers"] = int(backward - fetched if backward > loss_transient else 0)
    if moved:
        parts["offloaded, fetched back"] = int(fetched if backward > loss_transient else 0)
    if mc.gradient_checkpointing and backward > loss_transient:
        parts["backward buffers"] = int(backward - recompute)
        parts["recomputed layer"] = int(recompute)
    torch_bytes = sum(parts.values())
    parts["allocator slack"] = int(ALLOCATOR_SLACK_BYTES + ALLOCATOR_SLACK_FRACTION * torch_bytes)
    parts["CUDA context"] = CUDA_CONTEXT_BYTES
    host = {"pinned host (offload)": moved} if moved else {}
    if mc.host_embeddings and not args.tie_word_embeddings:  # ops.host_embedding
        table = args.vocab_size * h * s
        parts["base weights"] -= table
        host["pinned host (embeddings)"] = table
    return Breakdown(tokens, n, parts, "loss" if loss_transient >= backward else "backward", host)


def loss_chunk_bytes(args: ModelArgs, mc: MemoryConfig, targets: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The fused loss's [chunk, vocab] buffers alive at once over `targets` rows: the Triton
    chunk's logits in the compute dtype (turned into their gradient in place), or LOSS_CHUNK_COPIES
    fp32 chunks of the PyTorch one, with or without Gemma 2's final logit cap. 0 without the fused loss."""
    if not mc.fused_loss:
        return 0
    copies, per_logit = (1, mc.s) if mc.fused_layers else (LOSS_CHUNK_COPIES, 4)
    chunk = min(targets, chunk_rows_for(args.vocab_size, chunk_bytes, per_logit))
    return copies * per_logit * chunk * args.vocab_size


def quantized_base_change(args: ModelArgs, mc: MemoryConfig) -> int:
    """What base_quant changes in the base weights: the decoder linears' quantized bytes in place
    of their s bytes a weight (embeddings, head and norms stay dense)."""
    dense = args.num_hidden_layers * sum(o * i for o, i in linear_shapes(args)) * mc.s
    return quantized_weight_bytes(args, mc.base_quant, mc.kept_bytes) - dense


def dequant_workspace_bytes(args: ModelArgs, mc: MemoryConfig) -> int:
    """Dequantized base weights alive at once, s bytes a weight where a Triton kernel writes them
    in the compute dtype (NF4, the GGUF blocks), plus, for the plain reference, the fp32 values of
    the weight being dequantized (4 bytes a weight of the largest). Layer by layer (ops.quant_linear):
    one layer's largest weight, in forward and backward alike. Joined (lora.fuse_projections): the
    largest group's weights in one buffer (q/k/v's or gate/up's, model.quant.JoinedWeight); under
    gradient checkpointing each group call of the recomputed layer keeps its buffer for backward,
    so one layer's seven weights at once."""
    triton = mc.fused_layers and mc.base_quant in ("nf4", "keep")
    single = dequant_workspace_elements(args)
    if not mc.joined:
        return (mc.s if triton else 4 + mc.s) * single
    held = layer_weight_elements(args) if mc.gradient_checkpointing else dequant_workspace_elements(args, joined=True)
    return mc.s * held + (0 if triton else 4 * single)


def activation_bytes(args: ModelArgs, mc: MemoryConfig, tokens: int, targets: int | None = None) -> int:
    """Saved-for-backward bytes of one micro-batch (no checkpointing), LoRA casts included:
    what plan/measure.saved_activation_bytes measures."""
    b = breakdown(args, MemoryConfig(**{**mc.__dict__, "gradient_checkpointing": False}), tokens, targets)
    return b.parts["activations"] + b.parts["LoRA casts"]


def largest_micro_batch(args: ModelArgs, mc: MemoryConfig, memory_bytes: int, target_fraction: float = 1.0,
                        limit: int = 1 << 22) -> int:
    """The most tokens one micro-batch can hold with the predicted total within memory_bytes (0: none)."""
    def fits(t):
        return breakdown(args, mc, t, max(1, int(t * target_fraction))).total <= memory_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= limit and fits(limit):
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
