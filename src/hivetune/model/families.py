"""Decoder layers of the families beyond the Llama shape, and attention with a window, a scale or
a soft cap.

- Gemma 2 / Gemma 3 (text): RMSNorm with (1 + w), GeGLU (gelu, tanh approximation), a norm
  before and after both attention and MLP, attention scale query_pre_attn_scalar^-0.5, sliding
  layers beside global ones; Gemma 2 soft-caps the attention scores, Gemma 3 norms q and k and
  gives its sliding layers their own RoPE base. (The embedding scale and the final logit cap sit
  in model.decoder.CausalLM.)
- Phi-3 / Phi-4-mini: q/k/v as one qkv_proj and gate/up as one gate_up_proj (HF's and PEFT's
  names), RoPE on the first rotary_dim dims of a head.

Parameter names equal transformers' own, so HF weights load without renaming and PEFT adapter
keys match. The layers take the decoder's calling convention: layer(x, cos, sin, layout, cache).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from hivetune.model.config import ModelArgs
from hivetune.model.lora import LoRALinear, project_shared_input
from hivetune.ops import norm as norm_op
from hivetune.ops import rope as rope_op
from hivetune.ops import swiglu as swiglu_op
from hivetune.ops.attention import SDPA_BACKENDS, Masked, Packed, causal_attention

GEMMA = ("gemma2", "gemma3_text")


# ------------------------------------------------------------------------------ attention


def attend(q, k, v, layout=None, cache=None, layer: int = 0, *, scale: float | None = None,
           softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention, q [B, T, H, D], k / v [B, T, KVH, D] -> [B, T, H, D], where a query
    sees only keys less than `window` positions back (a sliding layer), scores are
    q k^T * `scale` (None: D^-0.5) and, with `softcap`, become cap * tanh(scores / cap).

    Without a cap the scale rides in q (q * scale * sqrt(D)), and where the window reaches past
    no example (every key within it) the call is plain causal attention with all its fast paths
    (ops.attention: flash varlen on packed rows). Otherwise an explicit mask: SDPA with it, or
    eager attention where the scores are capped (no fused kernel caps them)."""
    d = q.shape[-1]
    if softcap is None and scale is not None and scale != d ** -0.5:
        q, scale = q * (scale * math.sqrt(d)), None
    if softcap is None and not window_cuts(window, q, layout, cache):
        return causal_attention(q, k, v, layout, cache, layer)
    if isinstance(layout, Packed) and cache is not None:  # prefill: the prompts see only themselves
        cache.fill_packed(layer, k[0], v[0], layout.lengths)
        cache = None
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        k, v = cache.append(layer, k, v)
    allowed = allowed_keys(layout, q.shape[2], k.shape[2], window, q.device)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if softcap is None:
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    else:
        out = capped_attention(q, k, v, allowed, d ** -0.5 if scale is None else scale, softcap)
    return out.transpose(1, 2)


def window_cuts(window: int | None, q: torch.Tensor, layout, cache) -> bool:
    """Whether some query has keys `window` or more positions back (the window hides them)."""
    if window is None:
        return False
    if isinstance(layout, Packed):
        return max(layout.lengths or (layout.max_seqlen,)) > window
    keys = q.shape[1] + (cache.length if cache is not None else 0)
    return keys > window


def allowed_keys(layout, q_len: int, k_len: int, window: int | None, device) -> torch.Tensor:
    """Bool mask [B or 1, 1, Q, K], True where a query may attend: the layout's causal mask and,
    with a window, keys less than `window` slots back (queries are the last Q of K slots; a slot
    distance is a position distance: left pads come first, packed examples are contiguous), or
    less than `window` positions back where a Masked layout gives its slots' positions."""
    if layout is None:
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)[None, None]
    elif isinstance(layout, Packed):
        allowed = layout.block_causal_mask(q_len)
    elif isinstance(layout, Masked):
        mask = layout.mask
        allowed = mask if mask.dtype == torch.bool else mask == 0
    else:
        raise TypeError(f"unknown attention layout {type(layout).__name__}")
    if window is not None and isinstance(layout, Masked) and layout.positions is not None:
        pos = layout.positions  # [B, K]
        allowed = allowed & ((pos[:, None, -q_len:, None] - pos[:, None, None, :]) < window)
    elif window is not None:
        qpos = torch.arange(q_len, device=device) + (k_len - q_len)
        near = (qpos[:, None] - torch.arange(k_len, device=device)[None, :]) < window
        allowed = allowed & near
    return allowed


def capped_attention(q, k, v, allowed, scale: float, cap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) masked) v, the softmax in fp32; [B, H, Q, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of x [B, T, H, D], the rest as is."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return rope_op.apply_rope(x, cos, sin)
    return torch.cat([rope_op.apply_rope(x[..., :rot].contiguous(), cos, sin), x[..., rot:]], dim=-1)


def out_projection(o_proj: nn.Module, out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """o_proj(out) (+ residual, inside the LoRA matmul where it can)."""
    if isinstance(o_proj, LoRALinear):
        return o_proj(out, residual=residual)
    return o_proj(out) if residual is None else residual + o_proj(out)


# ------------------------------------------------------------------------------ Gemma


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: y = (1 + w) * x / sqrt(mean(x^2) + eps), w stored zero-centred, the
    product taken in fp32 and then cast (the reference); the fused norm kernel on GPUs takes
    (1 + w) in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        if norm_op.rms_norm_fused(x, self.weight):
            return norm_op.rms_norm(x, scale.to(x.dtype), self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)

    def source(self, x: torch.Tensor):
        return None  # no fused norm + LoRA dropout for this norm (decoder.read_input)


def attention_projections(block: nn.Module, args: ModelArgs, layer_idx: int, qk_norm: type, o_bias: bool) -> None:
    """An attention block's head counts, q/k/v/o projections, q/k norms (of the family's norm
    class `qk_norm`, where args.qk_norm) and sliding window: decoder.Attention's and GemmaAttention's."""
    h, hd = args.hidden_size, args.head_dim
    block.n_heads, block.n_kv, block.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
    block.layer_idx = layer_idx
    block.q_proj = nn.Linear(h, block.n_heads * hd, bias=args.attention_bias)
    block.k_proj = nn.Linear(h, block.n_kv * hd, bias=args.attention_bias)
    block.v_proj = nn.Linear(h, block.n_kv * hd, bias=args.attention_bias)
    block.o_proj = nn.Linear(block.n_heads * hd, h, bias=o_bias)
    if args.qk_norm:
        block.q_norm = qk_norm(hd, args.rms_norm_eps)
        block.k_norm = qk_norm(hd, args.rms_norm_eps)
    else:
        block.q_norm = block.k_norm = None
    block.qkv = None  # a lora.FusedProjections of q/k/v once lora.fuse_projections ran
    block.window = args.layer_window(layer_idx)  # Mistral's sliding window, Gemma's local layers


class GemmaAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        attention_projections(self, args, layer_idx, OffsetRMSNorm, args.attention_bias)
        self.scale = (args.query_pre_attn_scalar or args.head_dim) ** -0.5
        self.softcap = args.attn_logit_softcapping
        self.local_rope = args.rope_local_theta is not None and self.window is not None

    def forward(self, h, cos, sin, layout=None, cache=None):
        """h: the normed residual stream -> the block's output (the residual add is the layer's)."""
        b, t, _ = h.shape
        joined = self.qkv(h) if self.qkv is not None else None
        if joined is not None:
            q, k, v = joined.split(self.qkv.sizes, dim=-1)
        else:
            q, k, v = project_shared_input(h, self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv, self.head_dim)
        v = v.reshape(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos.dim() == 4:  # Gemma 3's tables: [global, local]
            cos, sin = (cos[1], sin[1]) if self.local_rope else (cos[0], sin[0])
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = attend(q, k, v, layout, cache, self.layer_idx, scale=self.scale, softcap=self.softcap,
                     window=self.window)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)): the SwiGLU kernel does not take it (plain PyTorch)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gate_up = None  # a lora.FusedProjections of gate/up once lora.fuse_projections ran

    def forward(self, x):
        joined = self.gate_up(x) if self.gate_up is not None else None
        if joined is not None:
            gate, up = joined.chunk(2, dim=-1)
        else:
            gate, up = project_shared_input(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_ffn_norm(mlp(pre_ffn_norm(x)))."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = GemmaAttention(args, layer_idx)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = GeGLU(args)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(self, x, cos, sin, layout=None, cache=None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, layout, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


# ------------------------------------------------------------------------------ Phi-3


class Phi3Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        h, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.layer_idx = layer_idx
        self.sizes = (self.n_heads * hd, self.n_kv * hd, self.n_kv * hd)
        self.qkv_proj = nn.Linear(h, sum(self.sizes), bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        self.window = args.layer_window(layer_idx)
        self.full_rotary = args.rotary_dim == hd

    def forward(self, x, cos, sin, layout=None, cache=None, norm=None):
        """x: the residual stream; returns x + the block's output (norm: the layer's input norm)."""
        b, t, _ = x.shape
        joined = self.qkv_proj(norm(x))
        if self.full_rotary and rope_op.rope_qkv_ok(joined, cos):
            q, k, v = rope_op.rope_qkv(joined, cos, sin, self.n_heads, self.n_kv)  # one kernel each way
        else:
            q, k, v = joined.split(self.sizes, dim=-1)
            q = rotate(q.reshape(b, t, self.n_heads, self.head_dim), cos, sin)
            k = rotate(k.reshape(b, t, self.n_kv, self.head_dim), cos, sin)
            v = v.reshape(b, t, self.n_kv, self.head_dim)
        out = attend(q, k, v, layout, cache, self.layer_idx, window=self.window)
        return out_projection(self.o_proj, out.reshape(b, t, self.n_heads * self.head_dim), x)


class Phi3MLP(nn.Module):
    """down(silu(gate) * up) with [gate | up] = gate_up_proj(x): the fused SwiGLU kernel reads it."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x, norm=None, last=False):  # last: decoder.MLP's (not used here)
        h = swiglu_op.swiglu_joined(self.gate_up_proj(norm(x)))
        return out_projection(self.down_proj, h, x)


# The layers decoder.CausalLM builds for a family: a layer class of its own (Gemma's sandwich
# norms), or the (attention, MLP) blocks inside decoder.DecoderLayer (Phi-3's joined projections).
LAYERS = {"gemma2": GemmaLayer, "gemma3_text": GemmaLayer}
BLOCKS = {"phi3": (Phi3Attention, Phi3MLP)}
