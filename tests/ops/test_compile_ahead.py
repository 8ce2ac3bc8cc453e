"""ops.compile_ahead.first_pass: a discovery pass that skipped launches leaves no trace (gradients,
accumulated tensors, RNG), and runs again; a pass that skipped nothing is the real one. The
compile workers against a real Triton: tests/gpu/test_compile_ahead.py."""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import contextmanager

import pytest
import torch

from hivetune.core.config import load_config
from hivetune.core.errors import UserError
from hivetune.ops import compile_ahead


class FakeAhead(compile_ahead.CompileAhead):
    """Discovery without Triton: each pass "skips" `skips` launches, their compiles already done."""

    def __init__(self, skips: int, reply: dict | None = None):
        super().__init__(workers=2, start_now=False, marker=None)
        self.skips, self.reply, self.passes = skips, reply or {"hash": "h", "seconds": 0.1}, 0

    @contextmanager
    def discovering(self):
        self.passes += 1
        for k in range(self.skips):
            done: Future = Future()
            done.set_result(self.reply)
            self.pending[f"k{k}"] = done
        self.skipped += self.skips
        yield


@pytest.fixture
def ahead(monkeypatch):
    def install(skips: int, **kw):
        fake = FakeAhead(skips, **kw)
        monkeypatch.setattr(compile_ahead, "_AHEAD", fake)
        return fake
    return install


def pass_fn(weight: torch.Tensor, stats: torch.Tensor, calls: list):
    """A first forward and backward: dropout from torch's generator, gradients and stats added to."""
    def fn():
        calls.append(1)
        x = torch.nn.functional.dropout(torch.ones(8), 0.5)
        loss = (weight * x).sum()
        loss.backward()
        stats.add_(loss.detach())
        return loss.detach()
    return fn


def test_a_pass_that_skipped_launches_is_undone_and_run_again(ahead):
    fake = ahead(skips=3)
    weight, frozen = torch.nn.Parameter(torch.arange(8.0)), torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.full((8,), 0.25)  # what earlier micro-batches left
    stats, calls, counts = torch.tensor([1.0]), [], {"passes": 3}

    def counted():
        counts["passes"] += 1
        counts["new"] = 1
        return pass_fn(weight, stats, calls)()

    torch.manual_seed(7)
    loss = compile_ahead.first_pass(counted, lambda: [weight, frozen], keep=(stats,), counters=(counts,))

    torch.manual_seed(7)
    ref_weight = torch.nn.Parameter(torch.arange(8.0))
    ref_weight.grad = torch.full((8,), 0.25)
    ref_stats = torch.tensor([1.0])
    ref_loss = pass_fn(ref_weight, ref_stats, [])()
    assert len(calls) == 2 and fake.passes == 1 and fake.done
    assert torch.equal(loss, ref_loss)  # the same dropout mask: the RNG state was put back
    assert torch.equal(weight.grad, ref_weight.grad) and torch.equal(stats, ref_stats)
    assert frozen.grad is None  # None before the passes, None after the discovery pass
    assert counts == {"passes": 4, "new": 1}  # counted once: the real pass
    assert compile_ahead.STATS["kernels"] == 3 and compile_ahead.STATS["errors"] == []
    # later calls: the function alone
    compile_ahead.first_pass(pass_fn(weight, stats, calls), lambda: [weight])
    assert len(calls) == 3 and fake.passes == 1


def test_a_pass_that_skipped_nothing_is_the_real_one(ahead):
    fake = ahead(skips=0)
    weight, stats, calls = torch.nn.Parameter(torch.ones(8)), torch.zeros(1), []
    compile_ahead.first_pass(pass_fn(weight, stats, calls), lambda: [weight], keep=(stats,))
    assert len(calls) == 1 and fake.done and compile_ahead.STATS["kernels"] == 0
    assert weight.grad is not None and stats.item() != 0


def test_an_error_in_a_pass_with_skipped_launches_comes_from_the_real_pass(ahead):
    ahead(skips=1, reply={"error": "SyntaxError: bad kernel"})
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("garbage where a launch was skipped")
        return torch.tensor(2.0)

    assert compile_ahead.first_pass(fn, lambda: []).item() == 2.0
    assert compile_ahead.STATS["errors"] == ["SyntaxError: bad kernel"]


def test_an_error_in_a_pass_that_skipped_nothing_is_raised(ahead):
    ahead(skips=0)

    def fn():
        raise ValueError("a real error")

    with pytest.raises(ValueError, match="a real error"):
        compile_ahead.first_pass(fn, lambda: [])


def test_off_the_gpu_nothing_starts(monkeypatch):
    monkeypatch.setattr(compile_ahead, "_AHEAD", None)
    compile_ahead.start(torch.device("cpu"), 4)
    assert compile_ahead._AHEAD is None


def test_compile_workers_below_minus_one_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("compile_workers: -2\n")
    with pytest.raises(UserError, match=r"compile_workers: must be >= -1 \(-1: auto, 0: off\), got -2"):
        load_config(path)


def test_a_compile_that_never_ends_is_left_to_the_real_pass(ahead, monkeypatch):
    fake = ahead(skips=0)
    fake.pending["stuck"] = Future()  # a worker that never answers
    fake.skipped = 1
    monkeypatch.setattr(compile_ahead, "WAIT_S", 0.1)
    calls = []
    compile_ahead.first_pass(lambda: calls.append(1), lambda: [])
    assert len(calls) == 2 and compile_ahead.STATS["errors"] == ["not compiled within 0.1 s"]


def test_kernels_met_before_the_load_leave_the_first_pass_one_run(ahead):
    """discover_early (train.twin's pass): what it met goes to the workers, its error is kept, not
    raised; the first pass, finding everything compiled, skips nothing and runs once."""
    fake = ahead(skips=3)
    calls = []

    def twin():
        calls.append("twin")
        raise RuntimeError("garbage where launches were skipped")

    early = compile_ahead.discover_early(twin)
    assert early["kernels"] == 3 and early["error"].startswith("RuntimeError: garbage")
    assert fake.skipped == 0 and not fake.sent and not fake.done
    fake.skips = 0  # the real pass: all on disk by now
    weight, stats = torch.nn.Parameter(torch.ones(8)), torch.zeros(1)
    compile_ahead.first_pass(lambda: (calls.append("real"), pass_fn(weight, stats, [])())[1], lambda: [weight])
    assert calls == ["twin", "real"] and fake.done
    assert compile_ahead.STATS["kernels"] == 3 and compile_ahead.STATS["early"] == early
    assert compile_ahead.STATS["missed"] == 0 and compile_ahead.STATS["errors"] == []


def test_a_cold_cache_is_told_without_importing_triton(tmp_path, monkeypatch):
    """The marker a finished first pass leaves, looked for where Triton keeps its cache."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert compile_ahead.cache_looks_cold()
    marker = compile_ahead.warm_marker(tmp_path / "cache", "9.9.9")
    marker.parent.mkdir()
    marker.touch()
    assert not compile_ahead.cache_looks_cold()
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    assert compile_ahead.cache_looks_cold()
    (tmp_path / "home" / ".triton" / "cache").mkdir(parents=True)
    compile_ahead.warm_marker(tmp_path / "home" / ".triton" / "cache", "9.9.9").touch()
    assert not compile_ahead.cache_looks_cold()
    assert compile_ahead.may_start(-1) and not compile_ahead.may_start(0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not compile_ahead.may_start(4)


def test_a_models_marker_lets_the_twin_run_on_a_cache_warm_from_other_models(tmp_path, monkeypatch):
    """The hivetune-wide marker present, this model's absent: the cache looks cold for its key, the
    twin may discover (the workers start at its first missing kernel), and the finished first
    pass leaves both markers; the next run of that model finds its own."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    marker = compile_ahead.warm_marker(tmp_path, "9.9.9")
    marker.touch()
    assert not compile_ahead.cache_looks_cold() and compile_ahead.cache_looks_cold("k1")
    assert compile_ahead.warm_marker(tmp_path, "9.9.9", "k1").name == marker.name[:-len(".warm")] + "-k1.warm"
    warm = compile_ahead.CompileAhead(workers=2, start_now=False, marker=marker)
    monkeypatch.setattr(compile_ahead, "_AHEAD", warm)
    assert compile_ahead.discovers_early() is False  # no key: only a cold cache's workers say yes
    assert compile_ahead.discovers_early("k1") is True and warm.workers is None and not warm.started_early
    warm.finish()
    assert not compile_ahead.cache_looks_cold("k1") and compile_ahead.cache_looks_cold("k2")
    assert compile_ahead.discovers_early("k2") is False  # the first pass has run
