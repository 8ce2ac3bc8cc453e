"""A quantized base on the GPU: 30 steps of the W1 shape with an nf4 base follow bf16's loss
curve within 2% at every step, on data the LoRA can learn (sequences over 64 token ids)."""

from __future__ import annotations

import random

import pytest
import torch

from hivetune.data.formats import Encoded
from hivetune.workflows.bench import run_hivetune
from hivetune.workflows.workloads import WORKLOADS, Workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def learnable_examples(n: int = 240, seed: int = 0) -> list[Encoded]:
    """Random sequences over 64 ids: a loss the LoRA can bring from ln(vocab) toward ln(64)."""
    rng = random.Random(seed)
    ids = rng.sample(range(1000, 100000), 64)
    out = []
    for _ in range(n):
        p, r = rng.randint(16, 64), rng.randint(32, 160)
        out.append(Encoded([rng.choice(ids) for _ in range(p + r)], [False] * p + [True] * r, truncated=False))
    return out


def losses(base_quant: str) -> list[float]:
    w1 = WORKLOADS["W1"]
    w = Workload("W1-learnable", w1.args, 240, 0, 1.0, 8, dict(w1.lora))
    w.examples = learnable_examples  # the same examples for both runs
    record = run_hivetune(w, torch.device("cuda"), {"base_quant": base_quant, "log_every": 1, "lr": 1e-3})
    return record["losses_logged"]


def test_nf4_loss_curve_follows_bf16():
    dense, quant = losses("none"), losses("nf4")
    assert len(dense) == len(quant) == 30
    assert dense[0] - dense[-1] > 1.0  # the curve really moves
    for step, (a, b) in enumerate(zip(dense, quant)):
        assert b == pytest.approx(a, rel=0.02), f"step {step + 1}: bf16 {a:.4f}, nf4 {b:.4f}"
