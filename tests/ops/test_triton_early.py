"""ops.triton_early: Triton's start-up begun before torch's import, for the commands that run a model."""

import importlib.util
import sys
import types

import pytest

from hivetune.ops import triton_early


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(triton_early, "_THREAD", None)
    monkeypatch.setattr(triton_early, "DONE", {})
    monkeypatch.delenv("HIVETUNE_REFERENCE", raising=False)
    return monkeypatch


def test_nothing_for_other_commands_or_without_a_gpu_node(fresh, tmp_path):
    fresh.setattr(triton_early, "DRIVERS", {str(tmp_path / "nvidiactl"): ("m", "C")})  # no such node
    triton_early.start("train")
    assert triton_early._THREAD is None
    (tmp_path / "nvidiactl").touch()
    for command in ("plan", "export", "data", None):
        triton_early.start(command)
        assert triton_early._THREAD is None
    fresh.setenv("HIVETUNE_REFERENCE", "fused_layers")
    triton_early.start("train")
    assert triton_early._THREAD is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_thread_hashes_triton_and_builds_the_drivers_utilities(fresh, tmp_path):
    built = []
    fake = types.ModuleType("fake_driver")
    fake.Utils = lambda: built.append(True)
    fresh.setitem(sys.modules, "fake_driver", fake)
    (tmp_path / "node").touch()
    fresh.setattr(triton_early, "DRIVERS", {str(tmp_path / "node"): ("fake_driver", "Utils")})
    triton_early.start("bench")
    triton_early.join(120)
    assert triton_early.DONE == {"key": True, "utils": True} and built == [True]
    from triton.runtime.cache import triton_key

    assert triton_key.cache_info().currsize == 1  # the first launch's key lookup finds it done


def test_prefetch_asks_for_torchs_libraries_first():
    files = triton_early.library_files()
    assert files and files[0].parent.name == "lib" and files[0].parent.parent.name == "torch"
    assert all(".so" in f.name for f in files)
    assert triton_early.prefetch() == len(files)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_hash_kernels_hashes_the_triton_functions_of_the_imported_ops():
    """The prewarm thread's hash_kernels: every jitted function of the kernel modules that
    load_kernels imported (those of the op modules imported: norm's among them here) has its
    source hash afterwards (the one its first launch would compute), none left at Triton's
    placeholder, and the count is theirs."""
    from triton.runtime.jit import JITFunction

    importlib.import_module("hivetune.ops.norm")  # an op module: load_kernels defines its kernels
    from hivetune.ops.triton_util import hash_kernels

    hashed = hash_kernels()
    functions = [value for name, module in list(sys.modules.items()) if name.startswith("hivetune.ops.kernels.")
                 for value in vars(module).values() if isinstance(value, JITFunction) and value.__module__ == name]
    assert "hivetune.ops.kernels.norm" in sys.modules
    assert hashed == len(functions) >= 5
    assert all(f.hash is not None and len(f.hash) == 64 and not f.hash.startswith("recursion:") for f in functions)
