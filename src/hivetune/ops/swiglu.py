"""SwiGLU, silu(gate) * up, as one Triton kernel each way (separate gate and up, or the halves
of a joined gate/up output), and SwiGLU with down_proj's LoRA dropout of its output in the same
pass, beside the plain-PyTorch reference.

The kernels save gate and up for backward (the reference also silu(gate), 2 I bytes a token);
rounding follows the reference (bf16 after silu and after the product).
"""

from __future__ import annotations

import torch

from hivetune.ops.dropout import keep_threshold
from hivetune.ops.triton_util import elementwise_grid, fused_ok, kernels, triton


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


@kernels
def _define_kernels():
    """The Triton kernels (ops.kernels.swiglu): imported at the first fused call, not at import
    (triton_util.kernels)."""
    global triton, tl, _hashed_keep, _swiglu_values, _swiglu_fwd, _swiglu_grads, _swiglu_bwd, _swiglu_drop_fwd
    global _swiglu_drop_bwd
    import triton
    import triton.language as tl

    from hivetune.ops.kernels.swiglu import (_hashed_keep, _swiglu_values, _swiglu_fwd, _swiglu_grads, _swiglu_bwd, _swiglu_drop_fwd,
        _swiglu_drop_bwd)


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up; `joined`: gate and up are the halves of one [.., 2 I] tensor (a fused
    gate/up projection), read in place, and the gradient comes back as one [.., 2 I] tensor."""
    BLOCK = 1024

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor | None, reuse: bool = False):
        """`reuse` (joined only): the caller owns `gate` and drops it, so backward may write
        the gradient over it: one [.., 2 I] buffer less at the peak of W2's backward."""
        ctx.reuse = reuse
        if up is None:
            joined = gate.contiguous()
            ctx.reuse = reuse and joined is gate
            ctx.save_for_backward(joined)
            return swiglu_raw(joined)
        g, u = gate.contiguous(), up.contiguous()
        cols = g.shape[-1]
        y = torch.empty_like(g)
        ctx.save_for_backward(g, u)
        n = y.numel()
        _swiglu_fwd[elementwise_grid(n, SwiGLUFunction.BLOCK)](g, u, y, n, cols, cols, BLOCK=SwiGLUFunction.BLOCK)
        return y

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous()
        n, cols = dy.numel(), dy.shape[-1]
        saved = ctx.saved_tensors  # unpacked once: a checkpointed layer allows no second unpack
        if len(saved) == 1:
            (joined,) = saved
            dgu = joined if ctx.reuse else torch.empty_like(joined)  # each element read, then written
            _swiglu_bwd[elementwise_grid(n, SwiGLUFunction.BLOCK)](dy, joined, joined[..., cols:], dgu, dgu[..., cols:],
                                                                     n, cols, 2 * cols, BLOCK=SwiGLUFunction.BLOCK)
            return dgu, None, None
        gate, up = saved
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        _swiglu_bwd[elementwise_grid(n, SwiGLUFunction.BLOCK)](dy, gate, up, dg, du, n, cols, cols,
                                                                 BLOCK=SwiGLUFunction.BLOCK)
        return dg, du, None
# Launch shape of the SwiGLU kernels with the dropout (benchmarks/fused_sweep.py times others).
SWIGLU_DROP_BLOCK = 1024  # elements a program
SWIGLU_DROP_WARPS = 4


def _swiglu_drop_launch(joined, seed, p, write_y: bool):
    cols = joined.shape[-1] // 2
    yd = joined.new_empty((*joined.shape[:-1], cols))
    y = joined.new_empty(yd.shape) if write_y else yd
    n = yd.numel()
    thr, scale = keep_threshold(p)
    _swiglu_drop_fwd[elementwise_grid(n, SWIGLU_DROP_BLOCK)](joined, joined[..., cols:], y, yd, seed, n, cols, 2 * cols,
                                                              thr, scale, BLOCK=SWIGLU_DROP_BLOCK, WRITE_Y=write_y,
                                                              num_warps=SWIGLU_DROP_WARPS)
    return y, yd


class SwiGLUDropFunction(torch.autograd.Function):
    """(silu(gate) * up, its dropout_hashed copy) of a joined [.., 2 I] gate/up output, in one
    kernel each way (see swiglu_dropped). Saves what the joined SwiGLUFunction saves, and the seed."""

    @staticmethod
    def forward(ctx, joined: torch.Tensor, seed: torch.Tensor, p: float, reuse: bool):
        ctx.set_materialize_grads(False)
        y, yd = _swiglu_drop_launch(joined, seed, p, True)
        ctx.save_for_backward(joined, seed)
        ctx.p, ctx.reuse = p, reuse
        return y, yd

    @staticmethod
    def backward(ctx, dy, dyd):
        joined, seed = ctx.saved_tensors
        cols = joined.shape[-1] // 2
        dy = dy.contiguous() if dy is not None else torch.zeros(joined.shape[:-1] + (cols,), dtype=joined.dtype,
                                                                  device=joined.device)
        dyd = dyd.contiguous() if dyd is not None else None
        n = dy.numel()
        thr, scale = keep_threshold(ctx.p)
        dgu = joined if ctx.reuse else torch.empty_like(joined)  # each element read, then written
        _swiglu_drop_bwd[elementwise_grid(n, SWIGLU_DROP_BLOCK)](dy, dyd if dyd is not None else dy, joined,
                                                                  joined[..., cols:], dgu, dgu[..., cols:], seed, n,
                                                                  cols, 2 * cols, thr, scale if dyd is not None else 0.0,
                                                                  BLOCK=SWIGLU_DROP_BLOCK, num_warps=SWIGLU_DROP_WARPS)
        return dgu, None, None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if fused_ok(gate) and up.dtype == gate.dtype and up.shape == gate.shape:
        return SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)


def swiglu_raw(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a joined [.., 2 I] tensor, outside autograd: SwiGLUFunction's joined
    forward, and down_proj's recompute in lora_group's backward (the same bits)."""
    joined = gate_up.contiguous()
    cols = joined.shape[-1] // 2
    y = joined.new_empty((*joined.shape[:-1], cols))
    n = y.numel()
    _swiglu_fwd[elementwise_grid(n, SwiGLUFunction.BLOCK)](joined, joined[..., cols:], y, n, cols, 2 * cols,
                                                            BLOCK=SwiGLUFunction.BLOCK)
    return y


def swiglu_joined(gate_up: torch.Tensor, reuse: bool = False) -> torch.Tensor:
    """silu(gate) * up where gate_up = [gate | up] along the last dim (a fused gate/up output).
    `reuse`: gate_up is an intermediate nobody else reads after this; its gradient may be
    written over it in backward."""
    if fused_ok(gate_up):
        return SwiGLUFunction.apply(gate_up, None, reuse)
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_reference(gate, up)


def swiglu_dropped_ok(gate_up: torch.Tensor) -> bool:
    """Whether swiglu_dropped takes a joined gate/up output (the Triton SwiGLU, the seeded
    dropout's conditions); else SwiGLU apart from the down_proj group's dropout."""
    return (fused_ok(gate_up) and gate_up.is_contiguous() and gate_up.shape[-1] % 2 == 0
            and gate_up.numel() < 2**31)


def swiglu_dropped(gate_up: torch.Tensor, seed: torch.Tensor, p: float, reuse: bool = False):
    """(h, hd): h = silu(gate) * up of a joined gate/up output, hd = dropout_hashed(h, seed, p),
    for down_proj's LoRA group reading h in its base matmul and hd in its A matmul
    (model.decoder.MLP). Its backward takes both gradients: the dropout's masked add rides in
    SwiGLU's backward kernel. `reuse` as swiglu_joined's."""
    return SwiGLUDropFunction.apply(gate_up, seed, p, reuse)


def swiglu_dropped_only(gate_up: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """swiglu_dropped's hd alone, outside autograd (the same bits): down_proj's group recomputes
    its dropped input from the gate/up output with it."""
    return _swiglu_drop_launch(gate_up, seed, p, False)[1]
