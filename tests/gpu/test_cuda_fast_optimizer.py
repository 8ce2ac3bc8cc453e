"""On CUDA: FusedAdamW's kept-lists step and ops.adamw.clip_grad_norm give torch's bits."""

import pytest
import torch

from hivetune.ops.adamw import FusedAdamW, clip_grad_norm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def lora_like(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(8, 896), (128, 8), (8, 896), (896, 8), (8, 4864), (9728, 8)] * 28
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in shapes]


def test_clip_grad_norm_equals_torch_bit_for_bit():
    a, b = lora_like(0), lora_like(0)
    g = torch.Generator(device="cuda").manual_seed(2)
    for p, q in zip(a, b):
        p.grad = torch.randn(p.shape, device="cuda", generator=g)
        q.grad = p.grad.clone()
    for max_norm in (1.0, 1e6):  # clipped, and left as it is
        mine = clip_grad_norm(a, max_norm)
        theirs = torch.nn.utils.clip_grad_norm_(b, max_norm)
        assert torch.equal(mine, theirs)
        for p, q in zip(a, b):
            assert torch.equal(p.grad, q.grad)


def test_fused_adamw_kept_lists_equal_torch_on_cuda():
    fast_params, ref_params = lora_like(1), lora_like(1)
    fast = FusedAdamW(fast_params, lr=2e-4, weight_decay=0.0, fused=True)
    ref = torch.optim.AdamW(ref_params, lr=2e-4, weight_decay=0.0, fused=True)
    grads_a = [torch.zeros_like(p) for p in fast_params]
    grads_b = [torch.zeros_like(p) for p in ref_params]
    for p, t in zip(fast_params, grads_a):
        p.grad = t
    for p, t in zip(ref_params, grads_b):
        p.grad = t
    calls = []
    real = fast._known_step
    fast._known_step = lambda *a: (calls.append(1), real(*a))
    g = torch.Generator(device="cuda").manual_seed(3)
    for k in range(6):
        for ta, tb in zip(grads_a, grads_b):
            ta.copy_(torch.randn(ta.shape, device="cuda", generator=g))
            tb.copy_(ta)
        fast.found_inf = ref.found_inf = torch.tensor(float(k == 2), device="cuda")
        for opt in (fast, ref):
            opt.param_groups[0]["lr"] = 2e-4 * (0.8 ** k)
            opt.step()
    assert len(calls) == 5  # torch's first step, then the kept lists
    for p, q in zip(fast_params, ref_params):
        assert torch.equal(p, q)
        assert torch.equal(fast.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def test_flat_adamw_and_clip_over_a_gradient_arena_on_cuda():
    """Gradients in a GradArena (CUDA graphs'): FusedAdamW's flat step (one kernel over the
    whole buffer) gives torch's fused AdamW's bits (the CUDA kernel's arithmetic does not
    depend on where an element sits), and clip_grad_norm's one norm of the buffer equals
    torch's to fp32 rounding."""
    from hivetune.ops.lora_grads import GradArena

    fast_params, ref_params = lora_like(1), lora_like(1)
    arena = GradArena(fast_params, None, move_params=True)
    for p, t in zip(fast_params, arena.grads):
        p.grad = t
    ref_grads = [torch.zeros_like(p) for p in ref_params]
    for p, t in zip(ref_params, ref_grads):
        p.grad = t
    fast = FusedAdamW(fast_params, lr=2e-4, weight_decay=0.0, fused=True)
    ref = torch.optim.AdamW(ref_params, lr=2e-4, weight_decay=0.0, fused=True)
    calls = []
    real = fast._known_step
    fast._known_step = lambda *a: (calls.append(len(a[0])), real(*a))
    g = torch.Generator(device="cuda").manual_seed(3)
    for k in range(6):
        for ta, tb in zip(arena.grads, ref_grads):
            ta.copy_(torch.randn(ta.shape, device="cuda", generator=g))
            tb.copy_(ta)
        mine, theirs = clip_grad_norm(fast_params, 1.0), torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=0)
        for ta, tb in zip(arena.grads, ref_grads):
            tb.copy_(ta)  # the same clipped gradients into both optimizers
        fast.found_inf = ref.found_inf = torch.tensor(float(k == 2), device="cuda")
        for opt in (fast, ref):
            opt.param_groups[0]["lr"] = 2e-4 * (0.8 ** k)
            opt.step()
    assert calls == [1] * 6  # the first step flat too (FusedAdamW._fresh_flat)
    for p, q in zip(fast_params, ref_params):
        assert torch.equal(p, q)
        assert torch.equal(fast.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def test_tail_kernels_leave_the_process_unchanged():
    """prewarm.tail_kernels (the prewarm thread's run of the step's tail) on another thread:
    it returns, and a FusedAdamW built after it over a GradArena still steps flat from the first
    step with torch's bits (nothing of the prewarm's optimizers is shared)."""
    import threading

    from hivetune.ops.prewarm import tail_kernels

    errors = []

    def run():
        try:
            tail_kernels(torch.device("cuda", torch.cuda.current_device()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert errors == [] and not thread.is_alive()
    test_flat_adamw_and_clip_over_a_gradient_arena_on_cuda()
