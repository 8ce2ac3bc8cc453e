"""LoRA: y = W x + (alpha / r) * B A dropout(x), saved and loaded in PEFT's format.

Module names follow PEFT's (``q_proj.base_layer``, ``q_proj.lora_A``, ``q_proj.lora_B``), so an
adapter key is ``base_model.model.<module>.lora_A.weight`` exactly as PEFT writes it and
``peft.PeftModel.from_pretrained`` loads our adapters onto the transformers model.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from hivetune.core.errors import UserError
from hivetune.core.config_schema import DEFAULT_TARGETS
from hivetune.ops import dropout as dropout_op
from hivetune.ops import lora_dropout
from hivetune.ops import norm as norm_op
from hivetune.ops.lora_casts import CastCache, casts_active, dropout_seed
from hivetune.ops.lora_group import lora_group
from hivetune.model.quant import JoinedWeight, QuantLinear
from hivetune.ops.quant_linear import dequant_linear

FROZEN_LINEARS = (nn.Linear, QuantLinear)  # what LoRA wraps: a dense or a quantized (model.quant) base

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class LoRASpec:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r (Kalajdzievski 2023)
    extra: dict = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


class LoRALinear(nn.Module):
    """A frozen nn.Linear (or model.quant.QuantLinear) plus a trainable low-rank update; A in
    fp32, B zero-initialised."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float, rslora: bool,
                 param_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.base_layer = base
        device = base.device if isinstance(base, QuantLinear) else base.weight.device
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=device, dtype=param_dtype)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=device, dtype=param_dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / (math.sqrt(r) if rslora else r)
        self.enabled = True  # False: behave as the base layer (A/B against the base model)
        self.fused = False  # True: forward through ops.lora_group (set by fuse_projections)
        self.keep_weight = False  # fused on a quantized base: the dequantized W kept for backward
        # PEFT's default init: A ~ kaiming_uniform(a=sqrt(5)), B = 0, so the update starts at 0.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor, dropped: torch.Tensor | None = None, source=None,
                residual: torch.Tensor | None = None, xd: torch.Tensor | None = None,
                unused: bool = False) -> torch.Tensor:
        """`dropped`: dropout(x) already drawn for a sibling layer reading the same x. `source`:
        (fn, tensor) with x = fn(tensor), a tensor kept for backward anyway (ops.lora_group).
        `residual`: returns residual + the layer's output (the decoder's residual stream; inside
        the base matmul on the joined path). `xd` (only where group_dropout_p() > 0): x dropped by
        the caller's kernel, which also takes the dropout's backward; fn(tensor) then gives xd.
        `unused`: the caller does not read the output (ops.lora_group's `unused`; the joined path
        only, elsewhere the output is made as usual)."""
        if self.fused and self.enabled and dropped is None:
            base = self.base_layer
            weight = base.dequantized if isinstance(base, QuantLinear) else base.weight
            return lora_group(x, weight, base.bias, (base.out_features,), self.dropout_p(), self.scaling,
                              [self.lora_A.weight], [self.lora_B.weight], source, residual, xd,
                              keep_weight=self.keep_weight, unused=unused)
        y = self.base_layer(x)
        if self.enabled:
            if dropped is None:
                dropped = self.lora_dropout(x)
            a = self.lora_A(dropped.to(self._compute_dtype(x))) * self.scaling  # scale the rank-r side
            y = add_low_rank(y, a, self.lora_B.weight)
        return y if residual is None else residual + y

    def dropout_p(self) -> float:
        """The dropout probability in force now (0 in eval mode)."""
        d = self.lora_dropout
        return d.p if isinstance(d, nn.Dropout) and d.training else 0.0

    def group_dropout_p(self) -> float:
        """The dropout probability a caller may apply for this layer's group (the `xd` of forward):
        the one in force where the layer runs through ops.lora_group with grad on, else 0."""
        return self.dropout_p() if self.fused and self.enabled and torch.is_grad_enabled() else 0.0

    def _compute_dtype(self, x):
        # Under autocast the matmul casts for us; without it, run the update in A's dtype.
        return x.dtype if torch.is_autocast_enabled(x.device.type) else self.lora_A.weight.dtype

    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B A in fp32 (for export)."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        base = self.base_layer
        return (base.dequantized() if isinstance(base, QuantLinear) else base.weight.float()) + self.scaling * delta


def add_low_rank(y: torch.Tensor, a: torch.Tensor, b_weight: torch.Tensor) -> torch.Tensor:
    """y + a @ B^T as one addmm: the add rides in the matmul's epilogue, so no [T, out]
    temporary is written and read again (y, a: [..., out], [..., r]; B: [out, r])."""
    if not torch.is_autocast_enabled(y.device.type) and a.dtype != y.dtype:
        a, b_weight = a.to(y.dtype), b_weight.to(y.dtype)  # e.g. fp32 LoRA on a bf16 base at eval
    out = torch.addmm(y.reshape(-1, y.shape[-1]), a.reshape(-1, a.shape[-1]), b_weight.t())
    return out.view(y.shape)


def shares_one_update(lora: list[LoRALinear], layers) -> bool:
    """Whether the enabled LoRA layers `lora` are all of `layers` and alike (rank, scale, the
    dropout in force), so one dropout draw and one A matmul can serve the group."""
    first = lora[0]
    return len(lora) == len(layers) and all(
        m.scaling == first.scaling and m.lora_A.out_features == first.lora_A.out_features
        and m.dropout_p() == first.dropout_p() for m in lora)


def project_shared_input(x: torch.Tensor, *layers: nn.Module) -> list[torch.Tensor]:
    """Apply layers that all read x (q/k/v, or gate/up), drawing one LoRA dropout mask for all.

    PEFT draws an independent mask per layer; sharing one is still dropout on each layer's
    LoRA input (same marginal distribution) and cuts the random numbers per layer from 7 to 4
    sets: on the CPU, drawing masks costs more than the LoRA matmuls themselves.
    """
    lora = [m for m in layers if isinstance(m, LoRALinear) and m.enabled]
    if len(lora) < 2 or not shares_one_update(lora, layers):
        return [m(x) for m in layers]
    first = lora[0]
    # One A for all: x @ [A_q; A_k; A_v]^T is one [T, 3r] matmul instead of three [T, r] ones
    # (forward and backward), then each B adds its own update onto its base output.
    dropped = first.lora_dropout(x).to(first._compute_dtype(x))
    a_all = torch.nn.functional.linear(dropped, torch.cat([m.lora_A.weight for m in lora])) * first.scaling
    rank = first.lora_A.out_features
    return [add_low_rank(m.base_layer(x), a, m.lora_B.weight) for m, a in zip(lora, a_all.split(rank, dim=-1))]


def drops_in_matmul(d: int, r: int, room: int) -> bool:
    """Whether a group of input width d and n r = `r` LoRA rows takes the in-matmul dropout
    kernels (ops.lora_dropout) rather than the norm's dropout kernel (FusedProjections.normed):
    where their shapes suit and the group has no wide layout (`room`: its free columns). With
    one, the norm's dropped input lets the LoRA update ride in the base matmul, which the
    in-matmul kernels cannot: W4's gate/up otherwise adds a matmul reading and writing all of
    its [T, 12,288] output each way (docs/log.md)."""
    return lora_dropout.drop_matmul_shape(d, r) and not room


class FusedProjections:
    """Layers that read one input (q/k/v, or gate/up) with their base weights stored as one
    [sum out, in] tensor: each ``base_layer.weight`` is a row view of it, so parameter names,
    loading and merging are unchanged, while the forward runs one base matmul for the group and
    the LoRA updates through ``ops.lora_group`` (see there for the formulas and the why).

    Calling it gives the joined output [..., sum out], or None when the group's LoRA layers are
    in mixed states (some disabled, or different ranks / scales / dropout): the caller then runs
    the layers one by one (``project_shared_input``), which is also the reference path.

    `storage` [sum out, in + room] (the wide layout, lora.fuse_projections): the weight is its
    first `in` columns and the CastCache writes the group's block-diagonal B into the next
    k = n r (`lora_cols`; room >= k keeps rows 128 bytes apart), so that the base matmul takes the
    LoRA update along (ops.lora_group.wide_matrix); its input then comes with `room` columns after
    each row.

    On a quantized base (any member a model.quant.QuantLinear) the members keep their packed
    blocks and ``weight`` is a model.quant.JoinedWeight: each call dequantizes them into one
    [sum out, in] buffer (a kernel a member) for the group's one matmul; `keep_weight` (under
    gradient checkpointing, lora.fuse_projections) keeps that buffer for backward instead of
    dequantizing again there.
    """

    def __init__(self, layers: list[nn.Module], storage: torch.Tensor | None = None, lora_cols: int = 0,
                 keep_weight: bool = False):
        self.layers = layers
        bases = [m.base_layer if isinstance(m, LoRALinear) else m for m in layers]
        self.sizes = tuple(b.out_features for b in bases)
        d = bases[0].in_features
        self.quantized = any(isinstance(b, QuantLinear) for b in bases)
        if self.quantized and storage is not None:
            raise ValueError("a quantized base has no wide layout")
        self.keep_weight = keep_weight and self.quantized
        self.room, self.lora_cols = (0, 0) if storage is None else (storage.shape[1] - d, lora_cols)
        self.b_slot = None if storage is None else storage[:, d:d + lora_cols]  # where the CastCache writes Bd
        with torch.no_grad():
            if self.quantized:
                self.weight = JoinedWeight(bases)
            elif storage is None:
                self.weight = torch.cat([b.weight for b in bases])
            else:
                self.weight, row = storage[:, :d], 0
                for b in bases:
                    self.weight[row:row + b.out_features].copy_(b.weight)
                    row += b.out_features
            self.bias = torch.cat([b.bias for b in bases]) if all(b.bias is not None for b in bases) else None
            if self.bias is None and any(b.bias is not None for b in bases):
                raise ValueError("fuse only layers that all have a bias or none")
        row = 0
        for b, size in zip(bases, self.sizes):  # the separate tensors are freed, the views remain
            if not self.quantized:
                b.weight = nn.Parameter(self.weight[row:row + size], requires_grad=False)
            if self.bias is not None:
                b.bias = nn.Parameter(self.bias[row:row + size], requires_grad=False)
            row += size

    def _room(self, lora: list) -> int:
        """The free columns the wide path writes xa into: the layout's room where its LoRA columns
        are these layers' A rows and the casts are in force, else 0."""
        return self.room if self.lora_cols == len(lora) * lora[0].lora_A.out_features and casts_active() else 0

    def __call__(self, x: torch.Tensor, source=None) -> torch.Tensor | None:
        """`source`: (fn, tensor) with x = fn(tensor), kept for backward anyway (ops.lora_group)."""
        lora = [m for m in self.layers if isinstance(m, LoRALinear) and m.enabled]
        if not lora:
            if self.quantized:
                return dequant_linear(x, self.weight, self.bias)
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if not shares_one_update(lora, self.layers):
            return None
        first = lora[0]
        room = self._room(lora)
        if room and (first.dropout_p() == 0 or not dropout_op.seeded_dropout_ok(x)):
            # x into a buffer with the free columns the wide path writes xa into (the seeded
            # dropout of the group's own is not taken there: no copy for nothing)
            x = torch.nn.functional.pad(x, (0, room))[..., :x.shape[-1]]
        else:
            room = 0
        return lora_group(x, self.weight, self.bias, self.sizes, first.dropout_p(), first.scaling,
                          [m.lora_A.weight for m in lora], [m.lora_B.weight for m in lora], source, room=bool(room),
                          keep_weight=self.keep_weight)

    def normed(self, norm: nn.Module, x: torch.Tensor):
        """(self(norm(x)), x') with the norm and the group's LoRA dropout as one kernel each way
        (norm_op.rms_norm_dropped): the base matmul reads norm(x), the A matmul its dropped
        copy, and x' is x for the residual add, whose gradient the norm's backward adds. W1 ran
        ~140 kernels a step fewer: the dropout, its masked add into dx and autograd's add of the
        residual's gradient, per group and layer. None where that does not apply (no seeded
        dropout in force, a norm that is not the Triton one, autocast into another dtype, the
        in-matmul dropout kernels chosen for the group: drops_in_matmul); the caller then runs
        norm(x) and the group."""
        lora = [m for m in self.layers if isinstance(m, LoRALinear) and m.enabled]
        if not lora or not shares_one_update(lora, self.layers) or not torch.is_grad_enabled():
            return None
        first = lora[0]
        p = first.dropout_p()
        device = x.device.type
        room = self._room(lora)
        if (p <= 0 or not norm_op.rms_norm_dropped_ok(x, norm.weight)
                or (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != x.dtype)
                or drops_in_matmul(x.shape[-1], len(lora) * first.lora_A.out_features, room)):
            return None
        seed = dropout_seed(x.device)
        y, yd, residual = norm_op.rms_norm_dropped(x, norm.weight, norm.eps, seed, p, room)
        redo = partial(norm_op.rms_norm_dropped_only, weight=norm.weight, eps=norm.eps, seed=seed, p=p)
        joined = lora_group(y, self.weight, self.bias, self.sizes, p, first.scaling, [m.lora_A.weight for m in lora],
                            [m.lora_B.weight for m in lora], (redo, x), xd=yd, room=bool(room),
                            keep_weight=self.keep_weight)
        return joined, residual


def fuse_projections(model: nn.Module, wide: bool | None = None, keep_weight: bool | None = None) -> int:
    """Join q/k/v and gate/up of every decoder layer (FusedProjections) and route every LoRA
    layer through ops.lora_group. For training on one device or under DDP, after the model is on
    its device (``.to()`` would split the views again); not for FSDP-sharded parameters.
    `wide`: store each group's weights in the wide layout (FusedProjections), all layers' of one
    group in one tensor (the CastCache then writes every layer's B with one kernel); None: on
    CUDA (on the CPU the input's copy into a wider buffer costs about what it saves); never on a
    quantized base. `keep_weight` (a quantized base): each group call keeps its dequantized
    weight for backward instead of dequantizing it again there; None: the model's
    gradient_checkpointing (set it first), under which one layer's saved tensors live at a time
    (recompute and backward then dequantize once, not twice); with checkpoint_layers, only the
    checkpointed layers keep theirs. Returns the number of groups joined."""
    layers = list(getattr(getattr(model, "model", None), "layers", []))
    quantized = any(isinstance(m, QuantLinear) for m in model.modules())
    if wide is None:
        wide = bool(layers) and layers[0].input_layernorm.weight.is_cuda
    wide = wide and not quantized  # the weights are dequantized per call: no storage to widen
    if keep_weight is None:
        keep_weight = bool(getattr(model, "gradient_checkpointing", False))
    # only a checkpointed layer keeps its weights (its saved tensors live one layer at a time)
    checkpointed = (model.checkpointed_layers() if getattr(model, "gradient_checkpointing", False)
                    and hasattr(model, "checkpointed_layers") else len(layers))
    keeps = {id(m): keep_weight and i < checkpointed for i, layer in enumerate(layers) for m in layer.modules()}
    groups, calls, joined, widened = 0, [], set(), False
    for owner, name, members in (("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")),
                                 ("mlp", "gate_up", ("gate_proj", "up_proj"))):
        if not all(hasattr(getattr(layer, owner), m) for layer in layers for m in members):
            continue  # joined in the checkpoint already (Phi-3's qkv_proj, gate_up_proj)
        kind = [[getattr(getattr(layer, owner), m) for m in members] for layer in layers]
        # one kind at a time: its old weights are freed as its layers move into the storage
        storage = _wide_storage(kind) if wide else None
        widened |= storage is not None
        for i, layer in enumerate(layers):
            fused = FusedProjections(kind[i], storage[i] if storage is not None else None,
                                     len(members) * kind[i][0].lora_A.out_features if storage is not None else 0,
                                     keeps[id(layer)])
            setattr(getattr(layer, owner), name, fused)
            groups += 1
            if all(isinstance(m, LoRALinear) for m in fused.layers):
                calls.append(([m.lora_A.weight for m in fused.layers], [m.lora_B.weight for m in fused.layers],
                              fused.sizes, fused.b_slot))
                joined.update(id(m) for m in fused.layers)
    for _, m in lora_modules(model):
        m.fused, m.keep_weight = True, keeps.get(id(m), keep_weight) and isinstance(m.base_layer, QuantLinear)
        if id(m) not in joined:
            calls.append(([m.lora_A.weight], [m.lora_B.weight], (m.out_features,), None))
    model.lora_casts = CastCache(calls) if calls else None  # refreshed by CausalLM.forward
    if widened:  # the segments the widening emptied, freed whole
        for owner, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            stack_frozen([getattr(getattr(layer, owner), name) for layer in layers])
    return groups


def stack_frozen(modules: list[nn.Module]) -> torch.Tensor | None:
    """After the wide layout's widening (fuse_projections): the frozen base weights of one linear
    kind (o_proj, or down_proj) of every layer moved into one [L, out, in] tensor, each layer's
    weight a view of it (names, loading and merging unchanged), the separate tensors freed. Why:
    per-layer weights under 10 MiB share the CUDA allocator's 20 MiB segments; the widening frees
    q/k/v's and gate/up's, but an o_proj or down_proj left beside them keeps each segment: W1
    holds ~0.4 GiB of free blocks empty_cache cannot hand back, and under its 4 GiB cap the
    optimizer's first state runs out of memory. Stacked, the old segments hold nothing (W1's
    figures: docs/log.md). Returns the stack, or None (layers that differ in shape, dtype or
    device, or a trainable weight: left as they are)."""
    bases = [m.base_layer if isinstance(m, LoRALinear) else m for m in modules]
    if not bases or not all(isinstance(b, nn.Linear) for b in bases):
        return None
    first = bases[0].weight
    if any(b.weight.requires_grad or b.weight.shape != first.shape or b.weight.dtype != first.dtype
           or b.weight.device != first.device for b in bases):
        return None
    stack = torch.empty((len(bases), *first.shape), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for i, b in enumerate(bases):
            stack[i].copy_(b.weight)
            b.weight = nn.Parameter(stack[i], requires_grad=False)
    return stack


def _wide_storage(groups: list[list[nn.Module]]) -> torch.Tensor | None:
    """One group kind's weights in the wide layout for every layer, [L, sum out, in + room] in the
    base weights' dtype (FusedProjections' `storage`; room: n r up to a multiple of 64 columns, so
    rows start 128-byte aligned), or None unless every layer of the kind is LoRA with one rank
    (then the groups stay as they were)."""
    if not groups or not all(isinstance(m, LoRALinear) for g in groups for m in g):
        return None
    first = groups[0][0]
    r, w = first.lora_A.out_features, first.base_layer.weight
    if any(m.lora_A.out_features != r or m.base_layer.weight.dtype != w.dtype for g in groups for m in g):
        return None
    rows, cols = sum(m.out_features for m in groups[0]), w.shape[1] + len(groups[0]) * r
    return torch.zeros((len(groups), rows, -(-cols // 64) * 64), dtype=w.dtype, device=w.device)


def target_names(model: nn.Module) -> list[str]:
    """Short names of the linear layers LoRA can target, e.g. q_proj ... down_proj."""
    names = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, FROZEN_LINEARS)}
    names.discard("lm_head")
    return sorted(names)


# Models whose q/k/v and gate/up are one linear each (Phi-3): the split names map to the joined
# ones, as PEFT names them (its target_modules for phi3: qkv_proj, o_proj, gate_up_proj, down_proj).
JOINED_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                  "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def model_targets(targets, valid: list[str]) -> tuple[str, ...]:
    """`targets` in the model's own names: q_proj / k_proj / v_proj -> qkv_proj and gate_proj /
    up_proj -> gate_up_proj where the model has the joined layer and not the split one."""
    out = []
    for t in targets:
        t = JOINED_TARGETS[t] if t not in valid and JOINED_TARGETS.get(t) in valid else t
        if t not in out:
            out.append(t)
    return tuple(out)


def apply_lora(model: nn.Module, spec: LoRASpec, param_dtype=torch.float32) -> list[str]:
    """Swap each targeted nn.Linear for a LoRALinear; freeze everything else. Returns the names.
    spec.targets becomes the model's own names (model_targets), as the adapter config lists them."""
    valid = target_names(model)
    spec.targets = model_targets(spec.targets, valid)
    unknown = [t for t in spec.targets if t not in valid]
    if unknown:
        raise UserError(f"lora.targets: {', '.join(unknown)} matches no module "
                        f"(valid: {', '.join(valid)})")
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        short = name.rpartition(".")[2]
        if short in spec.targets and isinstance(module, FROZEN_LINEARS) and name != "lm_head":
            parent = model.get_submodule(name.rpartition(".")[0])
            setattr(parent, short, LoRALinear(module, spec.r, spec.alpha, spec.dropout,
                                              spec.rslora, param_dtype))
            wrapped.append(name)
    return wrapped


def lora_modules(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextmanager
def lora_enabled(model: nn.Module, enabled: bool):
    """Temporarily switch every LoRA update on or off."""
    modules = [m for _, m in lora_modules(model)]
    before = [m.enabled for m in modules]
    for m in modules:
        m.enabled = enabled
    try:
        yield
    finally:
        for m, b in zip(modules, before):
            m.enabled = b


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, m in lora_modules(model) for p in (m.lora_A.weight, m.lora_B.weight)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key names: base_model.model.<module>.lora_A.weight; tensors on the CPU, each its own
    storage (safetensors refuses tensors that share one)."""
    weights = {}
    for name, m in lora_modules(model):
        for part in ("lora_A", "lora_B"):
            weight = getattr(m, part).weight.detach()
            if hasattr(weight, "full_tensor"):  # an FSDP2 shard (DTensor): gathered, a collective
                weight = weight.full_tensor()
            weights[f"base_model.model.{name}.{part}.weight"] = weight
    return to_host(weights)


STAGE_BYTES = 16 << 20  # to_host's pinned staging buffer


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU, each in its own storage (safetensors refuses shared ones). GPU
    tensors of one dtype go as one buffer: W2's 392 LoRA tensors one by one take ~0.2 s of the
    adapter save (each copy a sync and a small pageable transfer). On CUDA that buffer comes
    through a 16 MiB pinned stage, chunk by chunk, into the tensors' own host memory: W2's 323 MB
    in ~0.055 s, 0.149 s the first time, against ~0.3 s as one pageable copy and a clone per
    tensor on an H100. One pinned buffer of the whole size costs more the first time (its
    allocation), and a fit's save is a first time (figures in docs/log.md)."""
    on_gpu = [t for t in tensors.values() if t.device.type != "cpu"]
    if len(on_gpu) < 2 or len({(t.device, t.dtype) for t in on_gpu}) > 1:
        return {k: t.contiguous().cpu() for k, t in tensors.items()}
    joined = torch.cat([t.reshape(-1) for t in on_gpu])
    out = {k: (t.contiguous() if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype))
           for k, t in tensors.items()}
    stage = torch.empty(max(1, min(joined.numel(), STAGE_BYTES // joined.element_size())), dtype=joined.dtype,
                        pin_memory=joined.is_cuda)
    through_stage(joined, [out[k].view(-1) for k, t in tensors.items() if t.device.type != "cpu"], stage)
    return out


def through_stage(joined: torch.Tensor, pieces: list[torch.Tensor], stage: torch.Tensor) -> None:
    """Copy `joined` (on the device) into the host tensors `pieces` (1-D, in order, as many
    elements in all), one stage-sized chunk at a time through `stage` (pinned memory on CUDA)."""
    remaining = iter(pieces)
    piece, used = next(remaining, None), 0  # the host tensor being filled and how much of it is
    for start in range(0, joined.numel(), stage.numel()):
        chunk = stage[:min(stage.numel(), joined.numel() - start)]
        chunk.copy_(joined[start:start + chunk.numel()])  # blocking: the stage is read next
        taken = 0
        while piece is not None and taken < chunk.numel():
            n = min(piece.numel() - used, chunk.numel() - taken)
            piece[used:used + n].copy_(chunk[taken:taken + n])
            used, taken = used + n, taken + n
            while piece is not None and used == piece.numel():
                piece, used = next(remaining, None), 0


def peft_config(spec: LoRASpec, base_model_path: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path,
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.targets),
        "use_rslora": spec.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "revision": None,
    }


def save_adapter(model: nn.Module, spec: LoRASpec, folder: Path, base_model_path: str,
                 tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Write adapter_config.json + adapter_model.safetensors (PEFT format) into `folder`.

    Each file goes to a temporary name first and is renamed into place, so a crash never
    leaves a half-written adapter under the final name.
    """
    from safetensors.torch import save_file

    from hivetune.core.fileio import atomic_write_bytes, atomic_write_with

    folder.mkdir(parents=True, exist_ok=True)
    tensors = lora_state_dict(model) if tensors is None else tensors
    atomic_write_with(folder / ADAPTER_WEIGHTS, lambda tmp: save_file(tensors, str(tmp), {"format": "pt"}))
    cfg = peft_config(spec, base_model_path)
    atomic_write_bytes(folder / ADAPTER_CONFIG, json.dumps(cfg, indent=2).encode())


def read_adapter_spec(folder: Path) -> LoRASpec:
    path = Path(folder) / ADAPTER_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found (is {folder} a run folder or adapter folder?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable adapter config ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    targets = cfg.get("target_modules") or list(DEFAULT_TARGETS)
    if isinstance(targets, str):
        raise UserError(f"{path}: target_modules as a regex is not supported; list the names")
    return LoRASpec(r=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", cfg["r"])), dropout=0.0,
                    targets=tuple(targets), rslora=bool(cfg.get("use_rslora", False)))


def load_adapter(model: nn.Module, folder: str | Path, param_dtype=torch.float32) -> LoRASpec:
    """Apply LoRA to `model` as the adapter in `folder` describes and load its weights."""
    from safetensors.torch import load_file

    folder = Path(folder)
    spec = read_adapter_spec(folder)
    apply_lora(model, spec, param_dtype)
    path = folder / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise UserError(f"{path}: not found") from None
    except Exception as e:
        raise UserError(f"{path}: unreadable adapter weights ({e})") from None
    params = {}
    for name, m in lora_modules(model):
        params[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.weight
        params[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.weight
    # PEFT sometimes writes the adapter name into keys (lora_A.default.weight): accept both.
    tensors = {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}
    missing = set(params) - set(tensors)
    if missing:
        raise UserError(f"{path}: missing {len(missing)} LoRA tensors, e.g. {sorted(missing)[0]}")
    with torch.no_grad():
        for key, p in params.items():
            t = tensors[key]
            if t.shape != p.shape:
                raise UserError(f"{path}: {key} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            p.copy_(t)
    return spec
