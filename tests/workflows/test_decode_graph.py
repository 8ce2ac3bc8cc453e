"""workflows.decode_graph: the static decode step (the one a CUDA graph replays) against plain
greedy decoding, token for token in fp32 on the CPU (run eagerly: no graph without CUDA), and
where graphs are used. The graphed replay itself: tests/gpu/test_cuda_decode_graph.py."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from hivetune.workflows import decode_graph
from hivetune.workflows.generate import greedy_ids
from test_generate import NEW_TOKENS, plain_greedy, prompts_of, randomised


@pytest.fixture
def static_steps(monkeypatch):
    """greedy_ids through DecodeStep, eagerly (what the graph replays), on the CPU."""
    monkeypatch.setattr(decode_graph, "usable", lambda *a: True)
    monkeypatch.setattr(decode_graph, "decode", functools.partial(decode_graph.decode, graphed=False))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_static_steps_equal_plain_greedy(tmp_path, static_steps, family):
    kw = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64} if family == "gemma2" else {}
    model = randomised(tmp_path, family, **kw)  # Gemma 2: softcapped attention, a window past the cache
    prompts = prompts_of([7, 1, 19, 4, 12, 12, 2, 25, 9, 16], seed=0)
    free = [plain_greedy(model, p, NEW_TOKENS, set()) for p in prompts]
    assert greedy_ids(model, prompts, NEW_TOKENS, set()) == free
    counts = {t: sum(t in row for row in free) for row in free for t in row}
    stop = set(sorted(t for t, c in counts.items() if 0 < c <= len(free) // 2)[:3])
    expected = [plain_greedy(model, p, NEW_TOKENS, stop) for p in prompts]
    assert len({len(row) for row in expected}) >= 3  # rows end at different steps
    assert greedy_ids(model, prompts, NEW_TOKENS, stop) == expected


def fake_cache(device: str, capacity: int):
    return SimpleNamespace(k=[SimpleNamespace(device=torch.device(device), shape=(2, 2, capacity, 16))])


def test_where_graphs_are_used(monkeypatch):
    monkeypatch.delenv("HIVETUNE_REFERENCE", raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2)).eval()
    assert decode_graph.usable(model, fake_cache("cuda", 100), 96)
    assert not decode_graph.usable(model, fake_cache("cpu", 100), 96)
    assert not decode_graph.usable(model, fake_cache("cuda", 100), decode_graph.MIN_STEPS - 1)
    assert not decode_graph.usable(model.train(), fake_cache("cuda", 100), 96)
    model.eval()[0].window = 100  # a sliding window as long as the cache: nothing cut
    assert decode_graph.usable(model, fake_cache("cuda", 100), 96)
    assert not decode_graph.usable(model, fake_cache("cuda", 101), 96)
    monkeypatch.setenv("HIVETUNE_REFERENCE", "decode_graphs")
    assert not decode_graph.usable(model, fake_cache("cuda", 100), 96)


def test_a_failed_capture_goes_on_eagerly_with_one_note(tmp_path, monkeypatch, capsys):
    """On the CPU every capture fails: the steps go on eagerly from the warm-up's tokens, the same
    tokens, with one note line for the process."""
    from hivetune.core import fallbacks

    monkeypatch.setattr(decode_graph, "usable", lambda *a: True)  # decode(graphed=True) as on a GPU
    monkeypatch.setattr(fallbacks, "NOTED", {})
    model = randomised(tmp_path)
    prompts = prompts_of([7, 1, 19, 4], seed=2)
    capsys.readouterr()  # the model's build
    failed = decode_graph.STATS["failed"]
    assert greedy_ids(model, prompts, NEW_TOKENS, set()) == [plain_greedy(model, p, NEW_TOKENS, set()) for p in prompts]
    greedy_ids(model, prompts, NEW_TOKENS, set())
    assert decode_graph.STATS["failed"] == failed + 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hivetune:")]
    assert len(err) == 1 and err[0].startswith("hivetune: note: CUDA graphs for decoding unavailable (capture failed: ")
    assert err[0].endswith("; using eager decode steps")
