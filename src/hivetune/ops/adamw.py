"""AdamW and gradient clipping for LoRA parameters: torch's fused kernels without torch's
per-step Python bookkeeping, the same bits (tests/ops/test_fast_optimizer.py,
tests/gpu/test_cuda_fast_optimizer.py). HIVETUNE_REFERENCE=fused_adamw: torch's foreach AdamW."""

from __future__ import annotations

import inspect

import torch

from hivetune.core.fallbacks import FORCE_ENV, forced, note_fallback



def adamw(params, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for all parameters) when asked for and torch builds it for these
    parameters' device and dtype; else torch's default (foreach) implementation, with one line."""
    params = list(params)
    if fused and forced("fused_adamw"):
        note_fallback("fused_adamw", "fused AdamW", f"{FORCE_ENV} asks for the reference", "foreach AdamW")
    elif fused:
        try:
            return FusedAdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
        except (RuntimeError, ValueError, TypeError) as e:  # unsupported device / dtype / old torch
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            note_fallback("fused_adamw", "fused AdamW", text[:160], "foreach AdamW")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


class FusedAdamW(torch.optim.AdamW):
    """torch's fused AdamW, minus its per-step Python bookkeeping once its tensors are known
    (and over flat buffers where the gradients are one, _flat).

    torch's step rebuilds the lists of parameters, gradients and states and groups them by
    device and dtype on every call: about 4.6 ms of host time per W1 step for its 168 LoRA
    tensors (cProfile, H100), in a loop that CUDA graphs leave host-bound. Here the lists are
    kept while every gradient is the tensor it was (the graphs' persistent .grad tensors), and
    the step launches what torch's fused step launches, in the same order: the same bits
    (tests/ops/test_fast_optimizer.py, tests/gpu/test_cuda_fast_optimizer.py). Anything else (the
    first step, unless its gradients are one buffer: _fresh_flat; new gradient tensors, a loaded
    state, several groups, devices or dtypes, amsgrad, a tensor lr, a grad scaler, a closure)
    goes through torch's step, which then re-reads the lists."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._lists = None
        self._grads = None  # (params, their .grad tensors) the kept lists hold

    # torch's Optimizer wraps these four in torch._disable_dynamo, whose first call imports
    # torch._dynamo (~200 torch.library registrations: ~1 s on a CPU, 4-6 s on the device's
    # hosts) only to run the same function; hivetune never compiles its optimizer.
    def add_param_group(self, param_group):
        _undecorated(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True):
        _undecorated(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self):
        return _undecorated(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict):
        self._lists = None
        _undecorated(torch.optim.Optimizer.load_state_dict)(self, state_dict)

    def step(self, closure=None):
        lists = self._lists
        if lists is None and closure is None and not self.state:
            lists = self._lists = self._fresh_flat()
        if (closure is None and lists is not None and getattr(self, "grad_scale", None) is None
                and isinstance(self.param_groups[0]["lr"], float)
                and all(p.grad is g for p, g in zip(*self._grads))):
            self._known_step(*lists)
            return None
        if lists is not None and len(lists[0]) == 1 and len(self._grads[0]) > 1:  # flat: torch's step
            for p in self._grads[0]:  # would add 1 to the shared step count once per parameter
                self.state[p]["step"] = self.state[p]["step"].clone()
        self._lists = None
        # torch's step under the grad mode its _use_grad_for_differentiable wrapper sets, without
        # the wrapper, which imports torch._dynamo on every call (for graph breaks under compile)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            loss = inspect.unwrap(torch.optim.AdamW.step)(self, closure)
        self._lists = self._read_lists()
        if self._lists is not None:
            self._grads = (self._lists[0], self._lists[1])
            self._lists = self._flat(*self._lists) or self._lists
        return loss

    def _fresh_flat(self):
        """The first step, nothing loaded, over gradients in one buffer with the parameters laid
        out alike (CUDA graphs' GradArena): both moments made flat and zero at once and one step
        count shared, as _flat leaves them after torch's first step, so that the first step is
        the later steps' one fused call too. Torch's first step would set up a state per tensor
        and _flat then copy them into buffers and read every step count: 17 + 23 ms of host
        time for W2's 392 tensors on an H200, with the GPU idle (docs/log.md). The flat
        lists (self._grads set), or None where _flat would keep torch's."""
        if len(self.param_groups) != 1:
            return None
        group = self.param_groups[0]
        params = list(group["params"])
        if not self._plain(group, params) or group.get("capturable") or group.get("differentiable"):
            return None
        grads = [p.grad for p in params]
        layout = self._flat_layout(params, grads)
        if layout is None:
            return None
        flat_params, flat = layout
        step = torch.zeros((), dtype=torch.float32, device=flat.device)  # torch's fused step count
        self._grads = (params, grads)
        return self._point_states(params, grads, flat_params, flat, [torch.zeros_like(flat), torch.zeros_like(flat)],
                                  step)

    def _point_states(self, params, grads, flat_params, flat, moments, step):
        """Each parameter's moments made views of the flat `moments` where its gradient sits in
        `flat`, its step count the shared `step`; returns the flat lists _known_step takes."""
        for p, g in zip(params, grads):
            at = g.storage_offset()
            self.state[p].update(step=step, exp_avg=moments[0][at:at + p.numel()].view(p.shape),
                                 exp_avg_sq=moments[1][at:at + p.numel()].view(p.shape))
        return ([flat_params], [flat], [moments[0]], [moments[1]], [step])

    @staticmethod
    def _plain(group, params) -> bool:
        """Whether one fused call over these parameters is torch's step: fused, no amsgrad or
        maximize, every gradient present, one device and dtype."""
        return bool(params and group.get("fused") and not group["amsgrad"] and not group["maximize"]
                    and all(p.grad is not None for p in params)
                    and len({(p.device, p.dtype, p.grad.dtype) for p in params}) == 1)

    @staticmethod
    def _flat_layout(params, grads):
        """(the parameters' buffer as one flat tensor, the gradients' buffer) where the gradients
        are one buffer and the parameters another laid out alike, else None."""
        flat = one_buffer(grads)
        if flat is None or any(p.dtype != flat.dtype or p.device != flat.device for p in params):
            return None
        storage = params[0].untyped_storage()
        if (storage.nbytes() != flat.numel() * flat.element_size()
                or any(p.untyped_storage().data_ptr() != storage.data_ptr() or not p.is_contiguous()
                       or p.storage_offset() != g.storage_offset() for p, g in zip(params, grads))):
            return None
        return params[0].new_empty(0).set_(storage, 0, (flat.numel(),)), flat

    def _flat(self, params, grads, exp_avgs, exp_avg_sqs, steps):
        """Where the gradients are one buffer and the parameters another laid out alike (CUDA
        graphs' GradArena with move_params), both moments become views of buffers laid out
        alike too, sharing one step count: each step is then one fused kernel over flat tensors
        instead of a launch per ~36 of them (W1: 336 tensors, ~2 ms of host and ~0.25 ms of GPU
        a step). The parameters are not moved here: captured graphs read them where they are.
        Returns the flat lists, or None (the lists stay as they are)."""
        layout = self._flat_layout(params, grads)
        if layout is None or len({float(s) for s in steps}) != 1:  # (once, after torch's step: one host read)
            return None
        flat_params, flat = layout
        moments = []
        for tensors in (exp_avgs, exp_avg_sqs):
            buf = torch.empty_like(flat)
            for t, g in zip(tensors, grads):
                buf[g.storage_offset():][:t.numel()].copy_(t.reshape(-1))
            moments.append(buf)
        return self._point_states(params, grads, flat_params, flat, moments, steps[0])

    def _read_lists(self):
        if len(self.param_groups) != 1:
            return None
        group = self.param_groups[0]
        params = group["params"]
        if not self._plain(group, params) or any(p not in self.state for p in params):
            return None
        states = [self.state[p] for p in params]
        return (list(params), [p.grad for p in params], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [s["step"] for s in states])

    def _known_step(self, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        group = self.param_groups[0]
        found_inf = getattr(self, "found_inf", None)
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"],
                            beta1=float(beta1), beta2=float(beta2), weight_decay=group["weight_decay"],
                            eps=group["eps"], maximize=False, grad_scale=None, found_inf=found_inf)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))


def _undecorated(method):
    """The function a torch._disable_dynamo wrapper calls (functools.wraps keeps it as __wrapped__)."""
    return getattr(method, "__wrapped__", method)


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm), without its per-call grouping, for gradients on
    one CUDA device in one dtype: the same foreach kernels in the same order, so the same bits
    (tests/ops/test_fast_optimizer.py, tests/gpu/test_cuda_fast_optimizer.py); about 4 ms of host
    time less per W1 step. Anything else (CPU, where torch takes another path; DTensors; mixed
    dtypes) goes to torch's. Gradients that are one buffer (CUDA graphs' GradArena) take one norm
    and one scale of it: the same result but for the norm's summation order."""
    grads = [p.grad for p in params if p.grad is not None]
    first = grads[0] if grads else None
    if (first is None or first.device.type != "cuda" or type(first) is not torch.Tensor
            or any(g.dtype != first.dtype or g.device != first.device for g in grads)):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    flat = one_buffer(grads)
    if flat is not None:  # a GradArena: one norm and one scale over the whole buffer
        total = torch.linalg.vector_norm(flat, 2.0)
        flat.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def one_buffer(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The contiguous buffer these tensors are views of when together they are all of it (the
    gradients of a lora_grads.GradArena), else None."""
    base = tensors[0]._base if tensors else None
    if (base is None or not base.is_contiguous() or any(t._base is not base for t in tensors)
            or sum(t.numel() for t in tensors) != base.numel()
            or len({t.data_ptr() for t in tensors}) != len(tensors)):
        return None
    return base
