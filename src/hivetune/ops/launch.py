"""Triton kernel launches without JITFunction.run's per-call work.

`kernel[grid](*args, **kwargs)` through Triton binds the arguments, formats their
specialization as a string to find the compiled kernel, checks the kernel's globals, reads its
knobs and builds launch metadata for the profiler hooks: about as much host time as the launch
itself. Eager W2 steps make ~600 such launches (py-spy, 197c29b, H200: JITFunction.run's own
Python ~15 ms a step of ~190). `fast_launch(kernel)` keeps Triton's path for the first call of
each specialization, which compiles or finds the kernel and launches it, and then calls that
compiled kernel's launcher directly for every later call with the same key:

- a tensor: its dtype and whether its address is 16-byte aligned (Triton's pointer
  specialization);
- an int: whether it is 1, a multiple of 16, within int32, within int64 (Triton's integer
  specializations and types; asked also for the do_not_specialize ones, which only adds keys);
- a bool, a constexpr parameter, an option (num_warps ...): its value; a float: its type;
- the current device.

The key separates at least what Triton's binder separates, so a key's kernel is the one Triton
would pick. Launch hooks (Triton's profiler) are not called on the fast path. A grid given as a
callable, an argument of another type, or HIVETUNE_REFERENCE=triton_launch take Triton's path.
"""

from __future__ import annotations

import inspect

import torch

from hivetune.fastpath import forced

_I32, _I64 = 2**31, 2**63
_FLOAT = ("float",)
STATS = {"fast": 0, "triton": 0}  # launches each way (tests, benchmarks)


def _device() -> int:
    return torch.cuda.current_device()


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def fast_launch(fn):
    """The kernel wrapped for direct launches, or `fn` itself where Triton is missing or `fn`
    is not a JITFunction (TRITON_INTERPRET's InterpretedFunction)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - depends on the install
        return fn
    return FastLaunch(fn) if isinstance(fn, JITFunction) else fn


def specialization_key(values, constexpr) -> tuple | None:
    """The launch key of the bound argument values (module doc); None where an argument is of
    a type the key does not cover (Triton's path then)."""
    key = []
    for v, fixed in zip(values, constexpr):
        if fixed or v is None or isinstance(v, bool):
            key.append(v)
        elif isinstance(v, torch.Tensor):
            key.append((v.dtype, not v.data_ptr() & 15))
        elif isinstance(v, int):
            key.append((v == 1, not v & 15, -_I32 <= v < _I32, -_I64 <= v < _I64))
        elif isinstance(v, float):
            key.append(_FLOAT)
        else:
            return None
    return tuple(key)


class FastLaunch:
    """A Triton kernel, `kernel[grid](*args, **kwargs)` as before (module doc)."""

    def __init__(self, fn):
        self.fn = fn
        params = list(inspect.signature(fn.fn).parameters.values())
        self.names = tuple(p.name for p in params)
        self.constexpr = tuple(bool(p.is_constexpr) for p in fn.params)
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.launchers: dict[tuple, tuple] = {}  # key -> (launcher, function, packed metadata)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[list, tuple] | None:
        """(every parameter's value in order, the options' items), or None where the arguments
        do not bind (Triton's path then reports it)."""
        if len(args) > len(self.names):
            return None
        values = list(args)
        used = 0
        for name in self.names[len(args):]:
            if name in kwargs:
                values.append(kwargs[name])
                used += 1
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                return None
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.names)) if used < len(kwargs) else ()
        return values, options

    def launch(self, grid, args: tuple, kwargs: dict):
        bound = None if callable(grid) or forced("triton_launch") else self._bind(args, kwargs)
        key = None
        if bound is not None:
            values, options = bound
            key = specialization_key(values, self.constexpr)
            if key is not None:
                device = _device()
                key = (device, options, key)
                entry = self.launchers.get(key)
                if entry is not None:
                    launcher, function, packed = entry
                    STATS["fast"] += 1
                    return launcher(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                                    _stream(device), function, packed, None, None, None, *values)
        STATS["triton"] += 1
        kernel = self.fn[grid](*args, **kwargs)
        if key is not None and kernel is not None:
            try:
                self.launchers[key] = (kernel.run, kernel.function, kernel.packed_metadata)
            except AttributeError:  # another Triton's compiled kernel: its path every time
                pass
        return kernel
