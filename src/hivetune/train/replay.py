"""CUDA graphs for a packed micro-batch: forward, loss and backward replayed as one graph.

A small model's eager step is mostly host time dispatching kernels (W1: ~25 ms of GPU work in
a ~133 ms step, ~3,300 kernels); a graph replays them all with one launch. This module captures
and replays; it knows no run and no processes: it takes the step function, the model, plain
values and the plan's inputs (PlanInputs, from train.graph_plan), and reports what it measured
in ``stats``.

Shapes. A graph fixes every shape and address, so a micro-batch is padded to a graph size:
T real tokens -> the smallest planned size above T; the pad tokens form their own segment of
``cu_seqlens`` (attention never crosses a segment), so real tokens see what they saw unpadded.
Targets are padded to the graph's target capacity with IGNORE_INDEX (no loss, no gradient). The
step's target count (the loss divisor) is a device scalar filled before each replay.

Order of work. The first micro-batch runs eagerly on the capture stream through the model cut
to PRELOAD_LAYERS layers, its gradients dropped (the lazy inits capture needs, at a fraction of a
whole pass), or, where the cut does not apply, through the whole model (its real work). Then
the largest planned size is captured, timed on the host, and its first replay (of the first
micro-batch after a cut warm-up, else of the next) times the GPU a token;
plan.graph_sizes.plan_sizes weighs the two and picks the other sizes, agreed across processes
through ``gather``. They are captured largest first (smaller graphs reuse the shared pool's
blocks), at once, or, where a replay's GPU time covers a quarter of a capture's host time
(defers_captures), the sizes most micro-batches take first, one after each replay once
CAPTURE_LEAD replays are queued and no instantiation is in flight, their shapes met first by a
capture of the cut model while the GPU idles; the plan then counts a capture at
DEFERRED_CAPTURE_SHARE of its cost. A micro-batch no size holds takes the fixed grid
(BUCKET_TOKENS), captured when met.

Instantiation runs on a worker thread where torch can capture without instantiating
(keep_graph): it overlaps the next capture and the replays; a replay waits only for its own.

All graphs share one memory pool; each replay's loss is cloned at once. Gradients accumulate in
place into persistent .grad tensors, views of one buffer (lora_grads.GradArena), re-attached
(one memset) after the optimizer sets them to None. Dropout seeds are static inputs like the
token ids, so every replay gets its micro-batch's masks without the CUDA generator.
"""

from __future__ import annotations

import collections
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from hivetune.core.device import cuda_index
from hivetune.data.batch import MicroBatch
from hivetune.model.lora import lora_parameters
from hivetune.ops.attention import Packed
from hivetune.ops.lora_grads import GradArena
from hivetune.plan.graph_sizes import (BUCKET_TOKENS, DEFERRED_CAPTURE_SHARE, GRAIN, bucket_tokens,
                                       capture_cost_tokens, deferrable, defers_captures, grid_keys, max_tflop,
                                       plan_sizes, size_uses, target_capacities)
from hivetune.train.graph_batch import Bucket, first_line, batch_key, keeps_graphs, pad_packed_batch, release_generator

MAX_GRAPHS = 48  # keys beyond this many run eagerly
# A deferred capture waits until this many replays are queued ahead of the GPU, so that its host
# pass runs while the GPU works (docs/log.md: W2 DDP 9.40 / 9.27 s against 9.60 / 9.72).
CAPTURE_LEAD = 3
# The preload captures the model cut to this many layers: the first layer's backward has no
# input-gradient products (its input needs no gradient), the second's has them, as every later
# layer's does, so two layers meet every kernel shape of the real capture.
PRELOAD_LAYERS = 2

last_stats: dict = {}  # the most recent GraphedForwardBackward's stats (read by the benchmarks)


@dataclass
class PlanInputs:
    """What the size plan reads of the step plan, as plain values (train.graph_plan builds them).

    micro: (tokens, cu_seqlens entries) of every micro-batch of the step plan from its first
    step (under DDP each the most any rank has at that place: the step waits for the slowest);
    own: this process's own, likewise; targets: the target count of each of `own` ([] unknown);
    upcoming: this process's micro-batches from where the run starts (the fixed grid's keys);
    saved: the sizes a resumed run planned before, or None."""

    micro: list[tuple[int, int]] = field(default_factory=list)
    own: list[tuple[int, int]] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    upcoming: list[tuple[int, int]] = field(default_factory=list)
    saved: dict[int, list[int]] | None = None


def persistent_grads(params: list, model) -> tuple[GradArena | None, list]:
    """(arena, gradients): the LoRA parameters' persistent gradients, in one GradArena buffer where
    it can hold them (the parameters moved into a buffer laid out alike, for FusedAdamW's flat
    step), else one zeroed tensor each."""
    arena = (GradArena(params, getattr(model, "lora_casts", None), move_params=True)
             if GradArena.usable(params) else None)
    return arena, arena.grads if arena is not None else [torch.zeros_like(p) for p in params]


def attach_persistent_grads(params: list, grads: list, arena: GradArena | None) -> None:
    """Point every LoRA .grad at its persistent tensor (a graph accumulates into those): after
    the optimizer set them to None, one memset of the arena; a .grad made elsewhere is copied in."""
    if arena is not None and all(p.grad is None for p in params):
        arena.flat.zero_()
        for p, g in zip(params, grads):
            p.grad = g
        return
    fresh = []
    for p, g in zip(params, grads):
        current = p.grad
        if current is g:
            continue
        if current is None:
            fresh.append(g)
        else:
            g.copy_(current)
        p.grad = g
    if fresh:
        torch._foreach_zero_(fresh)


class GraphedForwardBackward:
    """Callable ``(batch on the host, n_targets) -> detached loss``, replaying one CUDA graph per
    graph size.

    body(batch, n_targets): forward, loss (ignoring IGNORE_INDEX targets: ignoring_loss_fn) and
    backward of a micro-batch already on the device, returning its loss; what gets captured.
    eager(batch, n_targets): the same for a host micro-batch, run where no graph serves.
    plan: returns the step plan's PlanInputs, called once at the first capture.
    gather(value) -> every process's value (all_gather), or None for one process: the first
    call's choices (graphs on or off, the capture cost) are then the same on every process.
    on_sizes(sizes): told the planned sizes ({cu_seqlens entries: [tokens]}) when they are known.
    bucket: a fixed grid of that many tokens instead of planned sizes (tests, benchmarks).
    defer: captures deferred or not, whatever the timing says (None: as defers_captures decides).
    """

    def __init__(self, body: Callable, eager: Callable, model: torch.nn.Module, device: torch.device,
                 pad_id: int = 0, plan: Callable[[], PlanInputs] | None = None, gather: Callable | None = None,
                 on_sizes: Callable | None = None, bucket: int = 0, max_graphs: int = MAX_GRAPHS,
                 defer: bool | None = None):
        self.body, self.eager, self.model, self.device, self.pad_id = body, eager, model, device, pad_id
        self.plan_inputs = plan or PlanInputs
        self.gather = gather or (lambda value: [value])
        self.on_sizes = on_sizes or (lambda sizes: None)
        self.bucket, self.planned = bucket or BUCKET_TOKENS, not bucket
        self.sizes: dict[int, list[int]] = {}  # cu_seqlens entries -> graph sizes (tokens)
        self.grain = GRAIN
        self.capacity: dict[tuple[int, int], int] = {}  # a new graph's target capacity
        self.max_graphs = max_graphs
        self.params = lora_parameters(model)
        # The persistent gradients, in one buffer: LoRAGroup adds into them (no autograd adds),
        # and the parameters in a buffer laid out alike, for FusedAdamW's flat step: before capture.
        self.arena, self.grads = persistent_grads(self.params, model)
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)
        self.background = keeps_graphs()
        self.instantiator = None  # the worker thread instantiating captured graphs (background)
        self.warmed = False
        self.n_seeds = 0  # dropout seeds a micro-batch (set at the warm-up: fit's micro-batches carry them)
        self.defer, self.pending = defer, []  # the deferred keys still to capture
        self.uses: collections.Counter = collections.Counter()  # the plan's micro-batches taking each key
        self.preloaded: dict[tuple[int, int], Bucket] = {}  # deferred keys whose shapes _preload met
        self.plan_due: dict | None = None  # the plan left for the next call (_finish_plan)
        self.calls = 0
        self.lead = CAPTURE_LEAD
        self.replayed: collections.deque = collections.deque(maxlen=self.lead)
        self.waited = 0
        self.off: str | None = None
        self.flops_per_token = 4 * model.args.linear_weight_count
        self.stats = {"graphs": 0, "replays": 0, "eager": 0, "capture_s": 0.0, "pad_tokens": 0, "tokens": 0,
                      "bucket_tokens": self.bucket if not self.planned else "planned", "sizes": None,
                      "capture_tokens": None, "off": None,
                      "warmup_s": None, "capture_each_s": [],  # where capture_s went
                      # of each capture: the host's time in capture_begin, and whether the GPU had
                      # run out of queued work just before it
                      "begin_each_s": [], "idle_before_begin": [],
                      "instantiate": "background" if self.background else "in capture",
                      "instantiate_wait_s": 0.0,  # host time replays waited for their graph's instantiation
                      "deferred": 0, "deferred_idle": 0}  # captures after a replay; those the GPU ran dry in
        global last_stats
        last_stats = self.stats

    def __call__(self, batch: MicroBatch, n_targets: int) -> torch.Tensor:
        self.calls += 1
        loss = self._call(batch, n_targets)
        if self.plan_due is not None and self.calls > self.plan_due["call"]:
            self._finish_plan()  # every process's second call, whatever its path (a collective)
        return loss

    def _call(self, batch: MicroBatch, n_targets: int) -> torch.Tensor:
        if not self.off and not self.buckets and not self.warmed:
            self._check_launch_bound(batch)
        # eager calls too: LoRAGroup adds into the persistent gradients (no fresh fp32 tensors,
        # nothing for autograd to accumulate), and clipping and FusedAdamW run over their one buffer
        self._attach_grads()
        if self.off or not isinstance(batch.layout, Packed):
            self.stats["eager"] += 1
            return self.eager(batch, n_targets)
        key = self.key_of(batch)
        tokens = key[0]
        bucket = self.buckets.get(key)
        full = bucket is None and len(self.buckets) >= self.max_graphs
        if full or (bucket is not None and not self._ready(bucket)):
            self.stats["eager"] += 1
            return self.eager(batch, n_targets)
        padded = pad_packed_batch(batch, tokens, self.pad_id,
                                  bucket.targets if bucket is not None else self.capacity.get(key))
        self.stats["tokens"] += batch.input_ids.shape[1]
        self.stats["pad_tokens"] += tokens - batch.input_ids.shape[1]
        if bucket is None:
            return self._capture(key, batch, padded, n_targets)
        bucket.load(padded, n_targets)
        return self._replay(key, bucket)

    def _replay(self, key: tuple[int, int], bucket: Bucket) -> torch.Tensor:
        """The loss of the micro-batch loaded into `bucket`, its graph replayed (timed where the
        size plan waits for that); then the next deferred capture, where one is due."""
        due = self.plan_due
        timed = due is not None and key == due["top"] and due["events"] is None  # the plan's timing: this replay alone
        if timed:
            due["events"] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            due["events"][0].record()
        bucket.graph.replay()
        self.stats["replays"] += 1
        if timed:
            due["events"][1].record()
        loss = bucket.loss.clone()  # now: the next replay of a graph in this pool may overwrite it
        if self.pending and self._instantiated() and self._lead_enough():
            self._capture_deferred()
        return loss

    def _instantiating(self) -> bool:
        return any(b.ready is not None and not b.ready.done() for b in self.buckets.values())

    def _instantiated(self) -> bool:
        """Whether no background instantiation is in flight; else the deferred capture waits for
        a later replay (an instantiation with replays queued waits for the queue to drain and holds
        up this thread's CUDA calls). stats held_for_instantiation counts those replays."""
        busy = self._instantiating()
        if busy:
            self.stats["held_for_instantiation"] = self.stats.get("held_for_instantiation", 0) + 1
        return not busy

    def _lead_enough(self) -> bool:
        """Whether the next deferred capture goes now: once the replay `lead` calls back is still
        queued on the GPU (the host is that many replays ahead, so the GPU has work through the
        capture's host pass), or after 4 x lead replays without such a lead (a host that never
        leads still captures). stats lead_waits: "queued" or "cap", a capture each."""
        done = torch.cuda.Event()
        done.record()
        self.replayed.append(done)
        self.waited += 1
        queued = len(self.replayed) == self.lead and not self.replayed[0].query()
        if queued or self.waited >= 4 * self.lead:
            self.waited = 0
            self.replayed.clear()
            self.stats["lead_waits"] = self.stats.get("lead_waits", []) + [("queued" if queued else "cap")]
            return True
        return False

    def _capture_deferred(self) -> None:
        """The next deferred size, captured while the GPU runs the replay just queued (and what
        was queued before it). stats: deferred counts these captures, deferred_idle those after
        which the replay had finished (the GPU waited for the rest of the host pass)."""
        queued = torch.cuda.Event()
        queued.record()
        key = self.pending.pop(0)
        # stats began_instantiating: deferred captures begun while an instantiation was in flight
        if self._instantiating():
            self.stats["began_instantiating"] = self.stats.get("began_instantiating", 0) + 1
        t0 = time.perf_counter()
        preloaded = self.preloaded.pop(key, None)
        captured = key in self.buckets or self._capture_key(key, preloaded)
        self.stats["capture_s"] = round(self.stats["capture_s"] + time.perf_counter() - t0, 3)
        self.stats["deferred"] += 1
        self.stats["deferred_idle"] += int(queued.query())
        if not captured:
            self.pending = []

    def key_of(self, batch: MicroBatch) -> tuple[int, int]:
        """The graph of a micro-batch: the smallest planned size captured so far that holds it
        and a pad token, with its segment count; the fixed grid's bucket where nothing planned
        holds it."""
        t, segments, n = batch.input_ids.shape[1], len(batch.layout.cu_seqlens) + 1, batch.target_ids.numel()
        size = next((s for s in self.sizes.get(segments, ())
                     if s > t and (s, segments) in self.buckets and n <= self.buckets[(s, segments)].targets), None)
        return (size, segments) if size else batch_key(batch, self.bucket)

    def _check_launch_bound(self, batch: MicroBatch) -> None:
        """Graphs remove host dispatch time (~5 ms a layer); a micro-batch whose matmuls alone
        keep the GPU busier than that gains little and pays capture time and pool memory. Every
        process decides on the largest one's micro-batch (gather), so all of them reach the
        plan's collective, or none does."""
        tflop = max(self.gather(self.flops_per_token * batch.input_ids.numel() / 1e12))
        if tflop > max_tflop(getattr(self.model, "gradient_checkpointing", False)):
            self._turn_off(f"compute-bound micro-batches, ~{tflop:.0f} TFLOP each")

    def _turn_off(self, reason: str) -> None:
        self.off = self.stats["off"] = reason
        print(f"hivetune: CUDA graphs off ({reason}); eager steps", file=sys.stderr)

    def _attach_grads(self) -> None:
        attach_persistent_grads(self.params, self.grads, self.arena)

    def _body(self, bucket: Bucket) -> torch.Tensor:
        bucket.cu.copy_(bucket.cu_src)
        return self.body(bucket.batch, bucket.n_targets)

    def _capture(self, key, batch: MicroBatch, padded: MicroBatch, n_targets: int) -> torch.Tensor:
        """A key without a graph: returns this micro-batch's loss, having captured what it can.

        The first time, an eager run on the capture stream meets the lazy inits capture needs
        (cuBLAS plans, Triton's module loads): of the model cut to PRELOAD_LAYERS layers, whose
        gradients are dropped (_warm_up_cut), or where the cut does not apply, of the whole model,
        which does this micro-batch's real work. Then the graphs of every key the step plan will
        meet are captured, largest first, so that the smaller ones reuse the shared pool's blocks
        (capture executes nothing, so the static inputs' contents do not matter then), and after
        a cut warm-up this micro-batch replays in its graph. A key the plan did not foresee is
        captured when met, then replayed."""
        t0 = time.perf_counter()
        loss = None
        if not self.warmed:
            # the graphs' dropout seeds come from their static inputs where fit gives them
            self.n_seeds = batch.dropout_seeds.numel() if batch.dropout_seeds is not None else 0
            bucket = Bucket(key[0], key[1] - 1, padded.n_examples, self.device, self.n_seeds)
            bucket.load(padded, n_targets)
            cut = self._warm_up_cut(bucket)
            if not cut:
                with self._on_capture_stream() as main:
                    loss = self._body(bucket)
                loss.record_stream(main)
            self.stats["warmup_layers"] = PRELOAD_LAYERS if cut else len(self.model.model.layers)
            self.warmed = True
            self.stats["warmup_s"] = round(time.perf_counter() - t0, 3)  # host time; the GPU runs on
            # The warm-up's activations went back to the ordinary allocator's cache, where the
            # graphs' private pool cannot reuse them: hand them back first, or the run reserves
            # one micro-batch of activations twice (W2 2 x 8: 36.9 GiB reserved, 22.9 allocated).
            torch.cuda.empty_cache()
            keys = self._plan(batch) if self.planned else grid_keys(self.plan_inputs().upcoming, self.bucket)
            self._capture_planned(sorted(set(keys) | {self.key_of(batch)}, reverse=True))
            if cut:
                loss = self._first_replay(batch, key, n_targets)
        elif self._capture_key(key, None) and self._ready(self.buckets[key]):
            bucket = self.buckets[key]
            bucket.load(padded, n_targets)
            bucket.graph.replay()
            self.stats["replays"] += 1
            loss = bucket.loss.clone()
        self.stats["capture_s"] = round(self.stats["capture_s"] + time.perf_counter() - t0, 3)
        return loss if loss is not None else self.eager(batch, n_targets)

    def _warm_up_cut(self, bucket: Bucket) -> bool:
        """The warm-up through the model cut to its first PRELOAD_LAYERS layers (embedding, final
        norm, head and loss kept: every kernel and shape of the whole model's pass, at a fraction
        of its host time), its LoRA gradients zeroed after. False where it does not apply (fewer
        layers, activation offload: it plans per layer index)."""
        model = self.model
        if len(model.model.layers) <= PRELOAD_LAYERS or getattr(model, "activation_offload", None) is not None:
            return False
        with self._cut(), self._on_capture_stream():
            self._body(bucket)
        for p in self.params:
            p.grad = None
        self._attach_grads()  # the persistent gradients, zeroed
        return True

    def _first_replay(self, batch: MicroBatch, warm_key: tuple[int, int], n_targets: int) -> torch.Tensor | None:
        """After a cut warm-up: the first micro-batch's loss from its graph (None: none is
        captured that holds it; it runs eagerly). Its pad tokens were counted for `warm_key`."""
        key = self.key_of(batch)
        bucket = self.buckets.get(key)
        if self.off or bucket is None or not self._ready(bucket):
            return None
        bucket.load(pad_packed_batch(batch, key[0], self.pad_id, bucket.targets), n_targets)
        self.stats["pad_tokens"] += key[0] - warm_key[0]
        return self._replay(key, bucket)

    def _capture_planned(self, keys: list[tuple[int, int]]) -> None:
        """The planned keys (largest first): captured now, or left pending where deferred (their
        shapes met now by _preload)."""
        keys = keys[:self.max_graphs]
        later = deferrable(keys) if self.defer else set()
        for planned in keys:
            if planned in later and planned not in self.buckets:
                self.pending.append(planned)
            elif self.off or (planned not in self.buckets and not self._capture_key(planned, None)):
                break
        # the sizes most micro-batches take first (all are below their segment count's largest,
        # captured already, whose pool blocks they reuse)
        self.pending.sort(key=lambda k: -self.uses[k])
        if self.pending and not self.off:
            self._preload(self.pending)

    def _plan(self, batch: MicroBatch) -> list[tuple[int, int]]:
        """Capture the largest graph the plan needs (its capacity: the most targets of any
        micro-batch) and time its capture, the host pass every graph costs. A fresh run leaves the
        sizes for the next call (_finish_plan), the first replay of that graph timing the GPU;
        until then every micro-batch of its segment count takes it. A resumed run takes the sizes
        it planned before (PlanInputs.saved: the same padding, the same matmul shapes)."""
        inputs = self.plan_inputs()
        micro = inputs.micro or [(batch.input_ids.shape[1], len(batch.layout.cu_seqlens) + 1)]
        top_t, top_segments = max(micro)
        top = (bucket_tokens(top_t, self.grain), top_segments)
        most = max(inputs.targets, default=top[0])
        self.capacity[top] = min(max(most, batch.target_ids.numel()), top[0])
        t0 = time.perf_counter()
        captured = self._capture_key(top, None) and self._ready(self.buckets[top])
        capture_s = time.perf_counter() - t0  # the host pass and the instantiation
        saved = inputs.saved
        if saved is None:
            self.plan_due = {"call": self.calls, "top": top, "capture_s": capture_s, "micro": micro, "events": None}
            self.sizes = {top_segments: [top[0]]}
            self.stats["plan"] = "on the first replay"
            return [top] if captured else []
        self.gather(None)  # the collective a fresh run's _finish_plan makes
        if not captured:
            return []
        self._set_sizes(saved)
        self.stats["sizes"], self.stats["capture_tokens"] = dict(saved), "saved"
        return ([(size, seg) for seg, sizes in saved.items() for size in sizes]
                or grid_keys(inputs.upcoming, self.bucket))

    def _finish_plan(self) -> None:
        """At every process's second call: the GPU seconds a token of the largest graph's first
        replay (waited for; where it was the first call's, the second's runs through the plan's
        host work), agreed across processes, plan the sizes; the ones not deferred are captured
        now. A process whose timed micro-batch took another graph (or none) brings no timing."""
        due, self.plan_due = self.plan_due, None
        timing = None
        if due["events"] is not None:
            start, end = due["events"]
            end.synchronize()
            timing = (due["capture_s"], start.elapsed_time(end) / 1000 / due["top"][0])
        agreed = self.gather(timing)
        if self.off:
            return
        t0 = time.perf_counter()
        keys = self._sizes_from([t for t in agreed if t is not None], due["micro"])
        self._capture_planned(sorted(set(keys), reverse=True))  # `top` among them: captured already
        self.stats["capture_s"] = round(self.stats["capture_s"] + time.perf_counter() - t0, 3)

    def _sizes_from(self, timings: list[tuple[float, float]], micro: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The planned sizes (self.sizes, on_sizes, stats) from the processes' (capture seconds,
        GPU seconds a token), averaged so that every process plans alike, and the plan's
        micro-batches; their keys."""
        if not timings:  # no micro-batch of the plan's shape at hand: the grid
            self.sizes = {}
            self.on_sizes(self.sizes)
            return grid_keys(self.plan_inputs().upcoming, self.bucket)
        capture_s, s_per_token = (sum(t[i] for t in timings) / len(timings) for i in (0, 1))
        if self.defer is None:
            self.defer = defers_captures(capture_s, s_per_token * sum(t for t, _ in micro) / len(micro))
        capture_tokens = capture_cost_tokens(capture_s * (DEFERRED_CAPTURE_SHARE if self.defer else 1.0), s_per_token)
        self.stats["capture_tokens"] = round(capture_tokens)
        self.stats["plan_us_per_token"] = round(s_per_token * 1e6, 4)
        groups: dict[int, list[int]] = {}
        for t, segments in micro:
            groups.setdefault(segments, []).append(t)
        self._set_sizes({seg: plan_sizes(ts, capture_tokens, self.grain) for seg, ts in groups.items()})
        self.stats["sizes"] = {seg: sizes for seg, sizes in self.sizes.items()}
        return [(size, seg) for seg, sizes in self.sizes.items() for size in sizes]

    def _set_sizes(self, sizes: dict[int, list[int]]) -> None:
        """The planned sizes, told to on_sizes, and each one's target capacity from this process's
        own micro-batches (stats target_capacity; a graph already captured keeps its own)."""
        self.sizes = sizes
        self.on_sizes(sizes)
        inputs = self.plan_inputs()
        self.uses = size_uses(sizes, inputs.micro)
        if inputs.own and len(inputs.own) == len(inputs.targets):
            self.capacity = target_capacities(self.sizes, inputs.own, inputs.targets)
            self.stats["target_capacity"] = {f"{t}x{seg}": c for (t, seg), c in sorted(self.capacity.items())}

    def _preload(self, keys: list[tuple[int, int]]) -> None:
        """Each deferred size met once now, while the GPU idles: a capture of the model cut to its
        first PRELOAD_LAYERS layers (embedding, final norm, head and loss kept), dropped unrun,
        into the bucket the size's real capture takes later. A capture that meets a new kernel
        shape behind queued replays waits for them, which would leave the GPU idle for the rest of
        its host pass. Skipped with activation offload (it plans per layer index). stats:
        preloaded (sizes), preload_s."""
        model = self.model
        if len(model.model.layers) < 2 or getattr(model, "activation_offload", None) is not None:
            return
        t0, key = time.perf_counter(), keys[0]
        with self._cut():
            try:
                for key in keys:
                    bucket = self._new_bucket(key)
                    # never instantiated (where torch can keep a graph uninstantiated): nothing of it runs
                    self._record(torch.cuda.CUDAGraph(keep_graph=True) if keeps_graphs() else torch.cuda.CUDAGraph(),
                                 bucket)
                    self.preloaded[key] = bucket
            except Exception as e:  # noqa: BLE001 - as a failed capture: eager from here
                self._capture_failed(f"a preload capture (the first {len(model.model.layers)} layers) of a "
                                     f"{key[0]}-token bucket failed: {first_line(e)}")
        self.stats["preloaded"] = len(self.preloaded)
        self.stats["preload_s"] = round(time.perf_counter() - t0, 3)

    @contextmanager
    def _cut(self):
        """The model cut to its first PRELOAD_LAYERS decoder layers (embedding, final norm, head
        and loss kept) while inside; its layers put back after."""
        layers = self.model.model.layers
        self.model.model.layers = torch.nn.ModuleList(layers[:PRELOAD_LAYERS])
        try:
            yield
        finally:
            self.model.model.layers = layers

    def _instantiator(self):
        if self.instantiator is None:
            self.instantiator = ThreadPoolExecutor(1, thread_name_prefix="hivetune-graphs",
                                                   initializer=torch.cuda.set_device,
                                                   initargs=(cuda_index(self.device),))
        return self.instantiator

    def _ready(self, bucket: Bucket) -> bool:
        """Whether the bucket's graph can replay: waits for its background instantiation; a
        failed one turns graphs off, as a failed capture does."""
        if bucket.ready is None:
            return not self.off
        ready, bucket.ready = bucket.ready, None
        t0 = time.perf_counter()
        try:
            ready.result()
        except Exception as e:  # noqa: BLE001 - as in _capture_key: run eagerly from now on
            self._turn_off(f"instantiating a {bucket.tokens}-token graph failed: {first_line(e)}")
            return False
        finally:
            self.stats["instantiate_wait_s"] = round(self.stats["instantiate_wait_s"] + time.perf_counter() - t0, 3)
        return True

    def _capture_key(self, key, bucket: Bucket | None) -> bool:
        t0 = time.perf_counter()
        bucket = bucket or self._new_bucket(key)
        # Background: capture_end leaves the graph uninstantiated, and the worker thread
        # instantiates it (the driver's part, GIL released) while this thread captures the next
        # one or replays others. "thread_local": the capture forbids unsafe CUDA calls in this
        # thread only, so the worker's instantiation is not one of them.
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.background else torch.cuda.CUDAGraph()
        try:
            bucket.loss = self._record(graph, bucket, timed=True)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly from now on
            self._capture_failed(f"capture of a {key[0]}-token bucket failed: {first_line(e)}")
            return False
        bucket.graph = graph
        if self.background:
            bucket.ready = self._instantiator().submit(graph.instantiate)
        self.buckets[key] = bucket
        self.stats["graphs"] += 1
        self.stats["capture_each_s"].append(round(time.perf_counter() - t0, 3))
        return True

    def _new_bucket(self, key: tuple[int, int]) -> Bucket:
        """The static inputs of the graph of `key` (tokens, cu_seqlens entries): one example a
        segment but the pad one, the micro-batches' dropout seeds, the key's target capacity."""
        return Bucket(key[0], key[1] - 1, key[1] - 2, self.device, self.n_seeds, self.capacity.get(key))

    def _record(self, graph: torch.cuda.CUDAGraph, bucket: Bucket, timed: bool = False) -> torch.Tensor:
        """The bucket's forward, loss and backward captured into `graph` on the capture stream;
        returns the captured loss. timed: stats idle_before_begin and begin_each_s.

        Not torch.cuda.graph: it synchronises the device first, which would idle the GPU for the
        whole host pass instead of letting it work through the queued replays (capture executes
        nothing, and replays run in stream order after them). capture_begin does run one thing,
        on the capture stream: it zeroes the CUDA generator's graph offset, which a replay
        drawing from the generator reads (not fit's: their seeds are static inputs). Ordered
        after the queued replays, and later work after it (GPU-side waits: the host goes on)."""
        with self._on_capture_stream() as main:
            if timed:
                queued = torch.cuda.Event()
                queued.record(main)
                self.stats["idle_before_begin"].append(queued.query())
            begin = time.perf_counter()
            graph.capture_begin(self.pool, capture_error_mode="thread_local" if self.background else "global")
            if timed:
                self.stats["begin_each_s"].append(round(time.perf_counter() - begin, 4))
            try:
                loss = self._body(bucket)
            finally:
                graph.capture_end()
        return loss

    @contextmanager
    def _on_capture_stream(self):
        """Inside: the capture stream current, after the main stream's queued work (a GPU-side
        wait); yields the main stream, which waits for the capture stream's work after."""
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            yield main
        main.wait_stream(self.stream)

    def _capture_failed(self, reason: str) -> None:
        """After a capture that raised: the device settled, the generator released, eager from here."""
        torch.cuda.synchronize()
        release_generator(self.device)
        self._turn_off(reason)
