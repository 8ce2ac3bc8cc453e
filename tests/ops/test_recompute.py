"""ops.recompute.checkpoint: the gradients of the plain forward, saved tensors made again in backward."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from hivetune.ops.recompute import checkpoint


class Block(nn.Module):
    """A layer with what the decoder's layers have: a residual, a nonlinearity, dropout from
    torch's generator, and a non-tensor argument."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, scale: float):
        return x + scale * self.down(self.drop(torch.nn.functional.silu(self.up(x))))


def run(blocks, x, ckpt: bool, seed: int = 0):
    torch.manual_seed(seed)
    for b in blocks:
        x = checkpoint(b, x, 0.5) if ckpt else b(x, 0.5)
    return x


def grads(blocks, x, ckpt: bool, autocast: bool = False):
    for p in blocks.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = run(blocks, x, ckpt)
    loss = (y.float() ** 2).sum()
    loss.backward()
    after = torch.rand(3)  # where the run's random stream stands after backward
    return loss.item(), [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()], after


@pytest.mark.parametrize("autocast", [False, True])
def test_checkpointed_gradients_equal_the_plain_ones_bitwise(autocast):
    torch.manual_seed(1)
    blocks = nn.ModuleList(Block() for _ in range(3)).train()
    x = torch.randn(5, 16)
    loss_plain, plain, after_plain = grads(blocks, x, False, autocast)
    loss_ckpt, ckpt, after_ckpt = grads(blocks, x, True, autocast)
    assert loss_ckpt == loss_plain
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)
    # the recompute restores the forward's generator state and gives the run's back afterwards
    assert torch.equal(after_plain, after_ckpt)


def test_forward_keeps_only_indices_and_a_second_backward_recomputes():
    torch.manual_seed(2)
    block = Block().eval()  # no dropout: two backward passes over one graph see the same values
    x = torch.randn(4, 16, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = checkpoint(block, x, 1.0)
    assert kept == []  # every saved tensor of the layer went through checkpoint's own hooks
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    assert torch.equal(x.grad, 2 * first)


def test_a_recompute_that_saves_other_tensors_is_refused():
    calls = []

    def moody(x):
        calls.append(1)
        return x.exp().sin() if len(calls) == 1 else x.exp()

    x = torch.randn(3, requires_grad=True)
    y = checkpoint(moody, x)
    with pytest.raises(RuntimeError, match="recompute saved 1 tensors where its forward saved 2"):
        y.sum().backward()


def test_checkpoint_imports_no_dynamo():
    code = ("import sys, torch; from hivetune.ops.recompute import checkpoint; "
            "x = torch.randn(2, 4, requires_grad=True); lin = torch.nn.Linear(4, 4); "
            "checkpoint(lin, x).sum().backward(); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy', 'torch.distributed.fsdp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
