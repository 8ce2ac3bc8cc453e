"""Matrix products through cuBLASLt with the plan cached: out = alpha a @ b + beta out.

Why: an eager W2 step (Qwen2.5-7B shape, one 16-example micro-batch) makes ~950 matmul calls,
and on the device's hosts each torch.mm / addmm costs 20-70 us of host time (cProfile of an
eager W2 step, docs/log.md), most of it in torch's cuBLAS path:
per call it builds the cuBLASLt descriptors, asks the heuristic for an algorithm and sets up the
handle. That is 20-65 ms of a ~180 ms step whose kernels take ~160 ms, so the step is bound by
the host's dispatch. Here the descriptors, the heuristic's algorithm and a workspace are made
once per shape / layout / dtype / alignment (a "plan") and each call is a dictionary lookup and
one cublasLtMatmul through ctypes. The heuristic is asked once per bucket of shapes (dimensions
above 1,024 rounded up to a multiple of 256, _bucket_algo): W2's token count changes every step.

The library is the libcublasLt that torch itself loaded (found in /proc/self/maps after a first
torch matmul), so there is no second copy and no build step. Layouts: torch's row-major [M, K] @
[K, N] = [M, N] is, in cuBLAS's column-major terms, D^T [N, M] = B^T [N, K] @ A^T [K, M]; a
transposed view (stride(0) == 1) is the other layout with the transpose flag set, so W^T and
g^T cost no copy. Outputs must be row-major; inputs row- or column-major with 16-byte aligned
leading dimensions (everything the LoRA groups pass).

Fallback (the reference path, and the oracle in tests/gpu/test_cuda_blas.py): torch.mm / addmm with
out=, on the CPU, without CUDA or the library, for any layout the plan does not take, and with
HIVETUNE_REFERENCE=cublaslt.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from hivetune.core.fallbacks import forced

_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE, _PREF_ALIGN_A, _PREF_ALIGN_B, _PREF_ALIGN_C, _PREF_ALIGN_D = 1, 5, 6, 7, 8
_OP_N, _OP_T = 0, 1
_DTYPES = {torch.float32: _CUDA_R_32F, torch.float16: _CUDA_R_16F, torch.bfloat16: _CUDA_R_16BF}
WORKSPACE_BYTES = 32 << 20  # per stream; the heuristic only returns algorithms that fit it


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class _Lib:
    """The process's libcublasLt, a handle per device, the argument types of the calls used here."""

    def __init__(self, path: str):
        lib = self.lib = ctypes.CDLL(path)
        vp, u64, i64, sz, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_int
        signatures = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceDestroy": [vp],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, i32
        self.handles: dict[int, ctypes.c_void_p] = {}
        self.matmul = lib.cublasLtMatmul

    def handle(self, index: int) -> ctypes.c_void_p:
        """Device `index`'s handle, made with that device current."""
        handle = self.handles.get(index)
        if handle is None:
            handle = ctypes.c_void_p()
            with torch.cuda.device(index):
                self.check(self.lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            self.handles[index] = handle
        return handle

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed: cuBLAS status {status}")

    def set_attr(self, setter, obj, attr: int, value: int, ctype) -> None:
        v = ctype(value)
        self.check(setter(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), setter.__name__)

    def layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(out), dtype, rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")
        return out


class _Plan:
    """One product's descriptors and algorithm (kept alive for the process: a few hundred of
    them for a training run, each a few hundred bytes)."""

    __slots__ = ("desc", "a_layout", "b_layout", "d_layout", "algo", "algo_ref", "shared", "handle")

    def __init__(self, lib: _Lib, handle, m: int, n: int, k: int, a_op: int, a_ld: int, b_op: int, b_ld: int,
                 in_type: int, out_type: int, out_ld: int, aligns: tuple[int, int, int], algo=None):
        # cuBLAS computes D^T [N, M] = op(B') [N, K] @ op(A') [K, M]: its "A" is our b, its "B" our a.
        desc = ctypes.c_void_p()
        lib.check(lib.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F),
                  "cublasLtMatmulDescCreate")
        lib.set_attr(lib.lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSA, b_op, ctypes.c_int32)
        lib.set_attr(lib.lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSB, a_op, ctypes.c_int32)
        # stored shapes (column-major rows x cols) before the op
        self.b_layout = lib.layout(in_type, *((n, k) if b_op == _OP_N else (k, n)), b_ld)
        self.a_layout = lib.layout(in_type, *((k, m) if a_op == _OP_N else (m, k)), a_ld)
        self.d_layout = lib.layout(out_type, n, m, out_ld)
        self.desc, self.shared, self.handle = desc, algo is not None, handle
        if algo is not None:  # the heuristic's answer for this product's bucket (_bucket_algo)
            self.algo, self.algo_ref = algo, ctypes.byref(algo)
            return
        STATS["heuristics"] += 1
        pref = ctypes.c_void_p()
        lib.check(lib.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        setter = lib.lib.cublasLtMatmulPreferenceSetAttribute
        lib.set_attr(setter, pref, _PREF_MAX_WORKSPACE, WORKSPACE_BYTES, ctypes.c_uint64)
        a_align, b_align, d_align = aligns
        for attr, value in ((_PREF_ALIGN_A, b_align), (_PREF_ALIGN_B, a_align), (_PREF_ALIGN_C, d_align),
                            (_PREF_ALIGN_D, d_align)):
            lib.set_attr(setter, pref, attr, value, ctypes.c_uint32)
        result, count = _HeuristicResult(), ctypes.c_int(0)
        status = lib.lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, self.b_layout, self.a_layout,
                                                        self.d_layout, self.d_layout, pref, 1,
                                                        ctypes.byref(result), ctypes.byref(count))
        lib.lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0 or count.value < 1:
            self.destroy(lib)
            raise RuntimeError(f"cuBLASLt has no algorithm for {m}x{k} @ {k}x{n} (status {status})")
        self.algo = result.algo
        self.algo_ref = ctypes.byref(self.algo)

    def destroy(self, lib: _Lib) -> None:
        """Free the descriptors (a CUDA graph that captured this plan's call does not need them)."""
        for layout in (self.a_layout, self.b_layout, self.d_layout):
            lib.lib.cublasLtMatrixLayoutDestroy(layout)
        lib.lib.cublasLtMatmulDescDestroy(self.desc)


_LIB: _Lib | None | bool = None  # None: not tried yet; False: unavailable in this process
_PLANS: dict[tuple, _Plan | None] = {}
MAX_PLANS = 8192  # W2 makes ~14 a step (its token count changes each step); past this all are freed
_WORKSPACES: dict[int, torch.Tensor] = {}  # raw stream -> its workspace
_SCALARS: dict[float, object] = {}  # alpha / beta -> a reference to it as a C float (_scalar)
_LOCK = threading.Lock()
STATS = {"lt": 0, "torch": 0, "plans": 0, "heuristics": 0}  # calls each way, plans and heuristic queries made
# Dimensions above 1,024 are bucketed to multiples of this for the heuristic's query: the token
# count of W2's products changes every step (2,316-3,426), and each new one asked the heuristic
# (~0.2 ms of host time, ~14 a step); a bucket's products share the algorithm chosen for its
# largest shape (model widths, multiples of 256 in every supported family, stay exact).
BUCKET = 256
_ALGOS: dict[tuple, object] = {}  # a bucket's product -> the heuristic's algorithm for it


def _find_library() -> str | None:
    """The libcublasLt torch loaded (after one CUDA matmul), from this process's memory map."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        return None
    return None


def _lib(device: torch.device) -> _Lib | None:
    global _LIB
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                try:
                    with torch.cuda.device(device):
                        a = torch.ones((16, 16), device=device, dtype=torch.bfloat16)
                        torch.mm(a, a)  # loads torch's cuBLAS / cuBLASLt
                    path = _find_library()
                    _LIB = _Lib(path) if path else False
                except (OSError, AttributeError, RuntimeError):
                    _LIB = False
    return _LIB or None


def _alignment(ptr: int) -> int:
    return min(256, ptr & -ptr) if ptr else 256


def _plan_aligns(key: tuple) -> tuple[int, int, int]:
    """The alignments of a, b and out / c from a plan's key (their pointers' last 8 bits)."""
    return _alignment(key[-3]), _alignment(key[-2]), _alignment(key[-1])


def _scalar(value: float):
    """alpha or beta as cuBLASLt reads it (a pointer to a float), kept for the next call."""
    if len(_SCALARS) >= 256:
        _SCALARS.clear()
    ref = _SCALARS[value] = ctypes.byref(ctypes.c_float(value))  # byref keeps the float alive
    return ref


def _operand(t: torch.Tensor, rows: int, cols: int) -> tuple[int, int] | None:
    """(op, leading dimension) of a torch [rows, cols] operand as cuBLAS sees its transpose, or
    None for a layout the plan does not take."""
    s0, s1 = t.stride()
    if s1 == 1 or cols == 1:  # row-major: column-major [cols, rows], used as is
        ld = s0 if rows > 1 else cols
        return (_OP_N, ld) if ld >= cols and ld * t.element_size() % 16 == 0 else None
    if s0 == 1 or rows == 1:  # column-major [rows, cols]: its transpose
        ld = s1 if cols > 1 else rows
        return (_OP_T, ld) if ld >= rows and ld * t.element_size() % 16 == 0 else None
    return None


def available(device: torch.device) -> bool:
    """Whether products on `device` take the cuBLASLt plans."""
    return device.type == "cuda" and not forced("cublaslt") and _lib(device) is not None


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, alpha: float = 1.0,
         beta: float = 0.0, out_dtype: torch.dtype | None = None, c: torch.Tensor | None = None) -> torch.Tensor:
    """out = alpha a @ b + beta c for 2-D a [M, K], b [K, N]; c defaults to out (an in-place
    accumulate), and must have out's dtype and strides. out None: a new [M, N] tensor (of
    out_dtype, default a's; beta counts as 0 unless c is given). a and b share a dtype; out is
    that dtype or float32 (cuBLAS writes fp32 from bf16 / fp16 inputs)."""
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype, device=a.device)
        if c is None:
            beta = 0.0
    if c is None or c is out:
        c = out
    elif c.dtype != out.dtype or c.stride() != out.stride():
        c = out.copy_(c)
    if a.is_cuda and not forced("cublaslt"):
        lib = _LIB if _LIB else _lib(a.device)
        if lib is not None:
            pa, pb, po, pc = a.data_ptr(), b.data_ptr(), out.data_ptr(), c.data_ptr()
            device = a.get_device()
            # the pointers' offsets within 256 bytes stand for their alignments (_plan_aligns)
            key = (a.shape, a.stride(), b.shape, b.stride(), out.stride(), a.dtype, out.dtype, device,
                   pa & 255, pb & 255, (po | pc) & 255)
            plan = _PLANS.get(key, False)
            if plan is False:
                if len(_PLANS) >= MAX_PLANS:
                    _clear(lib)
                plan = _PLANS[key] = _plan(lib, a, b, out, _plan_aligns(key))
            if plan is not None:
                stream = torch._C._cuda_getCurrentRawStream(device)
                workspace = _WORKSPACES.get(stream)
                if workspace is None:
                    workspace = _WORKSPACES[stream] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                  device=a.device)
                status = lib.matmul(plan.handle, plan.desc, _SCALARS.get(alpha) or _scalar(alpha), pb, plan.b_layout,
                                    pa, plan.a_layout, _SCALARS.get(beta) or _scalar(beta), pc, plan.d_layout, po,
                                    plan.d_layout, plan.algo_ref, workspace.data_ptr(), WORKSPACE_BYTES, stream)
                if status != 0 and plan.shared:  # the bucket's algorithm refused: this shape's own
                    plan.destroy(lib)
                    plan = _PLANS[key] = _plan(lib, a, b, out, _plan_aligns(key), shared=False)
                    return gemm(a, b, out, alpha, beta, c=c)
                if status == 0:
                    STATS["lt"] += 1
                    return out
                _PLANS[key] = None  # refused at run time: this shape takes torch from now on
    STATS["torch"] += 1
    return _reference(a, b, out, alpha, beta, c)


def _reference(a, b, out, alpha, beta, c):
    """The same product through torch (fp32 output from bf16 / fp16 inputs: the inputs upcast,
    exact products accumulated in fp32, as cuBLAS does)."""
    if out.dtype != a.dtype:
        a, b = a.to(out.dtype), b.to(out.dtype)
    if beta == 0.0:
        return torch.mm(a, b, out=out) if alpha == 1.0 else torch.addmm(out, a, b, beta=0, alpha=alpha, out=out)
    return torch.addmm(c, a, b, beta=beta, alpha=alpha, out=out)


def _clear(lib: _Lib) -> None:
    """Free every plan (their calls already queued or captured do not read the descriptors)."""
    for plan in _PLANS.values():
        if plan is not None:
            plan.destroy(lib)
    _PLANS.clear()


def _bucket(d: int) -> int:
    return d if d <= 1024 else -(-d // BUCKET) * BUCKET


def _bucket_algo(lib: _Lib, handle, m: int, n: int, k: int, a_op: int, a_ld: int, b_op: int, b_ld: int,
                 in_type: int, out_type: int, out_ld: int, aligns: tuple[int, int, int]):
    """The heuristic's algorithm for the bucketed product (each dimension rounded up by _bucket,
    leading dimensions widened to hold it), asked once per bucket."""
    mb, nb, kb = _bucket(m), _bucket(n), _bucket(k)
    a_ld, b_ld = max(a_ld, kb if a_op == _OP_N else mb), max(b_ld, nb if b_op == _OP_N else kb)
    key = (handle.value, mb, nb, kb, a_op, a_ld, b_op, b_ld, in_type, out_type, max(out_ld, nb), aligns)
    algo = _ALGOS.get(key)
    if algo is None:
        probe = _Plan(lib, handle, *key[1:])
        probe.destroy(lib)
        algo = _ALGOS[key] = probe.algo
    return algo


def _plan(lib: _Lib, a, b, out, aligns: tuple[int, int, int], shared: bool = True) -> _Plan | None:
    """The plan of this product, or None where the layout or dtypes are not taken (torch runs it).
    shared: with its bucket's algorithm (_bucket_algo; inside a graph capture: its own)."""
    (m, k), n = a.shape, b.shape[1]
    in_type, out_type = _DTYPES.get(a.dtype), _DTYPES.get(out.dtype)
    a_op, b_op = _operand(a, m, k), _operand(b, k, n)
    out_ok = out.stride(1) == 1 and out.stride(0) >= n and out.stride(0) * out.element_size() % 16 == 0
    if not (m and n and k and in_type is not None and out_type is not None and b.dtype == a.dtype
            and a.dtype != torch.float32 and out.dtype in (a.dtype, torch.float32) and a_op and b_op and out_ok):
        return None
    handle = lib.handle(a.get_device())
    product = (m, n, k, a_op[0], a_op[1], b_op[0], b_op[1], in_type, out_type, max(out.stride(0), n), aligns)
    try:
        # not inside a CUDA graph capture: a graph asks once per size, and its replays keep the
        # algorithm chosen for their exact shape
        shared = shared and not torch.cuda.is_current_stream_capturing()
        algo = _bucket_algo(lib, handle, *product) if shared else None
        plan = _Plan(lib, handle, *product, algo=algo)
    except RuntimeError:
        return None
    STATS["plans"] += 1
    return plan
