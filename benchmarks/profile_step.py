"""Profile a few optimizer steps of a workload on the GPU: top ops by CUDA and CPU time.

    python benchmarks/profile_step.py W1 [--steps 20] [--set packing=false] [--set cuda_graphs=false]
    python benchmarks/profile_step.py W1 --steps 203 --no-profile               # time only
    python benchmarks/profile_step.py W1 --steps 203 --cprofile                  # host time by function
    python benchmarks/profile_step.py W2 --narrow --no-profile --set cuda_graphs=false  # host dispatch alone
    python benchmarks/profile_step.py W1 --first --steps 3   # cProfile over a fresh process's first steps
    python benchmarks/profile_step.py W2 --memory --steps 2  # what is alive at the peak, by allocating line
    python benchmarks/profile_step.py W2 --narrow --ops --steps 4 --set cuda_graphs=false  # aten ops by calling line

--narrow keeps the workload's layers, heads, LoRA and data but shrinks the widths (head_dim 16,
intermediate 512, vocab 8192): the GPU work becomes negligible, so an eager step's wall time is
the host's dispatch time for the same kernels and Python.

With CUDA graphs each fit call captures its buckets again: the timing line gives ms/step with
and without that capture time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hivetune.workflows.workloads import WORKLOADS, random_model  # noqa: E402
from hivetune.core.config import load_config, parse_overrides  # noqa: E402
from hivetune.core.device import cap_memory  # noqa: E402
from hivetune.ops import prewarm  # noqa: E402
from hivetune.train.loop import fit  # noqa: E402
from hivetune.train.setup import assemble  # noqa: E402


def capture_seconds() -> float:
    from hivetune.train import replay as graphs
    return graphs.last_stats.get("capture_s", 0.0) if graphs.last_stats else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", default="W1", nargs="?")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--compile", action="store_true", help="experiment: torch.compile each decoder layer")
    parser.add_argument("--no-profile", action="store_true", help="only time the steps")
    parser.add_argument("--sync-debug", action="store_true", help="print where the steps synchronise with the host")
    parser.add_argument("--cprofile", action="store_true", help="where the host's time goes: cProfile over the steps")
    parser.add_argument("--narrow", action="store_true", help="tiny widths: wall time = host dispatch time")
    parser.add_argument("--first", action="store_true",
                        help="cProfile over the first --steps steps, lazy inits and graph capture included")
    parser.add_argument("--memory", action="store_true",
                        help="the allocations alive at the steps' peak, grouped by the hivetune line that made them")
    parser.add_argument("--ops", action="store_true",
                        help="count the aten ops a step dispatches, by op and the hivetune line that called it")
    parser.add_argument("--cap", type=float, default=0.0, help="cap the allocator at this many GiB, as bench's "
                        "--memory-cap does")
    parser.add_argument("--gaps", default="", help="with the profiler: write the GPU's idle gaps between kernels "
                        "(and what ran around the longest) as JSON to this file")
    opts = parser.parse_args()
    w = WORKLOADS[opts.workload]
    device = torch.device("cuda")
    values = {"model": "random", "data": "generator", "precision": "bf16", "device": "cuda",
              "max_steps": opts.steps, "batch_size": w.micro_batch or w.examples_per_step,
              "grad_accum": w.examples_per_step // (w.micro_batch or w.examples_per_step), "lora": w.lora, "eval_prompts": 0,
              "max_length": 4096, "log_every": 1000, "save_every_minutes": 0}
    values.update(parse_overrides(opts.overrides))
    cfg = load_config(None, values)
    args = w.args
    if opts.narrow:
        heads = args.num_attention_heads
        args = dataclasses.replace(args, hidden_size=16 * heads, head_dim=16, intermediate_size=512, vocab_size=8192)
    if opts.first:  # as train's setup and the benchmark do: Triton's first-launch work overlaps the build
        prewarm.prewarm(device)
    examples = dataclasses.replace(w, args=args).data()  # the workload's own lengths (W4's long tail)
    model = random_model(args, device, torch.bfloat16)
    if opts.cap:  # after the build, as bench does (W2's random init runs in fp32)
        cap_memory(device, opts.cap)
    run = assemble(cfg, model, examples, None, device, "bf16", Path(f"/tmp/prof-{time.time()}"), Path("random"))
    if opts.compile:
        torch._dynamo.config.cache_size_limit = 64
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    if opts.first:
        prewarm.join_prewarm()
        run.steps = run.steps[:opts.steps]
        print_host_profile(run)
        return
    t_warm = time.perf_counter()
    warm = run.steps[:3]
    run.steps, rest = warm, run.steps[3:]
    fit(run, progress=False)
    torch.cuda.synchronize()
    print(f"warm-up (3 steps{', compile' if opts.compile else ''}): {time.perf_counter() - t_warm:.1f} s")
    run.steps = rest
    if opts.sync_debug:
        print_syncs(run)
        return
    if opts.cprofile:
        print_host_profile(run)
        return
    if opts.memory:
        print_memory_peak(run)
        return
    if opts.ops:
        print_op_census(run)
        return
    if opts.no_profile:
        t0 = time.perf_counter()
        fit(run, progress=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        from hivetune.train import replay as graphs
        cap = capture_seconds()
        print(f"{len(rest)} steps in {seconds:.3f} s ({1000 * seconds / len(rest):.1f} ms/step; "
              f"{1000 * (seconds - cap) / len(rest):.1f} ms/step without {cap:.2f} s of graph capture), "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved; graphs: {graphs.last_stats or 'off'}")
        return
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fit(run, progress=False)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"{len(rest)} steps in {seconds:.3f} s under the profiler ({1000 * seconds / len(rest):.1f} ms/step)")
    table = prof.key_averages()
    print(table.table(sort_by="cuda_time_total", row_limit=25))
    print(table.table(sort_by="self_cpu_time_total", row_limit=15))
    print_kernels(prof, len(rest))
    if opts.gaps:
        write_gaps(prof, len(rest), seconds, opts.gaps)


def print_host_profile(run) -> None:
    """cProfile over fit: the host's time by function (cumulative, then own time). With CUDA
    graphs each fit call captures again: ``_capture`` shows apart in the listing."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fit(run, progress=False)
    torch.cuda.synchronize()
    prof.disable()
    print(f"{len(run.steps)} steps in {time.perf_counter() - t0:.2f} s under cProfile")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(30)


def print_memory_peak(run) -> None:
    """Replays the allocator's trace of the steps: at the peak of allocated bytes, what is alive,
    grouped by the innermost hivetune frame (file:line function) that allocated it. Blocks alive
    before the steps (weights, LoRA, optimizer state) are one row."""
    from collections import defaultdict

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    fit(run, progress=False)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]

    def where(e):
        frames = [f for f in e.get("frames", []) if "hivetune" in f["filename"] or "benchmarks/" in f["filename"]]
        if not frames:
            return "(no hivetune frame)"
        f = frames[0]
        return f"{Path(f['filename']).name}:{f['line']} {f['name']}"

    groups, counts = defaultdict(int), defaultdict(int)
    for e in at_peak.values():
        groups[where(e)] += e["size"]
        counts[where(e)] += 1
    gib = 2 ** 30
    print(f"allocated before the steps: {before / gib:.3f} GiB; the steps' peak: {(before + peak) / gib:.3f} GiB "
          f"(torch says {torch.cuda.max_memory_allocated() / gib:.3f}); alive at the peak, by allocating line:")
    for name in sorted(groups, key=groups.get, reverse=True)[:40]:
        print(f"{groups[name] / gib:8.3f} GiB {counts[name]:6d} blocks  {name}")


def print_op_census(run) -> None:
    """The aten ops the steps dispatch (autograd's backward included), counted per step by op and
    by the innermost hivetune frame that made them: where copies, casts and reductions come from."""
    import traceback
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    by_op, by_site = Counter(), Counter()
    cheap = {"aten.view.default", "aten.t.default", "aten.as_strided.default", "aten.split.Tensor",
             "aten.slice.Tensor", "aten.detach.default", "aten._unsafe_view.default", "aten.reshape.default",
             "aten.select.int", "aten.unsqueeze.default", "aten.transpose.int", "aten.expand.default",
             "aten.permute.default", "aten.alias.default", "aten.empty.memory_format", "aten.empty_strided.default",
             "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty_like.default"}

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            by_op[name] += 1
            if name not in cheap:
                frames = [f for f in traceback.extract_stack()[:-1] if "/hivetune/" in f.filename]
                site = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else "(torch)"
                by_site[f"{name:40s} {site}"] += 1
            return func(*args, **(kwargs or {}))

    with Census():
        fit(run, progress=False)
    torch.cuda.synchronize()
    n = len(run.steps)
    print(f"aten ops per step ({n} steps; each fit also saves the adapter once): {sum(by_op.values()) / n:.0f}")
    for name, k in by_op.most_common(40):
        print(f"{k / n:9.1f}  {name}")
    print("by calling line (views and allocations left out):")
    for name, k in by_site.most_common(60):
        print(f"{k / n:9.1f}  {name}")


def print_syncs(run) -> None:
    """Each distinct Python stack that made a synchronising CUDA call during the steps."""
    import traceback
    import warnings
    from collections import Counter

    seen = Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-2] if "hivetune" in f.filename]
            seen[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))] += 1

    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode(1)
    fit(run, progress=False)
    torch.cuda.set_sync_debug_mode(0)
    print(f"synchronising calls in {len(run.steps)} steps: {sum(seen.values())}")
    for where, n in seen.most_common(15):
        print(f"{n:6d}  {where}")


def write_gaps(prof, steps: int, seconds: float, path: str) -> None:
    """The GPU timeline of the profiled steps: busy time (kernels and copies, overlaps merged)
    against the wall, the idle gaps by size, and the 30 longest with the kernels before and
    after them: where a graphed loop waits on the host."""
    import json

    from torch.autograd import DeviceType

    events = sorted((e.time_range.start, e.time_range.end, e.name[:80]) for e in prof.events()
                    if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, gaps, end, last = 0.0, [], None, ""
    for start, stop, name in events:
        if end is not None and start > end:
            gaps.append((start - end, last, name))
        if end is None or start > end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        if end is None or stop > end:
            end, last = stop, name
    span = (events[-1][1] - events[0][0]) if events else 0
    sizes = {"<2us": 0, "2-10us": 0, "10-100us": 0, "100us-1ms": 0, ">1ms": 0}
    totals = dict.fromkeys(sizes, 0.0)
    for g, _, _ in gaps:
        key = "<2us" if g < 2 else "2-10us" if g < 10 else "10-100us" if g < 100 else "100us-1ms" if g < 1000 else ">1ms"
        sizes[key] += 1
        totals[key] += g
    record = {"steps": steps, "wall_s": seconds, "gpu_span_us": span, "gpu_busy_us": busy,
              "idle_us_per_step": (span - busy) / steps, "gaps_by_size": sizes,
              "gap_us_by_size": {k: round(v, 1) for k, v in totals.items()},
              "longest": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:30]]}
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
    print(f"GPU busy {busy / 1000:.1f} of {span / 1000:.1f} ms over {steps} steps "
          f"({(span - busy) / steps / 1000:.2f} ms idle a step); gaps by size: {sizes}; us: {record['gap_us_by_size']}")


def print_kernels(prof, steps: int) -> None:
    """GPU kernels grouped by name: launches and GPU microseconds per optimizer step. With graphs
    off this is the kernel mix a graph replays; the count says how launch-bound a step is."""
    from collections import defaultdict

    from torch.autograd import DeviceType

    count, micros = defaultdict(int), defaultdict(float)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            name = e.name[:90]
            count[name] += 1
            micros[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total_n, total_us = sum(count.values()) / steps, sum(micros.values()) / steps
    print(f"GPU kernels per step: {total_n:.0f}, GPU time per step {total_us / 1000:.2f} ms "
          f"(mean {total_us / max(total_n, 1):.1f} us per kernel)")
    for name in sorted(micros, key=micros.get, reverse=True)[:40]:
        print(f"{count[name] / steps:8.1f}/step {micros[name] / steps:9.1f} us/step  {name}")


if __name__ == "__main__":
    main()
