"""The preference step replayed from a CUDA graph (train.pair_graph) trains as the eager step does."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def write_pairs(path, n: int = 24):
    services = ["nginx", "sshd", "redis", "podman", "httpd", "chronyd"]
    with open(path, "w") as f:
        for i in range(n):
            svc = services[i % 6]
            f.write(json.dumps({"prompt": f"How do I restart the {svc} service? ({i})" + " please" * (i % 5),
                                "chosen": f"Run `systemctl restart {svc}` as root." + " Then check it." * (i % 3),
                                "rejected": f"Use rpm-ostree status on {services[(i + 1) % 6]}."}) + "\n")
    return path


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_graphed_preference_steps_track_the_eager_ones(method, tiny_model_dir, tmp_path):
    from conftest import tiny_config
    from hivetune.train import pair_graph
    from hivetune.train.loop import fit
    from hivetune.train.setup import setup
    from hivetune.train.step import micro_parts

    data = write_pairs(tmp_path / "pairs.jsonl")
    rows = {}
    for graphs in (False, True):
        cfg = tiny_config(tiny_model_dir, data, tmp_path / f"run-{graphs}", method=method, device="cuda",
                          precision="bf16", cuda_graphs=graphs, batch_size=4, grad_accum=2, max_steps=3,
                          lora={"r": 4, "alpha": 8, "dropout": 0.1})
        run = setup(cfg)
        pair_graph.last_stats = {}
        fit(run, progress=False)
        rows[graphs] = [json.loads(line) for line in (tmp_path / f"run-{graphs}" / "metrics.jsonl").read_text().splitlines()
                        if '"loss"' in line]
        if graphs:
            stats = pair_graph.last_stats
            assert stats["off"] is None and stats["graphs"] == 1 and stats["eager"] == 0, stats
            micro = sum(len(micro_parts(run, ids)) for ids in run.steps[:3])
            assert micro >= 4 and stats["replays"] == micro - 1  # every micro-batch but the first (warm-up)
    eager, graphed = rows[False], rows[True]
    assert [r["step"] for r in eager] == [r["step"] for r in graphed] == [1, 2, 3]
    for a, b in zip(eager, graphed):  # bf16: the padded row's matmuls round differently
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), (a, b)
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
            assert b[key] == pytest.approx(a[key], rel=5e-2, abs=2e-3), (key, a, b)
        assert b["rewards/accuracy"] == pytest.approx(a["rewards/accuracy"], abs=0.126)  # a near-tie may flip
