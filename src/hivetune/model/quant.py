"""A quantized frozen base (config key base_quant): the decoder layers' linear weights stay
quantized in memory, packed bytes and scales as buffers of a QuantLinear, and each matmul
dequantizes its weight on the fly, one layer's weight at a time (ops.quant_linear): on GPUs one
Triton kernel writes it in the compute dtype, then cuBLAS runs the matmul. LoRA sits on top as on a dense base
(lora.LoRALinear wraps a QuantLinear as it wraps an nn.Linear); training joins q/k/v and
gate/up as on a dense base (lora.fuse_projections), each group dequantizing its members into
one weight (JoinedWeight) for one matmul.

    nf4   QLoRA's 4-bit NormalFloat, double-quantized scales (ops.nf4), ~4.13 bits a weight
    int8  per-row absmax int8 (ops.int8), 8 bits a weight + 4 bytes a row
    keep  a GGUF base's own blocks (ops.gguf_blocks): Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K /
          Q5_K / Q6_K

Embeddings, the LM head and the norms stay dense, as in QLoRA. From an HF folder each weight is
quantized as it is read (load.build_model), so the dense model never exists whole; under keep
the blocks are copied from the file as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from hivetune.core.errors import UserError
from hivetune.model.config import ModelArgs
from hivetune.ops import gguf_blocks, int8, nf4
from hivetune.ops.quant_linear import dequant_linear

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "qkv_proj", "gate_up_proj")  # the last two: Phi-3's joined linears


@dataclass
class GGUFBlocks:
    """A GGUF tensor's blocks as the file stores them: raw [rows, row bytes] uint8, the ggml
    type id, shape (rows, cols) of the weight they hold (load.gguf_state_dict under keep)."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, int]


class QuantLinear(nn.Module):
    """A frozen linear layer whose weight [out, in] is kept quantized (`fmt`: nf4, int8 or
    gguf, with `parts` its tensors as buffers); the bias, if any, stays a dense frozen parameter."""

    def __init__(self, in_features: int, out_features: int, fmt: str, parts: dict[str, torch.Tensor],
                 qtype: int = 0, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.qtype = in_features, out_features, fmt, qtype
        for name, tensor in parts.items():
            self.register_buffer(name, tensor, persistent=False)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach(), requires_grad=False))

    @classmethod
    def quantized(cls, weight: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> "QuantLinear":
        """Quantize a dense weight [out, in] (on its device) as `fmt` (nf4 or int8)."""
        out_features, in_features = weight.shape
        if fmt == "nf4":
            parts = nf4.quantize(weight).tensors()
        else:
            q, absmax = int8.quantize(weight)
            parts = {"q": q, "absmax": absmax}
        return cls(in_features, out_features, fmt, parts, bias=bias)

    @classmethod
    def kept(cls, blocks: GGUFBlocks, bias: torch.Tensor | None = None) -> "QuantLinear":
        rows, cols = blocks.shape
        return cls(cols, rows, "gguf", {"raw": blocks.raw}, blocks.qtype, bias)

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    def dequantized(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [out, in] in `dtype` (computed in fp32, one cast); `out`: a contiguous
        [out, in] tensor in `dtype` to write it into (JoinedWeight's row slice), returned."""
        shape = (self.out_features, self.in_features)
        if self.fmt == "nf4":
            return nf4.dequantize_parts(self.packed, self.q_absmax, self.absmax2, self.offset, shape, dtype, out)
        if self.fmt == "int8":
            return int8.dequantize(self.q, self.absmax, dtype, out)
        w = gguf_blocks.dequantize(self.raw, self.qtype, self.in_features, dtype)
        return w if out is None else out.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dequant_linear(x, self.dequantized, self.bias)

    def quantized_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        kind = gguf_blocks.BLOCK_TYPES[self.qtype][0] if self.fmt == "gguf" else self.fmt
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, bias={self.bias is not None}"


class JoinedWeight:
    """(dtype) -> the weights [sum out, in] of layers that read one input (q/k/v, or gate/up:
    lora.FusedProjections on a quantized base), each dequantized into its row slice of one
    buffer in `dtype` (one Triton kernel a QuantLinear on GPUs, no copy after); a dense member's
    weight is copied in. The joined LoRA group then runs one matmul on it."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.rows = sum(m.out_features for m in layers)
        self.in_features = layers[0].in_features

    def __call__(self, dtype: torch.dtype) -> torch.Tensor:
        first = self.layers[0]
        device = first.device if isinstance(first, QuantLinear) else first.weight.device
        out = torch.empty((self.rows, self.in_features), dtype=dtype, device=device)
        row = 0
        for m in self.layers:
            rows = out[row:row + m.out_features]
            if isinstance(m, QuantLinear):
                m.dequantized(dtype, rows)
            else:
                rows.copy_(m.weight)
            row += m.out_features
        return out


def quantizes(name: str) -> bool:
    """Whether the HF tensor `name` is a decoder layer's linear weight (quantized by base_quant)."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS and ".layers." in name


def place_weight(model: nn.Module, name: str, tensor, base_quant: str, dtype: torch.dtype, device) -> bool:
    """Put the weight `name` into `model` as a QuantLinear (replacing the nn.Linear that holds
    it, whose bias it keeps), quantized now (nf4 / int8: from the weight in `dtype`) or kept
    (GGUFBlocks). Returns False where the weight stays dense (the caller assigns it)."""
    if base_quant == "none" or not quantizes(name):
        return False
    if base_quant == "keep" and not isinstance(tensor, GGUFBlocks):
        return False  # an F32 / F16 / BF16 tensor of a GGUF: dense
    module_name = name.rpartition(".")[0]
    parent_name, _, short = module_name.rpartition(".")
    old = model.get_submodule(module_name)
    bias = old.bias if old.bias is not None and not old.bias.is_meta else None
    if isinstance(tensor, GGUFBlocks):
        layer = QuantLinear.kept(GGUFBlocks(tensor.raw.to(device), tensor.qtype, tensor.shape), bias)
    else:
        layer = QuantLinear.quantized(tensor.to(device=device, dtype=dtype), base_quant, bias)
    if old.bias is not None and bias is None:
        layer.bias = old.bias  # still on meta: load.build_model assigns it when its tensor comes
    setattr(model.get_submodule(parent_name), short, layer)
    return True


def quantize_model(model: nn.Module, base_quant: str) -> int:
    """Quantize a dense model's decoder linear weights in place as `base_quant` (nf4, int8), one
    layer at a time, each dense weight freed as its QuantLinear replaces it (a model built in
    memory: bench and tune's random models). Returns the count."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and quantizes(f"{name}.weight"):
            parent, _, short = name.rpartition(".")
            setattr(model.get_submodule(parent), short, QuantLinear.quantized(module.weight, base_quant, module.bias))
            count += 1
    return count


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def quant_name(model: nn.Module) -> str:
    """nf4, int8, or the GGUF block types kept (e.g. Q4_1 or Q4_K+Q6_K); '' for a dense base."""
    kinds = {gguf_blocks.BLOCK_TYPES[m.qtype][0] if m.fmt == "gguf" else m.fmt
             for m in model.modules() if isinstance(m, QuantLinear)}
    return "+".join(sorted(kinds))


def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replace every QuantLinear (inside LoRA layers too) by an nn.Linear holding its
    dequantized weight in `dtype`, one layer at a time (export --format merged / gguf).
    Returns the count replaced."""
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantLinear):
            continue
        dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device="meta")
        dense.weight = nn.Parameter(module.dequantized(dtype), requires_grad=False)
        if module.bias is not None:
            dense.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
        parent, _, short = name.rpartition(".")
        setattr(model.get_submodule(parent), short, dense)
        count += 1
    return count


def nf4_bytes(n: int) -> int:
    blocks = math.ceil(n / nf4.BLOCK)
    return n // 2 + blocks + 4 * math.ceil(blocks / nf4.DQ_BLOCK) + 4


def linear_shapes(args: ModelArgs) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's seven linear weights."""
    h, hd, i = args.hidden_size, args.head_dim, args.intermediate_size
    q, kv = args.num_attention_heads * hd, args.num_key_value_heads * hd
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def quantized_weight_bytes(args: ModelArgs, base_quant: str, kept_bytes: int = 0) -> int:
    """Bytes of every decoder layer's linear weights as base_quant stores them (keep:
    `kept_bytes`, what the GGUF's blocks of those weights take)."""
    if base_quant == "keep":
        return kept_bytes
    per_layer = sum(nf4_bytes(o * i) if base_quant == "nf4" else o * i + 4 * o for o, i in linear_shapes(args))
    return args.num_hidden_layers * per_layer


def dequant_workspace_elements(args: ModelArgs, joined: bool = False) -> int:
    """The largest decoder linear weight, the one dequantized weight alive at a time layer by
    layer; `joined` (lora.FusedProjections): the largest group's, q/k/v's or gate/up's joined."""
    shapes = linear_shapes(args)
    if not joined:
        return max(o * i for o, i in shapes)
    return max(sum(o * i for o, i in shapes[:3]), shapes[3][0] * shapes[3][1],
               sum(o * i for o, i in shapes[4:6]), shapes[6][0] * shapes[6][1])


def layer_weight_elements(args: ModelArgs) -> int:
    """One decoder layer's linear weights, all seven."""
    return sum(o * i for o, i in linear_shapes(args))


def unsupported_block_type(source: str, tensor_name: str, type_name: str) -> UserError:
    """The one line for a GGUF tensor of a block type keep does not take."""
    return UserError(f"base_quant: keep: {source}: {tensor_name} is {type_name}, not one of the supported "
                     f"block types {', '.join(gguf_blocks.SUPPORTED)} (or F32, F16, BF16); use base_quant "
                     f"nf4 or int8 to requantize it")
