"""Activation checkpointing: a layer's saved tensors are dropped after its forward and made again
in backward by running the layer once more.

``checkpoint(fn, *args)`` is torch.utils.checkpoint's non-reentrant scheme (saved-tensor hooks:
the forward packs an index instead of each tensor; the first unpack in backward runs ``fn`` again
on the same inputs and hands out what that run saved), without its cost: torch's reads
torch._dynamo's config on every call, and the first call imports torch._dynamo, sympy and
torch.distributed.fsdp (~1 s on a warm host, ~5 s where Python must compile their bytecode).

The recompute runs under the forward's autocast state and random-number state (CPU and the
inputs' CUDA device, outside a CUDA graph's capture), so ops that draw from torch's generator
(nn.Dropout) draw again what they drew. The decoder passes a lora_casts.SeedTape as ``fn``: the LoRA groups' seeded dropout and
cast cache then repeat the forward's without the generator.

The recompute stops once it has made every tensor the forward saved (the layer's last ops,
whose outputs backward does not need, are not run again). Each recomputed tensor is released as
autograd takes it; a second backward over the same graph
(retain_graph) recomputes again.
"""

from __future__ import annotations

import torch


class _Done(Exception):
    """Raised by the recompute's pack hook once it holds every tensor the forward saved."""


class _Layer:
    """One checkpointed call: its inputs, the states its recompute restores, the shapes and dtypes
    its forward saved, and (in backward) what the recompute saved."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        self.autocast = {kind: (torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
                         for kind in {"cpu", self.device.type if self.device is not None else "cpu"}
                         if torch.is_autocast_enabled(kind)}
        self.cpu_rng = torch.get_rng_state()
        # Inside a CUDA graph's capture the generator's state cannot be set; there the layers draw
        # their dropout from seeds the graph takes as inputs (SeedTape repeats them), not from it.
        capturing = self.device is not None and torch.cuda.is_current_stream_capturing()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if self.device is not None and not capturing else None
        self.saved: list[tuple[torch.Size, torch.dtype]] = []
        self.made: list[torch.Tensor | None] | None = None

    def pack(self, tensor: torch.Tensor) -> int:
        self.saved.append((tensor.shape, tensor.dtype))
        return len(self.saved) - 1

    def unpack(self, index: int) -> torch.Tensor:
        if self.made is None or self.made[index] is None:
            self.made = self._recompute()
        tensor, self.made[index] = self.made[index], None
        return tensor

    def _recompute(self) -> list[torch.Tensor]:
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                  for a in self.args]
        made: list[torch.Tensor] = []

        def keep(tensor):
            made.append(tensor)
            if len(made) == len(self.saved):
                raise _Done  # the rest of the layer saves nothing backward needs: not run again
            return len(made) - 1

        def refuse(index):
            raise RuntimeError("hivetune: a tensor saved by a checkpointed layer's recompute was "
                               "asked for inside that recompute")

        try:
            with _rng_as(self), _autocast_as(self), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(keep, refuse):
                self.fn(*inputs)
        except _Done:
            pass
        mine = [(t.shape, t.dtype) for t in made]
        if mine != self.saved:
            raise RuntimeError(f"hivetune: a checkpointed layer's recompute saved {len(mine)} tensors where its "
                               f"forward saved {len(self.saved)}, or other shapes or dtypes: the layer must "
                               "run the same ops on the same inputs both times")
        return made


class _rng_as:
    """Within: torch's generators (CPU, the layer's CUDA device) as the forward found them; after:
    as they were, so the recompute draws nothing from the run's stream."""

    def __init__(self, layer: _Layer):
        self.layer = layer

    def __enter__(self):
        layer = self.layer
        self.cpu = torch.get_rng_state()
        torch.set_rng_state(layer.cpu_rng)
        if layer.cuda_rng is not None:
            self.cuda = torch.cuda.get_rng_state(layer.device)
            torch.cuda.set_rng_state(layer.cuda_rng, layer.device)

    def __exit__(self, *exc):
        torch.set_rng_state(self.cpu)
        if self.layer.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda, self.layer.device)
        return False


class _autocast_as:
    """Within: autocast on for each device kind the forward had it on, with its dtype."""

    def __init__(self, layer: _Layer):
        self.contexts = [torch.autocast(kind, dtype=dtype, cache_enabled=cache)
                         for kind, (dtype, cache) in layer.autocast.items()]

    def __enter__(self):
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc):
        for context in reversed(self.contexts):
            context.__exit__(*exc)
        return False


def checkpoint(fn, *args):
    """fn(*args) with its saved tensors made again in backward instead of kept (module doc)."""
    layer = _Layer(fn, args)
    with torch.autograd.graph.saved_tensors_hooks(layer.pack, layer.unpack):
        return fn(*args)
