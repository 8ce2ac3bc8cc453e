"""benchmarks/keep_w1.py: W1's Q4_K_M-like mix of block types, and a CPU run of the script on its
tiny stand-in (2 steps a setting, the results lines it appends)."""

from __future__ import annotations

import importlib.util
import json
import math
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "keep_w1.py"


def keep_w1():
    spec = importlib.util.spec_from_file_location("keep_w1", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_q4_k_m_mix_on_w1_shape():
    """W1: hidden 896 (Q4_K -> Q5_0, Q6_K -> Q8_0), intermediate 4864 = 19 x 256 (down: Q4_K /
    Q6_K); llama.cpp's use_more_bits picks 12 of 24 layers for v and down."""
    m = keep_w1()
    more = [i for i in range(24) if m.use_more_bits(i, 24)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    shapes = {"q_proj": 896, "k_proj": 896, "v_proj": 896, "o_proj": 896, "gate_proj": 896, "up_proj": 896,
              "down_proj": 4864}
    counts = Counter(m.q4_k_m_type(name, i, 24, cols) for i in range(24) for name, cols in shapes.items())
    assert counts == {m.Q5_0: 5 * 24 + 12, m.Q8_0: 12, m.Q4_K: 12, m.Q6_K: 12}
    assert m.q4_k_m_type("q_proj", 0, 24, 1024) == m.Q4_K and m.q4_k_m_type("v_proj", 0, 24, 1024) == m.Q6_K


@pytest.mark.slow
def test_keep_w1_runs_on_cpu(tmp_path):
    assert keep_w1().main(["--tiny", "--max-steps", "2", "--results", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in (tmp_path / "W1-tiny-cpu.jsonl").read_text().splitlines()]
    assert [r["setting"] for r in lines] == [
        "base_quant none: dense fp32 base; max_steps 2", "base_quant keep: Q8_0 blocks; max_steps 2",
        "base_quant keep: Q4_K_M-like mix (Q4_K/Q6_K, Q5_0/Q8_0 where 256 does not divide); max_steps 2"]
    assert [r["hivetune"]["steps"] for r in lines] == [2, 2, 2]
    assert lines[1]["kept_base"]["types"] == {"Q8_0": 28} and lines[1]["kept_base"]["bits_per_weight"] == 8.5
    assert lines[2]["kept_base"]["types"] == {"Q4_K": 2, "Q5_0": 22, "Q6_K": 2, "Q8_0": 2}
    for r in lines[1:]:
        assert r["ratio_vs_bf16"] == round(r["hivetune"]["seconds"] / lines[0]["hivetune"]["seconds"], 3)
    # the same random weights, quantized: the losses follow the dense base's
    dense = lines[0]["hivetune"]["final_loss"]
    assert math.isfinite(dense)
    for r in lines[1:]:
        assert abs(r["hivetune"]["final_loss"] - dense) < 0.02
