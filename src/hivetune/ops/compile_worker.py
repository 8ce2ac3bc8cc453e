"""A compile worker of ops.compile_ahead: `python -m hivetune.ops.compile_worker BACKEND ARCH
WARP_SIZE` reads one job a line on stdin (JSON: a Triton kernel's module and name, the
specialization Triton serialises for its hooks, the cache hash the parent expects), compiles it
for that target into Triton's on-disk cache with the launcher it needs, and answers one JSON
line on stdout. It imports neither torch nor a CUDA context: the kernels live in ops.kernels,
free of torch, so a worker is ready in about a second."""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
import types


def json_tuples(value):
    """JSON lists back to the tuples Triton serialised (signatures of tuple arguments, options)."""
    return tuple(json_tuples(v) for v in value) if isinstance(value, list) else value


def _constant(value, tl):
    """A constexpr as Triton's specialization data writes it: a dtype's name, {"constexpr": v}, or v."""
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(value["constexpr"])
    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    return value


LAUNCHERS = {"cuda": ("triton.backends.nvidia.driver", "CudaLauncher"),
             "hip": ("triton.backends.amd.driver", "HIPLauncher")}


def launcher_class(target):
    """The class of Triton's kernel launchers on `target`'s backend, taken from its driver module:
    the driver itself would first build its own utilities with the C compiler (3.5-5 s on the
    device's hosts), which a launcher does not need."""
    module, name = LAUNCHERS[target.backend]
    return getattr(importlib.import_module(module), name)


# What a launcher reads of a compiled kernel's metadata besides its tensor descriptors: the
# launcher's C source depends on the signature, the constants and those descriptors alone.
LAUNCH_METADATA = {"tensordesc_meta": None, "num_ctas": 1, "global_scratch_size": 0, "global_scratch_align": 1,
                   "profile_scratch_size": 0, "profile_scratch_align": 1, "launch_cooperative_grid": False,
                   "launch_pdl": False}


def build_launcher(target, src, metadata) -> None:
    """The launcher Triton builds with the C compiler at a kernel's first launch, into Triton's
    on-disk cache (the parent's launch then loads it); nothing where that fails (the parent's
    first launch builds it)."""
    try:
        launcher_class(target)(src, metadata)
    except Exception:  # noqa: BLE001
        pass


def compile_job(job: dict, target) -> dict:
    """Compile one job for `target`; {"hash": the compiled kernel's cache hash, "seconds": ...}.
    The launcher's C build (~0.4 s) runs in a thread beside the kernel's compile: it needs the
    signature and the constants only, unless the kernel has tensor descriptors (built after)."""
    import triton
    import triton.language as tl
    from triton.compiler.compiler import ASTSource

    t0 = time.perf_counter()
    fn = getattr(importlib.import_module(job["module"]), job["name"])
    spec = json.loads(job["spec"])
    constants = {tuple(k): _constant(v, tl) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: json_tuples(v) for k, v in spec["signature"].items()}
    options = {k: json_tuples(v) for k, v in spec["options"].items()}
    src = ASTSource(fn, signature, constants, attrs)
    beside = threading.Thread(target=build_launcher, args=(target, src, types.SimpleNamespace(**LAUNCH_METADATA)))
    beside.start()
    kernel = triton.compile(src, target=target, options=options)
    t1 = time.perf_counter()
    beside.join()
    if kernel.hash != job["hash"]:
        return {"error": f"{job['name']}: compiled under hash {kernel.hash[:12]}, the parent looks for {job['hash'][:12]}"}
    if getattr(kernel.metadata, "tensordesc_meta", None):  # another launcher source: built with them
        build_launcher(target, kernel.src, kernel.metadata)
    return {"hash": kernel.hash, "seconds": round(t1 - t0, 3), "launcher_s": round(time.perf_counter() - t1, 3)}


def main() -> int:
    t0 = time.perf_counter()
    times = {"started": time.time()}
    from triton.backends.compiler import GPUTarget

    backend, arch, warp_size = sys.argv[1:4]
    target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, int(warp_size))
    try:  # what every job needs, before the first arrives
        from triton.runtime.cache import triton_key

        times["import_s"] = time.perf_counter() - t0
        triton_key()  # hashes Triton's installation once
        times["key_s"] = time.perf_counter() - t0
        launcher_class(target)
    except Exception:  # noqa: BLE001 - each job then reports what fails
        pass
    times["ready_s"] = time.perf_counter() - t0
    sys.stdout.write(json.dumps({k: round(v, 3) for k, v in times.items()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            reply = compile_job(json.loads(line), target)
        except Exception as e:  # noqa: BLE001 - the parent's own launch then compiles it
            reply = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
