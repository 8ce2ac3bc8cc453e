"""Work a process otherwise does at its first training step, started in a background thread
while the data and the model are built (train setup calls prewarm, the loop join_prewarm)."""

from __future__ import annotations

import threading
import time

import torch

from hivetune.core.fallbacks import forced
from hivetune.ops import compile_ahead, triton_early
from hivetune.ops.adamw import FusedAdamW, clip_grad_norm
from hivetune.ops.triton_util import hash_kernels, load_kernels

_PREWARM: threading.Thread | None = None
PREWARM_DONE_AT: float | None = None  # time.perf_counter() when the prewarm thread finished (bench records it)
PREWARM_TAIL: str | None = None  # tail_kernels in the prewarm thread: "<ms> ms" or the error (bench records it)


def prewarm(device: torch.device, compile_workers: int = -1) -> None:
    """Start, in a background thread, work a process otherwise does at its first training step:
    - the compile workers of ops.compile_ahead, where Triton's cache looks cold (compile_workers:
      the config key; -1 auto, 0 off);
    - the fused ops' first call: importing Triton and defining their kernels (load_kernels), and
      each kernel's first launch: hashing its source (hash_kernels);
    - Triton's, at its first kernel launch: hashing its own installation for the cache key
      (~0.4 s on the device's hosts) and importing its gluon modules (~0.2 s);
    - the kernels the first step meets only after its forward and backward, each run once on a
      few values (tail_kernels): clipping's norm and scale, the finite check and the fused
      AdamW step. Their first call loads their kernels (~160 ms for the clipping and ~15 ms for
      the optimizer's in a fresh process on an H200, docs/log.md), which would leave the GPU
      idle between the first step and the second.
    Called before the model loads, it overlaps that load instead of delaying the first training
    step. Once per process; nothing without CUDA."""
    global _PREWARM
    if _PREWARM is not None or device.type != "cuda":
        return
    with_triton = not forced("fused_layers")
    # a new thread starts on CUDA device 0: it is handed this process's device
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if torch.cuda.is_initialized() else 0)

    def warm():
        global PREWARM_DONE_AT, PREWARM_TAIL
        if with_triton:
            triton_early.join()  # the CLI's early start of the work below, where it began one
            try:
                compile_ahead.start(torch.device("cuda", index),
                                    compile_ahead.default_workers() if compile_workers < 0 else compile_workers)
                load_kernels()  # Triton's import and the ops' kernels, which the first fused call needs
                hash_kernels()
            except Exception:  # noqa: BLE001 - a Triton without these private parts: its first launch pays
                pass
            triton_early.warm()  # Triton's cache key and gluon modules (done already where the CLI began them)
        t0 = time.perf_counter()
        try:
            tail_kernels(torch.device("cuda", index))
            PREWARM_TAIL = f"{(time.perf_counter() - t0) * 1e3:.1f} ms"
        except Exception as e:  # noqa: BLE001 - the first step then loads them itself
            PREWARM_TAIL = f"{type(e).__name__}: {str(e).strip()[:200]}"
        PREWARM_DONE_AT = time.perf_counter()

    _PREWARM = threading.Thread(target=warm, name="hivetune-prewarm", daemon=True)
    _PREWARM.start()


def tail_kernels(device: torch.device) -> None:
    """What the loop runs after a step's backward (train.fit), on a few fp32 values of `device`:
    clip_grad_norm over gradients in one buffer (CUDA graphs' GradArena) and over separate ones,
    the finite check, and FusedAdamW's step with a found_inf: its flat one (_fresh_flat), whose
    fused kernels torch's step launches too (FusedAdamW imports no torch._dynamo for it: ops.adamw)."""
    with torch.cuda.device(device):
        values = torch.zeros(64, device=device)
        grads = torch.full((64,), 0.5, device=device)
        flat = [torch.nn.Parameter(values[:32].view(4, 8)), torch.nn.Parameter(values[32:])]
        for p, g in zip(flat, (grads[:32].view(4, 8), grads[32:])):
            p.grad = g
        apart = [torch.nn.Parameter(torch.zeros(4, 8, device=device)) for _ in range(2)]
        for p in apart:
            p.grad = torch.full_like(p, 0.5)
        clip_grad_norm(apart, 1.0)
        norm = clip_grad_norm(flat, 1.0)
        finite = torch.isfinite(norm.sum())
        finite &= torch.isfinite(norm)
        optimizer = FusedAdamW(flat, lr=1e-3, weight_decay=0.01, fused=True)
        optimizer.found_inf = (~finite).float()
        optimizer.step()  # no wait: a kernel loads when launched, and a wait here would last
        # until the main thread's own work on the stream is done


def join_prewarm(timeout: float = 30.0) -> None:
    """Wait for prewarm's thread, if one still runs (train.fit, before the first step).
    A kernel launched while it hashes would hash Triton's files a second time beside it
    (triton_key's lru_cache does not hold a lock while it computes), both threads sharing the
    GIL; waiting costs only what is left of the one pass."""
    if _PREWARM is not None and _PREWARM.is_alive():
        _PREWARM.join(timeout)
