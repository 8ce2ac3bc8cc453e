"""The compute-dtype LoRA weights of every joined group of a model (ops.lora_group), made once
per model forward, and the seeds of that forward's seeded dropouts.

A group call multiplies by A_all = [A_1; ...; A_n] [n r, d] and the block-diagonal
Bd = blockdiag(B_1, ..., B_n) [O, n r] in the compute dtype. A ``CastCache``
(``lora.fuse_projections`` builds it, ``CausalLM.forward`` refreshes it) holds every layer's
A_all and Bd of one group kind (q/k/v, o, gate/up, down) in one buffer, written by two or three
kernels for the whole model, instead of ~9 cast / fill / copy kernels per layer and group (on
W1, ~500 of a step's ~2,400 kernels). Without a fresh cache (a layer called alone) ops.lora_group
builds them itself. A checkpointed layer runs through a ``SeedTape``: its recompute in backward
takes the forward's cache and the very seeds its forward took.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from hivetune.ops import dropout as dropout_op

_ACTIVE: "CastCache | None" = None  # the cache refreshed by the model forward now running
# The seeds the next refreshed forward's seeded dropouts take (int64 on the device, one a group
# call), set by given_seeds: train draws them on the host per micro-batch, and a CUDA graph reads
# them from its static inputs, so no graph draws from torch's CUDA generator.
_GIVEN_SEEDS: "torch.Tensor | None" = None
_TAPE: "SeedTape | None" = None  # the checkpointed layer now running (forward or recompute)


class _Kind:
    """One group kind across L layers: A_1..A_n and B_1..B_n of each, same shapes in every layer.
    `slots`: each layer's place for Bd in the wide weight layout (lora.FusedProjections), or None;
    where they lie evenly apart in one storage, Bd is written there (in that dtype)."""

    def __init__(self, groups: list[tuple[list, list, torch.Tensor | None]], sizes: tuple[int, ...]):
        self.a = [a for a_params, _, _ in groups for a in a_params]  # layer-major, then A_1..A_n
        self.b = [b for _, b_params, _ in groups for b in b_params]
        self.sizes, self.layers, self.n = sizes, len(groups), len(sizes)
        self.r, self.d = groups[0][0][0].shape
        self.wide = _evenly_apart([slot for _, _, slot in groups])
        self.dtype = None

    def refresh(self, dtype: torch.dtype) -> None:
        L, n, r, d, rows = self.layers, self.n, self.r, self.d, sum(self.sizes)
        if self.dtype != dtype:
            device = self.a[0].device
            self.a_buf = torch.empty((L, n * r, d), dtype=dtype, device=device)
            self.bd_buf = (self.wide if self.wide is not None and self.wide.dtype == dtype
                           else torch.empty((L, rows, n * r), dtype=dtype, device=device))
            if n > 1:
                self.b_tmp = torch.empty((L, rows, r), dtype=self.b[0].dtype, device=device)
                onehot = torch.zeros((rows, n), dtype=self.b[0].dtype, device=device)
                row = 0
                for i, size in enumerate(self.sizes):
                    onehot[row:row + size, i] = 1
                    row += size
                self.onehot = onehot
            # Destinations with each source's shape and strides: torch._foreach_copy_ then casts
            # them all in a few multi-tensor kernels (torch.cat into another dtype copies one by one).
            self.a_views = list(self.a_buf.view(L * n, r, d).unbind(0))
            self.b_views = list(self.bd_buf.unbind(0)) if n == 1 else None
            self.dtype = dtype
        torch._foreach_copy_(self.a_views, self.a)
        if n == 1:
            torch._foreach_copy_(self.b_views, self.b)
        else:  # Bd [rows, n r] of every layer at once: B_i's rows in column block i, zeros elsewhere
            torch.cat(self.b, out=self.b_tmp.view(-1, r))  # same dtype: batched copies
            torch.mul(self.b_tmp[:, :, None, :], self.onehot[None, :, :, None], out=self.bd_buf.view(L, rows, n, r))


def _evenly_apart(slots: list) -> torch.Tensor | None:
    """The [L, rows, k] view over L same-shaped [rows, k] slots lying evenly apart in one
    storage, or None (a slot missing, other strides or dtypes, another storage)."""
    first = slots[0]
    if any(s is None for s in slots) or any(s.stride() != first.stride() or s.shape != first.shape
                                            or s.dtype != first.dtype
                                            or s.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                                            for s in slots):
        return None
    step = slots[1].storage_offset() - first.storage_offset() if len(slots) > 1 else 0
    if any(s.storage_offset() != first.storage_offset() + i * step for i, s in enumerate(slots)):
        return None
    return first.as_strided((len(slots), *first.shape), (step, *first.stride()))


class CastCache:
    """Compute-dtype A_all and block-diagonal B of every joined LoRA group of a model, refreshed
    once per model forward (see the module doc). ``groups``: (A params, B params, sizes, the
    wide layout's Bd slot or None) per group call, in layer order; groups of the same shapes
    form one kind (one buffer)."""

    def __init__(self, groups: list[tuple[list, list, tuple[int, ...], torch.Tensor | None]]):
        by_shape: dict[tuple, list] = {}
        for a_params, b_params, sizes, slot in groups:
            key = (tuple(sizes), tuple(a_params[0].shape), a_params[0].dtype, b_params[0].dtype)
            by_shape.setdefault(key, []).append((list(a_params), list(b_params), slot))
        self.kinds = [_Kind(g, key[0]) for key, g in by_shape.items()]
        self.slots: dict[int, tuple] = {}  # id(first A) -> (A params, B params, kind, layer index)
        for kind in self.kinds:
            for layer in range(kind.layers):
                a = tuple(kind.a[layer * kind.n:(layer + 1) * kind.n])
                b = tuple(kind.b[layer * kind.n:(layer + 1) * kind.n])
                self.slots[id(a[0])] = (a, b, kind, layer)
        self.dtype = None
        self.seeds, self.seeds_used = None, 0
        # Keep each group's dropped input for backward instead of recomputing it from its
        # `source` (train's lora_inputs: fewer kernels, more memory).
        self.keep_inputs = False
        self.kept_by_auto_bytes = 0  # train.planned_memory: what recomputing would free, where auto kept them

    @contextmanager
    def fresh(self, dtype: torch.dtype):
        """Refresh every kind in `dtype`; lora_group uses the buffers until the block ends (active)."""
        global _ACTIVE
        with torch.no_grad():
            for kind in self.kinds:
                kind.refresh(dtype)
        self.seeds, self.seeds_used = _GIVEN_SEEDS, 0
        self.dtype, previous, _ACTIVE = dtype, _ACTIVE, self
        try:
            yield
        finally:
            _ACTIVE = previous

    def next_seed(self, device) -> torch.Tensor:
        """The seeded dropout's seed for the next group call of this forward: the next of the
        seeds given for it (given_seeds), else one draw of a seed per group for the whole model
        at the first call (one kernel a forward, not one a group: W1 ran 96 of them a step),
        then a view of the next one."""
        if self.seeds is None or self.seeds_used == self.seeds.numel():
            self.seeds, self.seeds_used = dropout_op.new_dropout_seed(device, len(self.slots)), 0
        self.seeds_used += 1
        return self.seeds[self.seeds_used - 1:self.seeds_used]

    def lookup(self, a_params, b_params, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A_all, Bd) of this group call, or None when it is not the cached group in `dtype`."""
        slot = self.slots.get(id(a_params[0]))
        if slot is None or dtype != self.dtype or len(a_params) != len(slot[0]):
            return None
        a, b, kind, layer = slot
        if any(x is not y for x, y in zip(a, a_params)) or any(x is not y for x, y in zip(b, b_params)):
            return None
        return kind.a_buf[layer], kind.bd_buf[layer]


@contextmanager
def given_seeds(seeds: torch.Tensor | None):
    """The forwards refreshed inside this block take their dropout seeds from `seeds` (int64 on
    the model's device, at least one per joined group call: train.dropout_seeds) instead of
    drawing them from torch's CUDA generator. None: drawn, as without the block."""
    global _GIVEN_SEEDS
    previous, _GIVEN_SEEDS = _GIVEN_SEEDS, seeds
    try:
        yield
    finally:
        _GIVEN_SEEDS = previous


def active() -> CastCache | None:
    """The CastCache refreshed by the model forward now running, or None."""
    return _ACTIVE


def casts_active() -> bool:
    """Whether a model forward refreshed its CastCache (which the wide path's Bd comes from)."""
    return _ACTIVE is not None


def dropout_seed(device) -> torch.Tensor:
    """The seeded dropout's seed for the next group call: in a checkpointed layer's recompute the
    one its forward took (SeedTape), else the refreshed CastCache's (one draw a forward), else a
    fresh one."""
    return taped(lambda: _ACTIVE.next_seed(device) if _ACTIVE is not None else dropout_op.new_dropout_seed(device))


def taped(draw) -> torch.Tensor:
    """draw() (a dropout seed), except inside a checkpointed layer (SeedTape): there its forward
    records what draw() gives and its recompute takes the recorded seed instead of drawing."""
    return _TAPE.take(draw) if _TAPE is not None else draw()


def replaying() -> bool:
    """Whether a checkpointed layer's recompute is running (its SeedTape replays the forward's)."""
    return _TAPE is not None and _TAPE.recorded


class SeedTape:
    """The function a checkpointed layer runs through (``checkpoint(SeedTape(), layer, *args)``):
    its first call (the forward) records the dropout seeds the layer takes, in order; a later call
    (the recompute in backward, after the forward's given seeds and refreshed cache are gone)
    takes the same seeds and the forward's cache again. Without it the recompute would draw other
    seeds: other masks than those of the forward that made the loss, and wrong LoRA gradients."""

    def __init__(self):
        self.cache, self.seeds, self.recorded, self.position = _ACTIVE, [], False, 0

    def __call__(self, fn, *args):
        global _TAPE, _ACTIVE
        previous = _TAPE, _ACTIVE
        _TAPE, _ACTIVE, self.position = self, self.cache, 0
        try:
            return fn(*args)
        finally:
            _TAPE, _ACTIVE = previous
            self.recorded = True

    def take(self, draw) -> torch.Tensor:
        if not self.recorded:
            self.seeds.append(draw())
            return self.seeds[-1]
        self.position += 1
        return self.seeds[self.position - 1]

