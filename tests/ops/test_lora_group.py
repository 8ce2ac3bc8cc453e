"""ops.lora_group (joined projections with a hand-written backward) against the layer-by-layer
LoRALinear reference: outputs and every gradient, fp32 on the CPU, with and without dropout,
biases (Qwen2 q/k/v) and single layers (o / down)."""

import contextlib
import copy

import pytest
import torch

from hivetune.core.config import load_config
from hivetune.core.errors import UserError
from hivetune.model.config import ModelArgs
from hivetune.model.decoder import CausalLM
from hivetune.model.lora import LoRASpec, apply_lora, fuse_projections, lora_enabled, lora_parameters, stack_frozen
from hivetune.ops import lora_casts, lora_grads
from hivetune.ops import lora_group as lg
def tiny(model_type="llama", bias=False):
    args = ModelArgs(model_type=model_type, vocab_size=97, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     attention_bias=bias, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = CausalLM(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model


def with_lora(model, dropout):
    apply_lora(model, LoRASpec(r=4, alpha=8, dropout=dropout))
    torch.manual_seed(1)
    for p in lora_parameters(model):  # B nonzero, so every gradient path carries signal
        torch.nn.init.normal_(p, std=0.1)
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    hidden = model(ids)
    loss = model.logits(hidden).logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


class FixedMask:
    """torch.native_dropout with a mask from a private generator, the same on both paths."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(5)

    def mask(self, x, p):
        return torch.rand(x.shape, generator=self.gen) >= p


@pytest.mark.parametrize("model_type,bias", [("llama", False), ("qwen2", True)])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("wide", [False, True])
def test_fused_matches_reference(monkeypatch, model_type, bias, dropout, wide):
    """wide: q/k/v and gate/up in the wide layout, [x | xa] @ [W | Bd]^T as one matmul."""
    ref = with_lora(tiny(model_type, bias), dropout)
    fused = copy.deepcopy(ref)
    assert fuse_projections(fused, wide=wide) == 4
    assert all(m.qkv.lora_cols == 3 * 4 and m.qkv.weight.stride() == (128, 1) if wide else m.qkv.room == 0
               for m in (layer.self_attn for layer in fused.model.layers))
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    if dropout:
        # Both paths draw one mask per group and one per single layer, in the same order:
        # replace both draws with masks from one seeded stream so the results are comparable.
        fixed = FixedMask()
        masks = []

        def native_dropout(x, p, train):
            m = fixed.mask(x, p)
            masks.append(m)
            return x * m / (1 - p), m

        monkeypatch.setattr(torch, "native_dropout", native_dropout)
        loss_f, grads_f = loss_and_grads(fused, ids)
        replay = iter(masks)

        def dropout_forward(self, x):
            return x * next(replay).view(x.shape) / (1 - self.p)

        monkeypatch.setattr(torch.nn.Dropout, "forward", dropout_forward)
        loss_r, grads_r = loss_and_grads(ref, ids)
    else:
        loss_r, grads_r = loss_and_grads(ref, ids)
        loss_f, grads_f = loss_and_grads(fused, ids)
    assert torch.allclose(loss_f, loss_r, rtol=0, atol=1e-6), (loss_f, loss_r)
    assert grads_f.keys() == grads_r.keys() and len(grads_f) == 2 * 7 * 2
    for name in grads_r:
        err = (grads_f[name] - grads_r[name]).abs().max().item()
        assert err <= 1e-6 * max(1.0, grads_r[name].abs().max().item()), (name, err)


def test_fused_views_keep_names_and_values():
    model = with_lora(tiny("qwen2", True), 0.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    attn = model.model.layers[0].self_attn
    w = attn.q_proj.base_layer.weight
    assert w.data_ptr() == attn.qkv.weight.data_ptr() and not w.requires_grad
    assert attn.k_proj.base_layer.weight.data_ptr() == w.data_ptr() + w.numel() * w.element_size()


def test_wide_layout_holds_weights_and_the_cast_bd(monkeypatch):
    """The wide layout: each layer's q/k/v weights are the first 64 columns of one [rows, 128]
    block (64 + 3 r = 76 columns, rows 128-aligned) of a tensor shared by all layers (names and
    values unchanged), and a forward's
    CastCache refresh writes the block-diagonal B into the other columns; the output is the
    narrow layout's (an addmm of the LoRA update)."""
    model = with_lora(tiny("qwen2", True), 0.0)
    narrow = copy.deepcopy(model)
    fuse_projections(narrow, wide=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model, wide=True)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    layers = [layer.self_attn for layer in model.model.layers]
    w0, w1 = (attn.q_proj.base_layer.weight for attn in layers)
    assert w0.stride() == (128, 1) and w1.data_ptr() == w0.data_ptr() + 128 * 128 * 4  # q/k/v: 64 + 32 + 32 rows
    assert layers[0].k_proj.base_layer.weight.data_ptr() == w0.data_ptr() + 64 * 128 * 4
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    used = []
    real = lg.wide_matrix
    monkeypatch.setattr(lg, "wide_matrix", lambda w, bd: used.append(real(w, bd) is not None) or real(w, bd))
    out = model(ids)  # training with grad: the forward refreshes the CastCache
    assert used == [True] * 4  # q/k/v and gate/up of both layers ran wide
    slot, attn = layers[1].qkv.b_slot, layers[1]
    assert slot.shape == (128, 12) and slot.data_ptr() == attn.qkv.weight.data_ptr() + 64 * 4
    expect = torch.block_diag(*(m.lora_B.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj)))
    assert torch.equal(slot, expect)
    assert torch.allclose(narrow(ids), out, rtol=0, atol=1e-6)


def test_stacked_frozen_weights_are_views_of_one_tensor():
    """With the wide layout, every layer's o_proj and down_proj base weights become views of one
    [L, out, in] tensor per kind (lora.stack_frozen), in layer order, frozen, names and values
    unchanged, and the forward gives what the unstacked model gives. Without the wide layout,
    nothing is stacked."""
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(5))
    ref = with_lora(tiny("qwen2", True), 0.0)
    stacked, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    fuse_projections(stacked, wide=True)
    fuse_projections(plain, wide=False)
    after = stacked.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    for owner, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
        weights = [getattr(getattr(layer, owner), name).base_layer.weight for layer in stacked.model.layers]
        whole = weights[0].untyped_storage()
        assert all(w.untyped_storage().data_ptr() == whole.data_ptr() for w in weights)
        assert whole.nbytes() == sum(w.numel() * w.element_size() for w in weights)
        assert weights[1].data_ptr() == weights[0].data_ptr() + weights[0].numel() * weights[0].element_size()
        assert not any(w.requires_grad for w in weights)
        separate = [getattr(getattr(layer, owner), name).base_layer.weight for layer in plain.model.layers]
        assert separate[0].untyped_storage().data_ptr() != separate[1].untyped_storage().data_ptr()
    assert torch.allclose(stacked(ids), ref(ids), rtol=0, atol=1e-6)  # ref: unfused
    assert stack_frozen([plain.model.layers[1].mlp.gate_up]) is None  # not a linear layer
    assert stack_frozen([stacked.model.layers[0].self_attn.o_proj, stacked.model.layers[0].mlp.down_proj]) is None


def test_mixed_group_falls_back_and_disabled_is_base():
    ref = with_lora(tiny(), 0.0)
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    ids = torch.randint(0, 97, (1, 7))
    fused.model.layers[0].self_attn.k_proj.enabled = False  # a mixed group: layer by layer
    ref.model.layers[0].self_attn.k_proj.enabled = False
    with torch.no_grad():
        assert torch.allclose(fused(ids), ref(ids), atol=1e-6)
        with lora_enabled(fused, False), lora_enabled(ref, False):
            assert torch.allclose(fused(ids), ref(ids), atol=1e-6)
    assert fused.model.layers[0].self_attn.qkv(torch.zeros(1, 64)) is None


def test_mm_fp32():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    assert torch.equal(lora_grads.mm_fp32(a, b), a @ b)
    assert lora_grads.mm_fp32(a.bfloat16(), b.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("autocast", [False, True])
def test_cast_cache_equals_per_call_casts_and_follows_updates(monkeypatch, autocast):
    """CausalLM.forward refreshes the model's CastCache: every group call takes its A_all / Bd
    from it, the results equal the per-call casts bit for bit, and an in-place update of the
    LoRA weights (an optimizer step) is in the next forward's casts."""
    model = with_lora(tiny("qwen2", True), 0.0)
    fuse_projections(model)
    casts = model.lora_casts
    assert sorted((k.n, k.layers) for k in casts.kinds) == [(1, 2), (1, 2), (2, 2), (3, 2)]
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    hits = []
    real_lookup = lora_casts.CastCache.lookup
    monkeypatch.setattr(lora_casts.CastCache, "lookup", lambda self, *a: hits.append(real_lookup(self, *a)) or hits[-1])
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    results = []
    for step in range(2):
        for cached in (True, False):
            model.lora_casts = casts if cached else None
            hits.clear()
            with ctx:
                results.append(loss_and_grads(model, ids))
            assert len(hits) == (8 if cached else 0) and all(h is not None for h in hits)
        with torch.no_grad():  # an optimizer step: in place
            for p in lora_parameters(model):
                p.add_(0.01)
    (l0, g0), (l0r, g0r), (l1, g1), (l1r, g1r) = results
    assert torch.equal(l0, l0r) and torch.equal(l1, l1r) and not torch.equal(l0, l1)
    for name in g0:
        assert torch.equal(g0[name], g0r[name]) and torch.equal(g1[name], g1r[name]), name
    assert casts.kinds[0].a_buf.dtype == (torch.bfloat16 if autocast else torch.float32)


def test_seeded_dropout_recompute_equals_keeping_the_input(monkeypatch):
    """The seeded-dropout path (the Triton kernels' CPU stand-ins): o_proj and down_proj keep the
    attention / gate-up output and recompute their dropped input in backward; the loss and every
    gradient equal those of keeping the dropped input, bit for bit (same seeds)."""
    import hivetune.model.lora as lora_module
    from hivetune.plan.measure import fused_layers_standin

    model = with_lora(tiny("qwen2", True), 0.2).to(torch.bfloat16)
    fuse_projections(model)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    results = []
    for keep_source in (True, False):
        with monkeypatch.context() as m, fused_layers_standin():
            if not keep_source:
                real = lora_module.lora_group
                m.setattr(lora_module, "lora_group", lambda *a, **k: real(*a[:8], None, *a[9:]))  # drops `source`
            torch.manual_seed(9)
            results.append(loss_and_grads(model, ids))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert any(g.abs().sum() > 0 for g in grads_a.values())


@pytest.mark.parametrize("dtype,dropout", [(torch.float32, 0.0), (torch.float32, 0.3), (torch.bfloat16, 0.2)])
def test_grads_added_into_arena_equal_autograd_accumulation(monkeypatch, dtype, dropout):
    """Two micro-batches accumulated: with every LoRA .grad a view of a GradArena, LoRAGroup adds
    its gradients into them (autograd gets None) and the result equals autograd's own
    accumulation of fresh gradients bit for bit; the views stay the .grads, each group's A
    gradients are one block, and the arena order follows the groups."""
    from hivetune.plan.measure import fused_layers_standin

    model = with_lora(tiny("qwen2", True), dropout).to(dtype)
    for p in lora_parameters(model):
        p.data = p.data.float()  # fp32 LoRA weights on a bf16 base, as training has them
    fuse_projections(model)
    params = lora_parameters(model)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 97, (2, 11), generator=gen), torch.randint(0, 97, (1, 7), generator=gen)]
    calls = []
    real_into = lg.grads_into

    def two_micro_batches(arena):
        model.zero_grad(set_to_none=True)
        if arena is not None:
            for p, g in zip(params, arena.grads):
                p.grad = g
        torch.manual_seed(9)
        for ids in batches:
            model.logits(model(ids)).float().logsumexp(-1).mean().backward()
        return [p.grad.clone() for p in params]

    standin = fused_layers_standin() if dtype == torch.bfloat16 else contextlib.nullcontext()
    with standin:
        monkeypatch.setattr(lg, "grads_into", lambda *a: None)  # autograd accumulates everything
        want = two_micro_batches(None)
        monkeypatch.setattr(lg, "grads_into", lambda *a: calls.append(real_into(*a)) or calls[-1])
        arena = lora_grads.GradArena(params, model.lora_casts)
        got = two_micro_batches(arena)
    assert len(calls) == 2 * 2 * 8 and all(c is not None for c in calls)  # A and B, 8 groups, 2 micro-batches
    assert all(p.grad is g for p, g in zip(params, arena.grads))
    assert arena.flat.numel() == sum(p.numel() for p in params)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert any(w.abs().sum() > 0 for w in want)
    qkv_a = [m.lora_A.weight for m in model.model.layers[0].self_attn.qkv.layers]
    grads = [p.grad for p in qkv_a]
    assert all(g.data_ptr() == grads[0].data_ptr() + i * grads[0].numel() * 4 for i, g in enumerate(grads))


def test_grads_into_declines_what_autograd_must_accumulate():
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2, 3))
    assert lora_grads.grads_into([a, b]) is None  # no .grad yet: autograd takes the fresh tensor
    flat = torch.zeros(12)
    a.grad, b.grad = flat[:6].view(2, 3), flat[6:].view(2, 3)
    with torch.no_grad():
        assert lora_grads.grads_into([a, b]) == (a.grad, b.grad)
        joined = lora_grads.grads_into([a, b], joined_rows=4)[0]
        assert joined.shape == (4, 3) and joined.data_ptr() == flat.data_ptr()
        b.grad = torch.zeros(2, 3)  # not next to a's
        assert lora_grads.grads_into([a, b]) is not None and lora_grads.grads_into([a, b], joined_rows=4) is None
    assert lora_grads.grads_into([a, b]) is None  # grad mode on: a double backward needs autograd's graph
    b.grad = torch.zeros(3, 2).t()  # not contiguous
    with torch.no_grad():
        assert lora_grads.grads_into([b]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_rides_in_the_base_matmul(dtype):
    """lora_group(residual=r) = r + lora_group(...): the add in the base matmul's epilogue
    (addmm with C = r) to rounding; r's gradient is the output's, x's and the LoRA gradients agree."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 48, dtype=dtype)
    r = torch.randn(2, 9, 40, dtype=dtype)
    w = torch.randn(40, 48, dtype=dtype) * 0.1
    a0, b0 = torch.randn(4, 48) * 0.1, torch.randn(40, 4) * 0.1
    dy = torch.randn(2, 9, 40, dtype=dtype)

    def run(with_residual: bool):
        xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = (lg.lora_group(xs, w, None, (40,), 0.0, 2.0, [a], [b], residual=rs) if with_residual
             else rs + lg.lora_group(xs, w, None, (40,), 0.0, 2.0, [a], [b]))
        y.backward(dy)
        return y.detach(), xs.grad, rs.grad, a.grad, b.grad

    plain, fused = run(False), run(True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused[0], plain[0], rtol=tol, atol=tol)
    assert torch.equal(fused[2], dy) and torch.equal(plain[2], dy)
    for u, v in zip(fused[1:], plain[1:]):
        assert torch.equal(u, v)  # the backward does not see where the add happened


def test_wide_layout_only_where_micro_batches_are_small(monkeypatch):
    """train.wide_groups: the wide layout on CUDA for graph-sized micro-batches (W1: 0.5B, 8
    examples of ~199 tokens, ~2.3 TFLOP), not for W2's (7B, 16 x ~171 tokens, ~77 TFLOP, above
    graphs' 60), nor on the CPU; when the config asks for it
    or leaves it auto (the default), but not under FSDP by default.
    (Only shapes are read.)"""
    from types import SimpleNamespace

    from hivetune.workflows.workloads import WORKLOADS
    from hivetune.data.dataset import TokenizedExamples
    from hivetune.data.formats import Encoded
    from hivetune.train.prepare import wide_groups

    def run(name, batch, mean, device="cuda", asked="true", strategy="none"):
        data = TokenizedExamples([Encoded([1] * mean, [True] * mean, truncated=False)] * 4)
        return wide_groups(WORKLOADS[name].args, SimpleNamespace(batch_size=batch, wide_lora=asked), data, torch.device(device),
                           strategy)

    assert run("W1", 8, 199) and not run("W2", 16, 171) and run("W2", 1, 171)
    assert not run("W1", 8, 199, "cpu")
    assert not run("W1", 8, 199, asked="false") and not run("W2", 8, 171, asked="false", strategy="ddp")
    assert load_config(None, {"model": "random", "data": "generator"}).wide_lora == "auto"
    assert run("W1", 8, 199, asked="auto") and not run("W2", 8, 171, asked="auto", strategy="fsdp")
    assert not run("W2", 16, 171, asked="auto") and not run("W1", 8, 199, "cpu", asked="auto")
    assert run("W2", 8, 171, asked="auto", strategy="ddp") and not run("W2", 16, 171, asked="auto", strategy="ddp")
    # YAML's booleans and the three words; anything else is named in the error
    assert load_config(None, {"model": "random", "data": "generator", "wide_lora": True}).wide_lora == "true"
    assert load_config(None, {"model": "random", "data": "generator", "wide_lora": False}).wide_lora == "false"
    with pytest.raises(UserError, match="wide_lora: 'sometimes' is not one of auto, true, false"):
        load_config(None, {"model": "random", "data": "generator", "wide_lora": "sometimes"})


def test_given_seeds_decide_the_dropout_masks_not_the_generator(monkeypatch):
    """A forward inside lora_casts.given_seeds takes every group call's dropout seed from the
    given tensor (train.dropout_seeds; a CUDA graph's static inputs) and draws none from torch's
    generator: the same seeds give the same loss and gradients, bit for bit, whatever the
    generator's state; other seeds give other masks; without the block the generator decides."""
    from hivetune.ops import dropout
    from hivetune.plan.measure import fused_layers_standin

    model = with_lora(tiny("qwen2", True), 0.2).to(torch.bfloat16)
    fuse_projections(model)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    n = len(model.lora_casts.slots)
    seeds = torch.randint(0, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(3))
    with fused_layers_standin():
        draws = []
        real_draw = dropout.new_dropout_seed
        monkeypatch.setattr(dropout, "new_dropout_seed", lambda *a, **k: draws.append(1) or real_draw(*a, **k))
        results = []
        for generator_seed, given in ((1, seeds), (2, seeds), (1, seeds + 1)):
            torch.manual_seed(generator_seed)
            with lora_casts.given_seeds(given):
                results.append(loss_and_grads(model, ids))
        assert draws == []
        drawn = []
        for generator_seed in (1, 2):
            torch.manual_seed(generator_seed)
            drawn.append(loss_and_grads(model, ids))
        assert len(draws) == 2  # one draw a forward for all groups
    (loss_a, grads_a), (loss_b, grads_b), (loss_c, grads_c) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    assert not torch.equal(loss_a, loss_c)
    assert not torch.equal(drawn[0][0], drawn[1][0])


@pytest.mark.parametrize("given", [True, False], ids=["given-seeds", "drawn-seeds"])
def test_checkpointed_recompute_takes_the_forwards_seeds(given):
    """Gradient checkpointing over the seeded-dropout path (the Triton kernels' CPU stand-ins):
    each layer's recompute in backward takes the seeds its forward took (lora_casts.SeedTape),
    given or drawn, so the loss and every LoRA gradient equal the plain forward's, bit for bit.
    Drawn afresh in the recompute, the masks differed from the forward's."""
    from hivetune.plan.measure import fused_layers_standin

    model = with_lora(tiny("qwen2", True), 0.3).to(torch.bfloat16)
    fuse_projections(model)
    model.train()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    seeds = torch.randint(0, 2**31 - 1, (len(model.lora_casts.slots),), generator=torch.Generator().manual_seed(3))
    results = []
    with fused_layers_standin():
        for checkpointing in (False, True):
            model.gradient_checkpointing = checkpointing
            torch.manual_seed(5)
            with lora_casts.given_seeds(seeds if given else None):
                results.append(loss_and_grads(model, ids))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and any(g.abs().sum() > 0 for g in grads_a.values())
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
