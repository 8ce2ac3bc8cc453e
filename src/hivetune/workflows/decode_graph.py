"""Greedy decoding with each step replayed as one CUDA graph.

An eager decode step of a small model is host-bound: a 0.5B model's 24 layers launch ~600
kernels a token, ~25 ms of Python for well under 1 ms of GPU work (the held-out A/B after a
small job: 5 s of its 15). ``DecodeStep`` is the same step over tensors that never move: the
token, each row's position and the cache column to write live on the device and advance inside
the step; keys and values go to that column (``ColumnCache``) and attention reads every column
of the cache under an additive mask that opens a column when the step writes it. One warm-up
step runs eagerly (it compiles and loads the kernels), the next is captured, and every later
step is a replay and one read of the new tokens.

Rows are not compacted as the eager loop does (``generate.greedy_decode``): a finished row's
replay costs no host time, and the step's GPU time hardly depends on its rows. Used on CUDA for
models without a sliding window shorter than the cache and outside training;
``HIVETUNE_REFERENCE=decode_graphs`` or a failed capture (one note line) keeps the eager steps. The
step itself runs without a graph too (``graphed=False``): tests compare it with the eager loop
token for token.
"""

from __future__ import annotations

import torch

from hivetune.core.fallbacks import forced, note_fallback
from hivetune.model.decoder import KVCache
from hivetune.ops.attention import Masked

MIN_STEPS = 8  # fewer decode steps than this: the capture would cost more than it saves
STATS = {"captures": 0, "replays": 0, "failed": 0}  # this process's (tests and benchmarks read them)


class ColumnCache:
    """A KVCache's tensors, written at the column a device tensor holds; attention sees every
    column (the step's mask hides those not yet written)."""

    def __init__(self, cache: KVCache, column: torch.Tensor):
        self.k, self.v, self.column = cache.k, cache.v, column
        self.length = cache.k[0].shape[2]  # every column is read: no sliding window may cut (usable)
        self.prefix = None

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.k[layer].index_copy_(2, self.column, k)
        self.v[layer].index_copy_(2, self.column, v)
        return self.k[layer], self.v[layer]

    def advance(self, tokens: int, layout) -> None:
        pass  # the step advances its column on the device


class DecodeStep:
    """One greedy step of every row on static tensors; ``ids`` [rows, 1] holds the tokens the
    last step chose (at first the prefill's), ``position`` their positions, ``column`` the cache
    column they go to. Calling it advances all three."""

    def __init__(self, model, cache: KVCache, lengths: tuple[int, ...], first: torch.Tensor):
        device, dtype = first.device, cache.k[0].dtype
        width = max(lengths)
        self.model = model
        # 0 on each row's prompt columns, -inf on its left padding and on the columns not written yet
        self.bias = torch.full((len(lengths), cache.k[0].shape[2]), float("-inf"), dtype=dtype, device=device)
        for row, n in enumerate(lengths):
            self.bias[row, width - n:width] = 0
        self.ids = first[:, None].clone()
        self.position = torch.tensor(lengths, device=device)[:, None]
        self.column = torch.tensor([width], device=device)
        self.cache = ColumnCache(cache, self.column)

    def __call__(self) -> None:
        self.bias.index_fill_(1, self.column, 0)  # the column this step writes
        hidden = self.model(self.ids, self.position, Masked(self.bias[:, None, None, :]), self.cache)
        self.ids.copy_(self.model.logits(hidden[:, -1]).argmax(-1, keepdim=True))
        self.position += 1
        self.column += 1


def usable(model, cache: KVCache, max_new_tokens: int) -> bool:
    """Whether greedy_decode replays its steps as a CUDA graph (the module's doc)."""
    if cache.k[0].device.type != "cuda" or model.training or max_new_tokens < MIN_STEPS or forced("decode_graphs"):
        return False
    capacity = cache.k[0].shape[2]
    return all(getattr(m, "window", None) is None or m.window >= capacity for m in model.modules())


def capture(step: DecodeStep):
    """The step captured as a CUDA graph (after an eager warm-up step); None, with one note line,
    if the capture fails (the eager steps then go on from the warm-up's tokens)."""
    try:
        main = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                step()
            finally:
                graph.capture_end()
    except Exception as e:  # noqa: BLE001 - a step that cannot be captured: eager steps
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        note_fallback("decode_graphs", "CUDA graphs for decoding", f"capture failed: {line[:200]}",
                      "eager decode steps")
        STATS["failed"] += 1
        return None
    main.wait_stream(stream)
    STATS["captures"] += 1
    return graph


@torch.no_grad()
def decode(model, cache: KVCache, lengths: tuple[int, ...], first: torch.Tensor, max_new_tokens: int,
           stop_ids: set[int], graphed: bool = True) -> list[list[int]]:
    """greedy_decode's result through DecodeStep: replayed from the third step on where `graphed`
    (eager on from where a capture fails), else every step eager."""
    step = DecodeStep(model, cache, lengths, first)
    outputs: list[list[int]] = [[] for _ in lengths]
    live = set(range(len(lengths)))
    tokens = first.tolist()
    graph = None
    for i in range(max_new_tokens):
        if i:
            if graph is not None:
                graph.replay()
                STATS["replays"] += 1
            else:
                step()
                if graphed and i == 1:  # kernels loaded by the eager step: capture the next one
                    graph = capture(step)
                    graphed = graph is not None
            tokens = step.ids[:, 0].tolist()
        for row in sorted(live):
            if tokens[row] in stop_ids:
                live.discard(row)
            else:
                outputs[row].append(tokens[row])
        if not live:
            break
    return outputs
