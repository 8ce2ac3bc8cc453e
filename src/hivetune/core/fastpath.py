"""Fast paths chosen by what this machine can do (never by vendor name), each with its reference
fallback and one log line when it falls back.

    fast path                    chosen when                                   reference (fallback)
    flash varlen attention       varlen_attn runs forward + backward on a      SDPA over a padded view
      (ops.attention)              tiny packed input on this device and dtype    (ops.attention)
                                   and matches the float32 result
    fused AdamW (train)          torch builds a fused AdamW for the params     foreach AdamW
    the step's tail kernels      CUDA (fastpath.prewarm's thread, while the    loaded by the first
      loaded before the loop       data and the model are built)                 step (tail_prewarm)
    bf16 autocast on the CPU     the CPU has AMX or AVX512-BF16                fp32
      (device.resolve_precision)
    bf16 on a GPU                torch.cuda.is_bf16_supported()                fp16 with loss scaling
    CUDA graphs (ops.graphs)     ops.graphs.graphs_unsupported is None         eager steps (its own line)
    CUDA graphs instantiated on  torch captures without instantiating          instantiated in
      a worker thread (ops.graphs  (CUDAGraph keep_graph, torch 2.7+)            capture_end
      background instantiation)                                                  (graph_instantiate)
    DDP graph sizes planned on   torch.distributed, CUDA graphs                each rank's own counts
      the slowest rank's counts                                                  (paced_sizes)
      (ops.graphs, paced)
    CUDA graph sizes after the   a replay's GPU time covers a quarter of a     all at the first
      largest captured one after   capture's host time                           micro-batch
      each replay                  (ops.graphs.defers_captures)                  (deferred_captures)
    deferred sizes' shapes met   deferred captures, no activation offload      none (graph_preload)
      by a two-layer capture
      after the plan (_preload)
    a deferred capture waits     deferred captures                             one after each replay
      for 3 queued replays and                                                   (capture_lead,
      no instantiation in flight                                                 instantiation_wait)
    graph sizes planned on the   planned sizes, none saved in a checkpoint     a timing replay of the
      next micro-batch's replay                                                  first micro-batch
      of the largest graph                                                       (plan_on_replay)
    graphs hold as many targets  planned sizes, the step plan's target counts  a target row a token
      as their micro-batches                                                     (target_capacity)
      bring (target_capacities)
    LoRA-group and fused-CE      CUDA, the process's libcublasLt found, a     torch.mm / addmm
      matmuls through cached       layout the plan takes (ops.blas)             (cublaslt)
      cuBLASLt plans
    one cuBLASLt heuristic       dimensions above 1,024 in one 256-wide       a query per shape
      query per token bucket       bucket (ops.blas._bucket_algo), eager        (lt_buckets)
                                   products (not in a graph capture)
    activation_offload scaled    activation_offload on, packing, the step      N layers every
      to the micro-batch (ops.     plan's largest micro-batch known, one         micro-batch
      offload layers_for)          process                                       (scaled_offload)
    fused LM-head CE             config fused_loss (plain PyTorch, any device) ops.loss.target_loss_sum
    joined q/k/v, gate/up with   always in training (plain PyTorch, any        layer by layer LoRALinear
      LoRA (ops.lora_group)        device), except FSDP                          (model.lora)
    LoRA dropout inside the A    Triton on a GPU, bf16 / fp16, inputs          dropout_seeded, then
      matmuls (ops.elementwise     2,048+ wide in 128-column blocks, n x r       cuBLAS
      drop_matmul & co)            <= 32
    LoRA gradients added into    CUDA graphs' persistent gradients, one        autograd adds fresh
      one buffer (ops.lora_group   buffer (GradArena); any .grad present         gradients
      GradArena, grads_into)       (a later micro-batch)
    RMSNorm and the q/k/v or     Triton on a GPU, seeded dropout, rows of      the norm, then
      gate/up LoRA dropout as      128-column blocks, not the in-matmul          dropout_seeded
      one kernel (elementwise      dropout                                       (norm_dropout)
      rms_norm_dropped)
    RoPE of q and k, v's copy    Triton on a GPU, joined q/k/v, no q/k norm    split, RoPE of q and
      from the joined q/k/v in                                                   of k, v's copy
      one kernel (rope_qkv)                                                      (rope_qkv)
    SwiGLU and down_proj's LoRA  Triton on a GPU, joined gate/up, seeded       SwiGLU, then the
      dropout as one kernel each   dropout                                       group's dropout
      way (swiglu_dropped)                                                       (swiglu_dropout)
    q/k/v's and gate/up's LoRA   CUDA (fuse_projections' wide layout), the     the base matmul, then
      B in their base matmul,      group's CastCache fresh, no in-matmul or      an addmm of the LoRA
      [x | xa] [W | Bd]^T          seeded dropout of its own (the norm's or      update into y
      (lora_group.wide_matrix)     none)                                         (wide_lora)

A fallback on a device where the fast path is expected (a GPU for varlen and fused AdamW; a CPU
asked for auto precision) prints ``hivetune: note: <what> unavailable (<why>); using <reference>``
once per process. ``HIVETUNE_REFERENCE=varlen,fused_adamw,cpu_bf16,gpu_bf16`` (also fused_lora,
fused_layers, dropout_matmul, gc, autocast, grad_arena, residual_epilogue, flat_adamw, norm_dropout,
rope_qkv, swiglu_dropout, wide_lora, graph_instantiate, paced_sizes, deferred_captures, graph_preload,
capture_lead, instantiation_wait, plan_on_replay, target_capacity, cublaslt, lt_buckets, scaled_offload,
tail_prewarm;
or ``all``) forces the reference paths, for tests and A/B runs; the
fast and reference paths are compared in tests/test_robust_fallbacks.py (CPU) and
tests/gpu/test_fallbacks.py (CUDA).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from contextlib import contextmanager

import torch

FORCE_ENV = "HIVETUNE_REFERENCE"
PATHS = ("varlen", "fused_adamw", "cpu_bf16", "gpu_bf16", "fused_layers", "fused_lora")
NOTED: dict[str, str] = {}  # fast path -> the line printed when it fell back (tests read it)
_VARLEN_OK: dict[tuple[str, torch.dtype], str] = {}  # (device, dtype) -> "" when it works, else why not


_WANTED: tuple[str, frozenset] = ("", frozenset())  # the last HIVETUNE_REFERENCE value, parsed


_ENV_DATA = getattr(os.environ, "_data", None)  # CPython's dict behind os.environ (setenv writes it)
_ENV_KEYS: dict[str, object] = {}


def env(name: str, default: str = "") -> str:
    """os.environ.get(name, default) for the per-layer checks of a step (~30 a layer): a dict
    lookup, where os.environ.get costs ~3 us in Python's mapping methods (~5 ms of host time a
    W2 step). Sees every change made through os.environ (tests' monkeypatch.setenv)."""
    if _ENV_DATA is None:
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    raw = _ENV_DATA.get(key)
    return default if raw is None else os.environ.decodevalue(raw)


def forced(name: str) -> bool:
    """Whether HIVETUNE_REFERENCE asks for the reference path instead of `name`. (Asked ~10 times
    a layer each step: the parsed value is kept until the variable changes.)"""
    global _WANTED
    raw = env(FORCE_ENV)
    if raw != _WANTED[0]:
        _WANTED = (raw, frozenset(w.strip() for w in raw.split(",")))
    wanted = _WANTED[1]
    return name in wanted or "all" in wanted


@contextmanager
def quiet_gc():
    """The training loop's garbage collector: the objects alive at its start (model, data,
    optimizer: hundreds of thousands) are frozen out of the collector's scans, and young
    collections run every 50,000 allocations instead of 700 (a step makes tens of thousands of
    short-lived autograd objects, nearly all freed by reference counting). Python's collector
    otherwise runs in the middle of the host's kernel dispatch, which W2's eager step waits on
    (not timed on its own yet). Restored after; HIVETUNE_REFERENCE=gc keeps the defaults."""
    if forced("gc"):
        yield
        return
    import gc

    threshold = gc.get_threshold()
    gc.freeze()  # (no collection first: one full pass over a 7B run's objects took 0.14 s)
    gc.set_threshold(50_000, threshold[1], threshold[2])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def note_fallback(name: str, what: str, reason: str, reference: str) -> None:
    """One line on stderr, the first time `name` falls back in this process."""
    if name in NOTED:
        return
    NOTED[name] = f"hivetune: note: {what} unavailable ({reason}); using {reference}"
    print(NOTED[name], file=sys.stderr)


# ---- flash varlen attention ------------------------------------------------------------------

def varlen_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Flash varlen attention for packed rows: tried once per device and dtype (forward, backward,
    against float32 per-example attention); a failure falls back to the SDPA reference."""
    if forced("varlen"):
        if device.type == "cuda":
            note_fallback("varlen", "flash varlen attention", f"{FORCE_ENV} asks for the reference", "SDPA")
        return False
    key = (str(device), dtype)
    if key not in _VARLEN_OK:
        _VARLEN_OK[key] = isolated(probe_varlen, device, dtype)
        if _VARLEN_OK[key] and device.type == "cuda":
            note_fallback("varlen", "flash varlen attention", _VARLEN_OK[key], "SDPA over a padded view")
    return not _VARLEN_OK[key]


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


def probe_varlen(device: torch.device, dtype: torch.dtype) -> str:
    """'' when varlen attention runs here and agrees with the reference; else why not."""
    from hivetune.ops.attention import Packed, _varlen_fn, varlen_causal

    if _varlen_fn()[0] is None:
        return "torch.nn.attention.varlen.varlen_attn is not in this torch"
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 11)
    q, k, v = (torch.randn(1, sum(lengths), h, 64, generator=gen) for h in (4, 2, 2))
    layout = Packed(torch.tensor([0, 5, 16], dtype=torch.int32, device=device), max(lengths), lengths)
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qd, kd, vd = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
            out = varlen_causal(qd, kd, vd, layout)
            out.float().square().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as e:  # no kernel for this GPU / dtype / build: the reference path works everywhere
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {text}"[:200]
    ref = _per_example_attention(q, k, v, lengths)
    err = ((out.detach().float().cpu() - ref).abs().max() / ref.abs().max()).item()
    if not err <= 3e-2:  # bf16 / fp16 rounding is ~1e-2 at most here
        return f"wrong result on a tiny input (relative error {err:.3g})"
    if not all(torch.isfinite(t.grad).all() for t in (qd, kd, vd)):
        return "non-finite gradients on a tiny input"
    return ""


def _per_example_attention(q, k, v, lengths) -> torch.Tensor:
    """float32 causal attention of each example alone: q [1, T, H, D], k / v [1, T, KVH, D]."""
    groups = q.shape[2] // k.shape[2]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[0, start:start + n].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs)[None]


_PREWARM: threading.Thread | None = None
PREWARM_DONE_AT: float | None = None  # time.perf_counter() when the prewarm thread finished (bench records it)
PREWARM_TAIL: str | None = None  # tail_kernels in the prewarm thread: "<ms> ms" or the error (bench records it)


def prewarm(device: torch.device) -> None:
    """Start, in a background thread, work a process otherwise does at its first training step:
    - Triton's, at its first kernel launch: hashing its own installation for the cache key
      (~0.4 s on the device's hosts) and importing its gluon modules (~0.2 s);
    - the kernels the first step meets only after its forward and backward, each run once on a
      few values (tail_kernels): clipping's norm and scale, the finite check and the fused
      AdamW step. Their first call loads their kernels: 160 ms for the clipping and ~15 ms for
      the optimizer's in a fresh process on an H200 (bench/first_calls.py), with the GPU idle
      between the first step and the second. W2's DDP timeline (2 x H200, 5590018) from the
      first step's all-reduce to the second step: 9-14 ms, against 84-110 ms without this part
      (and 128-210 ms before FusedAdamW._fresh_flat). HIVETUNE_REFERENCE=tail_prewarm: not.
    Called before the model loads, it overlaps that load instead of delaying the first training
    step. Once per process; nothing without CUDA."""
    global _PREWARM
    if _PREWARM is not None or device.type != "cuda":
        return
    with_triton, with_tail = not forced("fused_layers"), not forced("tail_prewarm")
    if not (with_triton or with_tail):
        return
    # a new thread starts on CUDA device 0: it is handed this process's device
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if torch.cuda.is_initialized() else 0)

    def warm():
        global PREWARM_DONE_AT, PREWARM_TAIL
        if with_triton:
            try:
                from triton.runtime.cache import triton_key

                triton_key()  # lru_cached: the first kernel's cache lookup then finds it done
                import triton.experimental.gluon  # noqa: F401
            except Exception:  # noqa: BLE001 - a Triton without these private parts: its first launch pays
                pass
        if with_tail:
            t0 = time.perf_counter()
            try:
                tail_kernels(torch.device("cuda", index))
                PREWARM_TAIL = f"{(time.perf_counter() - t0) * 1e3:.1f} ms"
            except Exception as e:  # noqa: BLE001 - the first step loads them itself, as before
                PREWARM_TAIL = f"{type(e).__name__}: {str(e).strip()[:200]}"
        PREWARM_DONE_AT = time.perf_counter()

    _PREWARM = threading.Thread(target=warm, name="hivetune-prewarm", daemon=True)
    _PREWARM.start()


def tail_kernels(device: torch.device) -> None:
    """What the loop runs after a step's backward (train.fit), on a few fp32 values of `device`:
    clip_grad_norm over gradients in one buffer (CUDA graphs' GradArena) and over separate ones,
    the finite check, and FusedAdamW's step with a found_inf: its flat one (_fresh_flat), whose
    fused kernels torch's step launches too. Building the optimizer imports torch._dynamo (torch's
    Optimizer does; 0.7 s on this project's CPU machine, 4-6 s of the thread's time on the device's
    hosts), which the run's own optimizer, built before the loop, would import anyway."""
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
        optimizer.step()  # (no wait for them: a kernel loads when launched, and a wait here would
        # last until the main thread's own work on the stream is done: W1 at 6d9dda5, the loop then
        # waited 26-29 ms for this thread)


def join_prewarm(timeout: float = 30.0) -> None:
    """Wait for prewarm's thread, if one still runs (train.fit, before the first step).
    A kernel launched while it hashes would hash Triton's files a second time beside it
    (triton_key's lru_cache does not hold a lock while it computes), both threads sharing the
    GIL; waiting costs only what is left of the one pass."""
    if _PREWARM is not None and _PREWARM.is_alive():
        _PREWARM.join(timeout)


def fused_lora_usable() -> bool:
    """ops.lora_group for training (joined projections): plain PyTorch, so only forcing it off
    in HIVETUNE_REFERENCE stops it."""
    return not forced("fused_lora")


# ---- fused AdamW -----------------------------------------------------------------------------

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
    (tests/test_fast_optimizer.py, tests/gpu/test_cuda_fast_optimizer.py). Anything else (the
    first step, unless its gradients are one buffer: _fresh_flat; new gradient tensors, a loaded
    state, several groups, devices or dtypes, amsgrad, a tensor lr, a grad scaler, a closure)
    goes through torch's step, which then re-reads the lists."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._lists = None
        self._grads = None  # (params, their .grad tensors) the kept lists hold

    def load_state_dict(self, state_dict):
        self._lists = None
        super().load_state_dict(state_dict)

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
        loss = super().step(closure)
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
        time for W2's 392 tensors on an H200 (bench/first_calls.py), with the GPU idle. The flat
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
        are one buffer and the parameters another laid out alike, else None (and with
        HIVETUNE_REFERENCE=flat_adamw)."""
        if forced("flat_adamw"):
            return None
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
        Returns the flat lists, or None (as they are; and with HIVETUNE_REFERENCE=flat_adamw)."""
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


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm), without its per-call grouping, for gradients on
    one CUDA device in one dtype: the same foreach kernels in the same order, so the same bits
    (tests/test_fast_optimizer.py, tests/gpu/test_cuda_fast_optimizer.py); about 4 ms of host
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
    gradients of a lora_group.GradArena), else None."""
    base = tensors[0]._base if tensors else None
    if (base is None or not base.is_contiguous() or any(t._base is not base for t in tensors)
            or sum(t.numel() for t in tensors) != base.numel()
            or len({t.data_ptr() for t in tensors}) != len(tensors)):
        return None
    return base
