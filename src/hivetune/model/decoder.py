"""A compact Llama-family decoder whose parameter names equal transformers' own.

Same names mean HF safetensors load with no renaming and PEFT adapter keys are
``base_model.model.<our module name>.lora_A.weight``. The forward returns the final hidden
states; the LM head is applied by the caller, so training can project only the positions
that carry a loss (see ``hivetune.ops.loss``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn as nn

from hivetune.model.config import ModelArgs, checkpointed_count
from hivetune.model.families import BLOCKS, GEMMA, LAYERS, OffsetRMSNorm, attend, attention_projections, window_cuts
from hivetune.model.lora import LoRALinear, project_shared_input
from hivetune.ops import norm as norm_op
from hivetune.ops import rope as rope_op
from hivetune.ops import swiglu as swiglu_op
from hivetune.ops.attention import Packed, causal_attention
from hivetune.ops.lora_casts import SeedTape, dropout_seed, replaying
from hivetune.ops.recompute import checkpoint
from hivetune.ops.loss import cap_logits


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), the statistic taken in fp32 as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one Triton kernel each way on GPUs (ops.norm), saving only x and 1/rms
        return norm_op.rms_norm(x, self.weight, self.eps)

    def source(self, x: torch.Tensor):
        """(fn, x) with fn(x) = this norm's output, for the LoRA group reading that output: x is
        kept for the norm's backward anyway, so under the seeded dropout the group keeps x and
        recomputes the output (one small kernel) instead of saving the dropped output, a
        [T, hidden] tensor per norm and layer (W2: 1.3 GiB at a 3,400-token micro-batch)."""
        if not norm_op.rms_norm_fused(x, self.weight):
            return None
        return partial(norm_op.rms_norm, weight=self.weight, eps=self.eps), x


def rope_inv_freq(args: ModelArgs, theta: float | None = None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d) over the rotary dims d, with Llama 3's piecewise
    long-context scaling, linear scaling (inv_freq / factor) or Phi-3's longrope (inv_freq /
    short_factor, or / long_factor with `long`). `theta`: another base, unscaled (Gemma 3's
    sliding layers). Computed on the CPU whatever the default device (under torch.device("meta")
    this maths would run through torch._refs, which imports torch._dynamo: seconds of start-up)."""
    d = args.rotary_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    inv_freq = 1.0 / ((theta or args.rope_theta) ** exponents)
    if args.rope_freq_factors is not None:  # llama.cpp stores Llama 3 scaling precomputed
        return inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float32, device="cpu")
    s = args.rope_scaling
    if not s or theta is not None:
        return inv_freq
    if s.get("rope_type") == "linear":
        return inv_freq / s["factor"]
    if s.get("rope_type") == "longrope":
        factors = s["long_factor" if long else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the band
    # between is interpolated linearly in old_len / wavelen.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_buffers(args: ModelArgs) -> dict[str, torch.Tensor | None]:
    """CausalLM's RoPE buffers: inv_freq, and where the family has them inv_freq_long (longrope
    past the original context) and inv_freq_local (Gemma 3's sliding layers)."""
    longrope = (args.rope_scaling or {}).get("rope_type") == "longrope"
    return {"inv_freq": rope_inv_freq(args),
            "inv_freq_long": rope_inv_freq(args, long=True) if longrope else None,
            "inv_freq_local": rope_inv_freq(args, theta=args.rope_local_theta) if args.rope_local_theta else None}


def longrope_attention_factor(args: ModelArgs) -> float:
    """Phi-3's cos / sin scale: sqrt(1 + ln(s) / ln(original length)), s = the context's stretch."""
    rope = args.rope_scaling
    old = rope["original_max_position_embeddings"]
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = rope.get("factor") or args.max_position_embeddings / old
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [B, T, D] for rotate-half RoPE; angles computed in fp32."""
    angles = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; rotate-half form: x*cos + [-x2, x1]*sin (one Triton kernel on GPUs)."""
    return rope_op.apply_rope(x, cos, sin)


def read_input(fused, norm, x):
    """(h, joined, residual) for a block reading the residual stream x: its input h = norm(x)
    (x without a norm), the joined output of its fused projections (None without them, or where
    they decline), and the stream to add back (None without a norm). Where the norm and the
    group's LoRA dropout run as one kernel (FusedProjections.normed), h is not made apart (None)
    and the residual comes through the norm's kernel, whose backward adds its gradient."""
    if norm is None:
        return x, (fused(x) if fused is not None else None), None
    if fused is None:
        return norm(x), None, x
    normed = fused.normed(norm, x)
    if normed is not None:
        return None, *normed
    h = norm(x)
    return h, fused(h, norm.source(x)), x


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        # Qwen2 puts a bias on q, k, v only; Llama / Qwen3 with attention_bias on all four.
        attention_projections(self, args, layer_idx, RMSNorm, args.attention_bias and args.model_type != "qwen2")

    def forward(self, x, cos, sin, layout=None, cache=None, norm=None):
        """x: the residual stream. With `norm` (the layer's RMSNorm) the block reads norm(x) and
        returns x + its output (the add in o_proj's matmul where LoRA joins it); without, it
        reads x and returns its output alone."""
        b, t, _ = x.shape
        h, joined, residual = read_input(self.qkv, norm, x)
        if joined is not None and self.q_norm is None and rope_op.rope_qkv_ok(joined, cos):
            q, k, v = rope_op.rope_qkv(joined, cos, sin, self.n_heads, self.n_kv)  # one kernel each way
            return self._attend(q, k, v, layout, cache, residual)
        if joined is not None and self.q_norm is not None and rope_op.qk_norm_rope_ok(joined, cos, self.q_norm,
                                                                                      self.k_norm):
            q, k, v = rope_op.qk_norm_rope(joined, cos, sin, self.q_norm, self.k_norm, self.n_heads, self.n_kv)
            return self._attend(q, k, v, layout, cache, residual)
        if joined is not None:
            q, k, v = joined.split(self.qkv.sizes, dim=-1)  # views: RoPE reads q and k in place
            if self.q_norm is None:  # attention saves v: a view would keep all of q/k/v alive
                v = v.contiguous()  # (the q/k norms read and keep their views: joined stays alive)
        else:
            q, k, v = project_shared_input(h, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        v = v.view(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self._attend(q, k, v, layout, cache, residual)

    def _attend(self, q, k, v, layout, cache, residual):
        b, t = q.shape[:2]
        if not window_cuts(self.window, q, layout, cache):  # [B, T, H, D] in and out
            out = causal_attention(q, k, v, layout, cache, self.layer_idx)
        else:  # Mistral past its sliding window (model.families.attend)
            out = attend(q, k, v, layout, cache, self.layer_idx, window=self.window)
        out = out.reshape(b, t, self.n_heads * self.head_dim)
        if isinstance(self.o_proj, LoRALinear):  # the attention kernel keeps `out` for its backward
            return self.o_proj(out, source=(None, out), residual=residual)
        return self.o_proj(out) if residual is None else residual + self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gate_up = None  # a lora.FusedProjections of gate/up once lora.fuse_projections ran

    def forward(self, x, norm=None, last=False):
        """x: the residual stream; `norm` as in Attention.forward (the add in down_proj's matmul
        where LoRA joins it). `last`: the block ends its layer, so in a checkpointed layer's
        recompute nothing reads its output and down_proj's base matmul is not run again."""
        unused = last and replaying()
        x, joined, residual = read_input(self.gate_up, norm, x)
        p = self.down_proj.group_dropout_p() if isinstance(self.down_proj, LoRALinear) else 0.0
        if joined is not None and p > 0 and swiglu_op.swiglu_dropped_ok(joined):
            # SwiGLU writes h and down_proj's dropped input in one pass, and its backward takes
            # the dropout's: down_proj recomputes the dropped input from `joined`, kept anyway
            seed = dropout_seed(joined.device)
            h, hd = swiglu_op.swiglu_dropped(joined, seed, p, reuse=True)
            redo = partial(swiglu_op.swiglu_dropped_only, seed=seed, p=p)
            return self.down_proj(h, source=(redo, joined), residual=residual, xd=hd, unused=unused)
        if joined is not None:
            h = swiglu_op.swiglu_joined(joined, reuse=True)  # its gradient goes over `joined`
        else:
            gate, up = project_shared_input(x, self.gate_proj, self.up_proj)
            h = swiglu_op.swiglu(gate, up)  # saves gate and up only
        if isinstance(self.down_proj, LoRALinear):  # SwiGLU keeps `joined`: h is recomputed from it
            return self.down_proj(h, source=(swiglu_op.swiglu_raw, joined) if joined is not None else None,
                                  residual=residual, unused=unused)
        return self.down_proj(h) if residual is None else residual + self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        attention, mlp = BLOCKS.get(args.model_type, (Attention, MLP))  # model.families
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp(args)

    def forward(self, x, cos, sin, layout=None, cache=None):
        # each residual add rides in the block's last matmul (o_proj, down_proj) where it can
        x = self.self_attn(x, cos, sin, layout, cache, norm=self.input_layernorm)
        return self.mlp(x, norm=self.post_attention_layernorm, last=True)


class DecoderBody(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # Built from an empty weight and initialised here only off the meta device: normal_ on a
        # meta tensor (load.build_model) runs through torch._refs, which imports torch._dynamo.
        weight = torch.empty(args.vocab_size, args.hidden_size)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=weight)
        if not weight.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        layer = LAYERS.get(args.model_type, DecoderLayer)  # model.families
        self.layers = nn.ModuleList(layer(args, i) for i in range(args.num_hidden_layers))
        self.norm = (OffsetRMSNorm if args.model_type in GEMMA else RMSNorm)(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama-family decoder. ``forward`` gives final hidden states; ``logits`` applies the head."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderBody(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, table in rope_buffers(args).items():
            self.register_buffer(name, None if table is None else table.to(self.lm_head.weight.device),
                                 persistent=False)
        # Gemma scales the embedding by sqrt(hidden), in the embedding's dtype
        self.embed_scale = args.hidden_size ** 0.5 if args.model_type in GEMMA else None
        self.gradient_checkpointing = False
        self.checkpoint_layers = 0  # with gradient_checkpointing, the first N layers only (0: all)
        self.activation_offload = None  # an ops.offload.ActivationOffload (train setup, activation_offload)

    def forward(self, input_ids, position_ids=None, layout=None, cache=None) -> torch.Tensor:
        """input_ids, position_ids: [B, T] -> hidden states [B, T, hidden] after the final norm."""
        if position_ids is None:
            start = cache.length if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids[None].expand(input_ids.shape[0], -1)
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        # Under autocast the layer outputs are in the autocast dtype, so RoPE tables follow it.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        cos, sin = self.rope_tables(position_ids, dtype)
        casts = getattr(self, "lora_casts", None)  # lora.fuse_projections: the LoRA casts, one refresh
        if casts is None or not self.training or not torch.is_grad_enabled():
            casts = None
        offload = getattr(self, "activation_offload", None)
        with casts.fresh(dtype) if casts is not None else nullcontext():
            # the first layers' saved activations wait in host memory until backward (ops.offload)
            offload = (offload.begin(x, (cos, sin)) if offload is not None and self.training and cache is None
                       and not self.gradient_checkpointing else None)
            checkpointed = self.checkpointed_layers() if self.training and torch.is_grad_enabled() else 0
            for i, layer in enumerate(self.model.layers):
                if i < checkpointed:
                    # the recompute in backward takes this forward's casts and dropout seeds (SeedTape)
                    x = checkpoint(SeedTape(), layer, x, cos, sin, layout, None)
                elif offload is not None:
                    x = offload.layer(i, layer, x, cos, sin, layout)
                else:
                    x = layer(x, cos, sin, layout, cache)
        if cache is not None:
            cache.advance(input_ids.shape[1], layout)
        return self.model.norm(x)

    def checkpointed_layers(self) -> int:
        """How many decoder layers (the first ones) run checkpointed in training."""
        return checkpointed_count(len(self.model.layers), self.gradient_checkpointing, self.checkpoint_layers)

    def rope_tables(self, position_ids, dtype):
        """cos, sin [B, T, rotary dims]; Gemma 3's stacked [global, local] on a first axis."""
        rope = self.args.rope_scaling or {}
        if self.inv_freq_long is not None:  # longrope: the long factors once a position passes the original
            long = position_ids.max() + 1 > rope["original_max_position_embeddings"]
            cos, sin = rope_cos_sin(torch.where(long, self.inv_freq_long, self.inv_freq), position_ids, torch.float32)
            factor = longrope_attention_factor(self.args)
            return (cos * factor).to(dtype), (sin * factor).to(dtype)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, dtype)
        if self.inv_freq_local is None:
            return cos, sin
        local_cos, local_sin = rope_cos_sin(self.inv_freq_local, position_ids, dtype)
        return torch.stack([cos, local_cos]), torch.stack([sin, local_sin])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return cap_logits(self.lm_head(hidden).float(), self.args.final_logit_softcapping)


class KVCache:
    """Preallocated keys and values [B, KVH, max_len, D] per layer; ``length`` tokens are filled."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device, dtype):
        shape = (batch, args.num_key_value_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.num_hidden_layers)]
        self.length = 0
        # A packed prefill keeps the first prefix[e] tokens of example e (None: all of them), so
        # that a pass over prompt + response leaves the cache as a pass over the prompt would.
        self.prefix: tuple[int, ...] | None = None
        self._fill_key, self._fill_index = None, None  # fill_packed's gather, built once per prefill

    def fill_packed(self, layer: int, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]):
        """k, v: [T, KVH, D], the examples of a packed prefill back to back (T = sum of lengths);
        example e (its first prefix[e] tokens) goes to row e, right-aligned on the longest so that
        the rows' next tokens share one column. The slots before a shorter one get copies of a
        real row: they are masked."""
        keep = self.prefix or lengths
        width = max(keep)
        if self._fill_key != (lengths, keep, k.device):
            index, start = [], 0
            for n, m in zip(lengths, keep):  # slot j of row e holds packed position start + j - (width - m)
                index += [start] * (width - m) + list(range(start, start + m))
                start += n
            self._fill_key, self._fill_index = (lengths, keep, k.device), torch.tensor(index, device=k.device)
        for cached, new in ((self.k[layer], k), (self.v[layer], v)):
            padded = new.index_select(0, self._fill_index).view(len(lengths), width, *new.shape[1:])
            cached[:, :, :width] = padded.transpose(1, 2)

    def advance(self, tokens: int, layout) -> None:
        """After a forward of `tokens` positions: a packed prefill filled each row up to its longest."""
        self.length += max(self.prefix or layout.lengths) if isinstance(layout, Packed) else tokens

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: [B, KVH, T, D] new entries; returns everything cached so far for the layer."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
