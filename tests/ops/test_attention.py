"""Packed attention on the padded view: outputs and q/k/v gradients equal per-example causal SDPA."""

import pytest
import torch
import torch.nn.functional as F

from hivetune.ops.attention import RowGather, padded_view_attention


def per_example_reference(q, k, v, lengths):
    """Each example on its own: [1, L, H, D] slices, GQA by repeating K/V heads, causal SDPA."""
    groups = q.shape[2] // k.shape[2]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[0, start:start + n].transpose(0, 1)[None] for x in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)[None]


@pytest.mark.parametrize("lengths,heads,kv_heads", [((5, 1, 9, 3), 4, 2), ((7,), 2, 2), ((2, 2, 16), 6, 1)])
def test_padded_view_matches_per_example_sdpa_with_gradients(lengths, heads, kv_heads):
    torch.manual_seed(0)
    t, d = sum(lengths), 8
    q = torch.randn(1, t, heads, d, requires_grad=True)  # fp32: the path casts other dtypes to it
    k = torch.randn(1, t, kv_heads, d, requires_grad=True)
    v = torch.randn(1, t, kv_heads, d, requires_grad=True)
    weights = torch.randn(1, t, heads, d)  # a loss that weighs every output
    out = padded_view_attention(q, k, v, lengths)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref = per_example_reference(q, k, v, lengths)
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-5, rtol=1e-5)


def test_row_gather_backward_is_the_inverse_gather():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([2, 0, 3, 1])
    inverse = torch.tensor([1, 3, 0, 2])
    torch.autograd.gradcheck(lambda t: RowGather.apply(t, index, inverse, False), (x,))
    # with pad rows pointing at a zero row appended to the gradient
    y = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    take = torch.tensor([0, 2, 4])  # rows 1, 3, 5 of y are pads, dropped
    back = torch.tensor([0, 3, 1, 3, 2, 3])  # y-row -> position in the result, 3 = the zero row
    torch.autograd.gradcheck(lambda t: RowGather.apply(t, take, back, True), (y,))
