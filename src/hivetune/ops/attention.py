"""Causal self-attention for three batch layouts, each on plain SDPA (the reference path).

Layouts:
- ``None``: every row is one sequence (right padding is harmless: a padded key sits after
  every real query, so the causal mask already hides it).
- ``Packed(cu_seqlens)``: one row holds several examples back to back; attention must not
  cross an example boundary. Reference: a block-diagonal causal mask for SDPA.
- ``Masked(mask)``: an explicit mask [B, 1, Q, K], boolean (True = attend) or additive (0 or
  -inf, in the query dtype), used by batched generation with left padding and a KV cache.

With a KV cache, a ``Packed`` row is a prefill: each example's keys and values go to its own
cache row, left-padded to the longest (``KVCache.fill_packed``), and attention runs as for
training's packed rows, so no pad token goes through the linear layers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hivetune.core.errors import UserError
from hivetune.core.fallbacks import FORCE_ENV, forced, isolated, note_fallback

# cuDNN's SDPA builds an execution plan per new shape: 2-2.5 ms of host time per call measured
# on an H200 for W1's [8, 14, L, 64] (L changes every step), 35% of the step's host time.
# Flash / memory-efficient kernels have no per-shape plan; math is the fallback everywhere.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

BACKENDS = ("auto", "flash", "sdpa")
_BACKEND = "auto"  # the config key `attention`, set once by train setup (set_backend)
_VARLEN_OK: dict[tuple[str, torch.dtype], str] = {}  # (device, dtype) -> "" when it works, else why not


def set_backend(name: str) -> None:
    """Attention of packed rows on a GPU: auto (flash varlen where its probe passes, else SDPA),
    flash (flash varlen; an error where its probe fails) or sdpa (the SDPA reference)."""
    global _BACKEND
    if name not in BACKENDS:
        raise ValueError(f"attention: {name!r} is not one of {', '.join(BACKENDS)}")
    _BACKEND = name


@dataclass
class Packed:
    """Examples packed along the sequence axis of a batch of one row.

    ``cu_seqlens`` holds the cumulative example lengths [0, l0, l0+l1, ..., T] (int32),
    ``max_seqlen`` the longest example (a Python int, so no host sync is needed).
    """

    cu_seqlens: torch.Tensor  # [0, l0, l0+l1, ..., T]: every token, a trailing pad segment included
    max_seqlen: int
    lengths: tuple[int, ...] = ()  # the same segment lengths, on the host

    def block_causal_mask(self, total: int) -> torch.Tensor:
        """[1, 1, T, T] bool: query i sees key j iff same example and j <= i."""
        device = self.cu_seqlens.device
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        example = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        if example.numel() < total:  # trailing pad tokens get their own segment
            example = torch.cat([example, example.new_full((total - example.numel(),), -1)])
        pos = torch.arange(total, device=device)
        same = example[:, None] == example[None, :]
        return (same & (pos[None, :] <= pos[:, None]))[None, None]


@dataclass
class Masked:
    # [B, 1, Q, K]: bool, True where the query may attend to the key; or additive, 0 there and
    # -inf elsewhere (what SDPA turns a bool mask into on every call: decoding builds it once a step)
    mask: torch.Tensor
    # [B, K]: each key slot's position, where slot distance is not position distance (the shared-
    # prompt row of a preference pair: its rejected answer follows the chosen one); a sliding
    # window counts positions then. None: slots are positions.
    positions: torch.Tensor | None = None


def padded_view_attention(q, k, v, lengths: tuple[int, ...]) -> torch.Tensor:
    """Packed [1, T, H, D] -> [E, H, Lmax, D] padded view -> causal SDPA -> back to [1, T, H, D].

    The linear layers keep the packed row (no pad tokens through the matmuls); attention runs
    as one batched causal call, which on the CPU beats both a block-diagonal mask ((sum L)^2
    work) and one call per example (E small kernels). Pads sit after each example's last
    token, so the causal mask already hides them from every real query. Rows are gathered on
    the token axis of the contiguous [T, H, D] tensors (cheaper than gathering a transposed view).
    Both moves are row gathers whose backward is a row gather too (RowGather), not the
    scatter-add autograd gives index_select (11% of a CPU step, measured on SmolLM2).
    """
    gather, scatter, unpad = _padded_indices(lengths, q.device)
    e, width = len(lengths), max(lengths)
    groups = q.shape[2] // k.shape[2]
    gqa = native_gqa(q)
    dtype = q.dtype
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if q.device.type == "cpu" and dtype != torch.float32 and backward:
        # The CPU flash kernel's bf16 backward is ~3x slower than its fp32 one (measured on
        # [8, 9, 100, 64]: 29 ms vs 10 ms a layer); the casts cost far less. Its bf16 forward
        # alone is faster than fp32 (eval's [96, 9, 150, 64]: 35 vs 57 ms): no cast without grad.
        q, k, v = q.float(), k.float(), v.float()

    def to_padded(x, repeat=1):  # [1, T, h, D] -> [E, h * repeat, Lmax, D]
        x = RowGather.apply(x[0], gather, scatter, False).view(e, width, x.shape[2], x.shape[3]).transpose(1, 2)
        return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x

    kv_repeat = 1 if gqa else groups
    with torch.autocast(q.device.type, enabled=False), sdpa_kernel(SDPA_BACKENDS):  # no autocast back to bf16
        out = F.scaled_dot_product_attention(to_padded(q), to_padded(k, kv_repeat), to_padded(v, kv_repeat),
                                             is_causal=True, **gqa).to(dtype)
    out = RowGather.apply(out.transpose(1, 2).reshape(e * width, q.shape[2], q.shape[3]), scatter, unpad, True)
    return out[None]


class RowGather(torch.autograd.Function):
    """y = x[index] (rows), with the backward a gather as well: grad_x = grad_y[inverse].

    Exact when every row of x lands in y once, at y-row inverse[row], and the other rows of y
    get zero gradient. pad -> pack (zero_row=True): a padded slot's gradient is the packed
    row's, and pad slots point past the end, at a zero row appended to the gradient. pack ->
    pad: pad slots repeat a real row, and their gradient is exactly zero (their outputs are
    dropped, and causal masking keeps real queries off pad keys), so it may be left out.
    """

    @staticmethod
    def forward(ctx, x, index, inverse, zero_row: bool):
        ctx.save_for_backward(inverse)
        ctx.zero_row = zero_row
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        if ctx.zero_row:
            grad = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
        return grad.index_select(0, inverse), None, None, None


_INDEX_CACHE: dict = {}


def _padded_indices(lengths: tuple[int, ...], device):
    """gather[E*Lmax]: packed position for each padded slot (pads repeat the example's first
    token); scatter[T]: padded slot of each packed position; unpad[E*Lmax]: packed position of
    each padded slot, T (one past the end) for pads. Cached per micro-batch shape: the layers
    of one step reuse them."""
    key = (lengths, str(device))
    hit = _INDEX_CACHE.get(key)
    if hit is None:
        width, total = max(lengths), sum(lengths)
        gather, scatter, unpad, start = [], [], [], 0
        for e, n in enumerate(lengths):
            gather += list(range(start, start + n)) + [start] * (width - n)
            unpad += list(range(start, start + n)) + [total] * (width - n)
            scatter += range(e * width, e * width + n)
            start += n
        hit = tuple(torch.tensor(x, device=device) for x in (gather, scatter, unpad))
        if len(_INDEX_CACHE) > 64:
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = hit
    return hit


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout=None, cache=None,
                     layer: int = 0) -> torch.Tensor:
    """q: [B, T, H, D]; k, v: [B, T, KVH, D] with H a multiple of KVH (GQA). Returns [B, T, H, D].

    Packed rows on a GPU with flash varlen attention go to it directly (no padding, no copies);
    everything else takes the SDPA reference path in [B, H, T, D].
    """
    fast = getattr(layout, "fast_attention", None)  # a layout with its own fast path (ops.shared_prompt)
    if fast is not None and cache is None:
        out = fast(q, k, v)
        if out is not None:
            return out
    if isinstance(layout, Packed) and cache is not None:  # prefill: the prompts see only themselves
        cache.fill_packed(layer, k[0], v[0], layout.lengths)
        cache = None
    if isinstance(layout, Packed) and cache is None and varlen_supported(q):
        return varlen_causal(q, k, v, layout)
    if isinstance(layout, Packed) and cache is None and layout.lengths and sum(layout.lengths) == q.shape[1]:
        return padded_view_attention(q, k, v, layout.lengths)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        k, v = cache.append(layer, k, v)
    return sdpa_causal(q, k, v, layout).transpose(1, 2)


def native_gqa(q: torch.Tensor) -> dict:
    """SDPA's keyword for grouped K/V heads where the kernel takes them itself. The CPU flash
    kernel does (outputs equal those with repeated K/V, measured), which saves the G-fold K/V
    copies and, in training, their backward's reduction. SmolLM2 (G = 3), per layer on the
    2-core CPU: training's [8, 9, 130, 64] fp32 forward + backward 17.5 -> 14.0 ms, eval's
    [96, 9, 150, 64] bf16 forward 48.6 -> 34.8 ms, a decode step [67, 9, 1, 64] on 150 keys
    1.32 -> 1.15 ms. GPUs keep the explicit repeat: not every CUDA kernel takes enable_gqa, and
    SDPA would fall back to math."""
    return {"enable_gqa": True} if q.device.type == "cpu" else {}


def sdpa_causal(q, k, v, layout) -> torch.Tensor:
    """The reference path: q [B, H, Q, D], k, v [B, KVH, K, D] -> [B, H, Q, D]."""
    groups = q.shape[1] // k.shape[1]
    gqa = native_gqa(q) if groups > 1 else {}
    if groups > 1 and not gqa and isinstance(layout, Masked):
        return grouped_masked_attention(q, k, v, layout.mask, groups)
    if groups > 1 and not gqa:
        # Repeat K/V heads explicitly: SDPA's enable_gqa is not taken by every kernel and the
        # result is identical.
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    with sdpa_kernel(SDPA_BACKENDS):
        if layout is None:
            q_len, k_len = q.shape[2], k.shape[2]
            if q_len == k_len or q_len == 1:
                return F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, **gqa)
            # Queries are the last q_len positions of k_len (a chunk on top of a KV cache): SDPA's
            # is_causal aligns the mask top-left, so build the bottom-right aligned one here.
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        if isinstance(layout, Packed):
            mask = layout.block_causal_mask(q.shape[2])
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
        if isinstance(layout, Masked):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, **gqa)
    raise TypeError(f"unknown attention layout {type(layout).__name__}")


def grouped_masked_attention(q, k, v, mask, groups: int) -> torch.Tensor:
    """GQA without copying K/V: the G query heads sharing a K/V head become G*Q query rows.

    q [B, KVH*G, Q, D] -> [B, KVH, G*Q, D]; mask [B, 1, Q, K] -> [B, 1, G*Q, K]. Decoding on
    top of a KV cache otherwise copies the whole cache G times per step (SmolLM2: G = 3).
    """
    b, h, q_len, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, groups * q_len, d)
    if q_len > 1:  # one query (a decode step): [B, 1, 1, K] broadcasts over the G rows as it is
        mask = mask[:, :, None].expand(b, 1, groups, q_len, mask.shape[-1]).reshape(b, 1, groups * q_len, -1)
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.reshape(b, h, q_len, d)


_VARLEN = None


class FlashVarlen(torch.autograd.Function):
    """Causal flash attention over packed examples, straight on aten's flash kernels.

    torch.nn.attention.varlen.varlen_attn (torch 2.11) takes no grouped K/V heads, so K and V
    had to be repeated to every query head: on W2 (28 heads, 4 K/V heads) that is two copies
    and their backward's reduction per layer, and the repeated K/V are what attention saves for
    backward: 12 KB more per token and layer than the grouped ones (~1.2 GiB at a 3,600-token
    micro-batch). Flash itself takes K/V heads dividing the query heads. Going to the kernels
    also skips the custom op's per-call Python (argument defaults, redispatch, a zeroed RNG
    state tensor per call). q [T, H, D], k / v [T, KVH, D] -> [T, H, D].

    Query and key segments may differ (cu_q, cu_k): where a segment has more keys than queries,
    the causal mask is aligned bottom-right (the queries are the segment's last ones).
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.max_q, ctx.max_k = max_q, max_k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, True, seed, offset)
        return dq, dk, dv, None, None, None, None


def has_flash_ops() -> bool:
    """Whether this torch exposes aten's flash attention kernels (FlashVarlen)."""
    return hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(torch.ops.aten, "_flash_attention_backward")


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, enable_gqa=True):
    """FlashVarlen with varlen_attn's calling convention (causal, one cu_seqlens for q and k)."""
    if not is_causal or cu_q is not cu_k or max_q != max_k:
        raise ValueError("flash_varlen computes causal self-attention only")
    return FlashVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k)


def _varlen_fn():
    """The packed-attention function and how to ask it for causal + GQA, or None: aten's flash
    kernels through FlashVarlen where torch has them, else torch.nn.attention.varlen.varlen_attn."""
    global _VARLEN
    if _VARLEN is None:
        if has_flash_ops():
            _VARLEN = (flash_varlen, True, True)
            return _VARLEN
        try:
            import inspect

            from torch.nn.attention.varlen import varlen_attn

            params = inspect.signature(varlen_attn).parameters
            _VARLEN = (varlen_attn, "is_causal" in params, "enable_gqa" in params)
        except Exception:
            _VARLEN = (None, False, False)
    return _VARLEN


def varlen_supported(q: torch.Tensor) -> bool:
    # Tried once per device and dtype (varlen_usable): a GPU or build without the kernel takes
    # the SDPA reference path, with one log line.
    if _BACKEND == "sdpa":
        return False
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[0] == 1
            and varlen_usable(q.device, q.dtype))


def varlen_causal(q, k, v, layout: Packed) -> torch.Tensor:
    """Flash varlen attention over the examples of one packed row: [1, T, H, D] -> same."""
    fn, has_is_causal, has_gqa = _varlen_fn()
    # views without the batch dimension (not q[0]: select's backward zero-fills a [1, T, H, D]
    # tensor and copies the gradient in, three times a layer)
    q0, k0, v0 = q.squeeze(0), k.squeeze(0), v.squeeze(0)
    groups = q0.shape[1] // k0.shape[1]
    kwargs = {}
    if groups > 1:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:
            k0, v0 = k0.repeat_interleave(groups, dim=1), v0.repeat_interleave(groups, dim=1)
    if has_is_causal:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    cu = layout.cu_seqlens  # covers every token of the row, a trailing pad segment included
    out = fn(q0, k0, v0, cu, cu, layout.max_seqlen, layout.max_seqlen, **kwargs)
    return out[None]


# ---- the probe of flash varlen attention ------------------------------------------------

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
    why = _VARLEN_OK[key]
    if why and _BACKEND == "flash":
        raise UserError(f"attention: flash varlen attention does not run here ({why}); use attention: auto or sdpa")
    if why and device.type == "cuda":
        note_fallback("varlen", "flash varlen attention", why, "SDPA over a padded view")
    return not why


def probe_varlen(device: torch.device, dtype: torch.dtype) -> str:
    """'' when varlen attention runs here and agrees with the reference; else why not."""
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
        return probe_error(e)
    return probe_verdict(out, _per_example_attention(q, k, v, lengths), (qd, kd, vd))


def probe_error(e: Exception) -> str:
    """A probe's failure as one short line: the exception's type and first line."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:200]


def probe_verdict(out: torch.Tensor, ref: torch.Tensor, leaves) -> str:
    """'' when a probe's output on the device agrees with the float32 reference (bf16 / fp16
    rounding is ~1e-2 at most on its tiny inputs) and the leaves' gradients are finite; else why not."""
    err = ((out.detach().float().cpu() - ref).abs().max() / ref.abs().max()).item()
    if not err <= 3e-2:
        return f"wrong result on a tiny input (relative error {err:.3g})"
    if not all(torch.isfinite(t.grad).all() for t in leaves):
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
