"""ops.compile_worker against a real Triton, no GPU needed (Triton's wheel carries ptxas; the
target is given): a worker compiles a serialised specialization of an ops.kernels kernel into
Triton's cache under the hash the parent computes (ops.compile_ahead.cache_entry), and the
kernels' modules import no torch. Skipped where Triton is not installed (CI's CPU torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")


def test_the_kernel_modules_import_no_torch():
    code = ("import sys, importlib, pkgutil, hivetune.ops.kernels as k\n"
            "names = [m.name for m in pkgutil.iter_modules(k.__path__)]\n"
            "[importlib.import_module('hivetune.ops.kernels.' + n) for n in names]\n"
            "print(len(names), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["9", "False"]


def test_a_worker_compiles_into_the_cache_under_the_parents_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    from hivetune.ops.compile_ahead import Workers, cache_entry
    from hivetune.ops.kernels import norm

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    jit = norm._rms_norm_fwd
    signature = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32", "M": "i32", "H": "i32",
                 "stride_t": "i32", "stride_h": "i32", "N": "i32", "eps": "fp32", "ROWS": "constexpr",
                 "BLOCK": "constexpr"}
    constants, attrs = {(10,): 2, (11,): 1024}, {(i,): [["tt.divisibility", 16]] for i in range(9)}
    spec = serialize_specialization_data("norm", signature, constants, attrs, backend.parse_options({}), "key")
    digest, cached = cache_entry(jit, backend, signature, constants, attrs, spec)
    assert not cached
    workers = Workers(2, (target.backend, target.arch, target.warp_size))
    try:
        job = {"module": jit.module, "name": jit.__qualname__, "spec": spec, "hash": digest}
        reply = workers.submit(job).result(120)
        wrong = workers.submit({**job, "hash": "0" * 64}).result(120)
        missing = workers.submit({**job, "name": "_no_such_kernel"}).result(120)
    finally:
        workers.close()
    assert reply["hash"] == digest and "error" not in reply, reply
    assert reply["name"] == "_rms_norm_fwd" and reply["done_at"] > 0  # the job's kernel, back after the spawn
    assert cache_entry(jit, backend, signature, constants, attrs, spec) == (digest, True)
    assert wrong["error"] == f"_rms_norm_fwd: compiled under hash {digest[:12]}, the parent looks for 000000000000"
    assert missing["error"].startswith("AttributeError: module 'hivetune.ops.kernels.norm' has no attribute")
    assert set(workers.ready_at[0]) == {"started", "import_s", "key_s", "ready_s", "read_at"}


def test_compiles_are_counted_with_their_seconds_and_cache_hits(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from hivetune.ops.compile_ahead import counting_compiles
    from hivetune.ops.kernels import host_embedding

    jit = host_embedding._gather_rows  # (TABLE, IDS, OUT, D, BLOCK: constexpr)
    signature = {"TABLE": "*bf16", "IDS": "*i64", "OUT": "*bf16", "D": "i32", "BLOCK": "constexpr"}
    constants = {(4,): 64}
    with counting_compiles() as counts:
        for _ in range(2):
            triton.compile(ASTSource(jit, signature, constants), target=GPUTarget("cuda", 90, 32))
    assert counts["compiled"] == 1 and counts["from_cache"] == 1 and 0 < counts["compile_s"] < 60
    assert counts["names"] == ["_gather_rows"]
