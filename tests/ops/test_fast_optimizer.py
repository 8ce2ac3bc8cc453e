"""FusedAdamW's kept-lists step against torch's fused AdamW, on the CPU (torch fuses it there too):
the same bits, with persistent gradient tensors (what CUDA graphs give it), a skipped step
(found_inf), an lr schedule, and a state loaded from a checkpoint."""

import copy

import torch

from hivetune.ops.adamw import FusedAdamW, adamw


def make_params(seed=0, shapes=((8, 16), (16, 8), (3,), (5, 7))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def run_steps(opt, params, grads, steps=6, skip=(3,)):
    """Writes new values into the same gradient tensors each step (as graph replays do)."""
    g = torch.Generator().manual_seed(1)
    for p, t in zip(params, grads):
        p.grad = t
    for k in range(steps):
        for t in grads:
            t.copy_(torch.randn(t.shape, generator=g))
        opt.found_inf = torch.tensor(1.0 if k in skip else 0.0)
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (0.9 ** k)
        opt.step()
    return [p.detach().clone() for p in params]


def test_kept_lists_step_equals_torch_fused_bit_for_bit():
    fast_params, ref_params = make_params(), make_params()
    fast = adamw(fast_params, 1e-2, 0.01, fused=True)
    assert isinstance(fast, FusedAdamW)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, fused=True)
    calls = []
    real = fast._known_step
    fast._known_step = lambda *a: (calls.append(1), real(*a))
    a = run_steps(fast, fast_params, [torch.zeros_like(p) for p in fast_params])
    b = run_steps(ref, ref_params, [torch.zeros_like(p) for p in ref_params])
    assert len(calls) == 5  # the first step is torch's; the next 5 keep its lists
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for p, q in zip(fast_params, ref_params):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fast.state[p][key], ref.state[q][key]), key
    assert float(fast.state[fast_params[0]]["step"]) == 5.0  # 6 steps, one skipped


def test_new_gradient_tensors_and_a_loaded_state_go_through_torch():
    params = make_params()
    opt = adamw(params, 1e-2, 0.0, fused=True)
    run_steps(opt, params, [torch.zeros_like(p) for p in params], steps=2, skip=())
    assert opt._lists is not None
    params[0].grad = torch.ones_like(params[0])  # a new tensor: the kept lists no longer hold
    calls = []
    opt._known_step = lambda *a: calls.append(1)
    opt.step()
    assert calls == []
    opt.load_state_dict(opt.state_dict())
    assert opt._lists is None


def test_flat_step_over_a_gradient_arena_equals_torch_fused_bit_for_bit():
    """Gradients that are views of one GradArena buffer (CUDA graphs'): from the first step the
    parameters and both moments are buffers laid out alike, one step count shared, and each
    step (the first too: no per-tensor state first) is one fused call over the flat tensors:
    torch's fused AdamW to fp32 rounding
    (the CPU kernel rounds a vectorised body and a scalar tail apart, so a small tensor's
    elements can move from one to the other; tests/gpu checks the CUDA kernel bit for bit). A
    step through torch's path afterwards (a new gradient tensor) counts each parameter's step
    once, and the state round-trips through state_dict."""
    from hivetune.ops.lora_grads import GradArena

    fast_params, ref_params = make_params(), make_params()
    arena = GradArena(fast_params, None, move_params=True)
    fast = adamw(fast_params, 1e-2, 0.01, fused=True)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, fused=True)
    calls = []
    real = fast._known_step
    fast._known_step = lambda *a: (calls.append(len(a[0])), real(*a))
    a = run_steps(fast, fast_params, arena.grads)
    b = run_steps(ref, ref_params, [torch.zeros_like(p) for p in ref_params])
    assert calls == [1] * 6  # one flat tensor a step, the first step's too
    storages = {p.untyped_storage().data_ptr() for p in fast_params}
    assert len(storages) == 1 and fast_params[0].untyped_storage().nbytes() == arena.flat.numel() * 4
    assert len({id(fast.state[p]["step"]) for p in fast_params}) == 1
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-9)
    for p, q in zip(fast_params, ref_params):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fast.state[p][key], ref.state[q][key], rtol=1e-6, atol=1e-9, msg=key)
    # a new gradient tensor: torch's step, each parameter's count + 1 (not + 4 through a shared one)
    for opt, params in ((fast, fast_params), (ref, ref_params)):
        params[1].grad = torch.full_like(params[1], 0.5)
        opt.found_inf = torch.tensor(0.0)
        opt.step()
    for p, q in zip(fast_params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
        assert torch.equal(fast.state[p]["step"], ref.state[q]["step"]) and float(fast.state[p]["step"]) == 6.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fast.state[p][key], ref.state[q][key], rtol=1e-6, atol=1e-9, msg=key)
    loaded = adamw(make_params(), 1e-2, 0.01, fused=True)
    loaded.load_state_dict(fast.state_dict())
    assert all(torch.equal(loaded.state[p]["exp_avg"], fast.state[q]["exp_avg"])
               for p, q in zip(loaded.param_groups[0]["params"], fast_params))


def test_first_step_over_an_arena_with_a_loaded_state_goes_through_torch():
    """A state loaded from a checkpoint (a resumed run): the first step is torch's, which reads
    the loaded moments, and the flat lists are built after it; its parameters equal an unbroken
    run's to fp32 rounding."""
    from hivetune.ops.lora_grads import GradArena

    ref_params = make_params()
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, fused=True)
    run_steps(ref, ref_params, [torch.zeros_like(p) for p in ref_params], steps=2, skip=())
    params = make_params()
    with torch.no_grad():
        for p, q in zip(params, ref_params):
            p.copy_(q)
    arena = GradArena(params, None, move_params=True)
    opt = adamw(params, 1e-2, 0.01, fused=True)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # (as from a checkpoint: not ref's own tensors)
    calls = []
    real = opt._known_step
    opt._known_step = lambda *a: (calls.append(len(a[0])), real(*a))
    for p, g in zip(params, arena.grads):
        g.fill_(0.25)
        p.grad = g
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert calls == [] and opt._lists is not None and len(opt._lists[0]) == 1
    for p in ref_params:
        p.grad = torch.full_like(p, 0.25)
    ref.found_inf = torch.tensor(0.0)
    ref.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
        assert float(opt.state[p]["step"]) == 3.0
