"""What the Triton ops share: the optional Triton import, the fused_ops switch, and fused_ok,
the one test each op's wrapper asks before it takes its kernel instead of its PyTorch
reference (CPUs, fp32, no Triton, fused_ops false, HIVETUNE_REFERENCE=fused_layers).

Why the ops have kernels (ops.norm, rope, swiglu, dropout, lora_dropout): in eager PyTorch each
is 5-12 small kernels forward and as many backward, about 40% of a W1 step's ~3,300 kernels;
under CUDA graphs each kernel still costs a few microseconds of GPU time, and the reference
norm keeps fp32 copies of its input (W2: ~5 GB). Layers in each op's file: Triton kernel ->
autograd Function -> functional wrapper choosing the kernel or the reference."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

import torch

from hivetune.core.fallbacks import forced, note_fallback


class _NotImported:
    """triton before the first fused call: installed, not imported yet."""

    def __repr__(self) -> str:
        return "<triton: imported at the first fused call>"


# Triton is optional (CPUs, ROCm builds without it and old GPUs take the references). It is
# imported with the ops' kernels at the first fused call or in train's prewarm thread
# (load_kernels), not with hivetune: a process that never runs a kernel (the CLI, a CPU run, an
# export) skips it (0.19 s of the training modules' 0.41 s import on the H200 host, docs/log.md).
# None: not installed; _NotImported: installed, not imported yet; else the module.
triton = _NotImported() if importlib.util.find_spec("triton") is not None else None
_KERNELS: list = []  # each op module's function that defines its kernels (kernels), in import order
_LOADED = False
_LOCK = threading.RLock()

_HALF = (torch.bfloat16, torch.float16)
_FUSED_OPS = True  # the config key fused_ops, set once by train setup (set_fused_ops)


def set_fused_ops(on: bool) -> None:
    """The config key fused_ops: false makes every op take its PyTorch reference."""
    global _FUSED_OPS
    _FUSED_OPS = bool(on)


def fused_ok(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take this tensor (else the PyTorch reference runs): bf16 / fp16
    on a GPU (or a CPU under TRITON_INTERPRET=1, for tests), Triton installed, fused_ops on and
    no HIVETUNE_REFERENCE=fused_layers (or all)."""
    if x.dtype not in _HALF or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if not _FUSED_OPS or forced("fused_layers"):
        note_fallback("fused_layers", "fused RMSNorm / RoPE / SwiGLU", "asked for the reference", "PyTorch ops")
        return False
    if triton is None or (not _LOADED and not load_kernels()):
        note_fallback("fused_layers", "fused RMSNorm / RoPE / SwiGLU", "Triton is not installed", "PyTorch ops")
        return False
    return True


def kernels(define):
    """Decorator of an op module's function that imports Triton and defines the module's kernels
    as its globals: load_kernels calls it (at once where they are loaded already)."""
    with _LOCK:
        _KERNELS.append(define)
        if _LOADED and triton is not None:
            define()
    return define


def load_kernels() -> bool:
    """Import Triton and define every op module's kernels, once (the first fused call, or the
    prewarm thread); whether Triton is there."""
    global triton, _LOADED
    if not _LOADED:
        with _LOCK:
            if not _LOADED:
                try:
                    import triton as module
                except ImportError:  # a broken install: the references run
                    module = None
                triton = module
                if module is not None:
                    for define in _KERNELS:
                        define()
                _LOADED = True
    return triton is not None


def hash_kernels() -> int:
    """The source hash (JITFunction.cache_key: its source and those of the jitted functions it
    calls, their ASTs walked) of each Triton function that load_kernels defined (the kernels of
    the op modules imported), which the first launch of a kernel computes otherwise (a few ms a
    kernel, in the first step's host time); the prewarm thread calls it after load_kernels.
    Returns how many functions it hashed (0 without Triton)."""
    if not load_kernels():
        return 0
    from triton.runtime.jit import JITFunction

    hashed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("hivetune.ops.kernels.") or module is None:
            continue
        for value in list(vars(module).values()):
            fn = value if isinstance(value, JITFunction) else getattr(value, "fn", None)  # or an autotuner's
            if isinstance(fn, JITFunction) and fn.__module__ == name:
                fn.cache_key  # noqa: B018 - computed once, kept by the function (under its lock)
                hashed += 1
    return hashed


def elementwise_grid(n: int, block: int) -> tuple[int]:
    """A 1-D launch grid covering n elements, `block` a program."""
    return (triton.cdiv(n, block),)
