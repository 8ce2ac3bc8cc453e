"""The first training pass's Triton kernels compiled in parallel, before that pass runs.

Triton compiles a kernel at its first launch, in the launching thread: a fresh machine's first
step meets its ~15 kernels one after the other (~0.5 s each with the launcher's C build; W1 on an
H200: 7 s of a 15.7 s run, docs/log.md). ``first_pass`` runs the process's first micro-batch
forward and backward twice where that helps:
1. a discovery pass, with Triton's jit_cache_hook set: a kernel missing from Triton's on-disk
   cache is sent to the compile workers (ops.compile_worker: processes that import Triton and
   ops.kernels, not torch, ready in about a second) and its launch skipped; a cached one runs as
   usual. The pass computes garbage where launches were skipped, but every later kernel still
   meets its real shapes and dtypes;
2. once the workers are done, the gradients, the given tensors and the RNG states are put back
   as they were, and the pass runs again: every launch now loads from the cache.
A pass that skipped nothing was the real one, and is not repeated (a warm cache costs nothing).
The workers start with train's prewarm, while the data and the model load, where Triton's cache
lacks this hivetune's marker (a fresh machine, a new version); else at the first missing
kernel. A finished first pass also leaves one marker per model and configuration (train.twin's
kernel_key): a cache warm from another model's run still lets the twin find this one's kernels
before the weights load. Off under torchrun (ranks sharing one cache would disagree on which
pass is real) and with ``compile_workers: 0``. Anything unexpected (a Triton without these hooks, a worker that
fails) leaves the kernel to Triton's own compile at its launch.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, wait
from contextlib import contextmanager
from pathlib import Path

import torch

import hivetune
from hivetune.ops.compile_worker import json_tuples

_AHEAD: "CompileAhead | None" = None
STATS: dict | None = None  # the last first_pass's figures (bench records them)
EARLY: dict | None = None  # discover_early's: the kernels a twin of the model met before the weights loaded
WAIT_S = 180  # the longest first_pass waits for the workers; what is not compiled by then compiles at its launch


def default_workers() -> int:
    """Compile workers where the config says auto: the host's cores less two, 2 to 12."""
    return max(2, min(12, (os.cpu_count() or 4) - 2))


def cache_entry(jit, backend, signature: dict, constants: dict, attrs: dict, spec: str) -> tuple[str, bool]:
    """The hash under which triton.compile caches this specialization of `jit` (the one a worker's
    compile of Triton's serialised `spec` checks), and whether Triton's on-disk cache holds it."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import ASTSource
    from triton.runtime.cache import get_cache_key, get_cache_manager

    options = backend.parse_options({k: json_tuples(v) for k, v in json.loads(spec)["options"].items()})
    src = ASTSource(jit, signature, constants, attrs)
    digest = hashlib.sha256(get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
                            .encode("utf-8")).hexdigest()
    return digest, get_cache_manager(digest).get_group(f"{src.name[:150]}.json") is not None


class Workers:
    """`n` compile worker processes, each fed by a thread: submit(job) -> Future of its reply."""

    def __init__(self, n: int, target: tuple):
        env = dict(os.environ)
        root = str(Path(hivetune.__file__).resolve().parents[1])  # this hivetune, wherever it was imported from
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.started, self.started_wall = time.perf_counter(), time.time()
        self.jobs: queue.Queue = queue.Queue()
        command = [sys.executable, "-m", "hivetune.ops.compile_worker", *map(str, target)]
        self.procs = [subprocess.Popen(command, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL) for _ in range(n)]
        self.ready_at: list[dict] = []  # each ready worker: its start-up times, and when its line was read
        self.threads = [threading.Thread(target=self._feed, args=(p,), daemon=True, name="hivetune-compile")
                        for p in self.procs]
        for t in self.threads:
            t.start()

    def _feed(self, proc: subprocess.Popen) -> None:
        try:
            ready = json.loads(proc.stdout.readline())  # its imports done: {"started": time.time(), ...}
            ready["started"] = round(ready["started"] - self.started_wall, 3)  # from the spawn
            ready["read_at"] = round(time.perf_counter() - self.started, 3)
            self.ready_at.append(ready)
        except (OSError, ValueError, KeyError):
            pass
        while True:
            item = self.jobs.get()
            if item is None:  # close(): the worker ends at the end of its input
                try:
                    proc.stdin.close()
                    proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                return
            job, future = item
            try:
                proc.stdin.write(json.dumps(job) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                reply = json.loads(line) if line else {"error": f"worker exited ({proc.poll()})"}
                reply["name"] = job["name"]
                reply["done_at"] = round(time.perf_counter() - self.started, 3)  # from the workers' spawn
                future.set_result(reply)
            except Exception as e:  # noqa: BLE001 - a dead worker: the parent compiles this one itself
                future.set_result({"error": f"{type(e).__name__}: {e}"})

    def submit(self, job: dict) -> Future:
        future: Future = Future()
        self.jobs.put((job, future))
        return future

    def close(self) -> None:
        """Each feeding thread ends its worker once the jobs before it are answered."""
        for _ in self.threads:
            self.jobs.put(None)


class CompileAhead:
    """The process's compile workers and its discovery hook (see the module's doc)."""

    def __init__(self, workers: int, start_now: bool, marker: Path | None, target: tuple = ()):
        self.n, self.marker, self.target = workers, marker, target  # target: (backend, arch, warp size)
        self.markers = [marker] if marker is not None else []  # left by finish(): this hivetune's, one model's
        self.workers = Workers(workers, target) if start_now else None
        self.started_early = start_now
        self.pending: dict[str, Future] = {}  # by Triton's cache hash
        self.sent: set = set()
        self.skipped = 0
        self.done = False

    def hook(self, **kwargs) -> bool:
        """Triton's jit_cache_hook: True skips the launch of a kernel sent to the workers."""
        try:
            fn, compile = kwargs["fn"], kwargs["compile"]
            seen = (fn.module, fn.name, repr(kwargs["key"]))  # Triton's in-memory key of this specialization
            if seen in self.sent:  # launched again in this pass: sent already
                self.skipped += 1
                return True
            jit = fn.jit_function
            _, _, target, backend, _ = jit.device_caches[compile["device"]]
            digest, cached = cache_entry(jit, backend, compile["signature"], compile["constants"],
                                         compile["configs"][0], compile["specialization_data"])
            if cached:
                return False  # Triton loads it as usual
            if digest not in self.pending:
                if (target.backend, target.arch, target.warp_size) != self.target:
                    return False  # another device's kernel: compiled where it launches
                if self.workers is None:
                    self.workers = Workers(self.n, self.target)
                self.pending[digest] = self.workers.submit({
                    "module": fn.module, "name": fn.name, "spec": compile["specialization_data"], "hash": digest})
            self.sent.add(seen)
        except Exception:  # noqa: BLE001 - anything unexpected: Triton compiles it at the launch
            return False
        self.skipped += 1
        return True

    @contextmanager
    def discovering(self):
        from triton import knobs

        before = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self.hook
        try:
            yield
        finally:
            knobs.runtime.jit_cache_hook = before

    def finish(self) -> None:
        self.done = True
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        for marker in self.markers:
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            except OSError:
                pass


def may_start(workers: int) -> bool:
    """Workers asked for (the config's compile_workers: -1 auto, 0 off), and not under torchrun."""
    return workers != 0 and int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1


def warm_marker(cache_dir: Path, triton_version: str, key: str = "") -> Path:
    """The file a finished first pass leaves in Triton's cache: this hivetune's kernels are there
    (with `key`, train.twin's kernel_key: one model and configuration's are, keyed_marker)."""
    marker = cache_dir / f"hivetune-{hivetune.__version__}-triton-{triton_version}.warm"
    return keyed_marker(marker, key) if key else marker


def keyed_marker(marker: Path, key: str) -> Path:
    """The marker of one model and configuration (`key`) beside this hivetune's `marker`."""
    return marker.with_name(f"{marker.stem}-{key}{marker.suffix}")


def triton_cache_dir() -> Path:
    """Triton's on-disk kernel cache as Triton picks it, without importing Triton: TRITON_CACHE_DIR,
    else TRITON_HOME or home, then .triton/cache."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache"))


def cache_looks_cold(key: str = "") -> bool:
    """Whether Triton's cache (triton_cache_dir) lacks the marker (with `key`: that model's, which a
    first pass leaves beside this hivetune's), found without importing Triton. True where Triton's
    version cannot be read: the caller then asks the workers (discovers_early)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton_version = version("triton")
    except PackageNotFoundError:
        return True
    return not warm_marker(triton_cache_dir(), triton_version, key).exists()


def start(device: torch.device, workers: int) -> None:
    """Make this process's first pass compile ahead (prewarm, with Triton imported): workers
    start now where Triton's cache lacks this hivetune's marker. Nothing off CUDA, under
    torchrun or with workers <= 0."""
    global _AHEAD
    if _AHEAD is not None or device.type != "cuda" or workers <= 0 or not may_start(workers):
        return
    try:
        import triton
        from triton import knobs
        from triton.runtime.driver import driver

        if not hasattr(knobs.runtime, "jit_cache_hook"):
            return
        with torch.cuda.device(device):
            t = driver.active.get_current_target()
        target = (t.backend, t.arch, t.warp_size)
        marker = warm_marker(Path(knobs.cache.dir), triton.__version__)
        _AHEAD = CompileAhead(workers, start_now=not marker.exists(), marker=marker, target=target)
    except Exception:  # noqa: BLE001 - a Triton without these parts, no way to start a worker: each
        return  # kernel compiles at its launch


def discovers_early(key: str = "") -> bool:
    """Whether a pass before the weights load would help (train.twin): the first pass has not run,
    and the workers started at prewarm (a cold cache) or `key` names a model whose marker the
    cache lacks (cache_looks_cold(key)): the workers then start at the twin's first missing
    kernel, and the first pass leaves that model's marker too."""
    ahead = _AHEAD
    if ahead is None or ahead.done:
        return False
    if key and ahead.marker is not None:
        marker = keyed_marker(ahead.marker, key)
        if marker not in ahead.markers:
            ahead.markers.append(marker)
        return True
    return ahead.started_early


def discover_early(fn) -> dict:
    """fn() under the discovery hook, its result and any exception dropped: the kernels it meets
    go to the workers, so that the process's first pass finds them compiled, or waits for those
    still compiling. fn works on throwaway tensors (a twin of the model): nothing is put back.
    Returns {"kernels", "seconds"} (also EARLY, which first_pass's STATS carries)."""
    global EARLY
    ahead = _AHEAD
    t0 = time.perf_counter()
    error = None
    with ahead.discovering():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - garbage where launches were skipped: what it met is sent
            error = f"{type(e).__name__}: {str(e).strip()[:200]}"
    ahead.sent.clear()  # the first pass asks again: cached by then, or pending (it waits)
    ahead.skipped = 0
    EARLY = {"kernels": len(ahead.pending), "seconds": round(time.perf_counter() - t0, 3),
             "at_s": round(t0 - ahead.workers.started, 3) if ahead.workers else None}  # from the workers' spawn
    if error:
        EARLY["error"] = error
    return EARLY


def trained(model: torch.nn.Module) -> list:
    """The parameters a backward of `model` gives gradients."""
    return [p for p in model.parameters() if p.requires_grad]


def first_pass(fn, params, keep: tuple = (), counters: tuple = ()):
    """fn(), the process's first forward and backward, with its missing Triton kernels compiled
    in parallel first (the module's doc); later calls run fn() alone. `params()`: the parameters
    whose gradients fn adds to; `keep`: other tensors fn adds to in place; `counters`: dicts fn
    counts in (the activation offload's stats); all are restored between the two passes."""
    global STATS
    ahead = _AHEAD
    if ahead is None or ahead.done:
        return fn()
    t0 = time.perf_counter()
    params = list(params())
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    kept = [t.clone() for t in keep]
    counted = [dict(c) for c in counters]
    rng = torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    error = None
    with ahead.discovering():
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - from garbage where launches were skipped, or real: see below
            out, error = None, e
    if not ahead.skipped:
        ahead.finish()  # every kernel it met was on disk: compiled by the workers since discover_early
        STATS = {"kernels": len(ahead.pending), "workers_started_early": ahead.started_early, "early": EARLY,
                 "pass_s": round(time.perf_counter() - t0, 3), "errors": [], "missed": 0}
        if error is not None:
            raise error
        return out
    del out
    t1 = time.perf_counter()
    wait(list(ahead.pending.values()), timeout=WAIT_S)
    replies = [f.result() if f.done() else {"error": f"not compiled within {WAIT_S} s"} for f in ahead.pending.values()]
    errors = [r["error"] for r in replies if "error" in r]
    for p, g in zip(params, grads):
        if g is None:
            p.grad = None
        else:
            p.grad.copy_(g)
    for t, saved in zip(keep, kept):
        t.copy_(saved)
    for c, saved in zip(counters, counted):
        c.clear()
        c.update(saved)
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state(rng[1])
    workers = ahead.workers
    STATS = {"kernels": len(replies), "early": EARLY, "skipped_launches": ahead.skipped, "discovery_s": round(t1 - t0, 3),
             "compile_wait_s": round(time.perf_counter() - t1, 3), "workers": ahead.n,
             "workers_started_early": ahead.started_early, "errors": errors[:3],
             # when the pass began and the workers were ready, in seconds from the workers' start
             "pass_at_s": round(t0 - workers.started, 3) if workers else None,
             "ready": sorted(workers.ready_at, key=lambda r: r["read_at"])[::5] if workers else None,
             "compile_s": [f"{r.get('name', '?')} {r.get('seconds', 0)}"
                           for r in sorted(replies, key=lambda r: r.get("seconds", 0))[-3:]],
             "launcher_s": sorted(r.get("launcher_s", 0) for r in replies)[-3:],
             "compiled_by_s": max((r.get("done_at", 0) for r in replies), default=None)}
    ahead.finish()
    with counting_compiles() as counts:
        out = fn()
    STATS["missed"] = counts["compiled"]  # kernels the real pass still compiled itself (0 when all went well)
    return out


@contextmanager
def counting_compiles():
    """Yields {"compiled", "from_cache", "compile_s", "names"}: the Triton compiles inside the block
    in this process, those that found the on-disk cache, the seconds of the others' stages and
    their kernels' names."""
    counts = {"compiled": 0, "from_cache": 0, "compile_s": 0.0, "names": []}
    try:
        from triton import knobs
    except ImportError:
        yield counts
        return
    before = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if cache_hit:
            counts["from_cache"] += 1
        else:
            counts["compiled"] += 1
            counts["names"].append(getattr(src, "name", "?"))
            counts["compile_s"] += getattr(times, "total", 0) / 1e6  # Triton's CompileTimes, in microseconds
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener
    try:
        yield counts
    finally:
        knobs.compilation.listener = before
        counts["compile_s"] = round(counts["compile_s"], 3)
