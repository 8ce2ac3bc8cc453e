"""Measure what autograd keeps for backward: the ground truth for the activation model.

``saved_activation_bytes`` runs one real forward pass of our decoder + loss under
``torch.autograd.graph.saved_tensors_hooks`` and adds up the distinct storages autograd saves,
leaving out parameters (already counted as weights). On the CPU the packed layout takes the
padded-view SDPA path, not the flash varlen kernel of CUDA; ``varlen_standin`` swaps in an
autograd Function that saves exactly what ``torch.nn.attention.varlen.varlen_attn`` saves
(q, k, v, out and a [H, T] fp32 log-sum-exp), so a CPU measurement describes the GPU run.
Likewise ``fused_layers_standin`` swaps in Functions that save what the Triton RMSNorm and
SwiGLU of ops.norm and ops.swiglu save (CUDA, bf16 / fp16): x and 1/rms; gate and up (or the joined
gate|up tensor) only.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

import hivetune.model.decoder as decoder
from hivetune.core.device import DTYPES
from hivetune.ops import dropout, norm, swiglu as swiglu_op
from hivetune.ops.attention import Packed
from hivetune.ops.norm import rms_norm_reference, rows_of
from hivetune.ops.fused_ce import fused_target_loss_sum
from hivetune.ops.loss import target_loss_sum
from hivetune.ops.swiglu import swiglu_reference


class _VarlenStandIn(torch.autograd.Function):
    """Forward and backward of causal attention per packed example, saving what flash varlen saves."""

    @staticmethod
    def forward(ctx, q, k, v, cu):
        with torch.no_grad():
            out = _reference(q, k, v, cu)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, cu, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, cu, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            out = _reference(q_, k_, v_, cu)
            gq, gk, gv = torch.autograd.grad(out, (q_, k_, v_), grad_out)
        return gq, gk, gv, None


def _reference(q, k, v, cu):
    """[T, H, D] per example through causal SDPA (GQA by repeating K/V inside)."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ki, vi = ki.repeat_interleave(groups, 0), vi.repeat_interleave(groups, 0)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


def _standin_attention(q, k, v, layout=None, cache=None, layer: int = 0):
    assert isinstance(layout, Packed) and cache is None and q.shape[0] == 1
    return _VarlenStandIn.apply(q[0], k[0], v[0], layout.cu_seqlens)[None]


@contextmanager
def varlen_standin():
    """Route the decoder's packed attention through the varlen stand-in (CPU measurements)."""
    before = decoder.causal_attention
    decoder.causal_attention = _standin_attention
    try:
        yield
    finally:
        decoder.causal_attention = before


class _RMSNormStandIn(torch.autograd.Function):
    """Saves what ops.norm.RMSNormFunction saves: x's rows as ops.norm.rows_of reads them (a
    view of the input where its layout allows), the weight and an fp32 1/rms per row; computes
    with the reference."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = rows_of(x)[0]
        with torch.no_grad():
            y = rms_norm_reference(x, weight, eps)
            rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps).reshape(-1)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        rows, weight, _ = ctx.saved_tensors
        with torch.enable_grad():
            x_ = rows.detach().requires_grad_()
            (dx,) = torch.autograd.grad(rms_norm_reference(x_, weight, ctx.eps), x_, dy.reshape(rows.shape))
        return dx.reshape(dy.shape), None, None


class _SwiGLUStandIn(torch.autograd.Function):
    """Saves what ops.swiglu.SwiGLUFunction saves: gate and up, or the joined [.., 2I] tensor."""

    @staticmethod
    def forward(ctx, gate, up):
        if up is None:
            joined = gate.contiguous()
            ctx.save_for_backward(joined)
            gate, up = joined.chunk(2, dim=-1)
        else:
            gate, up = gate.contiguous(), up.contiguous()
            ctx.save_for_backward(gate, up)
        with torch.no_grad():
            return swiglu_reference(gate, up)

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            xs = [t.detach().requires_grad_() for t in saved]
            gate, up = xs[0].chunk(2, dim=-1) if len(xs) == 1 else xs
            grads = torch.autograd.grad(swiglu_reference(gate, up), xs, dy)
        return (grads[0], None) if len(grads) == 1 else grads


@contextmanager
def fused_layers_standin():
    """Route ops.norm.rms_norm, ops.swiglu.swiglu / swiglu_joined through the stand-ins where the
    Triton kernels would take the tensors on a GPU (bf16 / fp16; RMSNorm: a frozen weight of
    the input's dtype), and lora_group's dropout through a seeded CPU stand-in of the Triton
    one (no mask saved; o_proj / down_proj recompute their dropped input, q/k/v and gate/up
    theirs from the norm's input, RMSNorm.source)."""
    before = norm.rms_norm, swiglu_op.swiglu, swiglu_op.swiglu_joined
    half = (torch.bfloat16, torch.float16)

    def rms_norm(x, weight, eps):
        if x.dtype in half and weight.dtype == x.dtype and not weight.requires_grad:
            return _RMSNormStandIn.apply(x, weight, eps)
        return before[0](x, weight, eps)

    def swiglu(gate, up):
        return _SwiGLUStandIn.apply(gate, up) if gate.dtype in half else before[1](gate, up)

    def swiglu_joined(gate_up, reuse=False):
        return _SwiGLUStandIn.apply(gate_up, None) if gate_up.dtype in half else before[2](gate_up)

    # The seeded dropout of ops.lora_group: the mask from a CPU generator seeded with the seed.
    def mask_of(x, seed, p):
        return torch.rand(x.shape, generator=torch.Generator().manual_seed(int(seed))) >= p

    def dropout_seeded(x, seed, p):
        return x * mask_of(x, seed, p) / (1 - p)

    def seeded_masked_add_(out, t, seed, p):
        out.add_(t * mask_of(t, seed, p) / (1 - p))

    def swiglu_raw(gate_up):
        return swiglu_op.swiglu_reference(*gate_up.chunk(2, dim=-1))

    seeded = {"seeded_dropout_ok": lambda x: x.dtype in half and x.is_contiguous(),
              "rms_norm_fused": lambda x, weight: x.dtype in half and weight.dtype == x.dtype
              and not weight.requires_grad,
              "new_dropout_seed": lambda device, n=1: torch.randint(0, 2**31 - 1, (n,), device=device),
              "dropout_seeded": dropout_seeded, "seeded_masked_add_": seeded_masked_add_, "swiglu_raw": swiglu_raw}
    home = {"rms_norm_fused": norm, "swiglu_raw": swiglu_op}  # the rest: ops.dropout
    seeded_before = {name: getattr(home.get(name, dropout), name) for name in seeded}
    norm.rms_norm, swiglu_op.swiglu, swiglu_op.swiglu_joined = rms_norm, swiglu, swiglu_joined
    for name, fn in seeded.items():
        setattr(home.get(name, dropout), name, fn)
    try:
        yield
    finally:
        norm.rms_norm, swiglu_op.swiglu, swiglu_op.swiglu_joined = before
        for name, fn in seeded_before.items():
            setattr(home.get(name, dropout), name, fn)


def saved_activation_bytes(model, batch, precision: str, fused_loss: bool = True) -> int:
    """Bytes of distinct non-parameter storages saved for backward by one forward + loss."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}
    keep = []  # hold every saved tensor so no storage address is reused during the pass

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and t.device.type != "meta":
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        keep.append(t)
        return t

    device = batch.input_ids.device
    cast = (nullcontext() if precision == "fp32"
            else torch.autocast(device.type, dtype=DTYPES[precision]))
    loss_fn = fused_target_loss_sum if fused_loss else target_loss_sum
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        hidden = model(batch.input_ids, batch.position_ids, batch.layout)
        loss = loss_fn(hidden, model.lm_head.weight, batch.target_index, batch.target_ids,
                       softcap=model.args.final_logit_softcapping)
    del loss, hidden
    keep.clear()
    return sum(seen.values())
