"""Linear layers that read the same input (q/k/v, or gate/up), each with LoRA, as one matmul
group with a hand-written backward.

For n layers with base weights W_i [o_i, d] (stored concatenated as W [O, d], O = sum o_i, so
``q_proj.base_layer.weight`` is a row view of it), LoRA A_i [r, d], B_i [o_i, r], scale s and
dropout mask m (one mask for the group, as ``lora.project_shared_input`` draws):

    xd = x * m / (1 - p)                     [N, d]
    xa = s xd @ [A_1; ...; A_n]^T            [N, n r]     one matmul for every A (s as its alpha)
    y  = x @ W^T + xa @ Bd^T                 [N, O]       Bd = blockdiag(B_1, ..., B_n)

and the backward, given g = dL/dy [N, O]:

    ga  = s g @ Bd                           [N, n r]
    dx  = g @ W + (ga @ A_all) * m / (1 - p)
    dA  = ga^T @ xd                          [n r, d]     rows i r .. (i+1) r are dA_i
    dB_i = g_i^T @ xa_i                      [o_i, r]     (g_i, xa_i: layer i's columns)

The scale rides in the matmuls' alpha and the fp32 gradients come out of the matmuls (cuBLAS
writes fp32 from bf16 inputs), so A and B cost no elementwise kernels at all.

Why: the module-by-module path (the reference, ``lora.LoRALinear``) runs ~45 kernels forward
and backward for q/k/v on a GPU: per layer a base matmul, a cast of A and B to bf16, a scale,
an addmm, and in the backward their gradients, the casts' backward and an add per branch into
dx. Here q/k/v take ~20: one base matmul for all three, the LoRA term in the same output
(addmm), dx accumulated in place. W1 (0.5B, ~1,600 tokens per step) is bound by kernel count,
so that is its step time; on W2 (7B) the saved casts and adds are ~10% of the step.

Memory: saves xd (x itself when there is no dropout), the dropout mask (bool), xa [N, n r] and
the bf16 casts of A and Bd, as the reference path does; x is not needed (W is frozen). On GPUs
with Triton the dropout is seeded (ops.dropout.dropout_seeded): the mask is drawn again from
the seed in backward instead of being saved, and a call given a `source` (o_proj: the attention
output; down_proj: the gate/up output SwiGLU keeps) saves that instead of xd and recomputes xd.
Where the kernels take the shapes (ops.lora_dropout.drop_matmul_ok), xd is never made at all: the
A matmuls are Triton kernels that drop x's tiles as they load them (xa = s xd A^T, dA, and the
masked add into dx), three fewer kernels and three fewer [N, d] passes over memory per group.

A_all and Bd come from the model's ``ops.lora_casts.CastCache`` when its forward refreshed
one (every layer's casts of one group kind in one buffer), else the Function builds them itself.
The fp32 gradients and their accumulation into .grad (GradArena) are ``ops.lora_grads``.

On a quantized base (model.quant) W comes as a callable that dequantizes it in the compute dtype
(q/k/v's or gate/up's members into one buffer): made again for backward's g W, or kept where
the caller says (gradient checkpointing: one layer's saved tensors live at a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hivetune.core.fallbacks import forced
from hivetune.ops import blas
from hivetune.ops import dropout as dropout_op
from hivetune.ops import lora_casts
from hivetune.ops.lora_aside import aside_wanted, weight_grads_aside
from hivetune.ops.lora_dropout import drop_matmul, drop_matmul_grad, drop_matmul_ok, matmul_drop_add_
from hivetune.ops.lora_grads import add_mm_fp32_, grads_into, mm_fp32
from hivetune.ops.triton_util import fused_ok


def fused_lora_usable() -> bool:
    """Whether training joins q/k/v and gate/up into matmul groups (plain PyTorch, any device):
    unless HIVETUNE_REFERENCE=fused_lora."""
    return not forced("fused_lora")


class LoRAGroup(torch.autograd.Function):
    """Written for host time as much as for the GPU: W2's eager micro-batch dispatches ~3,000
    kernels, and where the host falls behind them the GPU waits (an H200 ran 16 x 1 at 187 ms a
    step against ~172 ms of GPU work). So each call avoids what costs the host without saving
    kernels: autocast contexts where autocast is off (backward), one ``split`` instead of a
    slice per layer, a single check for mm's fp32 output."""

    @staticmethod
    def forward(ctx, x, weight, bias, sizes, p, scale, source_fn, source, residual, xd, room, keep_weight, unused, *lora):
        """x [..., d]; weight [O, d] (frozen, rows per layer); lora = A_1..A_n, B_1..B_n.
        `source`: a tensor kept for backward anyway with x = source_fn(source) (or x itself
        when source_fn is None); with the seeded dropout, x is recomputed from it in backward
        instead of saving the dropped input. `residual` [..., O] or None: returned added to the
        output (the decoder's residual stream; in the base matmul's epilogue where it can).
        `xd`: x already dropped by the caller (ops.norm.rms_norm_dropped, ops.swiglu.swiglu_dropped), or
        None. Its gradient goes back unmasked (the caller's backward applies the mask), and
        source_fn then recomputes xd itself from `source`. `room`: x's rows lie n r or more
        elements further apart, the columns after each row free (the wide path writes xa there).
        `weight` may be a callable (dtype) -> W (a quantized base's dequantization): W is then
        kept for backward where `keep_weight`, else made again there. `unused`: nothing reads
        the output (a checkpointed layer's last matmul in its recompute): what backward keeps is
        made, the base matmul is not."""
        n = len(sizes)
        a_params, b_params = lora[:n], lora[n:]
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        weight_of = weight if callable(weight) else None
        if weight_of is not None:
            weight = weight_of(dtype)
        casts = lora_casts.active()
        cached = casts.lookup(a_params, b_params, dtype) if casts is not None else None
        if autocast:
            with torch.autocast(device_type, enabled=False):
                y, kept, mask, xa, a_all, bd, w, recompute, seeded, wide = _group_forward(
                    x, weight, bias, sizes, p, scale, source, a_params, b_params, dtype, cached, residual, xd, room, unused)
        else:
            y, kept, mask, xa, a_all, bd, w, recompute, seeded, wide = _group_forward(
                x, weight, bias, sizes, p, scale, source, a_params, b_params, dtype, cached, residual, xd, room, unused)
        ctx.save_for_backward(kept, mask, xa, a_all, bd, None if weight_of is not None and not keep_weight else w)
        ctx.weight_of, ctx.w_dtype = weight_of, w.dtype
        ctx.recompute, ctx.source_fn, ctx.seeded, ctx.wide = recompute, source_fn, seeded, wide
        ctx.a_params, ctx.b_params = a_params, b_params  # backward adds into their .grad where they have one
        ctx.sizes, ctx.p, ctx.scale, ctx.r, ctx.x_shape, ctx.x_dtype = sizes, p, scale, a_params[0].shape[0], x.shape, x.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        if saved[5] is None and ctx.needs_input_grad[0]:  # a quantized base's W, dequantized again for g W
            saved = (*saved[:5], ctx.weight_of(ctx.w_dtype))
        g = grad.reshape(-1, grad.shape[-1])
        if g.dtype != ctx.w_dtype:
            g = g.to(ctx.w_dtype)
        if not g.is_contiguous():
            g = g.contiguous()
        if torch.is_autocast_enabled(g.device.type):
            with torch.autocast(g.device.type, enabled=False):
                grad_x, grad_xd, grads_a, grads_b = _group_backward(ctx, g, *saved)
        else:
            grad_x, grad_xd, grads_a, grads_b = _group_backward(ctx, g, *saved)
        grad_residual = grad if ctx.needs_input_grad[8] else None  # y = residual + ...: its gradient as it is
        return (grad_x, None, None, None, None, None, None, None, grad_residual, grad_xd, None, None, None,
                *grads_a, *grads_b)


def wide_matrix(w: torch.Tensor, bd: torch.Tensor) -> torch.Tensor | None:
    """[W | Bd] as one [O, d + n r] matrix where Bd's rows come right after W's, in rows at least
    that far apart (lora.fuse_projections' wide layout, bd from the CastCache), else None."""
    d, k = w.shape[1], bd.shape[1]
    if (w.dim() != 2 or w.stride(1) != 1 or w.stride(0) < d + k or bd.stride() != w.stride()
            or bd.shape[0] != w.shape[0] or bd.dtype != w.dtype or bd.data_ptr() != w.data_ptr() + d * w.element_size()):
        return None
    return w.as_strided((w.shape[0], d + k), w.stride())


def _group_forward(x, weight, bias, sizes, p, scale, source, a_params, b_params, dtype, cached, residual=None,
                   given=None, room=False, unused=False):
    """LoRAGroup's forward outside autocast: y and what backward keeps (see the module doc).
    `given`: the dropped input made by the caller (LoRAGroup's `xd`), or None.
    `residual`: added to y; as the base matmul's C (cuBLAS beta = 1: no add kernel, no [N, O]
    pass) when it is in the compute dtype and there is no bias, else added at the end.
    `room`: x's rows lie n r or more further apart with those columns free. Where the weights are wide
    too (wide_matrix), xa is written there and y = [x | xa] @ [W | Bd]^T is one matmul: the
    LoRA update rides in the base matmul instead of an addmm reading and writing all of y
    (W1's gate/up: ~25 us of a ~40 us matmul on an H100), and backward [dx | d xa] = g [W | Bd]
    is one matmul too. `unused`: y is left unwritten (LoRAGroup.forward)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != dtype:
        x2 = x2.to(dtype)
    w = weight if weight.dtype == dtype else weight.to(dtype)
    a_all, bd = cached if cached is not None else _casts(x2, weight, sizes, a_params, b_params, dtype)
    mask = None
    seeded = "given" if given is not None else p > 0 and dropout_op.seeded_dropout_ok(x2)
    d, k = x2.shape[1], a_all.shape[0]
    wide = (wide_matrix(w, bd) if room and seeded in ("given", False) and x2.stride(1) == 1 and x2.stride(0) >= d + k
            and cached is not None else None)
    if seeded is True:  # the mask is drawn again from the seed in backward: nothing stored
        device = x2.device
        mask = lora_casts.taped(lambda: lora_casts.active().next_seed(device) if cached is not None
                                else dropout_op.new_dropout_seed(device))
    if seeded is True and drop_matmul_ok(x2, a_all):  # the dropout rides in the A matmuls
        seeded = "in_matmul"
        xa = drop_matmul(x2, a_all, mask, p, scale)
        xd = x2  # kept undropped: the backward kernels draw the mask again
    else:
        if given is not None:
            xd = given.reshape(x2.shape)
        elif seeded:
            xd = dropout_op.dropout_seeded(x2, mask, p)
        elif p > 0:
            xd, mask = torch.native_dropout(x2, p, True)
        else:
            xd = x2
        if wide is not None:  # xa into x's free columns; kept apart for backward (x is not kept)
            joined = x2.as_strided((x2.shape[0], d + k), x2.stride())
            slot = joined[:, d:]
            blas.gemm(xd, a_all.t(), slot, scale)
            if xd is x2:  # kept for backward: a view made after the write (autograd checks)
                xd = joined[:, :d]
            xa, x2, w = slot.contiguous(), joined, wide
        else:
            xa = x2.new_empty((x2.shape[0], k))
            blas.gemm(xd, a_all.t(), xa, scale)  # s (xd A^T): the scale is free
    if unused:
        y = x2.new_empty((x2.shape[0], w.shape[0]))
    else:
        r2 = residual.reshape(-1, w.shape[0]) if residual is not None else None
        if r2 is not None and bias is None and r2.dtype == dtype:
            y, r2 = blas.gemm(x2, w.t(), beta=1.0, c=r2), None  # residual + x W^T in one kernel
        else:
            y = blas.gemm(x2, w.t()) if bias is None else F.linear(x2, w, bias.to(dtype))  # (less dispatch than linear)
        if wide is None:
            blas.gemm(xa, bd.t(), y, 1.0, 1.0)
        if r2 is not None:
            y = r2 + y
    if wide is not None:
        w = w[:, :d]
    recompute = (bool(seeded) and source is not None and source.dtype == dtype
                 and not (cached is not None and lora_casts.active().keep_inputs))
    kept = source if recompute else xd  # x itself is not needed: W is frozen
    return y, kept, mask, xa, a_all, bd, w, recompute, seeded, wide is not None


def _group_backward(ctx, g, kept, mask, xa, a_all, bd, w):
    """d loss / d x and the fp32 A and B gradients (see the module doc), outside autocast."""
    sizes, r = ctx.sizes, ctx.r
    in_matmul = ctx.seeded == "in_matmul"  # the kernels apply the dropout to x as they read it
    given = ctx.seeded == "given"  # the caller dropped x (and source_fn gives the dropped input)
    xd = kept
    if ctx.recompute:  # the input from its source, then (unless in_matmul) the dropout from its seed
        x2 = kept if ctx.source_fn is None else ctx.source_fn(kept)
        xd = x2.reshape(-1, x2.shape[-1]).contiguous()
        if not in_matmul and not given:
            xd = dropout_op.dropout_seeded(xd, mask, ctx.p)
        del x2  # only the (dropped) input is needed from here
    if ctx.wide:  # [g W | g Bd] in one matmul; the scale then rides in the matmuls reading g Bd
        d, k = w.shape[1], a_all.shape[0]
        joined = g.new_empty((g.shape[0], w.stride(0)))[:, :d + k]  # rows as aligned as the weight's
        blas.gemm(g, w.as_strided((w.shape[0], d + k), w.stride()), joined)
        gw, g_xa, alpha = joined[:, :d], joined[:, d:], ctx.scale
    else:
        gw, alpha = None, 1.0
        g_xa = torch.empty((g.shape[0], a_all.shape[0]), dtype=g.dtype, device=g.device)
        blas.gemm(g, bd, g_xa, ctx.scale)  # d loss / d (xd A^T)
    # A's gradient first: a recomputed xd (down_proj: [T, I]) is freed before grad_x is made.
    # Where the parameters have their .grad (GradArena), added into it: autograd gets None.
    n = len(sizes)
    into_a = grads_into(ctx.a_params, n * r if n > 1 else 0)
    into_b = grads_into(ctx.b_params)
    if into_a and into_b and aside_wanted(g):  # dA and dB on the side stream, beside grad_x's chain
        with weight_grads_aside(g, keep=(g, g_xa, xd, mask, xa)):
            _a_grads(ctx, g_xa, xd, mask, alpha, into_a[0])
            grads_b = _b_grads(g, xa, sizes, r, into_b)
        grads_a = (None,) * n
    else:
        product = _a_grads(ctx, g_xa, xd, mask, alpha, into_a[0] if into_a else None)
        grads_a = (None,) * n if into_a else product.split(r)
        grads_b = None
    del xd
    grad_x, grad_xd = _input_grads(ctx, g, gw, g_xa, a_all, mask, w, alpha, given, in_matmul)
    if grads_b is None:  # one stream: dB after grad_x
        grads_b = _b_grads(g, xa, sizes, r, into_b)
    return grad_x, grad_xd, grads_a, grads_b


def _a_grads(ctx, g_xa, xd, mask, alpha, into):
    """A_1 .. A_n's gradients, alpha (g_xa^T xd) [n r, d] in contiguous blocks (the in_matmul
    kernel draws the dropout mask again as it reads xd): added into `into` (returns None there)
    or returned in fp32."""
    if ctx.seeded == "in_matmul":
        return drop_matmul_grad(g_xa, xd, mask, ctx.p, into=into)
    if into is None:
        return mm_fp32(g_xa.t(), xd, alpha)
    add_mm_fp32_(into, g_xa.t(), xd, alpha)
    return None


def _b_grads(g, xa, sizes, r, into_b):
    """dB_i = g_i^T xa_i (xa holds s): one matmul each, so each gradient is contiguous; added
    into `into_b` (autograd then gets None each) or returned in fp32."""
    n = len(sizes)
    pairs = zip(g.split(sizes, 1) if n > 1 else (g,), xa.split(r, 1))
    if into_b:
        for into, (gi, xai) in zip(into_b, pairs):
            add_mm_fp32_(into, gi.t(), xai)
        return (None,) * n
    return [mm_fp32(gi.t(), xai) for gi, xai in pairs]


def _input_grads(ctx, g, gw, g_xa, a_all, mask, w, alpha, given, in_matmul):
    """(d loss / d x, d loss / d xd): the base matmul's gradient plus the LoRA branch's, each
    only where autograd needs it; `gw`: g W already made (the wide path), else None."""
    grad_x = grad_xd = None
    if given:  # the dropout's backward is the caller's: g_xa A goes back as it is
        if ctx.needs_input_grad[0]:
            grad_x = (gw if gw is not None else blas.gemm(g, w)).view(ctx.x_shape)
        if ctx.needs_input_grad[9]:
            grad_xd = blas.gemm(g_xa, a_all, alpha=alpha).view(ctx.x_shape)
    elif ctx.needs_input_grad[0]:
        grad_x = gw if gw is not None else blas.gemm(g, w)
        if in_matmul:
            matmul_drop_add_(grad_x, g_xa, a_all, mask, ctx.p)
        elif ctx.seeded:
            dropout_op.seeded_masked_add_(grad_x, blas.gemm(g_xa, a_all), mask, ctx.p)
        elif mask is None:
            blas.gemm(g_xa, a_all, grad_x, alpha, 1.0)
        else:
            masked_add_(grad_x, blas.gemm(g_xa, a_all, alpha=alpha), mask, 1.0 / (1.0 - ctx.p))
        grad_x = grad_x.view(ctx.x_shape)
        if grad_x.dtype != ctx.x_dtype:
            grad_x = grad_x.to(ctx.x_dtype)
    return grad_x, grad_xd


def _casts(x2, weight, sizes, a_params, b_params, dtype):
    """A_all and Bd built for this call alone (no fresh CastCache)."""
    n, r = len(sizes), a_params[0].shape[0]
    a_all = torch.cat(a_params, out=x2.new_empty((n * r, x2.shape[1])))  # cast on the way
    if n == 1:
        return a_all, b_params[0].to(dtype)
    bd = x2.new_zeros((weight.shape[0], n * r))
    row = 0
    for i, b in enumerate(b_params):
        bd[row:row + sizes[i], i * r:(i + 1) * r] = b
        row += sizes[i]
    return a_all, bd


def masked_add_(out: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, keep: float) -> None:
    """out += t * mask * keep (the dropout backward of the LoRA branch): one Triton kernel on
    GPUs (torch's addcmul with a bool mask runs an unvectorised mixed-dtype loop), else torch."""
    if fused_ok(out) and out.is_contiguous() and t.is_contiguous() and mask.is_contiguous():
        dropout_op.masked_add_(out, t, mask, keep)
    else:
        out.add_(torch.ops.aten.native_dropout_backward(t, mask, keep))


def lora_group(x: torch.Tensor, weight, bias: torch.Tensor | None, sizes: tuple[int, ...],
               p: float, scale: float, a_params, b_params, source=None, residual=None, xd=None,
               room: bool = False, keep_weight: bool = True, unused: bool = False) -> torch.Tensor:
    """y [..., sum(sizes)] = x W^T (+ bias) + the LoRA update of each row block (see the module doc).
    `source`: (fn, tensor) with x = fn(tensor) (fn None: x itself) where that tensor is saved for
    backward by another op anyway (the attention output; the gate/up output that SwiGLU keeps):
    under the seeded dropout the Function then keeps it instead of the dropped input.
    `xd`: x dropped by the caller (ops.norm.rms_norm_dropped, ops.swiglu.swiglu_dropped); then fn(tensor)
    gives the dropped input itself, and xd's gradient goes back unmasked.
    `room`: x's rows lie n r or more elements further apart, those columns free: with the
    wide weight layout the group then runs its wide path (_group_forward).
    `weight`: W [O, d], or a callable (dtype) -> W for a base kept quantized (model.quant.JoinedWeight,
    QuantLinear.dequantized): called in forward in the compute dtype, and where not `keep_weight`
    again in backward (so no layer's dequantized W waits for backward: only under gradient
    checkpointing, where one layer's saved tensors live at a time, is keeping it cheap).
    `unused`: the caller does not read the output (a checkpointed layer's last matmul in its
    recompute, lora_casts.replaying): the output is returned unwritten."""
    fn, tensor = source if source is not None else (None, None)
    return LoRAGroup.apply(x, weight, bias, tuple(sizes), float(p), float(scale), fn, tensor, residual, xd,
                           bool(room), bool(keep_weight), bool(unused), *a_params, *b_params)
