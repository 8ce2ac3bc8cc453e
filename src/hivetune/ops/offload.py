"""Activation offload: the saved activations of the first N decoder layers wait in pinned host
memory between forward and backward, copied on a side CUDA stream that overlaps compute.

Why: W2 (Qwen2.5-7B shape, LoRA r 32 on all 7 projections, bf16, ~3,400 tokens a micro-batch)
peaks at 26.3 GiB allocated; autograd keeps ~107 KB a token a layer (0.34 GiB a layer), most of
it the [T, 2 I] gate|up output that SwiGLU and down_proj's LoRA group keep. Moving N = 8 layers'
(2.7 GiB) to the host brings the peak under 24 GiB at about the same step time (H200, 55 GB/s
each way over PCIe: 26.27 -> 23.55 GiB allocated, 227 against 230 ms a step; docs/log.md).

How many layers: N (``activation_offload``) for the run's largest micro-batch, which the memory
was sized for; a smaller micro-batch offloads the fewest first layers that keep no more saved
activations on the GPU than that one does (``layers_for``). W2 under a 24 GiB cap: N = 5 for
3,426 tokens, 1.6 layers on average over its 93 steps (2,316-3,426 tokens), so the copies and
hooks of 3.4 layers a step are saved. A step that still runs out of memory is redone with a
smaller budget (``back_off``).

How, per training forward (``CausalLM.forward`` calls ``begin``, then ``layer`` for each layer):

- Pack (``torch.autograd.graph.saved_tensors_hooks`` around layer i < N): a saved tensor whose
  storage holds at least ``threshold`` bytes (1 MiB) and is not persistent state (the model's
  parameters and buffers, the LoRA CastCache buffers of ops.lora_casts, the RoPE tables every
  layer shares) is replaced by a handle to a host copy of its whole storage; the saved tensor
  becomes (handle, dtype, offset, size, stride). One storage saved twice in a layer (under the
  seeded dropout: the norm's input x, kept by RMSNorm and by the q/k/v group as its `source`;
  the gate|up output, kept by SwiGLU and by down_proj's group) is copied once: the handles are keyed by storage address, and
  the layer holds each storage until its end, so no address is reused inside the layer. Anything
  else is kept as it is (detached: an output saved with its grad_fn would be a reference cycle).
- Device to host, at the layer's end: the side stream waits for the compute stream, copies every
  new storage into pinned memory (non_blocking) and ``record_stream`` keeps the allocator from
  handing the GPU block out before the copy ends; then nothing holds the GPU tensor. The host
  never waits: the forward goes on while the copies run (~7 ms a W2 layer at ~50 GB/s against
  ~2 ms of forward; the allocator counts the memory freed at once, and reuses the blocks once
  their copies are done).
- Host to device, ahead of backward: a hook on the output of layer j (run when backward reaches
  layer j) issues the copies of every offloaded layer i with ``prefetch_trigger(i) >= j``, i.e.
  layer i's when backward reaches layer min(L - 1, i + lead), lead = max(N, 4) up to N = L / 2
  (``prefetch_lead``: less on a model too shallow for that window; beyond, L - N, at least 2),
  highest layer first, each into a GPU
  buffer allocated on the compute stream, the side stream waiting for it, with an event after
  each layer's copies. Why lead N: the copies run back to back from the first one (issued at
  layer 2N - 1) at ~7 ms a layer while backward takes ~4 ms a layer, so layer i is ready 7 (N - i)
  ms after that point and needed 4 (2N - 1 - i) ms after it: in time for every i when N >= 4
  (W2 with N = 8: 56 ms of copies inside 60 ms of backward), hence the floor of 4. The window
  holds at most lead + 1 layers on the GPU (layers N..j and the fetched ones): up to N = L / 2 no
  more than the L - N of the start of backward, beyond it L - N + 1 (``peak_resident_layers``);
  fetching all N at once would hold 2N.
- Unpack: the compute stream waits for the layer's event, and gets a view of the GPU copy with
  the saved dtype, offset, size and strides. The handle keeps the GPU copy until it dies (when
  every node that saved it has run): SwiGLU's backward writes its gradient over the gate|up
  tensor that down_proj's backward read first, and both see the same GPU storage. An unpack
  before its prefetch copies there (correct, just later).
- Host memory: pinned chunks (``_HostArena``), leased to one forward's handles and back to the
  arena when the last of them dies, so steps reuse them; a lease never shares a chunk with
  another live one. Reuse is safe without a host wait: the next step's copies into a chunk are
  queued on the same side stream after this step's copies out of it.

Off (``begin`` returns None): outside training (eval, no_grad), while a CUDA graph is captured
(a graph keeps its activations in its own pool: ops.graphs' micro-batches run without offload,
eager ones with it; one stderr line), with gradient checkpointing (a checkpointed layer keeps
only its input). On the CPU it is a no-op for training (train builds none); ``cpu_test=True``
runs the same hooks with plain CPU tensors as the "host" copies, so tests check the mechanism.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch


THRESHOLD_BYTES = 1 << 20  # storages under 1 MiB stay on the GPU (W2: lse, 1/rms, the rank-r xa)
CHUNK_BYTES = 256 << 20  # pinned host memory is allocated in chunks of up to this size
ALIGN = 4096  # host copies start at 4 KiB boundaries
MIN_LEAD = 4  # prefetch_lead's floor up to half the layers offloaded
MIN_DEEP_LEAD = 2  # and beyond half


def prefetch_lead(offloaded: int, layers: int) -> int:
    """How many layers of backward ahead of offloaded layer i its copies are issued. Up to half
    the layers: N, at least MIN_LEAD (a few offloaded layers: each one's copies take ~7 ms a W2
    layer, its backward ~4) where the window of fetched and kept layers (lead + 1) stays within
    the L - N that never left. Beyond half: L - N, at least MIN_DEEP_LEAD, so that the window
    stays within those too and each further offloaded layer lowers the backward's peak (a lead
    of N would bring every offloaded layer back at once: all L for N = L); the copies may then
    keep backward waiting, the price of the memory."""
    if 2 * offloaded <= layers:
        return max(offloaded, min(MIN_LEAD, layers - offloaded - 1))
    return max(MIN_DEEP_LEAD, layers - offloaded)


def prefetch_trigger(layer: int, offloaded: int, layers: int) -> int:
    """The decoder layer whose backward, when reached, issues offloaded `layer`'s copies back."""
    return min(layers - 1, layer + prefetch_lead(offloaded, layers))


@functools.lru_cache(maxsize=4096)
def peak_resident_layers(offloaded: int, layers: int) -> int:
    """The most decoder layers whose saved activations are on the GPU at once during backward:
    when it reaches layer j, layers max(N, .)..j never left, and the offloaded layers <= j whose
    copies are issued (prefetch_trigger >= j) are back. With no offload: all `layers`."""
    peak = layers - offloaded
    for j in range(layers - 1, -1, -1):
        kept = max(0, j - offloaded + 1)
        fetched = sum(1 for i in range(min(j, offloaded - 1) + 1) if prefetch_trigger(i, offloaded, layers) >= j)
        peak = max(peak, kept + fetched)
    return peak


class _HostArena:
    """Reusable host chunks: pinned on CUDA, plain CPU tensors in the CPU test mode."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: list[torch.Tensor] = []  # in allocation order, so steps reuse them alike
        self.allocated = 0

    def chunk(self, nbytes: int) -> torch.Tensor:
        for k, c in enumerate(self.free):
            if c.numel() >= nbytes:
                return self.free.pop(k)
        return self.new(max(nbytes, min(CHUNK_BYTES, max(16 << 20, self.allocated))))  # doubles up to CHUNK_BYTES

    def new(self, size: int) -> torch.Tensor:
        self.allocated += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)


class _Lease:
    """One forward's host memory: chunks taken from the arena, bump-allocated, all returned
    together when the lease dies (the pass and every handle hold it)."""

    def __init__(self, arena: _HostArena):
        self.arena, self.chunks, self.used = arena, [], 0

    def take(self, nbytes: int) -> torch.Tensor:
        if not self.chunks or self.used + nbytes > self.chunks[-1].numel():
            self.chunks.append(self.arena.chunk(nbytes))
            self.used = 0
        view = self.chunks[-1][self.used:self.used + nbytes]
        self.used += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        return view

    def __del__(self):
        self.arena.free.extend(self.chunks)


class _Handle:
    """One offloaded storage: its host copy, and once fetched its GPU copy and the event after it."""

    __slots__ = ("host", "lease", "gpu", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, lease: _Lease):
        self.host, self.lease, self.gpu, self.ready = host, lease, None, None


class ActivationOffload:
    """Keeps the saved activations of decoder layers 0..layers-1 in host memory between a
    training forward and its backward (see the module doc). Build it after the model is on its
    device and lora.fuse_projections ran: the storages it never moves are read then."""

    def __init__(self, model, layers: int, threshold: int | None = None, cpu_test: bool = False):
        self.device = model.lm_head.weight.device  # (not the first parameter: host_embeddings)
        self.cuda = self.device.type == "cuda"
        if not self.cuda and not cpu_test:
            raise ValueError(f"ActivationOffload runs on CUDA (cpu_test=True: the CPU test mode), not {self.device}")
        self.layers, self.total = layers, model.args.num_hidden_layers
        if not 0 < layers <= self.total:
            raise ValueError(f"offload 1..{self.total} layers, not {layers}")
        self.threshold = THRESHOLD_BYTES if threshold is None else threshold
        self.persistent = frozenset(t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()))
        self.casts = getattr(model, "lora_casts", None)  # ops.lora_casts.CastCache: its buffers stay
        # The largest micro-batch's tokens (train's step plan), which `layers` is sized for: a
        # smaller one offloads fewer layers (layers_for). None: every forward offloads `layers`.
        self.max_tokens: int | None = None
        self.share = 1.0  # of that budget (back_off lowers it)
        self.last_layers: int | None = None  # what the latest training forward offloaded
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.arena = _HostArena(pin=self.cuda)
        # totals over all training forwards: forwards, layers offloaded, saved tensors moved,
        # storages copied (and their bytes), unpacks that came before their prefetch
        self.stats = {"passes": 0, "layers": 0, "saved": 0, "copies": 0, "bytes": 0, "late": 0, "back_offs": 0}
        self.graph_noted = False

    def begin(self, x: torch.Tensor, shared: tuple = ()) -> "_Pass | None":
        """The offload of this forward, or None when it does not apply (module doc). `shared`:
        tensors made once per forward and saved by every layer (the RoPE tables), never moved."""
        if not torch.is_grad_enabled() or x.device != self.device:
            return None
        if self.cuda and torch.cuda.is_current_stream_capturing():
            if not self.graph_noted:
                self.graph_noted = True
                print("hivetune: activation_offload skips CUDA-graphed micro-batches (a graph keeps its "
                      "activations in its pool); eager ones offload", file=sys.stderr)
            return None
        n = self.layers_for(x.numel() // max(1, x.shape[-1]))
        self.stats["passes"] += 1
        self.stats["layers"] += n
        self.last_layers = n
        if n == 0:
            return None
        skip = set(self.persistent)
        skip.update(t.untyped_storage().data_ptr() for t in shared)
        for kind in getattr(self.casts, "kinds", ()):  # reallocated when the compute dtype changes
            skip.update(getattr(kind, name).untyped_storage().data_ptr() for name in ("a_buf", "bd_buf")
                        if hasattr(kind, name))
        return _Pass(self, skip, n)

    def layers_for(self, tokens: int) -> int:
        """How many of the first layers a forward of `tokens` tokens offloads: the fewest that
        keep no more saved activations on the GPU (peak_resident_layers x tokens: a layer saves
        about the same per token) than the largest micro-batch (max_tokens) keeps with `layers`
        offloaded, which is what the run's memory was sized for. W2 under a 24 GiB cap (5 layers
        for 3,426 tokens): 1.6 layers a step on average instead of 5. No max_tokens, or a larger
        micro-batch than planned: `layers` always."""
        if self.max_tokens is None or tokens > self.max_tokens:
            return self.layers
        budget = peak_resident_layers(self.layers, self.total) * self.max_tokens * self.share
        return next((n for n in range(self.layers) if peak_resident_layers(n, self.total) * tokens <= budget),
                    self.layers)

    def back_off(self) -> bool:
        """After a CUDA out-of-memory error in a step (train.accumulate_step): whether redoing it
        offloads more, i.e. the latest forward offloaded fewer than N layers; then the budget
        shrinks by 5% for the rest of the run. The saved activations stay within the largest
        micro-batch's, but the allocator's free blocks need not fit the next request (W2 under
        a 24 GiB cap on an H100 hits it now and then; docs/log.md)."""
        if self.last_layers is None or self.last_layers >= self.layers:
            return False
        self.share *= 0.95
        self.stats["back_offs"] += 1
        return True

    def copy_in(self, handles: list[_Handle]) -> None:
        """Issue the host-to-device copies of `handles` (one layer's), with one event after them."""
        if not self.cuda:
            for h in handles:
                h.gpu = h.host.clone()
            return
        compute = torch.cuda.current_stream(self.device)
        for h in handles:
            h.gpu = torch.empty(h.host.numel(), dtype=torch.uint8, device=self.device)
        self.stream.wait_stream(compute)  # the new buffers' blocks may have been in use on it
        with torch.cuda.stream(self.stream):
            for h in handles:
                h.gpu.copy_(h.host, non_blocking=True)
            ready = self.stream.record_event()
        for h in handles:
            h.gpu.record_stream(self.stream)  # freed unused (a node never run): not reused mid-copy
            h.ready = ready

    def reserve(self, total: int, largest: int) -> None:
        """Allocate (pin) the arena's chunks ahead: `total` bytes a forward moves out, none of
        its storages above `largest` bytes; a quarter more, as the leases leave chunk ends unused."""
        size = max(CHUNK_BYTES, largest)
        while self.arena.allocated < total * 1.25 + size:
            self.arena.free.append(self.arena.new(size))

    @property
    def host_bytes(self) -> int:
        """Host memory held for offloaded activations (pinned on CUDA)."""
        return self.arena.allocated


class _Pass:
    """One training forward's offload: its pack / unpack hooks, its handles and their prefetch."""

    def __init__(self, offload: ActivationOffload, skip: set, layers: int):
        self.o, self.skip, self.n = offload, skip, layers  # this forward offloads layers 0..n-1
        self.triggers = {prefetch_trigger(i, layers, offload.total) for i in range(layers)}
        self.lease = _Lease(offload.arena)
        self.index = -1  # the offloaded layer running forward now
        self.saving: dict[int, tuple[_Handle, torch.Tensor]] = {}  # this layer's: address -> (handle, storage)
        self.handles: list[list] = [[] for _ in range(layers)]  # weak references, per layer
        self.next = layers - 1  # the highest offloaded layer whose copies are not issued yet

    def layer(self, i: int, module, x: torch.Tensor, cos, sin, layout) -> torch.Tensor:
        """Decoder layer i's forward, its saved tensors offloaded when i < N, and the prefetch
        hook on its output when backward reaching it issues copies back."""
        if i < self.n:
            self.index = i
            try:
                with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                    x = module(x, cos, sin, layout, None)
            finally:
                self._copy_out()
        else:
            x = module(x, cos, sin, layout, None)
        if i in self.triggers and x.requires_grad:
            x.register_hook(lambda grad, j=i: self.prefetch(j))
        return x

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if (nbytes < self.o.threshold or nbytes == 0 or ptr in self.skip or t.device != self.o.device
                or t.layout != torch.strided):
            return t.detach()
        self.o.stats["saved"] += 1
        entry = self.saving.get(ptr)
        if entry is None:
            handle = _Handle(self.lease.take(nbytes), self.lease)
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            entry = self.saving[ptr] = (handle, whole)
            self.handles[self.index].append(weakref.ref(handle))
            self.o.stats["copies"] += 1
            self.o.stats["bytes"] += nbytes
        return entry[0], t.dtype, t.storage_offset(), t.shape, t.stride()

    def _copy_out(self) -> None:
        """The layer's end: copy its new storages to the host (side stream), drop the GPU ones."""
        saving, self.saving = self.saving, {}
        if not saving:
            return
        if not self.o.cuda:
            for handle, whole in saving.values():
                handle.host.copy_(whole)
            return
        side = self.o.stream
        side.wait_stream(torch.cuda.current_stream(self.o.device))
        with torch.cuda.stream(side):
            for handle, whole in saving.values():
                handle.host.copy_(whole, non_blocking=True)
        for _, whole in saving.values():
            whole.record_stream(side)

    def prefetch(self, j: int) -> None:
        """Backward reached layer j: issue the copies of every offloaded layer due by then."""
        o = self.o
        while self.next >= 0 and prefetch_trigger(self.next, self.n, o.total) >= j:
            alive = [h for h in (ref() for ref in self.handles[self.next]) if h is not None and h.gpu is None]
            self.handles[self.next] = []
            if alive:
                o.copy_in(alive)
            self.next -= 1

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        handle, dtype, offset, size, stride = packed
        if handle.gpu is None:  # before its prefetch: copied now, the stream waits for it below
            self.o.stats["late"] += 1
            self.o.copy_in([handle])
        if handle.ready is not None:
            torch.cuda.current_stream(self.o.device).wait_event(handle.ready)
        gpu = handle.gpu
        return torch.empty(0, dtype=dtype, device=gpu.device).set_(gpu.untyped_storage(), offset, size, stride)
