"""ops.launch on the CPU: the launch key, and which calls take Triton's path and which the
recorded launcher (a stand-in for a Triton JITFunction; tests/gpu/test_fast_launch.py runs real
kernels)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hivetune.ops import launch


def _kernel(X, OUT, n, scale, flag, BLOCK, MODE=0):  # the stand-in's signature; BLOCK, MODE constexpr
    pass


class StandIn:
    """A JITFunction's surface as FastLaunch uses it: fn, params, kernel[grid](...) (a compiled
    kernel whose launcher records its calls)."""

    def __init__(self):
        self.fn = _kernel
        self.params = [SimpleNamespace(is_constexpr=name in ("BLOCK", "MODE"))
                       for name in ("X", "OUT", "n", "scale", "flag", "BLOCK", "MODE")]
        self.triton_calls, self.launched = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return SimpleNamespace(run=lambda *a: self.launched.append(a), function=f"fn{len(self.triton_calls)}",
                                   packed_metadata=("meta",))
        return run


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(launch, "_device", lambda: 0)
    monkeypatch.setattr(launch, "_stream", lambda device: 77)
    monkeypatch.delenv("HIVETUNE_REFERENCE", raising=False)
    return launch.FastLaunch(StandIn())


def test_a_repeated_specialization_goes_straight_to_the_launcher_with_every_bound_value(kernel):
    x, out = torch.zeros(64), torch.zeros(64)
    kernel[(4,)](x, out, 64, 0.5, True, BLOCK=16)
    assert len(kernel.fn.triton_calls) == 1 and kernel.fn.launched == []
    kernel[(5, 2)](x, out, 96, 0.25, True, BLOCK=16, num_warps=4)  # same key but for the option
    assert len(kernel.fn.triton_calls) == 2
    kernel[(6, 2)](x, out, 32, 2.0, True, BLOCK=16, num_warps=4)
    assert len(kernel.fn.triton_calls) == 2
    # grid padded to 3 dims, the current stream, the compiled function and metadata, no launch
    # metadata or hooks, then all seven parameters in order (the default MODE included)
    assert kernel.fn.launched == [(6, 2, 1, 77, "fn2", ("meta",), None, None, None, x, out, 32, 2.0, True, 16, 0)]


@pytest.mark.parametrize("change", ["misaligned", "dtype", "n_is_1", "n_not_16", "n_int64", "constexpr",
                                    "bool", "default_constexpr", "option"])
def test_each_specialization_triton_tells_apart_takes_triton_s_path_first(kernel, change):
    x, out = torch.zeros(64), torch.zeros(64)
    base = dict(args=(x, out, 64, 0.5, True), kwargs={"BLOCK": 16})
    kernel[(1,)](*base["args"], **base["kwargs"])
    kernel[(1,)](*base["args"], **base["kwargs"])
    assert len(kernel.fn.triton_calls) == 1 and len(kernel.fn.launched) == 1
    args, kwargs = list(base["args"]), dict(base["kwargs"])
    if change == "misaligned":
        args[0] = torch.zeros(65)[1:]  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "n_is_1":
        args[2] = 1
    elif change == "n_not_16":
        args[2] = 65
    elif change == "n_int64":
        args[2] = 2**33
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "bool":
        args[4] = False
    elif change == "default_constexpr":
        kwargs["MODE"] = 1
    else:
        kwargs["num_warps"] = 8
    kernel[(1,)](*args, **kwargs)
    assert len(kernel.fn.triton_calls) == 2 and len(kernel.fn.launched) == 1
    kernel[(1,)](*args, **kwargs)
    assert len(kernel.fn.triton_calls) == 2 and len(kernel.fn.launched) == 2


def test_values_that_share_every_specialization_share_the_launcher(kernel):
    """n 32 and 48 (both multiples of 16 in int32), another aligned tensor, another float: one key."""
    kernel[(1,)](torch.zeros(64), torch.zeros(64), 32, 0.5, True, BLOCK=16)
    kernel[(1,)](torch.zeros(128), torch.zeros(8), 48, -3.0, True, BLOCK=16)
    assert len(kernel.fn.triton_calls) == 1 and len(kernel.fn.launched) == 1


def test_callable_grids_unknown_types_the_reference_env_and_bad_bindings_take_triton_s_path(kernel, monkeypatch):
    x, out = torch.zeros(64), torch.zeros(64)
    kernel[(1,)](x, out, 64, 0.5, True, BLOCK=16)
    kernel[lambda meta: (1,)](x, out, 64, 0.5, True, BLOCK=16)
    kernel[(1,)](x, out, 64, "text", True, BLOCK=16)
    kernel[(1,)](x, out, 64, 0.5, True)  # BLOCK missing: Triton reports it
    monkeypatch.setenv("HIVETUNE_REFERENCE", "triton_launch")
    kernel[(1,)](x, out, 64, 0.5, True, BLOCK=16)
    assert len(kernel.fn.triton_calls) == 5 and kernel.fn.launched == []


def test_fast_launch_leaves_what_is_not_a_jit_function_alone():
    def plain():
        pass
    assert launch.fast_launch(plain) is plain


def test_the_key_of_a_tensor_is_its_dtype_and_16_byte_alignment():
    flags = (False,)
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert launch.specialization_key([buf], flags) == ((torch.bfloat16, True),)
    assert launch.specialization_key([buf[8:]], flags) == ((torch.bfloat16, True),)  # 16 bytes on
    assert launch.specialization_key([buf[1:]], flags) == ((torch.bfloat16, False),)
    assert launch.specialization_key([object()], flags) is None
