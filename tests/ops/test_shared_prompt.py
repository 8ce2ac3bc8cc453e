"""The flash pair path's segments (ops.shared_prompt) against the dense shared-prompt mask, on the
CPU: each varlen segment run as its own bottom-right causal attention, as flash runs it."""

import pytest
import torch
import torch.nn.functional as F

from hivetune.ops.shared_prompt import KeyGather, pair_segments, reference_pair_attention, row_parts

LENGTHS = [(3, 4, 2), (1, 1, 1), (5, 2, 6), (2, 3, 3)]


def segment_attention(q, k, v, lengths):
    """What one flash varlen call over pair_segments computes, segment by segment in float32."""
    s = pair_segments(lengths)
    q0 = q[0]
    k0 = KeyGather.apply(k[0], s.key_index, s.first, s.second)
    v0 = KeyGather.apply(v[0], s.key_index, s.first, s.second)
    groups = q.shape[2] // k.shape[2]
    outs = []
    for i in range(len(s.cu_q) - 1):
        qs = q0[s.cu_q[i]:s.cu_q[i + 1]].transpose(0, 1)
        ks, vs = (x[s.cu_k[i]:s.cu_k[i + 1]].transpose(0, 1).repeat_interleave(groups, 0) for x in (k0, v0))
        n_q, n_k = qs.shape[1], ks.shape[1]
        bottom_right = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bottom_right).transpose(0, 1))
    return torch.cat(outs)[None]


def test_segments_index_the_row():
    s = pair_segments([(2, 1, 3)])
    assert s.cu_q.tolist() == [0, 3, 6] and s.cu_k.tolist() == [0, 3, 8]
    assert s.key_index.tolist() == [0, 1, 2, 0, 1, 3, 4, 5]
    assert s.first.tolist() == [0, 1, 2, 5, 6, 7] and s.second.tolist() == [3, 4, 8, 8, 8, 8]
    assert (s.max_q, s.max_k) == (3, 5)
    pair, part = row_parts([(2, 1, 3), (1, 1, 1)])
    assert pair.tolist() == [0] * 6 + [1] * 3 and part.tolist() == [0, 0, 1, 2, 2, 2, 0, 1, 2]


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_segment_attention_equals_the_dense_mask(heads):
    gen = torch.Generator().manual_seed(1)
    t = sum(map(sum, LENGTHS))
    q, k, v = (torch.randn(1, t, h, 16, generator=gen, dtype=torch.float64).requires_grad_()
               for h in (heads[0], heads[1], heads[1]))
    out = segment_attention(q, k, v, LENGTHS)
    ref = reference_pair_attention(q.double(), k, v, LENGTHS).to(out.dtype)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_key_gather_backward_is_index_selects_and_fixed_order():
    s = pair_segments(LENGTHS)
    t = sum(map(sum, LENGTHS))
    x = torch.randn(t, 2, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(len(s.key_index), 2, 8, dtype=torch.float64)
    ours = torch.autograd.grad((KeyGather.apply(x, s.key_index, s.first, s.second) * g).sum(), x)[0]
    plain = torch.autograd.grad((x.index_select(0, s.key_index) * g).sum(), x)[0]
    torch.testing.assert_close(ours, plain, rtol=0, atol=1e-12)
