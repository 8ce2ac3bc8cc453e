"""ops.blas.gemm on the GPU: each product the LoRA groups make, through the cached cuBLASLt plan,
against torch's (the reference path), inside CUDA graphs too; the model's LoRA gradients with the
plans against HIVETUNE_REFERENCE=cublaslt."""

from __future__ import annotations

import copy

import pytest
import torch

from hivetune.model.lora import fuse_projections
from hivetune.ops import blas
from conftest import bf16_loss_and_grads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def products(n=300, d=256, o=384, r=16, seed=0):
    """(name, a, b, out, alpha, beta, c) for each form the groups call, the column slices of a
    joined gradient and of xa included (their rows 64 bytes apart in the slice's start)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    x, w = torch.randn(n, d, generator=g, **bf), torch.randn(o, d, generator=g, **bf) / d ** 0.5
    a_all, bd = torch.randn(3 * r, d, generator=g, **bf) / d ** 0.5, torch.randn(o, 3 * r, generator=g, **bf)
    grad, xa = torch.randn(n, o, generator=g, **bf), torch.randn(n, 3 * r, generator=g, **bf)
    res = torch.randn(n, o, generator=g, **bf)
    f32 = dict(dtype=torch.float32, device="cuda")
    return [
        ("y = x W^T", x, w.t(), torch.empty(n, o, **bf), 1.0, 0.0, None),
        ("y = res + x W^T", x, w.t(), torch.empty(n, o, **bf), 1.0, 1.0, res),
        ("xa = s x A^T", x, a_all.t(), torch.empty(n, 3 * r, **bf), 2.0, 0.0, None),
        ("y += xa Bd^T", xa, bd.t(), res.clone(), 1.0, 1.0, None),
        ("g_xa = s g Bd", grad, bd, torch.empty(n, 3 * r, **bf), 2.0, 0.0, None),
        ("dx = g W", grad, w, torch.empty(n, d, **bf), 1.0, 0.0, None),
        ("dA += g_xa^T x", xa.t(), x, torch.randn(3 * r, d, generator=g, **f32), 1.0, 1.0, None),
        ("dB_i = g_i^T xa_i", grad[:, o // 3:2 * o // 3].t(), xa[:, r:2 * r], torch.empty(o // 3, r, **f32), 1.0,
         0.0, None),
    ]


def reference(a, b, out, alpha, beta, c):
    """In fp32 (bf16 products are exact there), rounded to out's dtype."""
    product = alpha * (a.float() @ b.float())
    if beta == 0.0:  # out may hold anything, NaN included (torch.empty)
        return product.to(out.dtype)
    return (product + beta * (c if c is not None else out).float()).to(out.dtype)


@pytest.mark.parametrize("case", range(8))
def test_each_product_matches_torch_through_its_plan(case):
    name, a, b, out, alpha, beta, c = products()[case]
    assert blas.available(a.device)
    want = reference(a, b, out, alpha, beta, c)
    before = dict(blas.STATS)
    got = blas.gemm(a, b, out, alpha, beta, c=c)
    assert got is out and blas.STATS["lt"] == before["lt"] + 1, name  # the plan ran, not torch
    tol = dict(rtol=1e-5, atol=1e-4) if out.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol, msg=name)
    plans = blas.STATS["plans"]
    blas.gemm(a, b, out.clone(), alpha, beta, c=c)  # same shapes, layouts, alignments: the same plan
    assert blas.STATS["plans"] == plans


def test_reference_env_takes_torch(monkeypatch):
    name, a, b, out, alpha, beta, c = products()[0]
    monkeypatch.setenv("HIVETUNE_REFERENCE", "cublaslt")
    before = dict(blas.STATS)
    got = blas.gemm(a, b, out, alpha, beta)
    assert blas.STATS["torch"] == before["torch"] + 1 and blas.STATS["lt"] == before["lt"]
    assert torch.equal(got, torch.mm(a, b))


def test_plans_replay_in_a_cuda_graph():
    cases = products()
    for _, a, b, out, alpha, beta, c in cases:  # eager first: plans, workspaces, kernels loaded
        blas.gemm(a, b, out.clone(), alpha, beta, c=c)
    torch.cuda.synchronize()
    outs = [out.clone() for _, _, _, out, _, _, _ in cases]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for (_, a, b, _, alpha, beta, c), o in zip(cases, outs):
            blas.gemm(a, b, o, alpha, beta, c=c)
    fresh = products(seed=1)  # new inputs copied into the captured ones
    starts = [out.clone() for _, _, _, out, _, _, _ in fresh]
    for (_, a, b, _, _, _, c), (_, a2, b2, out2, _, _, c2), o, s in zip(cases, fresh, outs, starts):
        a.copy_(a2), b.copy_(b2), o.copy_(s)
        if c is not None:
            c.copy_(c2)
    graph.replay()
    torch.cuda.synchronize()
    for (name, a, b, _, alpha, beta, c), o, s in zip(cases, outs, starts):
        want = reference(a, b, s, alpha, beta, c)
        tol = dict(rtol=1e-5, atol=1e-4) if o.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(o, want, **tol, msg=name)


def test_model_gradients_with_the_plans_match_torchs(lora_model_and_batch, monkeypatch):
    ref, batch = lora_model_and_batch
    model = copy.deepcopy(ref)
    fuse_projections(model)

    before = blas.STATS["lt"]
    loss, grads = bf16_loss_and_grads(model, batch)
    assert blas.STATS["lt"] > before  # the groups took the plans
    monkeypatch.setenv("HIVETUNE_REFERENCE", "cublaslt")
    ref_loss, ref_grads = bf16_loss_and_grads(model, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    assert ((grads - ref_grads).norm() / ref_grads.norm()).item() < 1e-2


def test_plans_freed_past_the_bound_are_made_again(monkeypatch):
    monkeypatch.setattr(blas, "MAX_PLANS", 2)
    for name, a, b, out, alpha, beta, c in products(n=304):  # shapes no earlier test planned
        want = reference(a, b, out, alpha, beta, c)
        got = blas.gemm(a, b, out, alpha, beta, c=c)
        assert len(blas._PLANS) <= 2
        tol = dict(rtol=1e-5, atol=1e-4) if out.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(got, want, **tol, msg=name)


# fp32 sums of ~2,400 bf16 products of N(0, 1) values (~50 in size): another summation order
# differs by ~1e-4
TOL_LONG_K = dict(rtol=1e-4, atol=2e-3)


@pytest.mark.parametrize("case", [0, 2, 5, 6])
def test_token_counts_of_one_bucket_share_one_heuristic_query(case):
    """Products whose token count (above 1,024) rounds up to the same multiple of blas.BUCKET ask
    the heuristic once, for the bucket's shape, and still match fp32. Token counts chosen fresh
    for this test (no earlier plan holds them)."""
    heuristics = blas.STATS["heuristics"]
    for n in (2305, 2400, 2560):  # one bucket: 2,560
        name, a, b, out, alpha, beta, c = products(n=n, d=1280 + 16 * case, seed=n)[case]
        want = reference(a, b, out, alpha, beta, c)
        got = blas.gemm(a, b, out, alpha, beta, c=c)
        tol = TOL_LONG_K if out.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(got, want, **tol, msg=f"{name}, {n} tokens")
    assert blas.STATS["heuristics"] == heuristics + 1, name


def test_a_product_first_met_in_a_graph_capture_takes_its_own_heuristic_query():
    """Inside a capture the plan asks the heuristic for its exact shape (a graph asks once per
    size; its replays keep that choice), though its bucket's algorithm is known; the replay with
    new inputs matches fp32."""
    name, a, b, out, alpha, beta, c = products(n=2305, d=1296, seed=5)[5]
    blas.gemm(a, b, out, alpha, beta, c=c)  # eager: the bucket (2,560 tokens) asks once
    torch.cuda.synchronize()
    heuristics = blas.STATS["heuristics"]
    _, a2, b2, out2, _, _, _ = products(n=2410, d=1296, seed=6)[5]  # the same bucket, a new shape
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        blas.gemm(a2, b2, out2, alpha, beta)
    assert blas.STATS["heuristics"] == heuristics + 1, name
    _, a3, b3, _, _, _, _ = products(n=2410, d=1296, seed=7)[5]
    a2.copy_(a3), b2.copy_(b3)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out2, reference(a2, b2, out2, alpha, 0.0, None), rtol=1.6e-2, atol=1e-2, msg=name)
