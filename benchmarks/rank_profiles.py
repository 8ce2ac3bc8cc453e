"""The optional profiles of benchmarks/multi_gpu.py's runs, one context manager each, every rank
writing its own file into the folder given: --kernel-profile (GPU kernels and host CUDA calls over
the fit), --timeline (each step on the GPU clock), --first-profile (the first two steps under
cProfile), --pass-profile (the first forward-backward passes), --capture-profile (each deferred
CUDA-graph capture)."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from hivetune.parallel import distributed
from hivetune.train import replay as graphs
from hivetune.workflows.bench import allocator_counts


def totals_by(pairs) -> dict:
    """{key: (sum of values, count)} of (key, value) pairs."""
    out: dict = {}
    for key, value in pairs:
        total, count = out.get(key, (0.0, 0))
        out[key] = (total + value, count + 1)
    return out


@contextmanager
def kernel_profile(rank: int, folder: str | None):
    """--kernel-profile DIR: each rank's GPU kernels over the whole fit (CUPTI only: no
    operator events, the CUDA runtime and driver calls included), as DIR/kernels-rank<r>.txt: the
    GPU's busy time (the union of kernel intervals) against the wall, NCCL's share, the idle gaps
    by the kernels around them, the host's CUDA calls (by name, the longest, those over 2 ms in
    time order), and every kernel by total time."""
    if not folder:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
    wall = time.perf_counter() - t0
    events = prof.events()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    # The host's CUDA runtime and driver calls (CUPTI records them with the kernels): a call that
    # blocks (a synchronising allocation, a module load, a full launch queue) shows as a long one.
    api = sorted((e.time_range.end - e.time_range.start, e.time_range.start, e.name) for e in events
                 if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu"))
    busy, end, nccl, before, gaps = 0.0, -1.0, 0.0, "", []
    for start, stop, name in spans:
        if "nccl" in name.lower():
            nccl += stop - start
        if end >= 0 and start - end > 200:  # idle over 0.2 ms: (us, offset s, the kernels around it)
            gaps.append((start - end, (start - spans[0][0]) / 1e6, before[:50], name[:50]))
        if stop > end:
            busy += stop - max(start, end)
            end, before = stop, name
    first = spans[0][0] if spans else 0.0
    lines = [f"rank {rank}: wall {wall:.3f} s, kernels from first to last {(end - first) / 1e6:.3f} s, "
             f"GPU busy (union) {busy / 1e6:.3f} s, NCCL kernels {nccl / 1e6:.3f} s, {len(spans)} kernels, "
             f"{len(gaps)} gaps over 0.2 ms: {sum(g[0] for g in gaps) / 1e6:.3f} s"]
    by_pair = totals_by(((a, b), us) for us, _, a, b in gaps)
    lines.append("idle over 0.2 ms by the kernels around it (ms, count, before -> after):")
    pairs = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:25]
    lines += [f"  {t / 1e3:9.1f} {c:5d}  {a} -> {b}" for (a, b), (t, c) in pairs]
    lines.append("the longest gaps (ms, at s, before -> after):")
    lines += [f"  {us / 1e3:9.1f} {at:8.3f}  {a} -> {b}" for us, at, a, b in sorted(gaps, reverse=True)[:25]]
    # Every kernel (not the top rows: single-vs-DDP differences hide in the small ones), by total time
    totals = totals_by((name, stop - start) for start, stop, name in spans)
    api_totals = totals_by((name, us) for us, _, name in api)
    lines.append(f"host CUDA API calls: {len(api)}; by total (ms, calls, longest ms, name)")
    longest = {name: us for us, _, name in api}  # sorted ascending: the last one kept is the longest
    lines += [f"  {t / 1e3:9.1f} {c:7d} {longest[name] / 1e3:9.2f}  {name[:60]}"
              for name, (t, c) in sorted(api_totals.items(), key=lambda kv: -kv[1][0])[:25]]

    def call_row(us: float, at: float, name: str) -> str:
        return f"  {us / 1e3:9.2f} {(at - first) / 1e6:8.3f}  {name[:60]}"

    lines.append("the longest host CUDA API calls (ms, at s, name)")
    lines += [call_row(*call) for call in reversed(api[-40:])]
    lines.append("host CUDA calls over 2 ms but graph launches, in time order (ms, at s, name)")
    lines += [call_row(*call) for call in sorted((c for c in api if c[0] > 2000 and c[2] != "cudaGraphLaunch"),
                                                 key=lambda c: c[1])[:80]]
    lines.append("every kernel: total ms, calls, mean us, name")
    lines += [f"  {t / 1e3:9.2f} {c:7d} {t / c:9.1f}  {name[:110]}"
              for name, (t, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"kernels-rank{rank}.txt").write_text("\n".join(lines))


def median_by_size(step_seconds: dict[int, float], sizes: list[tuple[int, int, int]],
                   skip: int = 2) -> dict[int, tuple[float, int]]:
    """The median GPU milliseconds of the steps (from step `skip`: the first ones warm up,
    capture and plan) whose micro-batches all took one graph size, by that size, with the
    number of such steps. `sizes`: (step, graph size, real tokens) of each graphed micro-batch."""
    per_step: dict[int, set[int]] = {}
    for step, size, _ in sizes:
        per_step.setdefault(step, set()).add(size)
    by_size: dict[int, list[float]] = {}
    for step, seconds in step_seconds.items():
        taken = per_step.get(step, set())
        if step >= skip and len(taken) == 1:
            by_size.setdefault(next(iter(taken)), []).append(seconds * 1e3)
    return {size: (sorted(v)[len(v) // 2], len(v)) for size, v in by_size.items()}


@contextmanager
def step_timeline(rank: int, folder: str | None):
    """--timeline DIR: each rank's steps on the GPU clock, as DIR/timeline-rank<r>.json
    and a summary line: CUDA events at each step's start (train.step.accumulate_step), before and after
    its gradient all-reduce (distributed.allreduce_gradients), with the host's clock at each record.
    Per step: the micro-batches' GPU time (start -> before the all-reduce), the all-reduce's
    (its wait for the other rank included: NCCL's kernel spins until both have arrived), and the
    rest up to the next step's start (clipping, the optimizer, and any wait for the host); the
    host's lead is how far the GPU's start of a step trails the host's queueing of it. The step's
    tail is marked too, apart ("tail" in the file): at clipping's start and end and at the lr
    schedule's step (after the optimizer's), so the first step's host work can be told apart.
    With CUDA graphs, each micro-batch's graph size and real tokens ("sizes": step, size, tokens)
    and the micro-batches' GPU time by size (by_size_ms; median_by_size)."""
    if not folder:
        yield
        return
    import hivetune.train.loop as train_module

    marks: list[tuple[str, int, object, float]] = []  # (what, step index, event, host seconds)
    tail: list[tuple[str, int, object, float]] = []  # clipping and the optimizer, marked alike
    started = 0  # steps begun so far

    def mark(what: str, into: list = marks) -> None:
        nonlocal started
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        started += what == "start"
        into.append((what, started - 1, event, time.perf_counter()))

    clip_fn, schedule_fn = train_module.clip_grad_norm, torch.optim.lr_scheduler.LambdaLR.step

    def timed_clip(*args, **kwargs):
        mark("clip", tail)
        out = clip_fn(*args, **kwargs)
        mark("clipped", tail)
        return out

    def timed_schedule(self, *args, **kwargs):
        if started:  # not LambdaLR's own first step, at its construction
            mark("optimized", tail)
        return schedule_fn(self, *args, **kwargs)

    step_fn, reduce_fn = train_module.accumulate_step, distributed.allreduce_gradients

    def timed_step(*args, **kwargs):
        mark("start")
        return step_fn(*args, **kwargs)

    def timed_reduce(*args, **kwargs):
        mark("reduce")
        reduce_fn(*args, **kwargs)
        mark("reduced")

    sizes: list[tuple[int, int, int]] = []  # (step, graph size, real tokens) of each graphed micro-batch
    call_fn = graphs.GraphedForwardBackward._call

    def sized_call(self, batch, n_targets):
        if not self.off and isinstance(batch.layout, graphs.Packed):
            sizes.append((started - 1, self.key_of(batch)[0], batch.input_ids.shape[1]))
        return call_fn(self, batch, n_targets)

    train_module.accumulate_step, distributed.allreduce_gradients = timed_step, timed_reduce
    train_module.clip_grad_norm, torch.optim.lr_scheduler.LambdaLR.step = timed_clip, timed_schedule
    graphs.GraphedForwardBackward._call = sized_call
    try:
        yield
    finally:
        train_module.accumulate_step, distributed.allreduce_gradients = step_fn, reduce_fn
        train_module.clip_grad_norm, torch.optim.lr_scheduler.LambdaLR.step = clip_fn, schedule_fn
        graphs.GraphedForwardBackward._call = call_fn
    torch.cuda.synchronize()
    first_event, first_host = marks[0][2], marks[0][3]

    def as_rows(of: list) -> list[dict]:
        return [{"what": what, "step": step, "gpu_s": round(first_event.elapsed_time(event) / 1e3, 5),
                 "host_s": round(host - first_host, 5)} for what, step, event, host in of]

    rows = as_rows(marks)
    at = {(r["what"], r["step"]): r["gpu_s"] for r in rows}
    steps = sorted({r["step"] for r in rows})
    per_step = {k: at[("reduce", k)] - at[("start", k)] for k in steps if ("reduce", k) in at}
    compute = list(per_step.values())
    reduce = [at[("reduced", k)] - at[("reduce", k)] for k in steps if ("reduced", k) in at]
    rest = [at[("start", k + 1)] - at[("reduced", k)] for k in steps if ("start", k + 1) in at and ("reduced", k) in at]
    lead = [r["gpu_s"] - r["host_s"] for r in rows if r["what"] == "start"]

    def stats(values: list[float]) -> str:
        v = sorted(values)
        return (f"sum {sum(v):.3f} s, median {v[len(v) // 2] * 1e3:.1f} ms, max {v[-1] * 1e3:.1f} ms"
                if v else "none")

    by_size = median_by_size(per_step, sizes)
    summary = (f"rank {rank}: {len(steps)} steps; micro-batches {stats(compute)}; all-reduce {stats(reduce)}; "
               f"after it to the next step {stats(rest)}; GPU start minus host queueing of a step "
               f"{stats(lead)}")
    if by_size:
        summary += "; micro-batches by graph size (median ms, steps) " + ", ".join(
            f"{size}: {ms:.1f} ({n})" for size, (ms, n) in sorted(by_size.items()))
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"timeline-rank{rank}.json").write_text(json.dumps({
        "summary": summary, "marks": rows, "tail": as_rows(tail), "sizes": sizes,
        "by_size_ms": {str(size): ms for size, (ms, _) in sorted(by_size.items())}}))
    print(summary, file=sys.stderr, flush=True)


def profile_text(stats, rows: int, *orders: str) -> str:
    """A cProfile's pstats.Stats as text: its top `rows` functions in each of `orders` in turn."""
    import io

    text = io.StringIO()
    stats.stream = text
    for order in orders:
        stats.sort_stats(order).print_stats(rows)
    return text.getvalue()


@contextmanager
def first_steps_profile(rank: int, folder: str | None):
    """--first-profile DIR: the loop under cProfile from its start to the third
    step's start (the warm-up, the first captures, the first clipping and optimizer step), as
    DIR/first-steps-rank<r>.txt: its wall time and the functions by own and by cumulative time.
    A first call that loads kernels or waits for the GPU shows as one builtin with a long own time."""
    if not folder:
        yield
        return
    import cProfile
    import pstats

    import hivetune.train.loop as train_module

    step_fn = train_module.accumulate_step
    profiler, calls, t0, wall = cProfile.Profile(), 0, time.perf_counter(), [0.0]

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            profiler.disable()
            wall[0] = time.perf_counter() - t0
        return step_fn(*args, **kwargs)

    train_module.accumulate_step = counted
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        train_module.accumulate_step = step_fn
    text = profile_text(pstats.Stats(profiler), 40, "tottime", "cumulative")
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"first-steps-rank{rank}.txt").write_text(
        f"== the loop's first two steps: {wall[0]:.3f} s (under cProfile)\n{text}")


@contextmanager
def pass_profile(rank: int, folder: str | None, passes: int = 4):
    """--pass-profile DIR: each of the first `passes` forward-backward passes
    (train.step.forward_backward: an eager micro-batch, or a graph capture's host pass) under its own
    cProfile, as DIR/passes-rank<r>.txt: per pass its host time, the GPU still busy at its end or
    not, the caching allocator's cudaMalloc / cudaFree calls during it, and its functions by own
    time; then the functions whose own time in the first pass exceeds the second's most (what a
    fresh process pays once: kernel loads, plans, allocations)."""
    if not folder:
        yield
        return
    import cProfile
    import pstats

    import hivetune.train.step as train_module

    original = train_module.forward_backward
    reports: list[str] = []
    own: list[dict] = []

    def profiled(run, batch, n_targets, loss_fn):
        if len(own) >= passes:
            return original(run, batch, n_targets, loss_fn)
        counts = allocator_counts(run.device)
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        try:
            return original(run, batch, n_targets, loss_fn)
        finally:
            profiler.disable()
            wall = time.perf_counter() - t0
            after = allocator_counts(run.device)
            capturing = run.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            busy = None
            if run.device.type == "cuda" and not capturing:
                done = torch.cuda.Event()
                done.record()
                busy = not done.query()
            stats = pstats.Stats(profiler)
            own.append({f"{path.rsplit('/', 1)[-1]}:{line}({name})": row[2]
                        for (path, line, name), row in stats.stats.items()})
            grown = {k: after[k] - counts[k] for k in after if after[k] != counts[k]}
            reports.append(f"== pass {len(own)}: {wall * 1e3:.1f} ms host (under cProfile), tokens "
                           f"{batch.input_ids.shape[1]}, capturing {capturing}, GPU busy at its end {busy}, "
                           f"allocator {grown}\n{profile_text(stats, 25, 'tottime')}")

    train_module.forward_backward = profiled
    try:
        yield
    finally:
        train_module.forward_backward = original
    if len(own) >= 2:
        first, second = own[0], own[1]
        diff = sorted(((t - second.get(k, 0.0), k) for k, t in first.items()), reverse=True)[:40]
        reports.append("== own time, pass 1 minus pass 2 (ms)\n" + "\n".join(f"{d * 1e3:9.2f}  {k}" for d, k in diff))
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"passes-rank{rank}.txt").write_text("\n".join(reports))


@contextmanager
def capture_profile(rank: int, folder: str | None):
    """--capture-profile DIR: each deferred graph capture (train.replay's
    GraphedForwardBackward._capture_deferred) under cProfile, as DIR/captures-rank<r>.txt: per
    capture its wall time, whether the GPU still had work queued at its start and end, and the
    functions by their own time. A call that waits for the GPU (the queue draining inside a
    capture) shows as one builtin with a long own time; cProfile's overhead stretches the rest."""
    if not folder:
        yield
        return
    import cProfile
    import pstats

    cls = graphs.GraphedForwardBackward
    original = cls._capture_deferred
    reports: list[str] = []

    def profiled(self):
        before = torch.cuda.Event()
        before.record()
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        try:
            return original(self)
        finally:
            profiler.disable()
            wall = time.perf_counter() - t0
            busy_at_end = not before.query()
            reports.append(f"== capture {len(reports) + 1}: {wall:.3f} s, the work queued before it still running "
                           f"at its end: {busy_at_end}\n{profile_text(pstats.Stats(profiler), 25, 'tottime')}")

    cls._capture_deferred = profiled
    try:
        yield
    finally:
        cls._capture_deferred = original
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"captures-rank{rank}.txt").write_text("\n".join(reports) or "no deferred capture\n")
