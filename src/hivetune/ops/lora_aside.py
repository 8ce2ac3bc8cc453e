"""LoRA weight gradients on a side stream: inside a CUDA graph capture, LoRAGroup's backward
puts its A and B gradients on a second stream beside the chain of input gradients, and the
graph runs them as parallel branches (train's backward calls join_aside after each backward).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class _Aside:
    """The side stream of one device and the side work not yet joined: (event, tensors it reads)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.pending: list[tuple[torch.cuda.Event, tuple]] = []
        self.blocks = 0  # groups whose weight gradients went on the side stream (tests, benchmarks)


_ASIDE: dict[int, _Aside] = {}
ASIDE_WINDOW = 2  # side work of this many groups may be in flight; older work is joined as it is released


def aside_wanted(g: torch.Tensor) -> bool:
    """Whether this backward puts its LoRA weight gradients on the side stream: on CUDA, inside a
    CUDA graph capture only (eager steps would pay the stream switches and events on the host).
    The A and B gradients are small matmuls (W1: ~1/9 of a step's GPU time in ~12 launch-bound
    kernels a layer) that nothing in the backward waits for; on their own stream, the graph
    runs them as branches beside the chain of input gradients (W1: ~4% faster, docs/log.md)."""
    if not g.is_cuda:
        return False
    if g.device.index not in _ASIDE:  # made outside a capture (the graphs' eager warm-up comes first)
        _ASIDE[g.device.index] = _Aside(g.device)
    return torch.cuda.is_current_stream_capturing()


@contextmanager
def weight_grads_aside(g: torch.Tensor, keep: tuple):
    """Run the block on the device's side stream after the work queued so far on the current
    one; `keep` (what the block reads) stays referenced until the current stream has waited for
    the block (join_aside, or when newer side work pushes it out of the window), so that the
    caching allocator cannot hand its memory to later work of the current stream first."""
    aside = _ASIDE[g.device.index]
    main = torch.cuda.current_stream(g.device)
    aside.stream.wait_stream(main)
    with torch.cuda.stream(aside.stream):
        yield
    aside.blocks += 1
    done = torch.cuda.Event()
    done.record(aside.stream)
    aside.pending.append((done, keep))
    while len(aside.pending) > ASIDE_WINDOW:
        main.wait_event(aside.pending[0][0])
        del aside.pending[0]  # its tensors are released after the wait, in the current stream's order


def join_aside() -> None:
    """The current stream waits for all side work (the gradients are complete after this); called
    after every backward (train.forward_backward), a no-op when none was put aside."""
    for aside in _ASIDE.values():
        if aside.pending:
            try:
                torch.cuda.current_stream(aside.stream.device).wait_stream(aside.stream)
            finally:  # a failed capture's events are not waited on again
                aside.pending.clear()
