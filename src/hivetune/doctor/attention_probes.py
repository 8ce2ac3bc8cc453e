"""Each attention back-end tried forward and backward on a tiny causal input, checked against a
float64 reference: SDPA flash / efficient / cuDNN / math, varlen_attn, flex_attention, FA3 / FA4."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from hivetune.doctor.environment import first_line
from hivetune.doctor.selftest import rel_error, sync


def probe_attention(device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Each attention back-end on a tiny causal input, forward and backward, checked against the
    float64 math result: 'ok', 'forward only (...)', 'unsupported: ...', 'failed: ...', 'wrong
    result (...)' or 'missing' (not in this torch)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=gen) for _ in range(3))
    qkv = [t.double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*qkv, is_causal=True)
    out.square().sum().backward()
    ref = (out.detach(), torch.cat([t.grad.flatten() for t in qkv]))
    tol = 1e-4 if dtype == torch.float32 else 3e-2

    def sdpa(backend_name):
        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            return None

        def run(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run

    results = {}
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_efficient", "EFFICIENT_ATTENTION"),
                          ("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_math", "MATH")):
        results[name] = _probe(sdpa(backend), q, k, v, ref, device, dtype, tol)
    results["varlen_attn"] = _probe(_varlen(), q, k, v, ref, device, dtype, tol)
    results["flex_attention"] = _probe(_flex(device), q, k, v, ref, device, dtype, tol)
    results.update(_probe_flash_impls(sdpa("FLASH_ATTENTION"), q, k, v, ref, device, dtype, tol))
    return results


def _probe(fn, q, k, v, ref, device, dtype, tol) -> str:
    """Forward and backward against `ref` (output, flattened q / k / v gradients); a kernel that
    refuses gradients (flex attention on the CPU) is tried again without them, to tell 'forward
    only' from 'unsupported'."""
    if fn is None:
        return "missing"
    q, k, v = (t.to(device, dtype).clone().requires_grad_() for t in (q, k, v))
    backward_error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = fn(q, k, v)
            sync(device)
            out.float().square().sum().backward()
            sync(device)
        except Exception as e:
            backward_error = e
    if backward_error is not None:
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = fn(q.detach(), k.detach(), v.detach())
                sync(device)
        except Exception:
            return _probe_error(backward_error)
    err = rel_error(out, ref[0])
    if err > tol:
        return f"wrong result (relative error {err:.3g})"
    if backward_error is not None:
        return f"forward only ({_probe_error(backward_error)})"
    err = rel_error(torch.cat([t.grad.flatten() for t in (q, k, v)]), ref[1])
    return "ok" if err <= tol else f"wrong gradients (relative error {err:.3g})"


def _probe_error(e: Exception) -> str:
    text = str(e)
    unsupported = ("No available kernel", "No viable backend", "not supported", "does not support",
                   "Could not run", "only supports", "requires")
    kind = "unsupported" if isinstance(e, NotImplementedError) or any(s in text for s in unsupported) else "failed"
    return f"{kind}: {first_line(e)[:160]}"


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None

    def run(q, k, v):  # [1, H, L, D] -> packed [L, H, D], one sequence, causal
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        n = q.shape[0]
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        try:
            out = varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0))
        except TypeError:  # torch 2.9 / 2.10 spell causal as is_causal
            out = varlen_attn(q, k, v, cu, cu, n, n, is_causal=True)
        return out.transpose(0, 1)[None]
    return run


def _flex(device: torch.device):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None

    def run(q, k, v):
        # On a GPU the real path is the Triton kernel that torch.compile makes; eager flex
        # attention is a slow reference, so probe the compiled one.
        fn = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[2], k.shape[2],
                                 device=str(device))
        return fn(q, k, v, block_mask=mask)
    return run


def _probe_flash_impls(flash, q, k, v, ref, device, dtype, tol) -> dict[str, str]:
    """FA3 / FA4 through torch.nn.attention's flash implementation registry (torch 2.10+)."""
    import torch.nn.attention as attention

    list_impls = getattr(attention, "list_flash_attention_impls", None)
    if list_impls is None or flash is None:
        return {}
    active = attention.current_flash_attention_impl()
    out = {}
    for impl in list_impls():
        name = impl.lower()
        if device.type != "cuda" or torch.version.hip:
            out[name] = "unsupported: needs an NVIDIA GPU"
        elif active is not None:
            out[name] = "ok (active)" if impl == active else f"not probed ({active} is active)"
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    attention.activate_flash_attention_impl(impl)
            except Exception as e:
                out[name] = f"unsupported: {first_line(e)[:160]}"
                continue
            try:
                out[name] = _probe(flash, q, k, v, ref, device, dtype, tol)
            finally:
                attention.restore_flash_attention_impl()
    return out

