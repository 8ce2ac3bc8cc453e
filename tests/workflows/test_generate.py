"""Batched greedy decoding (packed prefill, one KV cache, finished rows dropped from the batch)
against plain greedy decoding: one prompt at a time, no cache, the whole sequence recomputed for
every new token. Token for token, on a tiny random model in fp32."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_model
from hivetune.workflows.generate import greedy_ids
from hivetune.model.load import load_model

NEW_TOKENS = 12


def randomised(folder, model_type: str = "llama", **kw):
    """A tiny fp32 model (4 query heads on 2 K/V heads: GQA) with weights at a scale where they
    shape the logits (no near-uniform ties)."""
    build_tiny_model(folder, model_type, vocab_size=64, seed=3, **kw)
    net = load_model(folder, torch.float32, "cpu").eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in net.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)
    return net


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return randomised(tmp_path_factory.mktemp("tiny-generate"))


@torch.no_grad()
def plain_greedy(net, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new_tokens):
        token = int(net.logits(net(torch.tensor([seq])))[0, -1].argmax())
        if token in stop_ids:
            break
        seq.append(token)
    return seq[len(prompt):]


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]


def test_batched_greedy_equals_plain_greedy(model):
    prompts = prompts_of([7, 1, 19, 4, 12, 12, 2, 25, 9, 16], seed=0)
    plain = [plain_greedy(model, p, NEW_TOKENS, set()) for p in prompts]
    assert greedy_ids(model, prompts, NEW_TOKENS, set()) == plain
    assert [greedy_ids(model, [p], NEW_TOKENS, set())[0] for p in prompts] == plain


def test_rows_that_stop_leave_the_batch_without_changing_the_others(model):
    prompts = prompts_of([5, 14, 3, 22, 8, 8, 11, 1, 17, 6], seed=1)
    free = [plain_greedy(model, p, NEW_TOKENS, set()) for p in prompts]
    # stop tokens that end some rows early, at different steps, and leave others to run on
    counts = {t: sum(t in row for row in free) for row in free for t in row}
    stop = {t for t, c in sorted(counts.items(), key=lambda kv: kv[1]) if 0 < c <= len(free) // 2}
    stop = set(sorted(stop)[:3])
    expected = [plain_greedy(model, p, NEW_TOKENS, stop) for p in prompts]
    ends = {len(row) for row in expected}
    assert len(ends) >= 3 and NEW_TOKENS in ends and min(ends) <= NEW_TOKENS // 2, ends
    assert greedy_ids(model, prompts, NEW_TOKENS, stop) == expected
