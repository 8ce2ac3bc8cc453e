"""The reference switch: fast paths a user can turn off, and the one line printed on a fallback.

Each fast path is chosen by what this machine can do (never by vendor name) and falls back to
its reference with one ``hivetune: note: <what> unavailable (<why>); using <reference>`` line,
once per process. ``HIVETUNE_REFERENCE=<name>[,<name>...]`` (or ``all``) forces the reference,
for a GPU or build where a fast path misbehaves:

    name          fast path                                  reference
    varlen        flash varlen attention of packed rows      SDPA over a padded view
                    (ops.attention, probed once per device
                    and dtype)
    fused_adamw   torch's fused AdamW, kept lists            foreach AdamW
                    (ops.adamw)
    cpu_bf16      bf16 autocast on a CPU with AMX or         fp32
                    AVX512-BF16 (core.device)
    gpu_bf16      bf16 on a GPU that supports it             fp16 with loss scaling
    fused_layers  Triton RMSNorm / RoPE / SwiGLU / seeded    the PyTorch ops beside each kernel
                    LoRA dropout (ops.norm, rope, swiglu,      (also the config key fused_ops:
                    dropout, lora_dropout)                     false)
    fused_lora    q/k/v and gate/up with their LoRA as one   layer by layer LoRALinear
                    matmul group (ops.lora_group)              (model.lora)
    cublaslt      LoRA-group and fused-CE matmuls through    torch.mm / addmm
                    cached cuBLASLt plans (ops.blas)
    decode_graphs greedy decode steps replayed as one      eager decode steps
                    CUDA graph (workflows.decode_graph)

The fast and reference paths are compared in tests/train/test_robust_fallbacks.py (CPU) and
tests/gpu/test_fallbacks.py (CUDA).
"""

from __future__ import annotations

import os
import sys
import threading

FORCE_ENV = "HIVETUNE_REFERENCE"
PATHS = ("varlen", "pairs", "fused_adamw", "cpu_bf16", "gpu_bf16", "fused_layers", "fused_lora", "cublaslt",
         "decode_graphs")
NOTED: dict[str, str] = {}  # fast path -> the line printed when it fell back (tests read it)

_WANTED: tuple[object, frozenset] = (None, frozenset())  # the last HIVETUNE_REFERENCE value read, parsed
# os.environ's own mapping and the variable's key in it: the fast paths ask forced() at each call
# (an eager W2 micro-step ~1,300 times), and os.environ.get encodes the key and decodes the value
# each time (~1.5 us on the device's hosts); the raw value read here is compared as it is.
try:
    _ENV_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(FORCE_ENV)
except AttributeError:  # another Python's os.environ: read through it
    _ENV_DATA, _ENV_KEY = None, None


def forced(name: str) -> bool:
    """Whether HIVETUNE_REFERENCE asks for the reference path instead of `name` (the parsed
    value is kept until the variable changes)."""
    global _WANTED
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else os.environ.get(FORCE_ENV)
    if raw != _WANTED[0]:
        _WANTED = (raw, frozenset(w.strip() for w in os.environ.get(FORCE_ENV, "").split(",")))
    wanted = _WANTED[1]
    return name in wanted or "all" in wanted


def note_fallback(name: str, what: str, reason: str, reference: str) -> None:
    """One line on stderr, the first time `name` falls back in this process."""
    if name in NOTED:
        return
    NOTED[name] = f"hivetune: note: {what} unavailable ({reason}); using {reference}"
    print(NOTED[name], file=sys.stderr)


def isolated(probe, *args) -> str:
    """Run a probe in a fresh thread. It is first called from inside a model's forward, which may
    be under autocast, no_grad or a checkpointed layer's saved-tensor hooks (a backward there
    fails); all three are thread-local, so a new thread starts clean."""
    result = []

    def run():
        try:
            result.append(probe(*args))
        except BaseException as e:  # the probe catches what it expects; anything else is a no
            result.append(f"{type(e).__name__}: {e}"[:200])

    thread = threading.Thread(target=run, name="hivetune-probe")
    thread.start()
    thread.join()
    return result[0]
